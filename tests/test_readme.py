"""The README and the method list keep their promises: the Quick start runs as pasted, every call and
option the README's tables name and every file it links exists, and docs/benchmark.md has a line for every
method."""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import aqr
from aqr.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_WORDS = 1300


def _readme() -> str:
    if not README.is_file():
        pytest.skip("README.md is not in this checkout")
    return README.read_text(encoding="utf-8")


def _section(text: str, title: str) -> str:
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_readme_is_short() -> None:
    assert len(_readme().split()) <= MAX_WORDS


def test_every_relative_link_in_the_readme_exists() -> None:
    links = re.findall(r"\]\(([^)\s]+)\)", _readme())
    local = [link.split("#", 1)[0] for link in links if "://" not in link and not link.startswith("#")]
    assert len(local) >= 10
    for target in local:
        assert (ROOT / target).exists(), target


def test_every_call_in_the_api_table_exists() -> None:
    calls = re.findall(r"^\| `(aqr\.[\w.]+)\(", _section(_readme(), "API"), flags=re.M)
    assert len(calls) >= 8
    for dotted in calls:
        parts = dotted.split(".")
        obj: object = aqr
        for i, part in enumerate(parts[1:], start=2):
            if not hasattr(obj, part):  # a submodule not yet imported, e.g. aqr.data.streams
                importlib.import_module(".".join(parts[:i]))
            obj = getattr(obj, part)
        assert callable(obj), dotted


def test_every_cli_option_in_the_readme_exists() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for line in _section(_readme(), "CLI").splitlines():
        found = re.match(r"^\| `aqr (\w+)", line)
        if not found:
            continue
        options = {o for a in sub.choices[found.group(1)]._actions for o in a.option_strings}
        for option in re.findall(r"(--[a-z][a-z-]*)", line):
            assert option in options, (found.group(1), option)


def test_benchmark_docs_list_every_method() -> None:
    text = (ROOT / "docs" / "benchmark.md").read_text(encoding="utf-8")
    section = text.split("## The methods compared", 1)[1].split("\n## ", 1)[0]
    for name in aqr.methods.available():
        assert re.search(rf"\*\*[^*]*\*\*[^\n]*`{re.escape(name)}`|\*\*{re.escape(name)}\*\*", section, re.I), name


@pytest.mark.slow
def test_the_quick_start_runs_as_pasted(tmp_path: Path) -> None:
    block = _section(_readme(), "Quick start").split("```python\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "quick_start.py"
    script.write_text(block + "\nprint(tuple(logits.shape))\n", encoding="utf-8")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "(4, 10)"
    assert (tmp_path / "resnet20_bn.aqr.safetensors").is_file()
