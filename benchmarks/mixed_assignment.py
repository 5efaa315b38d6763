"""How well ``target="mixed"`` could do with a better clustering: the field's streams replayed with each
image's cluster given from outside, offline.

``target="mixed"`` keeps per layer a shared running state and one per cluster of images, the clusters chosen
by a k-means of each image's descriptors at the first third of the recalibrated layers, and maps each image
with a blend of its cluster's map and the shared state's (``aqr.adapt.stream.mixed``). This script
separates the clustering from the rest: it replays a field cell (batch 64, online) with ``target="mixed"``
whose clusters are named by a label per image instead of its k-means (``--labels own`` keeps the
k-means; the first third of the layers map with the shared state, as always), and prints the stream's
accuracy. ``--blend`` is the target's ``blend``
(1: the cluster's map alone while the classes show no runs; 0: ``target="robust"``). The labels (``--labels``):

- ``own``: the target's own k-means; this run also records each image's descriptor
  (:func:`aqr.core.descriptors.image_descriptors`) at every layer, which the other labels need, in
  ``--descriptors`` (with ``--blend 0`` it is ``target="robust"``, value for value);
- ``domain``: the true corruption of each image (an oracle: no method knows it);
- ``kmeans``: k-means (``--k`` clusters) of the images' descriptors of the first ``--desc-layers`` layers
  (default all), each layer's z-scored and weighted by one over the square root of its width,
  concatenated, whitened to ``--pca`` principal components (0: not reduced); fitted on the whole stream at
  once (it sees the future: an upper bound for an online clustering of those descriptors). Needs
  scikit-learn;
- ``centroid``: the nearest of the 15 corruptions' centroids in that whitened space, the centroids taken
  from the true corruptions (an oracle of how far the descriptors tell the corruptions apart);
- ``online``: a causal leader clustering of the concatenated descriptors, batch by batch: each image to the
  nearest centre by the median squared difference; the farthest image of a batch starts a new centre (up
  to ``--k``) where it lies more than ``--tau`` times the running mean distance of the images to their
  centres; centres and that mean are running means over 500 images;
- ``minibatch``: scikit-learn's causal ``MiniBatchKMeans`` (``--k`` clusters: each batch labelled by the
  centres before it, then taken into them; the first batch all in cluster 0) of the same concatenation
  whitened by the pooled within-corruption covariance of the descriptors file ``--whiten-descriptors``
  (``--setting clean``'s: the source images' covariance, as the target's own whitening).

``--setting clean`` runs the last 2,560 clean CIFAR-10 test images (``$AQR_DATA_DIR/cifar10_test.npz``) in
batches of 64 instead of a field cell: with ``--labels own --descriptors clean.npz`` it records the
source's descriptors.

    AQR_DATA_DIR=... python benchmarks/mixed_assignment.py --setting mixed_domains --labels own \\
        --descriptors desc.npz
    AQR_DATA_DIR=... python benchmarks/mixed_assignment.py --setting mixed_domains --labels domain
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
from aqr.core.descriptors import image_descriptors
from aqr.data import to_float
from aqr.data.streams import StreamOrder
from aqr.harness import continual
from aqr.harness.cell_run import build_method
from aqr.harness.presets import preset
from aqr.harness.settings import apply_setting


@contextlib.contextmanager
def given_clusters(batch: dict[str, torch.Tensor]) -> Iterator[None]:
    """``target="mixed"``'s routers assign each image of the batch in flight to the cluster ``batch["labels"]``
    names (set from outside before each batch) and never move their centres (until the block ends)."""
    assignment, commit = mixed.ComponentRouter.assignment, mixed.ComponentRouter.commit

    def labelled(router: mixed.ComponentRouter) -> torch.Tensor | None:
        return batch["labels"].clone().long()

    mixed.ComponentRouter.assignment = labelled  # type: ignore[method-assign]
    mixed.ComponentRouter.commit = lambda router: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        mixed.ComponentRouter.assignment = assignment  # type: ignore[method-assign]
        mixed.ComponentRouter.commit = commit  # type: ignore[method-assign]


@contextlib.contextmanager
def recorded_descriptors(into: dict[int, list[torch.Tensor]]) -> Iterator[None]:
    """Every mixed layer state records its batch's descriptors in ``into`` (by the layer's order of first call)
    before it steps (until the block ends)."""
    step = mixed.MixedLayerStream.batch_step
    order: dict[int, int] = {}

    def recording(layer: mixed.MixedLayerStream, x: torch.Tensor, batch: object, pre: object = None):
        index = order.setdefault(id(layer), len(order))
        into.setdefault(index, []).append(image_descriptors(x, batch.images, pre, layer.source))  # type: ignore[attr-defined]
        return step(layer, x, batch, pre)

    mixed.MixedLayerStream.batch_step = recording  # type: ignore[method-assign]
    try:
        yield
    finally:
        mixed.MixedLayerStream.batch_step = step  # type: ignore[method-assign]


def router_of(method: torch.nn.Module) -> mixed.ComponentRouter:
    """The clusters' router of a ``target="mixed"`` method (the :class:`aqr.AQR` in it)."""
    for module in method.modules():
        shared = getattr(module, "_batch", None)
        if getattr(shared, "router", None) is not None:
            return shared.router
    raise ValueError("the method keeps no clusters (not target='mixed')")


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


