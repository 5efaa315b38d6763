"""``aqr train``: train a source model on an npz and write an aqr checkpoint."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from aqr.cli.common import UsageError, add_threads, amount, count, seed
from aqr.data.location import resolve_data_file
from aqr.util.files import check_writable_target


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``train`` sub-command."""
    p = subparsers.add_parser("train", help="train a source model (CPU or GPU, resumable)",
                              description="Supervised training on an npz (x uint8 NHWC, y labels).")
    p.add_argument("--model", help="architecture name (see aqr.models.available()); required unless --export")
    p.add_argument("--norm", default=None, help="normalization layers: bn, gn, ln, none (default: the model's)")
    p.add_argument("--model-kwargs", default="{}", type=json.loads,
                   help='JSON dict of architecture options, e.g. \'{"width": 32, "groups": 8}\'')
    p.add_argument("--data", type=resolve_data_file,
                   help="training npz; required unless --export (a relative name missing here is read from $AQR_DATA_DIR)")
    p.add_argument("--test", default=None, type=resolve_data_file, help="test npz, evaluated after every epoch")
    p.add_argument("--epochs", type=count(1), default=30, help="epochs of the learning-rate schedule")
    p.add_argument("--batch-size", type=count(1), default=128, help="training images per step")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd", help="optimizer")
    p.add_argument("--lr", type=amount(0), default=0.1, help="peak learning rate (after the warm-up; cosine decay to --min-lr)")
    p.add_argument("--min-lr", type=amount(0), default=0.0, help="learning rate at the end of the cosine schedule")
    p.add_argument("--momentum", type=amount(0), default=0.9, help="SGD momentum (AdamW ignores it)")
    p.add_argument("--nesterov", action="store_true", help="Nesterov momentum (SGD)")
    p.add_argument("--weight-decay", type=amount(0), default=5e-4, help="weight decay (on weights, not biases or norm parameters)")
    p.add_argument("--warmup-epochs", type=amount(0), default=1.0, help="linear warm-up, in epochs (may be fractional)")
    p.add_argument("--label-smoothing", type=amount(0), default=0.0, help="label smoothing of the cross-entropy")
    p.add_argument("--no-augment", action="store_true", help="disable random crop + flip")
    add_threads(p)
    p.add_argument("--seed", type=seed, default=0, help="seeds the initialisation, the data order and the augmentation")
    p.add_argument("--channels-last", action="store_true", help="train in the channels_last memory format (faster on some GPUs)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where the data, augmentation and model live")
    p.add_argument("--limit-train", type=count(1), default=None, help="use only the first N training images")
    p.add_argument("--stop-after", type=count(1), default=None,
                   help="stop after this many epochs (schedule still planned for --epochs; continue with --resume)")
    p.add_argument("--init", default=None, metavar="CHECKPOINT",
                   help="start from this aqr checkpoint's weights (same architecture) with a new optimizer and "
                        "schedule, e.g. a short low-lr fine-tune; its provenance goes into the new meta['init']")
    p.add_argument("--out", default=None, help="final small checkpoint (aqr format)")
    p.add_argument("--work-dir", default=None, help="folder for the resumable per-epoch state (last.pt)")
    p.add_argument("--resume", action="store_true", help="continue from <work-dir>/last.pt")
    p.add_argument("--export", action="store_true",
                   help="only write --out from <work-dir>/last.pt (e.g. of an unfinished run) and exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Build a TrainConfig from ``args`` and train; returns 0."""
    from aqr.models.train import TrainConfig, export_state, train

    if args.out is not None:
        check_writable_target(args.out, label="--out")
    if args.work_dir is not None:
        check_writable_target(args.work_dir, folder=True, label="--work-dir")
    if args.export:
        if not (args.work_dir and args.out):
            raise UsageError("--export needs --work-dir and --out")
        path = export_state(args.work_dir, args.out)
        print(f"wrote {path}")
        return 0

    if not (args.model and args.data):
        raise UsageError("--model and --data are required")
    if not isinstance(args.model_kwargs, dict):
        raise UsageError("--model-kwargs must be a JSON object")
    cfg = TrainConfig(model=args.model, data=args.data, test=args.test, norm=args.norm,
                      model_kwargs=args.model_kwargs, epochs=args.epochs, batch_size=args.batch_size,
                      optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, momentum=args.momentum,
                      nesterov=args.nesterov, weight_decay=args.weight_decay, warmup_epochs=args.warmup_epochs,
                      label_smoothing=args.label_smoothing, augment=not args.no_augment, threads=args.threads,
                      seed=args.seed, channels_last=args.channels_last, device=args.device,
                      limit_train=args.limit_train,
                      stop_after=args.stop_after, init=args.init,
                      out=args.out, work_dir=args.work_dir,
                      command="aqr " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["train"] else "")
    train(cfg, resume=args.resume)
    return 0
