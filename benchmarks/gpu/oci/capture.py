"""Save the OCI runtime spec containerd generated for every container of a pod on the real node.

    python benchmarks/gpu/oci/capture.py NAMESPACE POD [--out DIR] [--cluster-dir DIR]

Writes DIR/<pod>/<container>.json (default DIR: benchmarks/gpu/oci) for each init container, container
and the pod's sandbox: the bundle's config.json runc ran (the spec containerd stored once a container
exited). What a GPU run compares: user, capabilities, mounts (tmpfs sizes, hostPaths), devices, cgroup
limits, rlimits, seccomp. See README.md here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvtest import Cluster, node


def capture(c: Cluster, namespace: str, pod: str, out: Path) -> list[Path]:
    specs = node.oci_specs(c, namespace, pod)
    if not specs:
        raise SystemExit(f"pod {namespace}/{pod} has no started container on {node.NAME}")
    d = out / pod
    d.mkdir(parents=True, exist_ok=True)
    written = []
    for name, spec in specs.items():
        path = d / f"{name.strip('()')}.json"
        path.write_text(json.dumps(spec, indent=1, sort_keys=True) + "\n")
        written.append(path)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("namespace")
    ap.add_argument("pod")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    ap.add_argument("--cluster-dir", type=Path, help="the real node's cluster (default: KVO_CLUSTER_DIR or .cluster)")
    a = ap.parse_args()
    c = Cluster(dir=a.cluster_dir.resolve()) if a.cluster_dir else Cluster()
    for p in capture(c, a.namespace, a.pod, a.out):
        print(p)


if __name__ == "__main__":
    main()
