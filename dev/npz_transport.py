"""Shrink an image ``.npz`` (``x`` uint8 N x H x W x 3) for a size-limited transfer, and restore it exactly.

A lent GPU machine takes at most 64 MiB per call, and the JPEG-75 CIFAR-10 training set is a
142 MB npz. Its images were JPEG-decoded once already, so re-encoding
each at quality 75 (4:2:0) gives bytes that decode to almost the same pixels; ``pack`` keeps those
bytes (minus the header they all share) plus the exact residual, and ``unpack`` rebuilds ``x``
bit for bit and checks it against the SHA-256 of the original arrays, stored in the pack.

    python dev/npz_transport.py pack "$AQR_DATA_DIR/cifar10_train_jpeg75.npz" train.pack.npz
    python dev/npz_transport.py unpack train.pack.npz train.npz
    python dev/npz_transport.py restamp model.pt "$AQR_DATA_DIR/cifar10_train_jpeg75.npz" train.pack.npz

``restamp`` rewrites the ``data_sha256`` of a checkpoint trained on the rebuilt file (whose bytes differ
from the original's, since zip members carry timestamps) to the original file's hash, after checking
that the original's arrays hash to what the pack promised; the rebuilt file's hash is kept beside it.

``pack`` and ``unpack`` need Pillow (``restamp`` does not). Decoders other than the packing machine's may round differently; ``unpack`` then
fails loudly unless ``--allow-mismatch`` is given (and reports how far off the pixels are).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import sys
from pathlib import Path

import numpy as np

QUALITY = 75
SOS = b"\xff\xda"


def array_sha256(a: np.ndarray) -> str:
    """SHA-256 of an array's dtype, shape and C-order bytes."""
    h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
    h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _encode(img: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=QUALITY, subsampling=2)
    return buf.getvalue()


def _split_header(data: bytes) -> int:
    """Length of the JPEG header up to the end of the start-of-scan segment."""
    i = data.index(SOS)
    return i + 2 + int.from_bytes(data[i + 2:i + 4], "big")


def _decode(data: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def pack(src: str, dst: str) -> None:
    with np.load(src, allow_pickle=False) as d:
        arrays = {k: d[k] for k in d.files}
    x = arrays.pop("x")
    encoded = [_encode(img) for img in x]
    header = encoded[0][:_split_header(encoded[0])]
    if any(e[:len(header)] != header for e in encoded):
        raise ValueError("images do not share one JPEG header; cannot strip it")
    bodies = [e[len(header):] for e in encoded]
    offsets = np.cumsum([0] + [len(b) for b in bodies]).astype(np.int64)
    decoded = np.stack([_decode(e) for e in encoded])
    residual = x.astype(np.int16) - decoded
    residual = residual.astype(np.int8) if np.abs(residual).max() <= 127 else residual
    np.savez_compressed(
        dst, header=np.frombuffer(header, np.uint8), body=np.frombuffer(b"".join(bodies), np.uint8),
        offsets=offsets, residual=residual, x_shape=np.array(x.shape), x_sha256=np.array(array_sha256(x)),
        **{f"keep_{k}": v for k, v in arrays.items()})
    print(f"packed {len(x)} images: {offsets[-1] / len(x):.0f} JPEG bytes/image, residual nonzero "
          f"{(residual != 0).mean():.1%}, x sha256 {array_sha256(x)[:16]}")


def unpack(src: str, dst: str, allow_mismatch: bool = False) -> None:
    with np.load(src, allow_pickle=False) as d:
        p = {k: d[k] for k in d.files}
    header, body, offsets = p["header"].tobytes(), p["body"].tobytes(), p["offsets"]
    x = np.stack([_decode(header + body[offsets[i]:offsets[i + 1]]) for i in range(len(offsets) - 1)])
    x = (x.astype(np.int16) + p["residual"]).clip(0, 255).astype(np.uint8).reshape(tuple(p["x_shape"]))
    got, want = array_sha256(x), str(p["x_sha256"])
    if got != want:
        msg = f"rebuilt x has sha256 {got[:16]}, the original {want[:16]}: this JPEG decoder differs"
        if not allow_mismatch:
            raise SystemExit(msg)
        print("WARNING: " + msg, file=sys.stderr)
    arrays = {k[len("keep_"):]: v for k, v in p.items() if k.startswith("keep_")}
    np.savez(dst, x=x, **arrays)
    print(f"unpacked {len(x)} images to {dst}; x sha256 {got[:16]} {'matches' if got == want else 'DIFFERS'}")


def restamp(checkpoint: str, original: str, pack_file: str) -> None:
    from aqr.models.checkpoint import atomic_save, read_file

    with np.load(pack_file, allow_pickle=False) as p:
        promised = str(p["x_sha256"])
    with np.load(original, allow_pickle=False) as d:
        if array_sha256(d["x"]) != promised:
            raise SystemExit(f"{original}: its images are not the ones packed in {pack_file}")
    obj = read_file(checkpoint)
    meta = obj["meta"]
    if meta["data"] != Path(original).name:
        raise SystemExit(f"{checkpoint} was trained on {meta['data']!r}, not {Path(original).name!r}")
    meta["data_rebuilt_sha256"] = meta["data_sha256"]
    meta["data_sha256"] = hashlib.sha256(Path(original).read_bytes()).hexdigest()
    meta["data_images_sha256"] = promised
    meta["data_note"] = ("trained on a bit-exact rebuild of the data file (dev/npz_transport.py; the rebuild "
                         "checked its images against data_images_sha256)")
    atomic_save(obj, checkpoint)
    print(f"{checkpoint}: data_sha256 {meta['data_rebuilt_sha256'][:12]}... -> {meta['data_sha256'][:12]}...")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("pack", "unpack"):
        p = sub.add_parser(name)
        p.add_argument("src")
        p.add_argument("dst")
        if name == "unpack":
            p.add_argument("--allow-mismatch", action="store_true")
    p = sub.add_parser("restamp")
    p.add_argument("checkpoint")
    p.add_argument("original")
    p.add_argument("pack")
    args = parser.parse_args()
    if args.cmd == "restamp":
        restamp(args.checkpoint, args.original, args.pack)
    elif args.cmd == "pack":
        pack(args.src, args.dst)
    else:
        unpack(args.src, args.dst, args.allow_mismatch)


if __name__ == "__main__":
    main()
