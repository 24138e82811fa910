"""Save the OCI runtime spec containerd generated for every container of a pod on the real node.

    python benchmarks/gpu/oci/capture.py NAMESPACE POD [--out DIR] [--cluster-dir DIR]
    python benchmarks/gpu/oci/capture.py --rendered examples/workstation-llama31-8b.yaml --as lmcache

Writes DIR/<pod>/<container>.json (default DIR: benchmarks/gpu/oci) for each init container, container
and the pod's sandbox: the bundle's config.json runc ran (the spec containerd stored once a container
exited). What a GPU run compares: user, capabilities, mounts (tmpfs sizes, hostPaths), devices, cgroup
limits, rlimits, seccomp. See README.md here.

`--rendered FILE --as NAME`: the pod `kvoffload render` makes of FILE, fitted to the CPU node by
`for_cpu_node` (every change listed in NAME/changes.json), run there as its StatefulSet, captured into
DIR/NAME/ once each of its containers has been created, then deleted.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from kvoffload.rendering.render import exec_argv
from kvtest import Cluster, node
from kvtest.images import OPERATOR

# What the 2-core, 24 GiB CPU node can schedule: larger requests and limits are capped to these.
# gpu_oci.rewrite puts the rendered sizes back (memory limit and swap, CPU shares, oomScoreAdj).
CAP = {"memory": "1Gi", "cpu": "250m", "ephemeral-storage": "1Gi"}
_MEM = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "": 1}
# Where the disk tier's hostPath goes on the CPU machine (not the rendered /mnt/nvme/...).
HOST_PATH_ROOT = "/var/lib/kvoffload/oci-capture"
# Its own namespace: the demo's kvoffload-demo holds the operator's StatefulSets of the same names.
NAMESPACE = "kvoffload-oci-capture"
POD_KINDS = ("StatefulSet", "Deployment")  # the serving pods; PerNode's shared server (rendered with --node)
DISK_VOLUME = "kv-disk"
WAIT_INIT = "wait-for-shared-cache"
# A native sidecar's startup probe must pass before kubelet creates the next containers, and the capture
# image has no LMCache: the sidecar's command becomes this stand-in answering the rendered probe's URL.
PROBE_STAND_IN = ("import http.server as h\n"
                  "class H(h.BaseHTTPRequestHandler):\n"
                  "    def do_GET(self):\n        self.send_response(200); self.end_headers()\n"
                  "h.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n")


def _amount(kind: str, q: str) -> float:
    """A quantity in the unit the cap compares it in (bytes; millicores)."""
    q = str(q)
    if kind == "cpu":
        return float(q[:-1]) if q.endswith("m") else float(q) * 1000
    for suffix, mult in sorted(_MEM.items(), key=lambda kv: -len(kv[0])):
        if suffix and q.endswith(suffix):
            return float(q[: -len(suffix)]) * mult
    return float(q)


def for_cpu_node(docs: list[dict[str, Any]], name: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The rendered ConfigMaps + StatefulSet fitted to the CPU node, and every change. Pure.

    Only what the node cannot give is changed: requests/limits above CAP (its memory and cores), the GPU
    resource (the node's stand-in), the namespace (NAMESPACE), the placement, the images (only the
    operator image is on the node; every container sets its command, so the image contributes only its
    env, which gpu_oci drops), the
    hostPath's host directory, and a native sidecar's command (PROBE_STAND_IN). The OCI fields these
    change are the sizes (gpu_oci.rewrite restores them) and process.args/env (replaced by the rendered
    ones on the GPU host in any case)."""
    out, ch = [], []
    for d in docs:
        if d.get("kind") not in ("ConfigMap", *POD_KINDS):
            continue
        d = copy.deepcopy(d)
        out.append(d)
        ch.append(f"{d['kind']} {d['metadata']['name']}: namespace {d['metadata'].get('namespace')} -> {NAMESPACE}")
        d["metadata"]["namespace"] = NAMESPACE
        if d["kind"] not in POD_KINDS:
            continue
        spec = d["spec"]["template"]["spec"]
        spec.pop("nodeSelector", None)
        spec["nodeSelector"] = dict(node.PLACEMENT["nodeSelector"])
        spec["tolerations"] = [*spec.get("tolerations", []), *node.PLACEMENT["tolerations"]]
        ch.append(f"{d['kind']} pod: nodeSelector -> {spec['nodeSelector']} + the real node's toleration")
        for v in spec.get("volumes", []):
            if "hostPath" in v:  # PerNode's pods have two (the admin's tmpfs root, the disk tier's): one each
                new = f"{HOST_PATH_ROOT}/{name}" + ("" if v["name"] == DISK_VOLUME else f"-{v['name']}")
                ch.append(f"volume {v['name']}: hostPath {v['hostPath']['path']} -> {new}")
                v["hostPath"]["path"] = new
        for c in spec.get("initContainers", []) + spec["containers"]:
            if c["name"] == WAIT_INIT:
                # It waits for the node's server at the Service's DNS name: the real node has no cluster DNS (the
                # operator reads the ClusterIP back), and its spec, not what it runs, is what is captured.
                c["command"], c["args"] = ["python3", "-c", "pass"], []
                ch.append(f"{c['name']}: command -> python3 -c pass (no cluster DNS here for the Service's name)")
            if exec_argv(c)[:2] == ["lmcache", "server"]:
                port = int(c["args"][c["args"].index("--http-port") + 1])
                c["command"], c["args"] = ["python3", "-c", PROBE_STAND_IN.format(port=port)], []
                ch.append(f"{c['name']}: command -> a stand-in answering on 127.0.0.1:{port} (no LMCache here)")
            if c["image"] != OPERATOR:
                ch.append(f"{c['name']}: image {c['image']} -> {OPERATOR}")
                c["image"] = OPERATOR
                c["imagePullPolicy"] = "Never"
            res = c.setdefault("resources", {})
            for part in ("requests", "limits"):
                r = res.get(part) or {}
                if "nvidia.com/gpu" in r:
                    r[node.GPU_STAND_IN] = r.pop("nvidia.com/gpu")
                    ch.append(f"{c['name']}: {part} nvidia.com/gpu -> {node.GPU_STAND_IN} {r[node.GPU_STAND_IN]}")
                for kind, cap in CAP.items():
                    if kind in r and _amount(kind, r[kind]) > _amount(kind, cap):
                        ch.append(f"{c['name']}: {part}.{kind} {r[kind]} -> {cap}")
                        r[kind] = cap
            probe = (c.get("startupProbe") or {}).get("exec")
            if c.get("restartPolicy") == "Always" and probe:
                url = next(a for a in probe["command"] if "http://127.0.0.1:" in a)
                port = int(url.split("http://127.0.0.1:", 1)[1].split("/", 1)[0])
                c["command"], c["args"] = ["python3", "-c", PROBE_STAND_IN.format(port=port)], []
                ch.append(f"{c['name']}: command -> a stand-in answering its startup probe on 127.0.0.1:{port} "
                          "(the capture image has no LMCache)")
    return out, ch


