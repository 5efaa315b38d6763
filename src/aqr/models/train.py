"""Supervised training of aqr's own source models on CPU or GPU, resumable epoch by epoch.

Data is an ``.npz`` with ``x`` (uint8, N x H x W x 3) and ``y`` (int labels). Augmentation (random
crop with zero padding 4 and horizontal flip) runs in torch on uint8 batches. Every epoch the full
training state (model, optimizer, scheduler, RNG, epoch, history) is saved to
``<work_dir>/last.pt``; at the end a small weights-only aqr checkpoint is written to ``out``.

``init`` starts from another aqr checkpoint's weights (same architecture) with a new optimizer and
schedule: a fine-tune. The checkpoint's provenance is kept in the new one's ``meta["init"]``.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from aqr._version import __version__
from aqr.data.arrays import load_npz_arrays, to_float
from aqr.models import create, save_checkpoint
from aqr.models.checkpoint import PLAUSIBLE_OPTION, CheckpointError, atomic_save, plausible_option, read_file
from aqr.models.portable import portable_command, portable_train_config
from aqr.util.files import sha256_file
from aqr.util.threads import check_threads

MAX_ZOO_BYTES = 5 * 1024 * 1024


@dataclass
class TrainConfig:
    """Everything that defines a training run (saved inside every checkpoint it writes)."""

    model: str
    data: str
    test: str | None = None
    norm: str | None = None
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    epochs: int = 30
    batch_size: int = 128
    optimizer: str = "sgd"  # "sgd" or "adamw"
    lr: float = 0.1
    min_lr: float = 0.0
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 5e-4
    warmup_epochs: float = 1.0
    label_smoothing: float = 0.0
    augment: bool = True
    threads: int | None = None
    seed: int = 0
    channels_last: bool = False
    device: str = "cpu"  # "cuda" keeps the data, augmentation and model on the GPU
    eval_batch_size: int = 1000
    out: str | None = None
    work_dir: str | None = None
    limit_train: int | None = None  # use a seeded random subset of N training images (quick checks)
    stop_after: int | None = None  # stop (resumably) once this many epochs are done, schedule unchanged
    init: str | None = None  # start from this aqr checkpoint's weights (new optimizer and schedule)
    command: str = ""

    def __post_init__(self) -> None:
        """Refuse, before any data is read, a hyperparameter that is not a finite number in its range (a NaN
        learning rate trains a checkpoint of NaN weights), an architecture option too large to build, or a
        thread count torch cannot start."""
        ranges = {"lr": (0.0, math.inf), "min_lr": (0.0, math.inf), "momentum": (0.0, 1.0),
                  "weight_decay": (0.0, math.inf), "warmup_epochs": (0.0, math.inf), "label_smoothing": (0.0, 1.0)}
        for name, (low, high) in ranges.items():
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                    or not low <= value <= high):
                raise ValueError(f"{name} must be a finite number in [{low:g}, {high:g}], got {value!r}")
        if not isinstance(self.model_kwargs, dict):
            raise ValueError(f"model_kwargs must be a mapping of architecture options, got {self.model_kwargs!r}")
        for key, value in self.model_kwargs.items():
            if not plausible_option(value):
                raise ValueError(f"model_kwargs[{key!r}] must be {PLAUSIBLE_OPTION}, got {value!r:.80}")
        check_threads(self.threads)


@dataclass
class EpochResult:
    """One line of training history."""

    epoch: int
    loss: float
    train_acc: float
    test_acc: float | None
    lr: float
    seconds: float


def load_tensors(path: str | os.PathLike[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` of an npz (:func:`aqr.data.load_npz_arrays`) as tensors: uint8 N x H x W x 3 and int64 labels."""
    x, y = load_npz_arrays(path)
    return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y)


