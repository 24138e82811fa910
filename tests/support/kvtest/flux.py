"""Flux on the local control plane: its real source-controller and kustomize-controller (built by
tests/gitops/flux/build.sh), Flux's CRDs, and a git repository served on 127.0.0.1 for them to read.

Everything listens on 127.0.0.1 only: the controllers' health endpoints and source-controller's
artifact server; metrics are off and no events address is set (Flux then sends no notifications).
"""

from __future__ import annotations

import datetime
import http.server
import os
import signal
import subprocess
import threading
from pathlib import Path

import yaml

from . import gitops
from .client import Client, condition
from .procs import LOOPBACK, free_ports, listening_sockets, wait_until

REQUESTED_AT = "reconcile.fluxcd.io/requestedAt"  # what `flux reconcile` sets


def git(*args: str, cwd: Path) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "kvtest", "GIT_AUTHOR_EMAIL": "kvtest@localhost",
           "GIT_COMMITTER_NAME": "kvtest", "GIT_COMMITTER_EMAIL": "kvtest@localhost", "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True,
                          timeout=60).stdout.strip()


class _GitHandler(http.server.BaseHTTPRequestHandler):
    """One request through `git http-backend` (CGI): git's smart HTTP protocol, which Flux's go-git speaks."""
    project_root: Path

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._backend()

    def do_POST(self) -> None:  # noqa: N802
        self._backend()

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while (size := int(self.rfile.readline().split(b";")[0], 16)) > 0:
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            self.rfile.readline()
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _backend(self) -> None:
        path, _, query = self.path.partition("?")
        env = {"PATH": os.environ["PATH"], "GIT_PROJECT_ROOT": str(self.project_root), "GIT_HTTP_EXPORT_ALL": "1",
               "PATH_INFO": path, "QUERY_STRING": query, "REQUEST_METHOD": self.command,
               "CONTENT_TYPE": self.headers.get("Content-Type", ""), "REMOTE_ADDR": self.client_address[0],
               "HTTP_CONTENT_ENCODING": self.headers.get("Content-Encoding", ""),
               "GIT_PROTOCOL": self.headers.get("Git-Protocol", ""), "GIT_CONFIG_NOSYSTEM": "1"}
        out = subprocess.run(["git", "http-backend"], input=self._body(), env=env, capture_output=True,
                             timeout=60).stdout
        head, _, body = out.partition(b"\r\n\r\n") if b"\r\n\r\n" in out else out.partition(b"\n\n")
        headers = [line.split(":", 1) for line in head.decode().splitlines() if ":" in line]
        status = next((v.strip() for k, v in headers if k.lower() == "status"), "200 OK")
        self.send_response(int(status.split()[0]), status.partition(" ")[2])
        for k, v in headers:
            if k.lower() != "status":
                self.send_header(k, v.strip())
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - quiet
        pass


class GitServer:
    """A bare repository `name`.git served over HTTP on 127.0.0.1, and a clone of it to commit to."""

    def __init__(self, root: Path, name: str = "kvoffload-config") -> None:
        self.served = root / "served"
        self.bare = self.served / f"{name}.git"
        self.work = root / "work"
        self.bare.mkdir(parents=True)
        git("init", "-q", "--bare", "-b", "main", str(self.bare), cwd=root)
        git("clone", "-q", str(self.bare), str(self.work), cwd=root)
        git("symbolic-ref", "HEAD", "refs/heads/main", cwd=self.work)
        handler = type("Handler", (_GitHandler,), {"project_root": self.served})
        self.httpd = http.server.ThreadingHTTPServer((LOOPBACK, 0), handler)
        self.url = f"http://{LOOPBACK}:{self.httpd.server_address[1]}/{name}.git"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def commit(self, files: dict[str, str | None], message: str) -> str:
        """Write (text) or delete (None) files in the work tree, commit, push; the commit's SHA."""
        for rel, text in files.items():
            path = self.work / rel
            if text is None:
                path.unlink()
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
        git("add", "-A", cwd=self.work)
        git("commit", "-q", "--allow-empty", "-m", message, cwd=self.work)
        git("push", "-q", "origin", "main", cwd=self.work)
        return git("rev-parse", "HEAD", cwd=self.work)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class FluxControllers:
    """source-controller and kustomize-controller as subprocesses, against the cluster of `env`."""

    def __init__(self, env: dict[str, str], workdir: Path) -> None:
        tools = gitops.tools()
        storage, source_health, kustomize_health = free_ports(3)
        (workdir / "storage").mkdir(parents=True)  # source-controller refuses a storage path that is not there
        self.health = {"source-controller": source_health, "kustomize-controller": kustomize_health}
        self.storage = storage
        common = ["--metrics-addr=0", "--events-addr=", "--enable-leader-election=false",
                  "--watch-all-namespaces=true", "--log-level=debug"]
        args = {
            "source-controller": [f"--health-addr={LOOPBACK}:{source_health}", f"--storage-path={workdir / 'storage'}",
                                  f"--storage-addr={LOOPBACK}:{storage}", f"--storage-adv-addr={LOOPBACK}:{storage}"],
            # Flux's default 30 s between checks of a not-yet-Ready dependsOn: 5 s keeps the tests short.
            "kustomize-controller": [f"--health-addr={LOOPBACK}:{kustomize_health}", "--no-remote-bases=true",
                                     "--requeue-dependency=5s"],
        }
        self.logs: dict[str, Path] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        for name, extra in args.items():
            tmp = workdir / name / "tmp"
            tmp.mkdir(parents=True)
            self.logs[name] = workdir / f"{name}.log"
            with open(self.logs[name], "w") as log:
                self.procs[name] = subprocess.Popen(
                    [tools[name], *common, *extra], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                    env={**env, "TMPDIR": str(tmp), "RUNTIME_NAMESPACE": "flux-system"})

    def wait_ready(self, timeout: float = 60) -> None:
        import urllib.request

        def ready(name: str) -> bool:
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited:\n{self.output(name)[-3000:]}")
            with urllib.request.urlopen(f"http://{LOOPBACK}:{self.health[name]}/readyz", timeout=2) as resp:
                return resp.status == 200
        for name in self.procs:
            wait_until(lambda n=name: ready(n), timeout=timeout, message=f"{name} ready")
        wait_until(lambda: any(port == self.storage for _, port, _ in self.listeners()), timeout=timeout,
                   message="source-controller's artifact server listening")

    def listeners(self) -> list[tuple[str, int, int | None]]:
        return listening_sockets(p.pid for p in self.procs.values())

    def output(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace")

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)


def install_crds(client: Client) -> None:
    """Flux's CRDs, from the built modules' config/crd/bases, Established."""
    for path in sorted(Path(gitops.tools()["flux-crds"]).glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                client.apply(doc)
                client.established(doc["metadata"]["name"])


def request_reconcile(client: Client, resource: str, name: str, namespace: str) -> str:
    """What `flux reconcile` does: the requestedAt annotation; Flux echoes it in status.lastHandledReconcileAt."""
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat()
    client.patch(resource, name, {"metadata": {"annotations": {REQUESTED_AT: stamp}}}, namespace)
    return stamp


def ready(obj: dict | None) -> dict:
    """The Ready condition of a Flux object when it is about its current generation, else {}."""
    c = condition(obj, "Ready")
    return c if obj and c.get("observedGeneration") == obj["metadata"]["generation"] else {}
