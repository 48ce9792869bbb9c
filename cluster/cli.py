"""`specinfer` command line: models fetch, generate, serve, client, bench, experiment."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Each module adds its sub-commands with add_parsers(subparsers); missing ones are skipped. They are
# imported when the parser is built, never when this module is: `bench` (the benchmark harness) sits
# above `cluster`, and no cluster module imports it at import time.
COMMAND_MODULES = ("cluster.cli_generate", "cluster.cli_serve", "bench.cli", "cluster.cli_k8s")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specinfer", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name != name and not name.startswith(f"{error.name}."):
                raise
            continue
        module.add_parsers(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.handler(args) or 0)
    except (ValueError, FileNotFoundError) as error:
        print(f"specinfer: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
