"""`kvoffload` command line: each sub-command lives in its own module and registers itself."""

from __future__ import annotations

import argparse
import importlib
import sys

from ..api.errors import ConfigError

# sub-command -> module exposing `register(subparsers)`; the parser it adds sets `func`.
SUBCOMMANDS = {
    "plan": "kvoffload.cli.plan",
    "render": "kvoffload.cli.render",
    "run": "kvoffload.cli.run",
    "exporter": "kvoffload.exporter.cli",
    "clean-disk": "kvoffload.cli.clean_disk",
    "prepare-disk-tier": "kvoffload.cli.prepare_disk",
    "prepare-shared-memory": "kvoffload.cli.prepare_shm",
    "wait-for-shared-cache": "kvoffload.cli.wait_server",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """All sub-commands, or only `only`: the exporter sidecar must not pay for the kubernetes client."""
    parser = argparse.ArgumentParser(prog="kvoffload", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, module in SUBCOMMANDS.items():
        if only in (None, name):
            importlib.import_module(module).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    only = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    args = build_parser(only).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
