"""Running the CLI in a test and reading the one error line it should print."""

from __future__ import annotations

from aqr.cli import main


def one_error_line(capsys, argv: list[str], status: int, *words: str) -> str:
    """Run the CLI; check its exit status and that it printed one error line holding ``words`` (argparse's
    usage lines aside, and its own refusals' ``SystemExit`` read as their status); returns that line."""
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's own refusals
        code = stop.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("usage:", " "))]
    assert code == status and len(lines) == 1, (code, lines)
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]
