"""How well ``target="mixed"`` could do with a better assignment: the field's streams replayed with each
image's component given from outside, offline.

``target="mixed"`` keeps per layer several running states (components) and maps each image with the one its
descriptor picks (``aqr.adapt.stream.mixed``). This script separates the two halves of that design: it
replays a field cell (batch 64, online) with the components named by a label per image, one label shared by
every layer from ``--from-layer`` on (the earlier layers map every image with one state, as
``target="stream"``), and prints the stream's accuracy. The labels (``--labels``):

- ``stream``: one label for every image (``components=1``, which is ``target="stream"`` value for value);
  this run also records each image's descriptor (:func:`aqr.adapt.stream.mixed.image_descriptors`) at every
  layer, which the ``kmeans`` labels need, in ``--descriptors``;
- ``domain``: the true corruption of each image (an oracle: no method knows it);
- ``kmeans``: k-means (``--k`` clusters) of the images' descriptors of the first ``--desc-layers`` layers
  (default all), each layer's z-scored and weighted by one over the square root of its width,
  concatenated, whitened to ``--pca`` principal components (0: not reduced); fitted on the whole stream at
  once (it sees the future: an upper bound for an online clustering of those descriptors). Needs
  scikit-learn;
- ``centroid``: the nearest of the 15 corruptions' centroids in that whitened space, the centroids taken
  from the true corruptions (an oracle of how far the descriptors tell the corruptions apart);
- ``online``: a causal clustering of the same concatenation (not z-scored: the descriptors are already
  standardized by the source), batch by batch: each image to the nearest centre by the median squared
  difference; the farthest image of a batch starts a new centre (up to ``--k``) where it lies more than
  ``--tau`` times the running mean distance of the images to their centres; centres and that mean are
  running means over 500 images;
- ``minibatch``: a causal mini-batch k-means (``--k`` clusters, scikit-learn's ``MiniBatchKMeans``: each
  batch labelled by the centres before it, then taken into them; the first batch all in cluster 0) of
  the same concatenation whitened by the pooled within-corruption covariance, the images' spread that
  their content makes (an oracle: that covariance comes from the true corruptions; of the descriptors file
  ``--whiten-descriptors`` where given, e.g. the mixed stream's for a continual run, else of this stream's).

``--setting clean`` runs the last 2,560 clean CIFAR-10 test images (``$AQR_DATA_DIR/cifar10_test.npz``) in
batches of 64 instead of a field cell: with ``--labels stream --descriptors clean.npz`` it records the
source's descriptors, whose covariance (the content's spread) ``--whiten-descriptors clean.npz`` takes.

A component that takes its first image starts from a copy of the first component's state. The offline
assignment is not a method: the numbers bound what an assignment of the kind could give.

``--beta B`` (default 1) blends each image's component with one shared state: every recalibrated layer also
keeps a ``target="stream"`` state stepped by every image of every batch, and maps each image as ``(1 - B)``
times the shared state's map plus ``B`` times its component's (:class:`SharedBlend`; ``--beta 0`` is
``target="stream"``). A clustering that splits one domain by content maps each part onto the whole
source distribution; the blend keeps half of the shared state's map there.

    AQR_DATA_DIR=... python benchmarks/mixed_assignment.py --setting mixed_domains --labels stream \\
        --descriptors desc.npz
    AQR_DATA_DIR=... python benchmarks/mixed_assignment.py --setting mixed_domains --labels kmeans --k 8 \\
        --descriptors desc.npz
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from aqr.adapt.stream import mixed
from aqr.adapt.stream.base import all_finite
from aqr.adapt.stream.running import LayerStream
from aqr.data import to_float
from aqr.data.streams import StreamOrder
from aqr.harness import continual
from aqr.harness.cell_run import build_method
from aqr.harness.presets import preset
from aqr.harness.settings import apply_setting


class LabelAssigner:
    """A layer's assigner that takes each image's component from ``labels`` (the current batch's, set from
    outside); before ``from_layer`` every image goes to component 0. A label seen for the first time starts its
    component (one per batch, from component 0's state); the batch's other unseen labels go to component 0."""

    def __init__(self, layer: int, from_layer: int, batch: dict[str, torch.Tensor]) -> None:
        self.layer, self.from_layer, self.batch = layer, from_layer, batch
        self.started: list[int] = []

    def assign(self, descriptors: torch.Tensor, held: bool = False) -> mixed.Assignment:
        labels = self.batch["labels"]
        of = labels.clone() if self.layer >= self.from_layer else torch.zeros_like(labels)
        if not self.started:
            of = torch.full_like(of, int(of[0]))
            return mixed.Assignment.of_components(of, None if held else int(of[0]))
        new = [k for k in torch.unique(of).tolist() if k not in self.started]
        spawned = new[0] if new and not held else None
        known = torch.tensor(self.started + ([spawned] if spawned is not None else []))
        of = torch.where(torch.isin(of, known), of, torch.tensor(self.started[0]))
        return mixed.Assignment.of_components(of, spawned, None if spawned is None else self.started[0])

    def commit(self, assignment: mixed.Assignment) -> None:
        if assignment.spawned is not None:
            self.started.append(assignment.spawned)


class SharedBlend:
    """Each layer's components blended with one shared ``target="stream"`` state that every image steps: an
    image mapped as ``(1 - beta)`` times the shared state's map plus ``beta`` times its component's. Installed on
    :class:`aqr.adapt.stream.mixed.MixedLayerStream` while :meth:`installed` is entered."""

    def __init__(self, beta: float) -> None:
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"--beta must be in [0, 1], got {beta}")
        self.beta = beta

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Every mixed layer state steps and commits a shared state beside its components, and blends (until
        the block ends)."""

        step, commit, beta = mixed.MixedLayerStream.batch_step, mixed.MixedLayerStream.commit_batch, self.beta

        def blended_step(layer: mixed.MixedLayerStream, x: torch.Tensor, batch: object, pre: object = None):
            if not hasattr(layer, "shared"):
                layer.shared = LayerStream(layer.source, layer.settings, layer.kernels, layer.parts[0].batch_knots)
            y, staged, finite = step(layer, x, batch, pre)
            shared, shared_staged, shared_finite = layer.shared.flagged_step(x, batch.images, pre)
            if y is None or shared is None:
                return None, None, False
            return torch.lerp(shared, y, beta), (staged, shared_staged), all_finite(finite, shared_finite)

        def blended_commit(layer: mixed.MixedLayerStream, staged: tuple, batch: object) -> None:
            commit(layer, staged[0], batch)
            layer.shared.commit(staged[1])

        mixed.MixedLayerStream.batch_step = blended_step  # type: ignore[method-assign]
        mixed.MixedLayerStream.commit_batch = blended_commit  # type: ignore[method-assign]
        try:
            yield
        finally:
            mixed.MixedLayerStream.batch_step = step  # type: ignore[method-assign]
            mixed.MixedLayerStream.commit_batch = commit  # type: ignore[method-assign]


def saved_layers(path: Path, first: int | None) -> list[np.ndarray]:
    """The descriptors saved in ``path``, one ``(images, 2 C)`` array per layer, of the first ``first`` layers."""
    saved = np.load(path)
    names = sorted((n for n in saved.files if n.startswith("L")), key=lambda n: int(n[1:]))
    return [saved[name] for name in names[:first]]


def whitened(layers: list[np.ndarray], pca: int) -> np.ndarray:
    """The layers' descriptors z-scored, weighted by one over the square root of their width, concatenated and
    whitened to ``pca`` components (0: not reduced)."""
    from sklearn.decomposition import PCA

    x = np.concatenate([(v - v.mean(0)) / (v.std(0) + 1e-9) / np.sqrt(v.shape[1]) for v in layers], axis=1)
    return PCA(pca, whiten=True, random_state=0).fit_transform(x) if pca else x


def kmeans_labels(x: np.ndarray, k: int) -> np.ndarray:
    """The k-means labels of ``x``."""
    from sklearn.cluster import KMeans

    return KMeans(k, n_init=3, random_state=0).fit(x).labels_


def centroid_labels(x: np.ndarray, domain: np.ndarray) -> np.ndarray:
    """Each row's nearest centroid of the true domains."""
    centroids = np.stack([x[domain == d].mean(0) for d in np.unique(domain)])
    return ((x[:, None] - centroids[None]) ** 2).sum(-1).argmin(1)


def online_labels(x: np.ndarray, k: int, tau: float, batch: int = 64, horizon: float = 500.0) -> np.ndarray:
    """A causal clustering of ``x`` batch by batch (see the module docs)."""
    centres, seen, active = np.zeros((k, x.shape[1])), np.zeros(k), np.zeros(k, dtype=bool)
    spread, counted = 0.0, 0
    out = np.zeros(len(x), dtype=np.int64)

    def distance(a: np.ndarray) -> np.ndarray:
        return np.where(active[None], np.median((a[:, None] - centres[None]) ** 2, axis=-1), np.inf)

    for start in range(0, len(x), batch):
        v = x[start:start + batch]
        if not active.any():
            centres[0], active[0] = v.mean(0), True
        of = distance(v).argmin(1)
        near = distance(v)[np.arange(len(v)), of]
        if counted >= 16 and not active.all() and (near / spread).max() > tau:
            slot = int(np.argmin(active))
            centres[slot], active[slot], seen[slot] = v[int(np.argmax(near))], True, 0
            of = distance(v).argmin(1)
            near = distance(v)[np.arange(len(v)), of]
        for c in np.unique(of):
            taken = of == c
            n = taken.sum()
            centres[c] += n / max(min(seen[c] + n, horizon), 1) * (v[taken].mean(0) - centres[c])
            seen[c] += n
        spread += len(v) / min(counted + len(v), horizon) * (near.mean() - spread)
        counted += len(v)
        out[start:start + batch] = of
    return out


def agreement(given: np.ndarray, domain: np.ndarray) -> str:
    """``", adjusted Rand index X against the true corruptions"`` where scikit-learn is there, else ``""``."""
    try:
        from sklearn.metrics import adjusted_rand_score
    except ImportError:
        return ""
    return f", adjusted Rand index {adjusted_rand_score(domain, given):.2f} against the true corruptions"


def content_whitened(x: np.ndarray, reference: np.ndarray, domain: np.ndarray) -> np.ndarray:
    """``x`` whitened by the mean over the domains of ``reference``'s rows of their covariance (floored at 1e-3 of
    its mean eigenvalue)."""
    kinds = np.unique(domain)
    within = sum(np.cov((reference[domain == d] - reference[domain == d].mean(0)).T) for d in kinds) / len(kinds)
    values, vectors = np.linalg.eigh(within + 1e-3 * np.trace(within) / len(within) * np.eye(len(within)))
    return x @ (vectors / np.sqrt(values))


def minibatch_labels(x: np.ndarray, k: int, batch: int = 64) -> np.ndarray:
    """A causal mini-batch k-means of ``x`` (see the module docs)."""
    from sklearn.cluster import MiniBatchKMeans

    kmeans = MiniBatchKMeans(k, random_state=0, n_init=1, batch_size=batch)
    out = np.zeros(len(x), dtype=np.int64)
    for start in range(0, len(x), batch):
        v = x[start:start + batch]
        if start:
            out[start:start + batch] = kmeans.predict(v)
        kmeans.partial_fit(v)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet20_trainstats")
    parser.add_argument("--setting", default="mixed_domains")
    parser.add_argument("--labels", choices=("stream", "domain", "kmeans", "centroid", "online", "minibatch"), default="stream")
    parser.add_argument("--descriptors", type=Path, help="where --labels stream saves them; --labels kmeans reads them")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--pca", type=int, default=16)
    parser.add_argument("--desc-layers", type=int, default=None, help="the descriptors of the first N layers (all)")
    parser.add_argument("--tau", type=float, default=2.0)
    parser.add_argument("--whiten-descriptors", type=Path, help="--labels minibatch: whose corruptions' covariance")
    parser.add_argument("--from-layer", type=int, default=0, help="the first recalibrated layer given components")
    parser.add_argument("--beta", type=float, default=1.0, help="the component's share of each image's map, the "
                        "rest a shared stream state's (1: the component alone)")
    parser.add_argument("--cifar-c", default="cache/cifar10c")
    parser.add_argument("--cache", default="cache")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.labels not in ("stream", "domain") and args.descriptors is None:
        sys.exit(f"--labels {args.labels} needs --descriptors (saved by a --labels stream run)")

    grid = apply_setting(preset("field", cifar_c=args.cifar_c), "mixed_domains" if args.setting == "clean" else args.setting)
    cells = [c for c in grid.cells() if c.model.name == args.model and c.batch_size == 64 and c.protocol == "online"]
    if not cells:
        sys.exit(f"the field preset's {args.setting!r} setting has no online batch-64 cell of {args.model!r}")
    cell = cells[0]
    blocks = continual.stream_blocks(cell)
    if cell.order:
        domain = StreamOrder.parse(cell.order).stream([b[2] for b in blocks], cell.seed)[:, 0]
    else:  # one corruption after another
        domain = np.concatenate([np.full(len(b[2]), i) for i, b in enumerate(blocks)])
    images, labels, starts = continual.stream_batches(cell, blocks)
    if args.setting == "clean":
        clean = np.load(Path(os.environ["AQR_DATA_DIR"]) / "cifar10_test.npz")
        images, labels = clean["x"][-2560:], clean["y"][-2560:]
        starts, domain = list(range(0, len(labels), 64)), np.zeros(len(labels), dtype=np.int64)
    if args.labels == "stream":
        given = np.zeros(len(labels), dtype=np.int64)
    elif args.labels == "domain":
        given = domain.astype(np.int64)
    elif args.labels == "minibatch":
        x = np.concatenate(saved_layers(args.descriptors, args.desc_layers), axis=1)
        reference, of = x, domain
        if args.whiten_descriptors is not None:
            reference = np.concatenate(saved_layers(args.whiten_descriptors, args.desc_layers), axis=1)
            of = np.load(args.whiten_descriptors)["domain"]
        given = minibatch_labels(content_whitened(x, reference, of), args.k)
    elif args.labels == "online":
        given = online_labels(np.concatenate(saved_layers(args.descriptors, args.desc_layers), axis=1), args.k, args.tau)
    else:
        x = whitened(saved_layers(args.descriptors, args.desc_layers), args.pca)
        given = (kmeans_labels(x, args.k) if args.labels == "kmeans" else centroid_labels(x, domain)).astype(np.int64)
    components = int(given.max()) + 1
    method = build_method(dataclasses.replace(cell, method="aqr", options={"target": "mixed", "components": components}),
                          args.cache)

    batch: dict[str, torch.Tensor] = {}
    layers: dict[int, int] = {}
    recorded: dict[int, list[torch.Tensor]] = {}
    assign = mixed.MixedLayerStream.assign

    def labelled(self: mixed.MixedLayerStream, x: torch.Tensor, n: int, pre: object, held: bool = False):
        layer = layers.setdefault(id(self), len(layers))
        if not isinstance(self.assigner, LabelAssigner):
            self.assigner = LabelAssigner(layer, args.from_layer, batch)  # type: ignore[assignment]
        if args.labels == "stream" and args.descriptors is not None:
            recorded.setdefault(layer, []).append(mixed.image_descriptors(x, n, pre, self.source))
        return assign(self, x, n, pre, held)

    mixed.MixedLayerStream.assign = labelled  # type: ignore[method-assign]
    correct = np.zeros(len(labels), dtype=bool)
    began = time.perf_counter()
    with SharedBlend(args.beta).installed() if args.beta < 1.0 else contextlib.nullcontext():
        for start, end in zip(starts, [*starts[1:], len(labels)]):
            batch["labels"] = torch.as_tensor(given[start:end])
            correct[start:end] = method(to_float(images[start:end])).argmax(1).numpy() == labels[start:end]
    if recorded:
        np.savez(args.descriptors, domain=domain, **{f"L{k}": torch.cat(v).numpy() for k, v in recorded.items()})
    kept = np.mean([np.bincount(given[domain == d]).max() / (domain == d).sum() for d in np.unique(domain)])
    print(f"labels: {components} components; each corruption's share in its largest component {kept:.2f} "
          f"(mean over the corruptions){agreement(given, domain)}")
    print(f"{args.model} {args.setting} labels={args.labels} k={components} "
          f"from_layer={args.from_layer} beta={args.beta}: accuracy {100 * correct.mean():.2f} % "
          f"({len(labels)} images, {time.perf_counter() - began:.0f} s)")


if __name__ == "__main__":
    main()
