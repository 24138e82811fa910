"""The images built for real (podman, no network, local bases: kvtest.images) and run the way the
chart and the operator's rendered pods run them: as their UIDs, read-only root, no capabilities,
no privilege escalation, no network.

- the operator image: `kvoffload --help`, `kvoffload plan` (the same answer as this checkout's code)
  and the exporter, as the chart's securityContext runs them;
- the default serving image (vLLM 0.33.0 + LMCache 0.5.6), as `make test` builds it (kvtest.images prebuilt: the
  LMCache wheel its engine venv compiled against torch 2.14.0 for sm_90, FROM the thin base): the Dockerfile's own
  steps ran (LMCache installed from the wheelhouse, its CUDA extension's shared object loaded against the base's
  torch), its pins, user and entrypoint, as the rendered pod runs it, and a build whose extension check fails is a
  failed build;
- the README's `docker build` lines: the wheel pair's (vLLM 0.26.0 + LMCache 0.5.3) gives the image kvtest.images
  gives; the default's compiles LMCache for seven GPU architectures (an hour on 2 cores), so it is not run here;
- the stand-in engine image (vLLM 0.26.0 + LMCache 0.5.3's serving image, kvtest.images STANDIN_PAIR): the rendered
  lmcache-server pod (tests/golden: the example pins that pair) in a podman pod, every container under its rendered
  command, args, env, user and mounts, with the images swapped for the local ones: the versions init reports the
  image's real versions, `lmcache server` runs for real, the stand-in serves the recorded page and the exporter
  reads both.

Cold, the 0.26.0 vLLM base costs ~8 min and ~8 GiB (copying the engine venv); the default's thin base is symlinks;
then each is reused while its inputs' hash is unchanged (docs/benchmarks.md "Images").
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

import kvtest.images as images
from kvoffload.api import settings
from kvoffload.api.spec import parse
from kvtest import background
from kvtest.dockerfile import serving
from kvtest.readme import README, commands

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(3600)
HARDENED = ("--network=none", "--read-only", "--cap-drop=ALL", "--security-opt=no-new-privileges", *images.RUN_LIMITS)
STANDIN_VLLM, STANDIN_LMCACHE = images.STANDIN_PAIR.split("-")
VERSIONS = {"vllm": STANDIN_VLLM, "lmcache": STANDIN_LMCACHE, "torch": "2.11.0"}  # what the stand-in image holds
DEFAULT_VERSIONS = {"vllm": images.VLLM_VERSION, "lmcache": images.LMCACHE_VERSION, "torch": "2.14.0"}


def _require(what: str, ok: bool) -> None:
    if not ok:
        if os.environ.get("KVO_REQUIRE_CLUSTER") or os.environ.get("KVO_REQUIRE_ENGINE"):
            pytest.fail(what)
        pytest.skip(what)


@pytest.fixture(scope="module")
def podman() -> None:
    _require("podman, runc and debootstrap are needed (make system-deps)",
             all(shutil.which(t, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
                 for t in ("podman", "runc", "debootstrap")))
    _require("running as root is needed (debootstrap, podman's root store)", os.geteuid() == 0)


@pytest.fixture(scope="module")
def operator_image(podman) -> str:
    return images.build("operator")


@pytest.fixture(scope="module")
def serving_image(podman) -> tuple[str, tuple[str, ...]]:
    """The default pair's serving image as `make test` builds it (kvtest.images.serving_tag()) and the podman run
    arguments it needs (its thin base's mounts of the engine venv, read-only)."""
    background.wait("engine")
    _require(f"no engine venv at {images.ENGINE_VENV} (make engine-venv)", (images.ENGINE_VENV / ".done").exists())
    return images.build("serving"), images.run_mounts()


@pytest.fixture(scope="module")
def standin_serving_image(podman) -> str:
    """The stand-in's pair's serving image (FROM the full local base; LMCache's PyPI wheel)."""
    background.wait("engine")
    venv = images.pair(images.STANDIN_PAIR).engine_venv
    _require(f"no engine venv at {venv} (make engine-venv)", (venv / ".done").exists())
    return images.build("serving", images.STANDIN_PAIR)


@pytest.fixture(scope="module")
def standin_image(standin_serving_image) -> str:
    return images.build("standin")


def run(image: str, *args: str, user: str, entrypoint: list[str] | None = None, extra: tuple[str, ...] = (),
        timeout: float = 600) -> subprocess.CompletedProcess:
    ep = ["--entrypoint", json.dumps(entrypoint)] if entrypoint else []
    return images.podman("run", "--rm", *HARDENED, "--user", user, *ep, *extra, image, *args, check=False,
                         timeout=timeout)


def inspect(image: str) -> dict:
    return json.loads(images.podman("image", "inspect", image).stdout)[0]


# --- the operator image -------------------------------------------------------------------------

CHART_USER = "65532:65532"  # charts/kvoffload-operator/templates/deployment.yaml (tests/unit/test_images.py checks it)


def test_operator_image_runs_as_the_chart_runs_it(operator_image):
    cfg = inspect(operator_image)["Config"]
    assert cfg["User"] == CHART_USER and cfg["Entrypoint"] == ["kvoffload"]
    cp = run(operator_image, "--help", user=CHART_USER)
    assert cp.returncode == 0 and all(w in cp.stdout for w in ("run", "exporter", "plan")), cp.stdout + cp.stderr
    cp = run(operator_image, "-c", "id -u; id -g; grep -E '^(CapEff|NoNewPrivs)' /proc/self/status; "
             "touch /opt/kvoffload/x 2>&1 || echo read-only", user=CHART_USER, entrypoint=["/bin/sh"])
    assert cp.stdout.split("\n")[:2] == ["65532", "65532"], cp.stdout + cp.stderr
    assert re.search(r"CapEff:\s+0+\n", cp.stdout) and re.search(r"NoNewPrivs:\s+1", cp.stdout), cp.stdout
    assert "Read-only file system" in cp.stdout and cp.stdout.rstrip().endswith("read-only"), cp.stdout
    # The README's `kvoffload plan` in the image prints what this checkout's code prints: the image holds this operator.
    plan = shlex.split(next(c for c in commands() if c.startswith("kvoffload plan ")))[1:]
    cp = run(operator_image, *plan, user=CHART_USER)
    assert cp.returncode == 0, cp.stderr
    here = subprocess.run([sys.executable, "-m", "kvoffload.cli", *plan], capture_output=True, text=True, check=True)
    assert cp.stdout == here.stdout and "40" in cp.stdout


def test_operator_image_serves_the_exporter_read_only(operator_image, tmp_path):
    """The exporter sidecar as rendered runs it (the image's entrypoint, 65532, read-only root) against
    the recorded H200 vLLM page, served by Python's http.server in the same network-less container."""
    page = ROOT / "tests/fixtures/vllm-0.26.0-lmcache-0.5.3-h200-v1runner/vllm-metrics-with-lmcache.txt"
    name = f"kvo-exporter-{uuid.uuid4().hex[:8]}"
    script = ("python -m http.server 8000 --bind 127.0.0.1 --directory /page >/dev/null 2>&1 & "
              "exec kvoffload exporter --listen 127.0.0.1:9400 --vllm-metrics-url "
              f"http://127.0.0.1:8000/{page.name} --backend lmcache --cpu-capacity-bytes {40 * 2**30}")
    images.podman("run", "-d", "--name", name, *HARDENED, "--user", CHART_USER, "--entrypoint", '["/bin/sh"]',
                  "-v", f"{page.parent}:/page:ro", operator_image, "-c", script)
    try:
        body = ""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "kvoffload_source_up" not in body:
            time.sleep(1)
            body = exec_get(name, "http://127.0.0.1:9400/metrics")
        assert re.search(r'kvoffload_source_up\{[^}]*source="vllm"[^}]*\} 1\.0', body), body[-3000:]
        assert "kvoffload_prompt_tokens" in body and 'tier="cpu"' in body, body[-3000:]
        assert exec_get(name, "http://127.0.0.1:9400/healthz") != ""
    finally:
        images.podman("rm", "-f", "-t", "0", name, check=False)


def exec_get(container: str, url: str) -> str:
    """GET url from inside the container (its network namespace), with its own Python."""
    cp = images.podman("exec", container, "python3", "-c",
                       f"import urllib.request as u; print(u.urlopen({url!r}, timeout=5).read().decode())", check=False)
    return cp.stdout if cp.returncode == 0 else ""


# --- the serving image --------------------------------------------------------------------------

def test_serving_image_steps_ran_for_real(serving_image, tmp_path):
    """As the operator's pods run it (UID 1000, read-only root, no capabilities, no network): the pinned versions, its
    user and entrypoint, and LMCache's compiled extension loaded against its torch 2.14.0 with every symbol bound
    (extension_check.py) and as the Dockerfile's own check loads it; then `import lmcache` with the pod's writable HOME
    and /tmp (tests/golden: emptyDirs; XDG_CACHE_HOME under HOME) loads its compute backend and the extension. Without
    a writable HOME, LMCache 0.5.6's numba kernels (cache=True) cannot cache and LMCache says "No compute backend
    loaded; CLI-only mode": the pod's HOME volume is what avoids that."""
    image, mounts = serving_image
    df = serving(images.SERVING)
    info = inspect(image)
    assert info["Config"]["User"] == "1000:1000" and info["Config"]["Entrypoint"] == ["vllm", "serve"]
    labels = info["Config"]["Labels"]
    assert ((labels["io.kvoffload.vllm-version"], labels["io.kvoffload.lmcache-version"])
            == (images.VLLM_VERSION, images.LMCACHE_VERSION))
    # Its LMCache is the wheel the engine venv compiled, and the label says for which GPUs (not the published list).
    done = (images.pair().lmcache_wheels() / ".done").read_text()
    arch = re.search(r"^torch_cuda_arch_list=(.+)$", done, re.M).group(1)
    assert f"TORCH_CUDA_ARCH_LIST={arch} only" in labels["io.kvoffload.lmcache-build"], labels
    assert arch != df.args["TORCH_CUDA_ARCH_LIST"]
    ext = df.args["LMCACHE_EXTENSION"]
    so = rf"/opt/vllm/lib/python3\.11/site-packages/lmcache/{ext}\.cpython-311-x86_64-linux-gnu\.so"
    # The build's own check step loaded the shared object (its log), and so does the same step run again in the image.
    log = (images.LOGS / f"{image.replace('/', '_')}.log").read_text()
    assert re.search(rf"loaded {so} against torch 2\.14\.0", log) and "extensions load:" in log, log[-3000:]
    (check,) = [r for r in df.all("RUN") if "module_from_spec" in r]
    cp = run(image, "-o", "pipefail", "-c", check, user="1000:1000", entrypoint=["/bin/bash"], extra=mounts)
    assert cp.returncode == 0 and re.search(rf"loaded {so} against torch 2\.14\.0", cp.stdout), (
        cp.stdout + cp.stderr[-3000:])
    script = ("import json, os; from importlib.metadata import version; import torch; "
              "print(json.dumps({'versions': {n: version(n) for n in ('vllm', 'lmcache', 'torch')}, "
              "'torch': torch.__version__, 'uid': os.getuid(), 'gid': os.getgid(), 'home': os.path.expanduser('~')}))")
    cp = run(image, "-c", script, user="1000:1000", entrypoint=["python3"], extra=mounts)
    assert cp.returncode == 0, cp.stdout + cp.stderr[-3000:]
    got = json.loads(cp.stdout.strip().splitlines()[-1])
    assert got["versions"] == DEFAULT_VERSIONS and got["torch"].startswith("2.14.0"), got
    assert (got["uid"], got["gid"], got["home"]) == (1000, 1000, "/home/vllm"), got
    # Every CUDA extension of the compiled LMCache, bound with RTLD_NOW against this torch, then imported.
    cp = run(image, "/opt/kvoffload/extension_check.py", user="1000:1000", entrypoint=["python3"], extra=mounts)
    assert cp.returncode == 0, cp.stdout + cp.stderr[-3000:]
    loaded = json.loads(cp.stdout.split("extensions load:", 1)[1])
    assert loaded["modules"] == [f"lmcache.{ext}"] and loaded["lmcache"] == images.LMCACHE_VERSION, loaded
    assert loaded["torch"].startswith("2.14.0"), loaded
    # The image's default user is the pod's, with its home.
    cp = run(image, "-c", "id -un; id -u; echo ~; stat -c %u:%g:%a ~", user="1000:1000", entrypoint=["/bin/sh"],
             extra=mounts)
    assert cp.stdout.split() == ["vllm", "1000", "/home/vllm", "1000:1000:750"], cp.stdout + cp.stderr
    home = tmp_path / "home"
    home.mkdir(mode=0o750)
    os.chown(home, 1000, 1000)
    pod = (*mounts, "-v", f"{home}:/home/vllm", "--tmpfs", "/tmp:rw,mode=1777", "--env",
           "XDG_CACHE_HOME=/home/vllm/.cache")
    cp = run(image, "-c", f"import lmcache, lmcache.{ext} as c; print('extension', c.__spec__.origin)",
             user="1000:1000", entrypoint=["python3"], extra=pod)
    out = cp.stdout + cp.stderr
    assert cp.returncode == 0 and re.search(rf"extension {so}", cp.stdout), out[-3000:]
    assert "CLI-only mode" not in out and (home / ".cache" / "numba").is_dir(), out[-3000:]
    # The entrypoint is vLLM's own CLI: without a GPU it stops while building its parser (vLLM cannot infer a
    # device), after running from the image's vllm console script.
    cp = images.podman("run", "--rm", "--network=none", *images.RUN_LIMITS, *mounts, "--user", "1000:1000",
                       "--tmpfs", "/tmp:rw,mode=1777", "-v", f"{home}:/home/vllm", image, "--help", check=False,
                       timeout=600)
    out = cp.stdout + cp.stderr
    assert cp.returncode != 0 and '"/opt/vllm/bin/vllm"' in out and "/vllm/entrypoints/cli/main.py" in out \
        and "RuntimeError: Failed to infer device type" in out, out[-3000:]


def test_serving_build_fails_when_the_extension_check_fails(serving_image):
    """The same Dockerfile with LMCACHE_EXTENSION naming a module the installed LMCache does not ship (c_ops, the
    name of LMCache 0.5.3's): the check step fails, so the build does and no image is tagged."""
    tag = f"localhost/kvoffload-test/vllm-lmcache:wrong-extension-{images.DEFAULT_PAIR}"
    img = images.images(extension="c_ops", tag=tag)["serving"]
    with pytest.raises(images.BuildFailed) as failed:
        images.build_image(img, force=True)
    out = failed.value.output
    assert re.search(r"lmcache/c_ops\.cpython-311-x86_64-linux-gnu\.so", out) and "No such file" in out, out[-3000:]
    assert images.image_id(tag) is None


def installed(image: str) -> list[str]:
    """What the Dockerfiles install (/opt, /home, the users): path, size, mode, owner of every file but
    bytecode (pip's .pyc files are not byte-reproducible)."""
    cp = images.podman("run", "--rm", "--network=none", *images.RUN_LIMITS, "--user", "0:0", "--entrypoint", '["find"]',
                       image,
                       "/opt", "/home", "/etc/passwd", "/etc/group", "-not", "-name", "*.pyc", "-printf",
                       "%p %s %m %u\n",
                       timeout=600)
    return sorted(cp.stdout.splitlines())


def test_the_readmes_build_commands_build_these_images(operator_image, standin_serving_image):
    """README "Images": each `docker build` line, run with podman (the same CLI) plus only what this
    machine needs (the local base, the wheelhouse, no network), gives the image `make images` gives;
    the push lines push what was built, and the values point the chart and the operator at it. The default
    pair's line compiles LMCache for the Dockerfile's seven GPU architectures (an hour of CPU on 2 cores), so it
    is not run here: its arguments are the header's (tests/unit/test_images.py), its steps ran with the wheel
    the engine venv compiled (test_serving_image_steps_ran_for_real)."""
    text = README.read_text().split("\n## Images\n", 1)[1].split("\n## ", 1)[0]
    cmds = commands(text)
    wheel_pair = images.pair(images.STANDIN_PAIR)
    table = images.images(pair_name=wheel_pair.name)
    built, not_built = {}, {}
    for argv in [shlex.split(c) for c in cmds if c.startswith("docker build ")]:
        dockerfile = ROOT / (argv[argv.index("-f") + 1] if "-f" in argv else f"{argv[-1]}/Dockerfile")
        (img,) = [i for i in (table["operator"], table["serving"]) if i.dockerfile == dockerfile]
        tag = argv[argv.index("-t") + 1]
        if img is table["serving"] and not tag.endswith(f":{wheel_pair.name}"):
            not_built[tag.rsplit(":", 1)[1]] = tag
            continue
        offline = ["--build-arg", f"BASE_IMAGE={img.base}", "-v", f"{img.wheelhouse}:/wheels:ro",
                   *[a for k, v in img.args.items() for a in ("--build-arg", f"{k}={v}")]]
        cp = images.podman("build", "--format=docker", "--network=none", "--pull=never", *images.RUN_LIMITS, *offline,
                           *argv[2:], cwd=ROOT, check=False, timeout=1800)
        try:
            assert cp.returncode == 0, (cp.stdout + cp.stderr)[-3000:]
            assert installed(tag) == installed(img.tag)
            assert {k: v for k, v in inspect(tag)["Config"].items() if k != "Labels"} == \
                {k: v for k, v in inspect(img.tag)["Config"].items() if k != "Labels"}
            built[img.tag] = tag
        finally:
            images.podman("rmi", tag, check=False)
    assert set(built) == {images.OPERATOR, wheel_pair.tag} and set(not_built) == {images.DEFAULT_PAIR}
    assert (sorted(c.split()[2] for c in cmds if c.startswith("docker push "))
            == sorted([*built.values(), *not_built.values()]))
    (block,) = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
    values = yaml.safe_load(block)
    assert f"{values['image']['repository']}:0.1.0" == built[images.OPERATOR]
    cfg = settings.from_dict(values["operator"]["config"])
    assert cfg.default_image == not_built[images.DEFAULT_PAIR]
    minimal = {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}, "engine": {"maxModelLen": 8192},
               "offload": {"cpu": {"size": "8Gi"}}}
    engine = parse(minimal, cfg).engine
    assert (engine.image, engine.vllm_version, engine.lmcache_version) == (cfg.default_image, images.VLLM_VERSION,
                                                                           images.LMCACHE_VERSION)
    pinned = parse({**minimal, "engine": {**minimal["engine"], "image": built[wheel_pair.tag]}}, cfg).engine
    assert (pinned.vllm_version, pinned.lmcache_version) == (wheel_pair.vllm, wheel_pair.lmcache)