def augment_batch(x: torch.Tensor, generator: torch.Generator, pad: int = 4) -> torch.Tensor:
    """Random crop (zero padding ``pad``) and random horizontal flip of a uint8 N x H x W x C batch.

    Returns a uint8 batch of the same shape; each image gets its own offsets and flip.
    """
    n, h, w, _ = x.shape
    padded = F.pad(x, (0, 0, pad, pad, pad, pad))
    # Draws come from the (CPU) generator whatever the device, so a run's augmentation is device-independent.
    oy = torch.randint(0, 2 * pad + 1, (n,), generator=generator).to(x.device)
    ox = torch.randint(0, 2 * pad + 1, (n,), generator=generator).to(x.device)
    flip = (torch.rand(n, generator=generator) < 0.5).to(x.device)
    rows = oy[:, None] + torch.arange(h, device=x.device)[None, :]
    cols = torch.arange(w, device=x.device)[None, :].expand(n, w)
    cols = torch.where(flip[:, None], cols.flip(1), cols) + ox[:, None]
    return padded[torch.arange(n, device=x.device)[:, None, None], rows[:, :, None], cols[:, None, :]]


@torch.no_grad()
def evaluate_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1000,
                      channels_last: bool = False) -> float:
    """Top-1 accuracy in percent of ``model`` (switched to eval mode, left there) on uint8 NHWC images.

    Batches go to the device of the model's parameters.
    """
    model.eval()
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    correct = torch.zeros((), dtype=torch.int64, device=device)
    for i in range(0, len(x), batch_size):
        xb = to_float(x[i:i + batch_size].to(device), channels_last=True)
        if channels_last:
            xb = xb.contiguous(memory_format=torch.channels_last)
        correct += (model(xb).argmax(1) == y[i:i + batch_size].to(device)).sum()
    return 100.0 * int(correct) / max(len(x), 1)


def lr_factor(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """Linear warmup from ~0 to 1 over ``warmup_steps``, then cosine decay to ``min_ratio`` at ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: weights of conv/linear layers decay; biases, norm parameters and embeddings do not."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 or name.endswith(("pos_embed", "cls_token")) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """SGD (momentum, optional Nesterov) or AdamW, with weight decay on weights only."""
    groups = param_groups(model, cfg.weight_decay)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr)
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}; choose 'sgd' or 'adamw'")


def model_config(cfg: TrainConfig, num_classes: int) -> dict[str, Any]:
    """The ``config`` entry of the checkpoints: what :func:`aqr.models.create` needs to rebuild the model."""
    return {"name": cfg.model, "num_classes": num_classes, "norm": cfg.norm, "kwargs": dict(cfg.model_kwargs)}


def load_init(model: nn.Module, path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load the weights of the aqr checkpoint ``path`` into ``model`` (strictly; weights only) and return
    its provenance for ``meta["init"]``: file name, sha256, config and the scalar entries of its meta."""
    from aqr.models.checkpoint import is_aqr_checkpoint

    obj = read_file(path)
    if not is_aqr_checkpoint(obj):
        raise CheckpointError(f"--init {path}: not an aqr checkpoint")
    try:
        model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in obj["state_dict"].items()})
    except RuntimeError as err:
        raise CheckpointError(f"--init {path}: its weights do not fit this model ({str(err).splitlines()[0]})") from None
    meta = {k: v for k, v in (obj.get("meta") or {}).items() if k not in ("history", "train_config")}
    history = (obj.get("meta") or {}).get("history") or []
    return {"file": os.path.basename(str(path)), "sha256": sha256_file(path), "config": obj["config"],
            "meta": meta, "test_acc_by_epoch": [h.get("test_acc") for h in history]}


def resume_path(work_dir: str | os.PathLike[str]) -> Path:
    """Where the resumable state of a run in ``work_dir`` lives."""
    return Path(work_dir) / "last.pt"


