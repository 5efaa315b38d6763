"""The developer tools in ``dev/`` (not part of the package)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest


def test_npz_transport_rebuilds_the_images_bit_for_bit(tmp_path: Path) -> None:
    """dev/npz_transport.py: pack an image npz small, unpack it bit for bit, catch a damaged pack."""
    pytest.importorskip("PIL")
    rng = np.random.default_rng(0)
    smooth = rng.integers(0, 256, (40, 8, 8, 3)).repeat(4, axis=1).repeat(4, axis=2).astype(np.uint8)
    np.savez(tmp_path / "orig.npz", x=smooth, y=np.arange(40) % 10, classes=np.array(["a", "b"]))
    tool = Path(__file__).resolve().parents[1] / "dev" / "npz_transport.py"
    for args in (["pack", tmp_path / "orig.npz", tmp_path / "p.npz"], ["unpack", tmp_path / "p.npz", tmp_path / "back.npz"]):
        subprocess.run([sys.executable, str(tool), *map(str, args)], check=True, capture_output=True)
    with np.load(tmp_path / "orig.npz") as a, np.load(tmp_path / "back.npz") as b:
        assert sorted(a.files) == sorted(b.files)
        for k in a.files:
            assert np.array_equal(a[k], b[k]), k
    # a damaged residual is caught by the stored hash
    with np.load(tmp_path / "p.npz") as p:
        parts = {k: p[k] for k in p.files}
    parts["residual"] = parts["residual"].copy()
    parts["residual"].flat[0] += 1
    np.savez(tmp_path / "bad.npz", **parts)
    done = subprocess.run([sys.executable, str(tool), "unpack", str(tmp_path / "bad.npz"), str(tmp_path / "x.npz")],
                          capture_output=True, text=True)
    assert done.returncode != 0 and "differs" in done.stderr + done.stdout