# --- the stand-in engine image: the rendered lmcache-server pod in a podman pod ----------------

GOLDEN = ROOT / "tests/golden/server-llama31-8b.yaml"
L1_GB = "1.0"  # the rendered L1 is 40 GiB, allocated up front (--no-l1-use-lazy): this machine has 24


def rendered_pod() -> tuple[dict, dict]:
    docs = list(yaml.safe_load_all(GOLDEN.read_text()))
    (sts,) = [d for d in docs if d and d["kind"] == "StatefulSet"]
    return sts["metadata"], sts["spec"]["template"]["spec"]


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command, args and subPathExpr."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), value)


class PodmanPod:
    """The rendered pod's containers sharing one network namespace (no network), as in a pod: init
    containers in order, sidecars (restartPolicy Always) and containers detached; each with its
    rendered command, args, env, securityContext and mounts; volumes are host directories."""

    def __init__(self, spec: dict, image_for: dict[str, str], work: Path, fields: dict[str, str]) -> None:
        self.spec, self.image_for, self.work, self.fields = spec, image_for, work, fields
        self.name = f"kvo-pod-{uuid.uuid4().hex[:8]}"
        self.volumes: dict[str, Path] = {}
        self.shm = Path("/dev/shm") / self.name  # memory-backed emptyDirs: a directory on the host's tmpfs
        for v in spec["volumes"]:
            memory = v.get("emptyDir", {}).get("medium") == "Memory"
            d = (self.shm if memory else work) / v["name"]
            d.mkdir(parents=True)
            # kubelet makes emptyDirs 0777; the admin's root is 0755 root's
            d.chmod(0o755 if "hostPath" in v else 0o777)
            self.volumes[v["name"]] = d
        # The pod's network namespace (no network), held by a sleeping container like a pod's pause container.
        images.podman("run", "-d", "--name", f"{self.name}-infra", *HARDENED, "--user", "65534:65534",
                      "--entrypoint", '["sleep"]', images.PYTHON_BASE, "infinity")
        self.logs: dict[str, str] = {}

    def args(self, c: dict) -> list[str]:
        pod_sc, sc = self.spec.get("securityContext", {}), c.get("securityContext", {})
        env = {e["name"]: e["value"] if "value" in e else self.fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
               for e in c.get("env", [])}
        uid, gid = sc.get("runAsUser", pod_sc.get("runAsUser", 0)), sc.get("runAsGroup", pod_sc.get("runAsGroup", 0))
        out = ["--network", f"container:{self.name}-infra", "--name", f"{self.name}-{c['name']}",
               "--user", f"{uid}:{gid}", *images.RUN_LIMITS]
        if pod_sc.get("fsGroup") is not None:
            out += ["--group-add", str(pod_sc["fsGroup"])]
        if sc.get("readOnlyRootFilesystem"):
            out.append("--read-only")
        if sc.get("allowPrivilegeEscalation") is False:
            out += ["--security-opt", "no-new-privileges"]
        caps = sc.get("capabilities", {})
        out += [f"--cap-drop={c}" for c in caps.get("drop", [])] + [f"--cap-add={c}" for c in caps.get("add", [])]
        for k, v in env.items():
            out += ["--env", f"{k}={v}"]
        for m in c.get("volumeMounts", []):
            src = self.volumes[m["name"]]
            if m.get("subPathExpr"):
                src = src / expand(m["subPathExpr"], env)
                src.mkdir(parents=True, exist_ok=True)
            out += ["-v", f"{src}:{m['mountPath']}{':ro' if m.get('readOnly') else ''}"]
        if c.get("command"):
            out += ["--entrypoint", json.dumps([expand(a, env) for a in c["command"]])]
        return [*out, self.image_for[c["image"]], *[expand(a, env) for a in c.get("args", [])]]

    def start(self, override_args=lambda c, args: args) -> None:
        for c in self.spec.get("initContainers", []):
            if c.get("restartPolicy") == "Always":
                images.podman("run", "-d", *override_args(c, self.args(c)))
                continue
            cp = images.podman("run", "--rm", *override_args(c, self.args(c)), check=False, timeout=600)
            self.logs[c["name"]] = cp.stdout + cp.stderr
            assert cp.returncode == 0, f"init container {c['name']} failed:\n{cp.stdout}{cp.stderr}"
        for c in self.spec["containers"]:
            images.podman("run", "-d", *override_args(c, self.args(c)))

    def exec(self, container: str, *cmd: str) -> subprocess.CompletedProcess:
        return images.podman("exec", f"{self.name}-{container}", *cmd, check=False, timeout=60)

    def log(self, container: str) -> str:
        cp = images.podman("logs", f"{self.name}-{container}", check=False)
        return cp.stdout + cp.stderr

    def remove(self) -> None:
        names = [f"{self.name}-{c['name']}" for c in self.spec.get("initContainers", []) + self.spec["containers"]]
        for batch in (names, [f"{self.name}-infra"]):  # the namespace holder last: the others depend on it
            cp = images.podman("rm", "-f", "-t", "0", "--ignore", *batch, check=False)
            assert cp.returncode == 0, cp.stderr
        shutil.rmtree(self.shm, ignore_errors=True)