def train(cfg: TrainConfig, resume: bool = False, log: Any = None) -> dict[str, Any]:
    """Train ``cfg.model`` and return ``{"model", "history", "test_acc", "out"}``.

    With ``resume`` and a ``<work_dir>/last.pt``, training continues after the last completed
    epoch (same optimizer, schedule and RNG state); ``cfg.epochs`` may be raised on resume, which
    stretches the cosine schedule from the current step. ``log`` is a file for progress lines
    (default stderr).
    """
    from tqdm import tqdm

    log = log or sys.stderr
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {cfg.device!r} asked for, but torch {torch.__version__} sees no CUDA GPU")
    x_train, y_train = load_tensors(cfg.data)
    if cfg.limit_train and cfg.limit_train < len(x_train):  # a seeded random subset (files may be sorted by class)
        keep = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(cfg.seed))[:cfg.limit_train]
        x_train, y_train = x_train[keep], y_train[keep]
    x_train, y_train = x_train.to(device), y_train.to(device)
    test = load_tensors(cfg.test) if cfg.test else None
    num_classes = int(y_train.max()) + 1
    if test is not None:
        num_classes = max(num_classes, int(test[1].max()) + 1)

    torch.manual_seed(cfg.seed)
    model = create(cfg.model, num_classes=num_classes, norm=cfg.norm, **cfg.model_kwargs).to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = make_optimizer(model, cfg)
    n = len(x_train)
    bs = min(cfg.batch_size, n)
    steps_per_epoch = n // bs  # drop the last partial batch
    total_steps = steps_per_epoch * cfg.epochs
    warmup = int(round(cfg.warmup_epochs * steps_per_epoch))
    min_ratio = cfg.min_lr / cfg.lr if cfg.lr > 0 else 0.0
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total_steps, warmup, min_ratio))
    gen = torch.Generator().manual_seed(cfg.seed)
    start_epoch, history = 0, []
    # a resumed run has its weights, and the init's provenance, in its state
    init = load_init(model, cfg.init) if cfg.init and not resume else None

    state_file = resume_path(cfg.work_dir) if cfg.work_dir else None
    if resume:
        if state_file is None or not state_file.is_file():
            raise FileNotFoundError(f"--resume: no training state at {state_file}")
        state = read_file(state_file)
        if not isinstance(state, dict) or state.get("format") != "aqr-train-state":
            raise CheckpointError(f"{state_file} is not an aqr training state")
        if state["config"]["model"] != cfg.model:
            raise CheckpointError(f"{state_file} trains {state['config']['model']!r}, not {cfg.model!r}")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        gen.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        start_epoch, history = int(state["epoch"]), list(state["history"])
        init = state.get("init")
        print(f"resumed {state_file} after epoch {start_epoch}", file=log, flush=True)

    data_hash = sha256_file(cfg.data)
    if resume and state.get("data_sha256") not in (None, data_hash):
        raise ValueError(f"--resume: {cfg.data} (sha256 {data_hash[:12]}...) is not the file the run in "
                         f"{state_file} trained on (sha256 {str(state['data_sha256'])[:12]}...)")
    interactive = hasattr(log, "isatty") and log.isatty()
    last_epoch = cfg.epochs if cfg.stop_after is None else min(cfg.epochs, cfg.stop_after)
    for epoch in range(start_epoch, last_epoch):
        model.train()
        t0 = time.perf_counter()
        order = torch.randperm(n, generator=gen).to(device)
        # Running sums stay on the device; reading them every step would stall a GPU on each batch.
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        correct = torch.zeros((), dtype=torch.int64, device=device)
        seen = 0
        check_every = 1 if device.type == "cpu" else 50
        bar = tqdm(range(steps_per_epoch), desc=f"epoch {epoch + 1}/{cfg.epochs}", file=log, leave=False,
                   mininterval=1.0 if interactive else 60.0, dynamic_ncols=True)
        for step in bar:
            idx = order[step * bs:(step + 1) * bs]
            xb = x_train[idx]
            if cfg.augment:
                xb = augment_batch(xb, gen)
            xb, yb = to_float(xb, channels_last=True), y_train[idx]
            if cfg.channels_last:
                xb = xb.contiguous(memory_format=torch.channels_last)
            logits = model(xb)
            loss = F.cross_entropy(logits, yb, label_smoothing=cfg.label_smoothing)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            loss_sum += loss.detach() * len(yb)
            correct += (logits.argmax(1) == yb).sum()
            seen += len(yb)
            if step % check_every == 0 or step == steps_per_epoch - 1:
                if not torch.isfinite(loss_sum):
                    raise FloatingPointError(f"loss became {loss.item()} at epoch {epoch + 1} step {step}")
                bar.set_postfix(loss=f"{float(loss_sum) / seen:.3f}", acc=f"{100 * int(correct) / seen:.1f}",
                                refresh=False)
        bar.close()
        train_seconds = time.perf_counter() - t0
        test_acc = evaluate_accuracy(model, *test, cfg.eval_batch_size, cfg.channels_last) if test else None
        result = EpochResult(epoch + 1, float(loss_sum) / max(seen, 1), 100 * int(correct) / max(seen, 1), test_acc,
                             optimizer.param_groups[0]["lr"], time.perf_counter() - t0)
        history.append(asdict(result))
        print(f"epoch {result.epoch}/{cfg.epochs} loss {result.loss:.4f} train_acc {result.train_acc:.2f} "
              f"test_acc {'-' if test_acc is None else f'{test_acc:.2f}'} lr {result.lr:.5f} "
              f"{train_seconds:.1f} s train, {result.seconds:.1f} s/epoch", file=log, flush=True)
        if state_file is not None:
            atomic_save({"format": "aqr-train-state", "config": asdict(cfg), "epoch": epoch + 1,
                         "history": history, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict(), "generator": gen.get_state(),
                         "torch_rng": torch.get_rng_state(), "data_sha256": data_hash,
                         "num_classes": num_classes, "init": init}, state_file)

    model.eval().cpu()
    final_acc = history[-1]["test_acc"] if history else None
    out = None
    if cfg.out:
        out = write_final(cfg.out, model, cfg, num_classes, history, data_hash, init)
        print(f"saved {out} ({out.stat().st_size / 1e6:.2f} MB), clean accuracy {final_acc}", file=log, flush=True)
    return {"model": model, "history": history, "test_acc": final_acc, "out": out}