def render(path: str, operator_config: str | None = None) -> list[dict[str, Any]]:
    """`kvoffload render` of path; a PerNode resource's server pod as if a replica were on the real node."""
    extra = ["--operator-config", operator_config] if operator_config else []
    text = subprocess.run([sys.executable, "-m", "kvoffload.cli", "render", "-f", path, "--node", node.NAME, *extra],
                          capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(text) if d]


def capture(c: Cluster, namespace: str, pod: str, out: Path, as_name: str | None = None) -> list[Path]:
    specs = node.oci_specs(c, namespace, pod)
    if not specs:
        raise SystemExit(f"pod {namespace}/{pod} has no started container on {node.NAME}")
    d = out / (as_name or pod)
    d.mkdir(parents=True, exist_ok=True)
    written = []
    for name, spec in specs.items():
        path = d / f"{name.strip('()')}.json"
        path.write_text(json.dumps(spec, indent=1, sort_keys=True) + "\n")
        written.append(path)
    return written


def _pod_of(c: Cluster, d: dict[str, Any]) -> dict[str, Any] | None:
    """The pod of a one-replica StatefulSet (<name>-0) or Deployment (found by its selector)."""
    ns = d["metadata"]["namespace"]
    if d["kind"] == "StatefulSet":
        return c.client.get_or_none("pods", d["metadata"]["name"] + "-0", ns)
    pods = [p for p in c.client.list("pods", ns, labels=d["spec"]["selector"]["matchLabels"])
            if not p["metadata"].get("deletionTimestamp")]
    return pods[0] if pods else None


