"""The ``aqr`` command line: a thin dispatcher over the Python API.

Each sub-command lives in its own module ``aqr.cli.<name>`` exposing ``register(subparsers)``,
which adds its parser and sets ``func`` (a callable taking the parsed namespace and returning an
exit code); :mod:`aqr.cli.common` holds the arguments several commands share. A command imports
what it runs only when it runs, so a missing optional dependency only breaks its own command.

Errors are handled here, once for every command: an exception a command lets through becomes one
line on stderr (``aqr COMMAND: error: ...``) and exit status 2 when the arguments are at fault
(:class:`aqr.cli.common.UsageError`, unknown names, values out of range, a missing input file) or 1
when running failed (an unreadable checkpoint, statistics or database, NaN activations, any other
error). ``--debug`` (before or after the command) or ``AQR_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

DEBUG_ENV = "AQR_DEBUG"  # set to 1: tracebacks instead of one-line errors
WORKER_TRACEBACK = "Original Traceback (most recent call last):"  # how torch's DataLoader re-raises a worker's error

# name of the command -> module that implements it
COMMANDS: dict[str, str] = {
    "calibrate": "aqr.cli.calibrate",
    "corrupt": "aqr.cli.corrupt",
    "train": "aqr.cli.train",
    "evaluate": "aqr.cli.evaluate",
    "export": "aqr.cli.export",
    "bench": "aqr.cli.bench",
    "report": "aqr.cli.report",
    "demo": "aqr.cli.demo",
    "synth": "aqr.cli.synth",
}


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every available sub-command registered."""
    from aqr._version import __version__

    parser = argparse.ArgumentParser(prog="aqr", description="Test-time adaptation by Adaptive Quantile Recalibration.")
    parser.add_argument("--version", action="version", version=f"aqr {__version__}")
    debug_help = f"show the traceback of an error (also: {DEBUG_ENV}=1)"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMANDS.values():
        importlib.import_module(module_name).register(sub)
    for command in sub.choices.values():  # also after the command; SUPPRESS keeps a --debug given before
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    from aqr.cli.common import use_help_formatter

    use_help_formatter(parser)  # every command's --help shows its defaults
    return parser


def exit_status(err: BaseException) -> int:
    """2 when a command's arguments are at fault, 1 when running it failed (see the module docstring)."""
    import sqlite3

    from aqr.backends.native import NativeKernelError
    from aqr.cli.common import UsageError
    from aqr.core.layers import NonFiniteActivationError
    from aqr.core.stats import StatsError
    from aqr.harness.results import ResultsDBError
    from aqr.models.checkpoint import CheckpointError

    if isinstance(err, (CheckpointError, StatsError, NonFiniteActivationError, ResultsDBError, NativeKernelError,
                        sqlite3.Error)):
        return 1  # a file or a batch that cannot be used (these subclass ValueError too)
    if isinstance(err, (UsageError, ValueError, KeyError, TypeError, FileNotFoundError)):
        return 2
    return 1


def error_line(err: BaseException) -> str:
    """The error as one line: its message (a KeyError's without quotes), with the type for unexpected kinds."""
    from aqr.cli.common import UsageError

    message = str(err.args[0] if isinstance(err, KeyError) and err.args else err)
    if WORKER_TRACEBACK in message:  # a DataLoader worker's error carries its whole traceback: keep its last line
        last = [line for line in message.split(WORKER_TRACEBACK, 1)[1].splitlines() if line.strip()][-1:]
        message = last[0].split(": ", 1)[-1] if last else message
    text = " ".join(message.split()) or type(err).__name__
    expected = (UsageError, ValueError, KeyError, TypeError, OSError, ImportError, RuntimeError, MemoryError)
    return text if isinstance(err, expected) else f"{type(err).__name__}: {text}"


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
    except Exception as err:  # noqa: BLE001 - every error a command lets through becomes one line
        if args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        print(f"aqr {args.command}: error: {error_line(err)}", file=sys.stderr)
        return exit_status(err)
