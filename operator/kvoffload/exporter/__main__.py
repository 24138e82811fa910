"""`python -m kvoffload.exporter [flags]`: the exporter alone. It does not import the operator's
other sub-commands (and their Kubernetes client), which keeps the sidecar's memory small."""

from __future__ import annotations

import argparse
import sys

from ..api.errors import ConfigError
from .cli import DESCRIPTION, add_arguments, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvoffload.exporter", description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