def capture_rendered(c: Cluster, path: str, as_name: str, out: Path, timeout: float = 240,
                     operator_config: str | None = None) -> list[Path]:
    """Run the rendered pods of `path` (the StatefulSet's first; PerNode: also the real node's server), fitted by
    for_cpu_node, on the real node; capture each (the server's into <as_name>-server/); delete them."""
    docs, changes = for_cpu_node(render(path, operator_config), as_name)
    workloads = [d for d in docs if d["kind"] in POD_KINDS]
    ns = workloads[0]["metadata"]["namespace"]
    c.client.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    for w in workloads:
        for v in w["spec"]["template"]["spec"].get("volumes", []):
            if "hostPath" in v:  # the admin's root (type Directory): made here, as an admin makes it
                Path(v["hostPath"]["path"]).mkdir(parents=True, exist_ok=True)
    for d in docs:
        c.client.apply(d)
    seen: list[str] = []
    try:
        written = []
        for w in sorted(workloads, key=lambda d: d["kind"] != "Deployment"):  # the server first: replicas wait for it
            spec = w["spec"]["template"]["spec"]
            names = [x["name"] for x in spec.get("initContainers", []) + spec["containers"]]
            deadline = time.monotonic() + timeout
            while True:
                p = _pod_of(c, w)
                st = (p or {}).get("status", {})
                created = {s["name"] for s in st.get("initContainerStatuses", []) + st.get("containerStatuses", [])
                           if s.get("containerID")}
                if p is not None and created >= set(names):
                    break
                if time.monotonic() > deadline:
                    raise SystemExit(f"{ns}/{w['metadata']['name']}: containers {sorted(set(names) - created)} not "
                                     f"created in {timeout:.0f}s: {json.dumps(st)[-800:]}")
                time.sleep(2)
            pod = p["metadata"]["name"]
            seen.append(pod)
            name = as_name if w["kind"] == "StatefulSet" else f"{as_name}-server"
            written += capture(c, ns, pod, out, name)
            d = out / name
            (d / "changes.json").write_text(json.dumps({"rendered": path, "pod": f"{ns}/{pod}", "changes": changes,
                                                        "statuses": st}, indent=1) + "\n")
            (d / "applied.yaml").write_text(yaml.safe_dump_all(docs, sort_keys=False))
        return written
    finally:
        for d in docs:
            c.client.delete(d["kind"].lower() + "s", d["metadata"]["name"], ns, missing_ok=True)
        for pod in seen:
            c.client.delete("pods", pod, ns, missing_ok=True, wait=True, timeout=120)
        for w in workloads:
            for v in w["spec"]["template"]["spec"].get("volumes", []):
                if "hostPath" in v:
                    shutil.rmtree(v["hostPath"]["path"], ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("namespace", nargs="?")
    ap.add_argument("pod", nargs="?")
    ap.add_argument("--rendered", help="a KVOffloadServe file: run its rendered pod "
                                       "(fitted to the CPU node) and capture it")
    ap.add_argument("--as", dest="as_name", help="--rendered: the capture's directory name (e.g. the backend)")
    ap.add_argument("--operator-config", help="--rendered: operator settings YAML (PerNode needs sharedMemoryRoot)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    ap.add_argument("--cluster-dir", type=Path, help="the real node's cluster (default: KVO_CLUSTER_DIR or .cluster)")
    a = ap.parse_args()
    c = Cluster(dir=a.cluster_dir.resolve()) if a.cluster_dir else Cluster()
    if a.rendered:
        paths = capture_rendered(c, a.rendered, a.as_name or Path(a.rendered).stem, a.out,
                                 operator_config=a.operator_config)
    elif a.namespace and a.pod:
        paths = capture(c, a.namespace, a.pod, a.out)
    else:
        ap.error("NAMESPACE POD, or --rendered FILE")
    for p in paths:
        print(p)


if __name__ == "__main__":
    main()
