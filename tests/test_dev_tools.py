"""The developer tools in ``dev/`` (not part of the package)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

TOOL = Path(__file__).resolve().parents[1] / "dev" / "npz_transport.py"


def _array_sha256(a: np.ndarray) -> str:  # as the tool hashes the images
    import hashlib

    h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
    h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def test_npz_transport_rebuilds_the_images_bit_for_bit(tmp_path: Path) -> None:
    """dev/npz_transport.py: pack an image npz small, unpack it bit for bit, catch a damaged pack."""
    pytest.importorskip("PIL")
    rng = np.random.default_rng(0)
    smooth = rng.integers(0, 256, (40, 8, 8, 3)).repeat(4, axis=1).repeat(4, axis=2).astype(np.uint8)
    np.savez(tmp_path / "orig.npz", x=smooth, y=np.arange(40) % 10, classes=np.array(["a", "b"]))
    tool = TOOL
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


def test_npz_transport_restamps_a_checkpoint_with_the_original_files_hash(tmp_path: Path) -> None:
    """restamp: the original file's hash replaces the rebuild's, only when the images match the pack's promise."""
    import hashlib

    x = np.random.default_rng(1).integers(0, 256, (6, 4, 4, 3)).astype(np.uint8)
    np.savez(tmp_path / "train.npz", x=x, y=np.arange(6))
    np.savez(tmp_path / "pack.npz", x_sha256=np.array(_array_sha256(x)))
    np.savez(tmp_path / "other_pack.npz", x_sha256=np.array(_array_sha256(x[::-1])))
    ckpt = tmp_path / "model.pt"
    torch.save({"format": "aqr-model", "meta": {"data": "train.npz", "data_sha256": "rebuilt"}}, ckpt)

    def restamp(pack: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(TOOL), "restamp", str(ckpt), str(tmp_path / "train.npz"),
                               str(tmp_path / pack)], capture_output=True, text=True)

    refused = restamp("other_pack.npz")
    assert refused.returncode != 0 and "not the ones packed" in refused.stderr
    assert torch.load(ckpt, weights_only=True)["meta"]["data_sha256"] == "rebuilt"
    assert restamp("pack.npz").returncode == 0
    meta = torch.load(ckpt, weights_only=True)["meta"]
    assert meta["data_sha256"] == hashlib.sha256((tmp_path / "train.npz").read_bytes()).hexdigest()
    assert meta["data_rebuilt_sha256"] == "rebuilt" and meta["data_images_sha256"] == _array_sha256(x)
