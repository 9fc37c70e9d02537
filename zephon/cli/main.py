"""The ``zephon`` command line.

Each command registers itself with ``register(subparsers)`` and sets ``func(args) -> exit code``.
"""

from __future__ import annotations

import argparse
import importlib
import sys


def _ledger(args: argparse.Namespace) -> int:
    from ..runtime import ledger as L

    try:
        if args.ledger_command == "diff":
            result = L.diff(args.a, args.b)
            print(result)
            return 0 if result.match else 1
        for line in L.show_lines(args.path):
            print(line)
        return 0
    except (OSError, ValueError) as exc:
        print(f"zephon ledger: {exc}", file=sys.stderr)
        return 2


def _register_ledger(sub) -> None:
    ledger = sub.add_parser("ledger", help="batch ledgers: compare the batches of two runs step by step")
    lsub = ledger.add_subparsers(dest="ledger_command", required=True)
    d = lsub.add_parser("diff", help="first step and lane where two ledgers diverge")
    d.add_argument("a", help="a ledger file or a directory of per-rank ledger files")
    d.add_argument("b", help="the other ledger file or directory")
    show = lsub.add_parser("show", help="print the global digest of every complete step, and the skipped steps")
    show.add_argument("path", help="a ledger file or a directory of per-rank ledger files")
    ledger.set_defaults(func=_ledger)


def _command(module: str):
    """The ``register`` of a command that lives in a module of its own, imported when called."""
    return lambda sub: importlib.import_module(f".{module}", __package__).register(sub)


#: One entry per command, in the order ``zephon --help`` lists them.
COMMANDS = [
    _command("demo"),
    _register_ledger,
    _command("plan"),
    _command("index"),
    _command("inspect"),
    _command("explain"),
    _command("bench"),
]


def main(argv: list[str] | None = None) -> int:
    from .. import __version__

    parser = argparse.ArgumentParser(prog="zephon", description="Deterministic, elastic LLM data loading.")
    parser.add_argument("--version", action="version", version=f"zephon-lanes {__version__}", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    for register in COMMANDS:
        register(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
