"""matplotlib is an extra (``aqr[report]``): the library and its CLI run without it, and whatever
would draw says in one line what to install, before it writes anything."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = "import sys; sys.modules['matplotlib'] = None  # as if it were not installed\n"


def _run(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + textwrap.dedent(code)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)


def test_matplotlib_is_an_extra_not_a_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("matplotlib") for d in project["dependencies"])
    for extra in ("report", "demo", "test"):
        assert any(d.startswith("matplotlib") for d in project["optional-dependencies"][extra]), extra


def test_calibrating_and_adapting_need_no_matplotlib(tmp_path):
    done = _run("""
        import torch, aqr
        from torch import nn
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.LazyLinear(3))
        model(torch.rand(2, 3, 8, 8)); model.eval()
        stats = aqr.calibrate(model, [torch.rand(16, 3, 8, 8) for _ in range(2)])
        y = aqr.AQR(model, stats)(torch.rand(16, 3, 8, 8) * 2)
        import aqr.harness.report, aqr.experiments.demo, aqr.cli  # the modules that draw import without it too
        print(tuple(y.shape), sys.modules['matplotlib'])
    """, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["(16,", "3)", "None"]


def test_report_and_demo_say_what_to_install_before_writing(tmp_path):
    for argv, what in ((["report", "--db", "results.db", "--out", "report"], "aqr report's figures"),
                       (["demo", "--out", "demo", "--quick"], "the demo's figure")):
        done = _run(f"from aqr.cli import main; raise SystemExit(main({json.dumps(argv)}))", tmp_path)
        lines = done.stderr.strip().splitlines()
        assert done.returncode != 0 and len(lines) == 1, done.stderr
        assert what in lines[0] and "pip install 'aqr[report]'" in lines[0], lines[0]
        assert not (tmp_path / argv[argv.index("--out") + 1]).exists()  # nothing written before the refusal
