"""CCC cells (``--setting ccc``): Continuously Changing Corruptions streams of the CIFAR-10 test images, and
the command that measures the source model's accuracy table their walks follow.

A CCC cell's corruption is ``ccc:baseline=B,speed=S,images=N``: a stream of ``N`` images whose two
corruptions walk so that the source model scores about ``B`` %, one severity step every ``S`` images
(:mod:`aqr.data.ccc`). Its images are drawn from the clean test set's ``DataSpec.eval_indices`` (the file
``DataSpec.clean``) and corrupted on the fly, once per stream (:func:`stream_cache` keeps them for the other
methods' cells); the walks read the model's accuracy table,
``<DataSpec.root>/ccc_accuracy/<model name>.json``, which

    python -m aqr.harness.ccc_table --model resnet20_trainstats --baseline 40

measures (on the clean test images ``0:5000``, outside the preset's evaluation pool ``5000:10000``). The
table's content, the clean images and the frost overlays enter the cell's key as its files.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aqr.data.arrays import load_npz_arrays
from aqr.data.ccc import AccuracyTable, CCCImages, Step, ccc_corruptions, ccc_steps
from aqr.data.corruption_params import CIFAR_PARAMS
from aqr.data.corruptions import load_frost_overlays
from aqr.harness.cells import CCC, Cell, DataSpec, ModelSpec, is_ccc, parse_range

TABLE_FOLDER = "ccc_accuracy"
STREAM_FOLDER = "ccc_streams"


@dataclass(frozen=True)
class CCCSpec:
    """A CCC stream: the source model's accuracy it holds (``baseline``, %), images per severity step
    (``speed``) and its length (``images``)."""

    baseline: float
    speed: int
    images: int

    def __post_init__(self) -> None:
        if not 0 < self.baseline < 100:
            raise ValueError(f"the CCC baseline must be an accuracy in (0, 100) %, got {self.baseline!r}")
        for name, value in (("speed", self.speed), ("images", self.images)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"the CCC {name} must be an integer >= 1, got {value!r}")

    @property
    def name(self) -> str:
        """The cell corruption that names this stream."""
        return f"{CCC}:baseline={self.baseline:g},speed={self.speed},images={self.images}"

    @classmethod
    def parse(cls, corruption: str) -> "CCCSpec":
        """The stream a cell corruption ``ccc:baseline=B,speed=S,images=N`` names; ``ValueError`` otherwise."""
        form = "ccc:baseline=B,speed=S,images=N"
        if not is_ccc(corruption):
            raise ValueError(f"{corruption!r} is not a CCC stream ({form})")
        try:
            fields = dict(part.split("=", 1) for part in corruption[len(CCC) + 1:].split(","))
            if set(fields) != {"baseline", "speed", "images"}:
                raise ValueError
            return cls(float(fields["baseline"]), int(fields["speed"]), int(fields["images"]))
        except ValueError as err:
            detail = f": {err}" if str(err) else ""
            raise ValueError(f"CCC stream {corruption!r} must read {form}{detail}") from None


def table_path(data: DataSpec, model: ModelSpec) -> Path:
    """Where the accuracy table of ``model`` lives for the data ``data``."""
    return Path(data.root) / TABLE_FOLDER / f"{model.name}.json"


def ccc_files(cell: Cell) -> dict[str, Path]:
    """Role -> file for what a CCC cell reads besides its model: the clean images, the accuracy table and,
    where its walks may use frost, the frost overlays."""
    if cell.data.clean is None:
        raise ValueError("a CCC cell makes its images from the clean test set: set DataSpec.clean")
    files = {"clean": Path(cell.data.clean), "ccc_table": table_path(cell.data, cell.model)}
    if "frost" in ccc_corruptions(CCCSpec.parse(cell.corruption).baseline):
        if cell.data.frost_dir is None:
            raise ValueError("a CCC stream uses frost: set DataSpec.frost_dir")
        files["frost"] = Path(cell.data.frost_dir)
    return files


def stream_of(cell: Cell, cache: bool = True) -> tuple[CCCImages, np.ndarray, list[Step]]:
    """A CCC cell's images (made when sliced, and kept in :func:`stream_cache` unless ``cache`` is false), their
    labels and the steps of its walks (seeded by the cell's seed)."""
    spec = CCCSpec.parse(cell.corruption)
    path = table_path(cell.data, cell.model)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no CCC accuracy table for {cell.model.name}; measure it with "
                                f"`python -m aqr.harness.ccc_table --model {cell.model.name} --baseline {spec.baseline:g}`")
    table = AccuracyTable.load(path)
    files = ccc_files(cell)
    images, labels = load_npz_arrays(files["clean"])
    pool = parse_range(cell.data.eval_indices, len(labels), "DataSpec.eval_indices")
    if pool is not None:
        images, labels = images[pool], labels[pool]
    steps = ccc_steps(table, spec.baseline, spec.speed, spec.images, cell.seed)
    overlays = load_frost_overlays(files["frost"], CIFAR_PARAMS.frost_scale) if "frost" in files else None
    stream = CCCImages(images, steps, cell.seed, overlays, cache=stream_cache(cell) if cache else None)
    return stream, np.asarray(labels)[stream.picks].astype(np.int64), steps


def stream_cache(cell: Cell) -> Path:
    """The folder that keeps a CCC cell's images once made: ``<DataSpec.root>/ccc_streams/<key>``, the key a
    hash of everything the images depend on (the files' contents, the pool, the stream, the seed and the
    generator's code), so the cells of every method on one stream share it and nothing else does."""
    from aqr.harness.fingerprints import file_fingerprint
    from aqr.harness.keys import canonical_json

    files = {role: file_fingerprint(role, path, "CCC stream") for role, path in ccc_files(cell).items()}  # as the key
    payload = {"files": files,
               "pool": cell.data.eval_indices, "stream": CCCSpec.parse(cell.corruption).name, "seed": cell.seed,
               "code": _generator_code()}
    return Path(cell.data.root) / STREAM_FOLDER / hashlib.sha256(canonical_json(payload).encode()).hexdigest()[:24]


@functools.lru_cache(maxsize=1)
def _generator_code() -> str:
    """A hash of what makes a CCC image: the source of aqr's modules that read the pool, walk the steps and
    corrupt the images, and the versions of the libraries they call (numpy's generators, scipy, Pillow and its
    JPEG library). A change to any makes new images."""
    import PIL
    import scipy
    from PIL import features

    import aqr.data.arrays
    import aqr.data.ccc
    import aqr.data.corruption_params
    import aqr.data.corruptions
    import aqr.harness.cells

    versions = f"{np.__version__} {scipy.__version__} {PIL.__version__} {features.version('jpg')}"
    digest = hashlib.sha256(versions.encode())
    for module in (aqr.data.ccc, aqr.data.corruptions, aqr.data.corruption_params, aqr.data.arrays,
                   aqr.harness.cells):
        digest.update(Path(module.__file__ or "").read_bytes())
    digest.update(Path(__file__).read_bytes())  # stream_of: the pool, the steps, the frost overlays' scale
    return digest.hexdigest()


def step_names(steps: Sequence[Step]) -> list[str]:
    """One name per step (``first-s1+second-s2``), as a stream result's blocks are named."""
    return [f"{s.first}-{s.first_severity:g}+{s.second}-{s.second_severity:g}" for s in steps]
