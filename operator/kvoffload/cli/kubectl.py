"""`kubectl kvs`: the kubectl plugin (the `kubectl-kvs` executable from this package).

  kubectl kvs plan ...            = kvoffload plan ...   (offline sizing)
  kubectl kvs render -f FILE      = kvoffload render ... (offline children)
  kubectl kvs why NAME [-n NS]    a resource's conditions, budget, children and events in plain words

`why` reads through the kubeconfig (KUBECONFIG, --kubeconfig, --context), as kubectl does.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone

from ..api import crd
from ..rendering import render, shared_cache
from . import main as kvoffload_main
from . import why as why_mod

USAGE = __doc__


def _client(kubeconfig: str | None, context: str | None):
    from kubernetes import client, config

    config.load_kube_config(config_file=kubeconfig, context=context)
    _, active = config.list_kube_config_contexts(config_file=kubeconfig)
    if context:
        active = next(c for c in config.list_kube_config_contexts(config_file=kubeconfig)[0] if c["name"] == context)
    return client.ApiClient(), (active.get("context") or {}).get("namespace") or "default"


def why(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kubectl kvs why", description="Explain a KVOffloadServe in plain words.")
    p.add_argument("name")
    p.add_argument("-n", "--namespace")
    p.add_argument("--kubeconfig")
    p.add_argument("--context")
    args = p.parse_args(argv)
    from ..controller.kube import ApiError, Kube, collection

    api, default_ns = _client(args.kubeconfig, args.context)
    kube, ns = Kube(api), args.namespace or default_ns
    base = f"/apis/{crd.GROUP}/{crd.VERSION}/namespaces/{ns}/{crd.PLURAL}"
    try:
        obj = kube.get(f"{base}/{args.name}")
        if obj is None:
            print(f"error: KVOffloadServe {args.name} not found in namespace {ns}", file=sys.stderr)
            return 1
        sts = kube.get(f"{collection('apps/v1', 'StatefulSet', ns)}/{render.names(args.name)['statefulset']}")
        pods = kube.list(collection("v1", "Pod", ns), f"{render.OWNER_LABEL}={args.name}")
        names = {args.name, *(p["metadata"]["name"] for p in pods)}
        # PerNode: the node servers' Deployments (they keep the owner label; their pods do not).
        servers = kube.list(collection("apps/v1", "Deployment", ns),
                            f"{render.OWNER_LABEL}={args.name},app.kubernetes.io/component={shared_cache.COMPONENT}")
        events = [e for e in kube.request("GET", f"/api/v1/namespaces/{ns}/events")["items"]
                  if (e.get("involvedObject") or {}).get("uid") == obj["metadata"]["uid"]
                  or ((e.get("involvedObject") or {}).get("kind") == "Pod"
                      and e["involvedObject"].get("name") in names)]
    except ApiError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(why_mod.explain(obj, sts, pods, events, datetime.now(timezone.utc), servers))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command in ("plan", "render"):
        return kvoffload_main.main([command, *rest])
    if command == "why":
        return why(rest)
    print(f"error: unknown command {command!r}; allowed: plan, render, why\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