def write_final(out: str | os.PathLike[str], model: nn.Module, cfg: TrainConfig, num_classes: int,
                history: list[dict[str, Any]], data_hash: str, init: dict[str, Any] | None = None) -> Path:
    """Write the small aqr checkpoint (weights + config + provenance meta), in fp16 if fp32 exceeds 5 MB.
    Paths in the provenance are relative to the working folder or cut to file names (no machine folders).

    ``meta["partial"]`` is True when fewer than ``cfg.epochs`` epochs were trained; ``meta["init"]`` is
    the provenance of the ``--init`` checkpoint (see :func:`load_init`), when there was one.
    """
    final_acc = history[-1]["test_acc"] if history else None
    meta = {"data": os.path.basename(cfg.data), "data_sha256": data_hash,
            "test": os.path.basename(cfg.test) if cfg.test else None,
            "test_sha256": sha256_file(cfg.test) if cfg.test else None,
            "epochs": len(history), "scheduled_epochs": cfg.epochs, "partial": len(history) < cfg.epochs,
            "seed": cfg.seed, "clean_accuracy": final_acc, "command": portable_command(cfg.command),
            "train_config": portable_train_config(asdict(cfg)), "history": history,
            "aqr_version": __version__, "torch_version": str(torch.__version__)}
    if init is not None:
        meta["init"] = init
    config = model_config(cfg, num_classes)
    path = save_checkpoint(out, model, config, meta)
    if path.stat().st_size > MAX_ZOO_BYTES:
        path = save_checkpoint(out, model, config, meta, half=True)
    return path


def export_state(work_dir: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write the small aqr checkpoint from a run's resumable state (``<work_dir>/last.pt``), e.g. of an unfinished run."""
    state_file = resume_path(work_dir)
    state = read_file(state_file)
    if not isinstance(state, dict) or state.get("format") != "aqr-train-state":
        raise CheckpointError(f"{state_file} is not an aqr training state")
    cfg = TrainConfig(**state["config"])
    num_classes = state.get("num_classes")
    if num_classes is None:  # states written before num_classes was stored
        num_classes = int(load_tensors(cfg.data)[1].max()) + 1
        if cfg.test:
            num_classes = max(num_classes, int(load_tensors(cfg.test)[1].max()) + 1)
    model = create(cfg.model, num_classes=int(num_classes), norm=cfg.norm, **cfg.model_kwargs)
    model.load_state_dict(state["model"])
    data_hash = state.get("data_sha256") or sha256_file(cfg.data)
    return write_final(out, model.eval(), cfg, int(num_classes), list(state["history"]), data_hash,
                       state.get("init"))
