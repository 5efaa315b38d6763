"""The ``aqr`` command line: a thin dispatcher over the Python API.

Each sub-command lives in its own module ``aqr.cli.<name>`` exposing ``register(subparsers)``,
which adds its parser and sets ``func`` (a callable taking the parsed namespace and returning an
exit code); :mod:`aqr.cli.common` holds the arguments several commands share. A command imports
what it runs only when it runs, so a missing optional dependency only breaks its own command.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name of the command -> module that implements it
COMMANDS: dict[str, str] = {
    "calibrate": "aqr.cli.calibrate",
    "corrupt": "aqr.cli.corrupt",
    "train": "aqr.cli.train",
    "evaluate": "aqr.cli.evaluate",
    "bench": "aqr.cli.bench",
    "report": "aqr.cli.report",
    "demo": "aqr.cli.demo",
    "synth": "aqr.cli.synth",
}


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every available sub-command registered."""
    from aqr import __version__

    parser = argparse.ArgumentParser(prog="aqr", description="Test-time adaptation by Adaptive Quantile Recalibration.")
    parser.add_argument("--version", action="version", version=f"aqr {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMANDS.values():
        importlib.import_module(module_name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