def draw_clusters(given: np.ndarray, domain: np.ndarray, names: list[str], path: Path, title: str) -> None:
    """A heat map of each corruption's share of its images in each cluster (a column 0 of ``--labels own``:
    the shared state alone, before the centres were seeded), written to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds, clusters = np.unique(domain), int(given.max()) + 1
    share = np.stack([np.bincount(given[domain == d], minlength=clusters) / (domain == d).sum() for d in kinds])
    fig, ax = plt.subplots(figsize=(1.2 + 0.45 * clusters, 0.9 + 0.32 * len(kinds)))
    image = ax.imshow(share, cmap="viridis", vmin=0, vmax=1, aspect="auto")
    ax.set_yticks(range(len(kinds)), [names[int(d)] if int(d) < len(names) else str(d) for d in kinds], fontsize=8)
    ax.set_xticks(range(clusters), [str(c) for c in range(clusters)], fontsize=8)
    ax.set_xlabel("cluster")
    ax.set_title(title, fontsize=8)
    fig.colorbar(image, ax=ax, label="share of the corruption's images")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet20_trainstats")
    parser.add_argument("--setting", default="mixed_domains")
    parser.add_argument("--labels", choices=("own", "domain", "kmeans", "centroid", "online", "minibatch"), default="own")
    parser.add_argument("--descriptors", type=Path, help="where --labels own saves them; the other labels read them")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--pca", type=int, default=16)
    parser.add_argument("--desc-layers", type=int, default=None, help="the descriptors of the first N layers (all)")
    parser.add_argument("--tau", type=float, default=2.0)
    parser.add_argument("--whiten-descriptors", type=Path, help="--labels minibatch: whose corruptions' covariance")
    parser.add_argument("--blend", type=float, default=1.0, help="the target's blend: the cluster's share of "
                        "each image's map, the rest the shared state's (1: the cluster's alone)")
    parser.add_argument("--figure", type=Path, help="draw where each corruption's images went (PNG; matplotlib)")
    parser.add_argument("--cifar-c", default="cache/cifar10c")
    parser.add_argument("--cache", default="cache")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.labels not in ("own", "domain") and args.descriptors is None:
        sys.exit(f"--labels {args.labels} needs --descriptors (saved by a --labels own run)")

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
    given = None
    if args.labels == "own":
        pass
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
    components = args.k if given is None else int(given.max()) + 1
    options = {"target": "mixed", "components": components, "blend": args.blend}
    method = build_method(dataclasses.replace(cell, method="aqr", options=options), args.cache)

    batch: dict[str, torch.Tensor] = {}
    recorded: dict[int, list[torch.Tensor]] = {}
    chosen: list[np.ndarray] = []  # --labels own: the clusters the target chose (-1: the shared state alone)
    correct = np.zeros(len(labels), dtype=bool)
    began = time.perf_counter()
    with contextlib.ExitStack() as patches:
        if given is not None:
            patches.enter_context(given_clusters(batch))
        elif args.descriptors is not None:
            patches.enter_context(recorded_descriptors(recorded))
        for start, end in zip(starts, [*starts[1:], len(labels)]):
            if given is not None:
                batch["labels"] = torch.as_tensor(given[start:end])
            correct[start:end] = method(to_float(images[start:end])).argmax(1).numpy() == labels[start:end]
            if given is None:
                routed = router_of(method)._assignment
                chosen.append(np.full(end - start, -1) if routed is None else routed.numpy())
    if recorded:
        np.savez(args.descriptors, domain=domain, **{f"L{k}": torch.cat(v).numpy() for k, v in recorded.items()})
    if given is None:
        given = np.concatenate(chosen) + 1  # 0: the shared state alone
    if args.figure is not None:
        draw_clusters(given, domain, [b[0] for b in blocks], args.figure,
                      f"{args.model}, {args.setting}, labels={args.labels}: {100 * correct.mean():.2f} %")
    kept = np.mean([np.bincount(given[domain == d]).max() / (domain == d).sum() for d in np.unique(domain)])
    print(f"labels: {components} components; each corruption's share in its largest component {kept:.2f} "
          f"(mean over the corruptions){agreement(given, domain)}")
    print(f"{args.model} {args.setting} labels={args.labels} k={components} "
          f"blend={args.blend:g}: accuracy {100 * correct.mean():.2f} % "
          f"({len(labels)} images, {time.perf_counter() - began:.0f} s)")


if __name__ == "__main__":
    main()