def test_the_rendered_server_pod_runs_on_the_standin_image(standin_image, operator_image, tmp_path):
    meta, spec = rendered_pod()
    ns = meta["namespace"]
    fields = {"metadata.name": f"{meta['name']}-0", "metadata.namespace": ns, "status.podIP": "127.0.0.1"}
    image_for = {images.pair(images.STANDIN_PAIR).tag: standin_image, images.OPERATOR: operator_image}
    assert {c["image"] for c in spec["containers"] + spec["initContainers"]} == set(image_for)

    def small_l1(c: dict, args: list[str]) -> list[str]:
        if c["name"] == "lmcache-server":
            args[args.index("--l1-size-gb") + 1] = L1_GB
        return args

    pod = PodmanPod(spec, image_for, tmp_path, fields)
    try:
        pod.start(small_l1)
        # The init containers: the disk-tier directory handed to UID 1000, the image's real versions.
        # The volume is the allowed root; the subPath of the container holding the disk tier (the LMCache server
        # here) is <rel>/<ns>/<name>/<pod>, the init container's its parent.
        sub = next(m["subPathExpr"] for c in spec["initContainers"] + spec["containers"]
                   if c["name"] != "prepare-disk-tier"
                   for m in c.get("volumeMounts") or [] if m["name"] == "kv-disk")
        disk = tmp_path / "kv-disk" / expand(sub, {"POD_NAMESPACE": ns, "POD_NAME": fields["metadata.name"]})
        assert disk.relative_to(tmp_path / "kv-disk").parts[1:] == (ns, meta["name"], fields["metadata.name"])
        st = disk.stat()
        assert (st.st_uid, st.st_gid, oct(st.st_mode & 0o7777)) == (1000, 1000, "0o750")
        assert f"kvoffload: emptied {ns}/{meta['name']}/{fields['metadata.name']}" in pod.logs["prepare-disk-tier"]
        assert (disk.parent / f".kvoffload-owner-{fields['metadata.name']}.json").stat().st_uid == 0  # the owner marker
        assert json.loads((tmp_path / "engine-info" / "versions.json").read_text()) == VERSIONS
        # Every container up: the rendered probes, run where the kubelet would run them.
        sidecar = next(c for c in spec["initContainers"] if c["name"] == "lmcache-server")
        probe = sidecar["startupProbe"]["exec"]["command"]
        metrics = ""
        deadline = time.monotonic() + 420
        while time.monotonic() < deadline:
            up = pod.exec("lmcache-server", *probe).returncode == 0
            health = exec_get(f"{pod.name}-exporter", "http://127.0.0.1:8000/health") == "\n"
            metrics = exec_get(f"{pod.name}-exporter", "http://127.0.0.1:9400/metrics")
            if up and health and re.search(r'kvoffload_source_up\{[^}]*source="lmcache"[^}]*\} 1\.0', metrics):
                break
            time.sleep(3)
        else:
            pytest.fail("pod not up:\n" + "\n".join(f"--- {c}:\n{pod.log(c)[-3000:]}"
                                                    for c in ("vllm", "lmcache-server", "exporter")) +
                        f"\n--- exporter /metrics:\n{metrics[-3000:]}")
        # The stand-in says what it is, took vLLM's own parser's word for the rendered args, and serves the recorded
        # page.
        vllm_log = pod.log("vllm")
        assert "STAND-IN vLLM" in vllm_log and "server-vllm.txt (LMCacheMPConnector)" in vllm_log, vllm_log[-3000:]
        page = exec_get(f"{pod.name}-exporter", "http://127.0.0.1:8000/metrics")
        recorded = (ROOT / "tests/fixtures/h200-backends-vllm-0.26.0-lmcache-0.5.3/server-vllm.txt").read_text()
        assert page.rstrip("\n") == recorded.rstrip("\n")
        models = json.loads(exec_get(f"{pod.name}-exporter", "http://127.0.0.1:8000/v1/models"))
        assert [m["id"] for m in models["data"]] == ["meta-llama/Llama-3.1-8B-Instruct"]
        # The real LMCache server: its /status, with the L1 it was given.
        status = json.loads(exec_get(f"{pod.name}-exporter", "http://127.0.0.1:8081/status"))
        assert status["storage_manager"]["l1_manager"]["memory_total_bytes"] == int(float(L1_GB) * 2**30), status
        # The exporter in its own image and UID read the versions file, the stand-in and the server.
        info = re.search(r"kvoffload_engine_info\{([^}]*)\} 1\.0", metrics)
        assert info and all(f'{k}="{v}"' in info.group(1) for k, v in VERSIONS.items()), metrics[-3000:]
        assert re.search(r'kvoffload_source_up\{[^}]*source="vllm"[^}]*\} 1\.0', metrics), metrics[-3000:]
        for container, uid in (("vllm", "1000"), ("lmcache-server", "1000"), ("exporter", "65532")):
            assert pod.exec(container, "id", "-u").stdout.strip() == uid
    finally:
        pod.remove()
