"""`kvoffload render -f FILE`: the children the operator would apply, offline, as a YAML stream."""

from __future__ import annotations

import argparse
import re
import sys

import yaml

from ..api import crd
from ..api import settings as settings_mod
from ..api.errors import ConfigError
from ..controller import pipeline
from ..rendering import shared_cache


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("render", help="print the children of KVOffloadServe(s) without a cluster")
    p.add_argument("-f", "--filename", required=True, help="YAML file with KVOffloadServe documents ('-' for stdin)")
    p.add_argument("--operator-config", help="operator settings YAML (allowed disk roots, default image, ...)")
    p.add_argument("--namespace", default="default", help="namespace for documents that name none")
    p.add_argument("--node", action="append", default=[], metavar="NAME",
                   help="spec.offload.server PerNode: render the shared server of this node too, as if a replica "
                        "were bound there (repeatable; without it, no node runs one offline)")
    p.set_defaults(func=render_file)


def desired_from_file(filename: str, namespace: str, operator_config: str | None,
                      nodes: tuple[str, ...] = ()) -> list[tuple[str, pipeline.Desired]]:
    """What the operator wants for each KVOffloadServe in a file: its own parse -> plan -> render, offline. `nodes`:
    where PerNode resources' replicas are taken to be bound (each gets its server; the address stays the DNS name)."""
    settings = settings_mod.load(operator_config)
    with (sys.stdin if filename == "-" else open(filename, encoding="utf-8")) as fh:
        docs = [d for d in yaml.safe_load_all(fh) if d]
    out = []
    for doc in docs:
        if doc.get("kind") != crd.KIND:
            continue
        meta = doc.get("metadata") or {}
        name, ns = meta.get("name", ""), meta.get("namespace", namespace)
        try:
            # Offline there is no uid, so children carry no ownerReferences; the operator adds them.
            out.append((f"{ns}/{name}", pipeline.desired(name, ns, "", doc.get("spec") or {}, settings,
                                                          nodes=tuple(shared_cache.Node(n) for n in sorted(nodes)))))
        except ConfigError as exc:
            raise ConfigError(f"{ns}/{name} {exc.field}", exc.message) from None
    if not out:
        raise ConfigError(filename, f"no {crd.KIND} documents found")
    return out


def render_file(args: argparse.Namespace) -> int:
    sys.stdout.write(dump_all([c for _, d in desired_from_file(args.filename, args.namespace, args.operator_config,
                                                               tuple(args.node)) for c in d.children]))
    return 0


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: object) -> bool:  # manifests, not anchors
        return True


# Strings a YAML 1.2 reader (kubectl, Go) would take for a number or a bool; PyYAML (YAML 1.1) leaves
# some of them, such as 1e3, unquoted.
_AMBIGUOUS = re.compile(r"^([-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)"
                        r"|0x[0-9a-fA-F]+|0o[0-7]+|true|false|True|False|TRUE|FALSE|null|Null|NULL|~|yes|no|on|off)$")


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    # Multi-line strings (the LMCache config) as literal blocks, so reviews read like the file itself.
    if "\n" in value:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|")
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style='"' if _AMBIGUOUS.match(value) else None)


_Dumper.add_representer(str, _str)


def dump_all(objs: list[dict]) -> str:
    return yaml.dump_all(objs, Dumper=_Dumper, sort_keys=False)
