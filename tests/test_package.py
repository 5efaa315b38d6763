"""The package's front: the public names, ``import aqr`` stays light, subpackages load on first use."""

from __future__ import annotations

import subprocess
import sys

import aqr

PUBLIC = {"AQR", "AQRConfig", "LayerError", "LayerInfo", "LayerStats", "NonFiniteActivationError", "SourceStats",
          "StatsError", "TAILS", "calibrate", "channel_quantiles", "dkw_epsilon", "export", "norm_layers",
          "quantile_map", "recalibrating", "SmallBatchWarning"}


def test_public_names() -> None:
    assert set(aqr.__all__) == PUBLIC and all(hasattr(aqr, name) for name in PUBLIC)
    assert set(aqr.SUBMODULES) <= set(dir(aqr))


def test_import_is_light_and_subpackages_load_on_first_use() -> None:
    script = """
import sys
import aqr
heavy = ("torch", "numpy", "matplotlib", "scipy", "ray", "sklearn", "PIL", "aqr.data", "aqr.harness", "aqr.methods",
         "aqr.models", "aqr.experiments", "aqr.cli")
assert not [m for m in heavy if m in sys.modules], [m for m in heavy if m in sys.modules]
assert callable(aqr.models.load) and callable(aqr.methods.create) and "aqr.methods" in sys.modules
assert aqr.AQR.__name__ == "AQR" and "aqr.adapt" in sys.modules
try:
    aqr.no_such_thing
except AttributeError as err:
    assert "no_such_thing" in str(err)
else:
    raise SystemExit("aqr.no_such_thing did not raise AttributeError")
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_the_command_line_help_does_not_import_torch() -> None:
    """``aqr --help`` answers at once: no command imports torch (or numpy's heavier users) to register."""
    script = "import sys\nfrom aqr.cli import build_parser\nbuild_parser().format_help()\nprint('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-2000:]
