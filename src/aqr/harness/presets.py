"""The paper's experiments as named grids (:func:`preset`) on the data folder's files.

Each preset names its protocol: the paper's tables (``main``, ``tails``, ``granularity``, ``vit-blocks``,
``smoke``, ``imagenet``) are episodic, the stream presets online or realtime.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from aqr.core.qmap import TAILS
from aqr.data.location import resolve_data_dir
from aqr.harness.cells import CONTINUAL, DataSpec, ModelSpec
from aqr.harness.specs import GridSpec, MethodSpec


# The presets preset() knows, and the methods of the paper's main tables.
PRESETS = ("main", "tails", "granularity", "vit-blocks", "smoke", "imagenet", "stream", "stream-noniid", "field",
           "field-batch1")
BASELINES = ("source", "ttn", "tent", "sar", "moments", "aqr")

# The stream preset's methods: per-batch AQR (the reference at batch 128), streaming AQR, and the
# methods used on streams, all online.
STREAM_METHODS = ("source", "ttn", "bn-ema", "tent", "sar", "aqr", "aqr:target=stream")

# The stream-noniid preset: the stream preset's stream in these orders, i.i.d. first, then ever
# longer runs of one class, then all corruptions mixed; its methods add rbn and AQR's robust variant, balanced
# and with its class-conditional source knots (balance=0.5: statistics calibrated with groups).
NONIID_ORDERS = ("iid", "delta=1", "delta=0.1", "delta=0.01", "mixed")
NONIID_METHODS = ("source", "ttn", "bn-ema", "rbn", "tent", "aqr", "aqr:target=stream", "aqr:target=robust",
                  "aqr:target=robust,balance=0.5")


# The field preset: the field's methods beside AQR's targets, all online, on the continual stream in four
# settings (i.i.d., class-correlated, mixed domains, mixed domains in class-correlated order), offline and
# under the realtime protocol.
FIELD_METHODS = ("source", "ttn", "bn-ema", "rbn", "tent", "sar", "eta", "eata", "cotta", "rotta", "lame", "roid",
                 "deyo", "moments", "aqr", "aqr:target=stream", "aqr:target=robust",
                 "aqr+tent", "aqr+eta", "aqr+roid", "aqr+roid:target=robust", "aqr+lame", "unmixtns",
                 "aqr:target=mixed")
# The methods of the offline cells: every method of the field runs under both protocols
FIELD_OFFLINE_METHODS = FIELD_METHODS
# The batch-1 column (BN model, continual, offline): the methods that adapt on batches, per-batch AQR and its
# compositions through the reference's sliding window of the 64 most recent images (ProtocolConfig.window); the
# source model and the methods made for streams (bn-ema, rbn, streaming and robust AQR, UnMix-TNS) as they are
FIELD_WINDOW = 64
FIELD_UNWINDOWED = ("source", "bn-ema", "rbn", "aqr:target=stream", "aqr:target=robust", "unmixtns",
                    "aqr:target=mixed")
FIELD_BATCH1_METHODS = tuple(m if m in FIELD_UNWINDOWED else f"{m}{',' if ':' in m else ':'}window={FIELD_WINDOW}"
                             for m in FIELD_OFFLINE_METHODS)
# continual (i.i.d.), correlated, mixed_domains and mixed_domains_correlated, all delta 0.1
FIELD_ORDERS = (None, "delta=0.1", "mixed", "mixed,delta=0.1")
FIELD_REALTIME_ORDERS = FIELD_ORDERS              # the settings that also run under the realtime protocol
FIELD_MODELS = ("resnet20_trainstats", "resnet20_gn", "vit_ln")
# AQR's configurations in the field preset (as tables label them), and the one of them per setting and
# protocol reported as AQR's default: chosen before the final run by
# aqr.harness.report.field_target.choose_defaults on another image draw (seed 1, blocks of 500 images as
# in the run, batch 64, the three models: docs/results/field/selection.db); tests check the choice against that database.
FIELD_AQR_CONFIGS = ("aqr", "aqr[target=stream]", "aqr[target=robust]", "aqr+tent", "aqr+eta", "aqr+roid",
                     "aqr+roid[target=robust]", "aqr+lame", "aqr[target=mixed]")
FIELD_DEFAULTS: dict[str, dict[str, str]] = {
    "continual": {"offline": "aqr+roid", "realtime": "aqr[target=stream]"},
    "correlated (delta=0.1)": {"offline": "aqr[target=robust]", "realtime": "aqr[target=robust]"},
}


def field_grid(models: dict[str, ModelSpec], data: DataSpec) -> GridSpec:
    """The ``field`` preset (see :func:`preset`): batch 64 on the three models and batch 16 on the BN one,
    each offline (online protocol) in :data:`FIELD_ORDERS` and realtime in :data:`FIELD_REALTIME_ORDERS`."""
    methods = tuple(MethodSpec.parse(m) for m in FIELD_METHODS)
    offline = tuple(MethodSpec.parse(m) for m in FIELD_OFFLINE_METHODS)
    three = tuple(models[n] for n in FIELD_MODELS)
    common = dict(corruptions=(CONTINUAL,), severities=(5,), seeds=(0,), n_images=500)
    realtime = GridSpec("field", three, data, methods, batch_sizes=(64,), protocol="realtime",
                        orders=FIELD_REALTIME_ORDERS, **common)
    bn = (models[FIELD_MODELS[0]],)
    small = GridSpec("field", bn, data, offline, batch_sizes=(16,), protocol="online", orders=FIELD_ORDERS, **common)
    small_realtime = GridSpec("field", bn, data, methods, batch_sizes=(16,), protocol="realtime",
                              orders=FIELD_REALTIME_ORDERS, **common)
    return GridSpec("field", three, data, offline, batch_sizes=(64,), protocol="online", orders=FIELD_ORDERS,
                    parts=(realtime, small, small_realtime), **common)


def field_batch1_grid(models: dict[str, ModelSpec], data: DataSpec) -> GridSpec:
    """The ``field-batch1`` preset: the field's batch-1 column (:data:`FIELD_BATCH1_METHODS` on the BN model,
    continual, offline), recorded under the ``field`` grid's name so that its report shows the column; a
    preset of its own, so that the field's settings and batch sizes never reach it."""
    return GridSpec("field", (models[FIELD_MODELS[0]],), data, tuple(MethodSpec.parse(m) for m in FIELD_BATCH1_METHODS),
                    corruptions=(CONTINUAL,), severities=(5,), batch_sizes=(1,), seeds=(0,), n_images=500,
                    protocol="online", orders=(None,))


#: What each of the reproduction's model names stands for, in a line (reports print it beside their tables).
MODEL_NOTES: dict[str, str] = {
    "resnet20": "the third-party (akamaster) CIFAR-10 ResNet-20 with BatchNorm; source statistics from clean "
                "test images 0-4999 (its lossless training set is not available)",
    "resnet20_trainstats": "the third-party (akamaster) BN ResNet-20 of `resnet20`, with source statistics from "
                           "10,000 random images of the JPEG-compressed CIFAR-10 training set (the nearest we have to "
                           "the lossless set it was trained on)",
    "resnet20_bn": "the zoo's BN ResNet-20, trained on the JPEG training set; statistics from 10,000 of its images",
    "resnet20_gn": "the zoo's GroupNorm ResNet-20, trained on the JPEG training set; statistics from 10,000 of its "
                   "images",
    "vit_ln": "the zoo's LayerNorm ViT, trained on the JPEG training set; statistics from 10,000 of its images",
}


def default_models(data_dir: str | Path | None = None) -> dict[str, ModelSpec]:
    """The reproduction's models: the akamaster ResNet-20 (BN), twice, and the zoo's BN and GN ResNet-20 and ViT.

    ``data_dir`` is the data folder (default ``$AQR_DATA_DIR``, see :func:`aqr.data.resolve_data_dir`).
    The zoo's models were trained on the JPEG training set, their source domain: their statistics
    come from 10,000 of those images, as in the paper, drawn at random (the file is sorted by class,
    so its first 10,000 images would be airplanes and automobiles only). The akamaster model was
    trained on the lossless training set, which we lack: ``resnet20`` takes its statistics from clean
    test images 0-4999 (evaluation uses 5000-9999; the first reproduction's choice), and
    ``resnet20_trainstats`` from the same 10,000 JPEG training images as the zoo's models, the
    nearest we have to its source domain.
    """
    d = resolve_data_dir(data_dir)
    train = str(d / "cifar10_train_jpeg75.npz")
    akamaster = str(d / "checkpoints/akamaster/resnet20-12fca82f.th")
    return {
        "resnet20": ModelSpec("resnet20", "resnet20", akamaster, str(d / "cifar10_test.npz"), "0:5000"),
        "resnet20_trainstats": ModelSpec("resnet20_trainstats", "resnet20", akamaster, train, "0:50000~10000"),
        "resnet20_bn": ModelSpec("resnet20_bn", "resnet20_bn", None, train, "0:50000~10000"),
        "resnet20_gn": ModelSpec("resnet20_gn", "resnet20_gn", None, train, "0:50000~10000"),
        "vit_ln": ModelSpec("vit_ln", "vit_ln", None, train, "0:50000~10000"),
    }


def default_data(data_dir: str | Path | None = None, cifar_c: str | Path = "cache/cifar10c") -> DataSpec:
    """CIFAR-10-C in ``cifar_c``, generated when missing from the clean test set and frost images of the data folder."""
    d = resolve_data_dir(data_dir)
    return DataSpec("cifar10-c", str(cifar_c), "5000:10000", clean=str(d / "cifar10_test.npz"),
                    frost_dir=str(d / "frost"))


def imagenet_models(imagenet_dir: str | Path) -> dict[str, ModelSpec]:
    """The paper's ImageNet models as timm names, with 10,000 class-balanced training images as source.

    ResNet-50 (BN) has torchvision's original weights (the paper's "PyTorch model zoo" model),
    ResNet-50 (GN) timm's, ViT-B/16 is pre-trained on ImageNet-21k and fine-tuned on ImageNet-1k.
    """
    train = str(Path(imagenet_dir) / "train")
    return {
        "resnet50_bn": ModelSpec("resnet50_bn", "timm:resnet50.tv_in1k", None, train, "balanced~10000"),
        "resnet50_gn": ModelSpec("resnet50_gn", "timm:resnet50_gn.a1h_in1k", None, train, "balanced~10000"),
        "vit_b16": ModelSpec("vit_b16", "timm:vit_base_patch16_224.augreg2_in21k_ft_in1k", None, train,
                             "balanced~10000"),
    }


def imagenet_data(imagenet_dir: str | Path, imagenet_c: str | Path | None = None) -> DataSpec:
    """ImageNet-C (released, or written by ``aqr corrupt`` from ``<imagenet_dir>/val``), every image a pool."""
    root = Path(imagenet_c) if imagenet_c is not None else Path(imagenet_dir) / "imagenet-c"
    return DataSpec("imagenet-c", str(root), "all")


def preset(name: str, data_dir: str | Path | None = None, cifar_c: str | Path = "cache/cifar10c",
           imagenet_dir: str | Path | None = None, imagenet_c: str | Path | None = None) -> GridSpec:
    """The paper's experiments on our data (see the module docs of each field in :class:`~aqr.harness.specs.GridSpec`).

    ``data_dir``: the data folder (default ``$AQR_DATA_DIR``); ``cifar_c``: the CIFAR-10-C folder;
    ``imagenet_dir``: ImageNet with ``train/`` (default ``<data_dir>/imagenet``); ``imagenet_c``: ImageNet-C
    (default ``<imagenet_dir>/imagenet-c``).

    ``main``: Tables 1 and 4-6; ``tails``: Table 2 (tail strategies, batch 128/512); ``granularity``:
    Table 3 (K = 11 vs 101); ``vit-blocks``: AQR on all / top-half / bottom-half ViT layers;
    ``smoke``: the six baselines on ResNet-20, two corruptions, one severity, 256 images: 12 cells (the first
    run also generates the two corruptions, 100,000 images, and calibrates: about 8 minutes on 2 cores);
    ``imagenet``: Table 1's ImageNet-C setting (ResNet-50 BN and GN, ViT-B/16 from timm; severities
    1, 3, 5; batch 64; 5,000 of the 50,000 images per cell; see docs/imagenet.md for its cost);
    ``stream``: continual CIFAR-10-C: each cell one stream of the 15 corruptions at severity 5
    in the continual order, blocks of ``n_images`` (2,000) test images, online (no reset), batch sizes
    1, 4, 16, 64 and 128, for :data:`STREAM_METHODS` (see docs/results/stream for its cost);
    ``stream-noniid``: that stream in each of :data:`NONIID_ORDERS`, blocks of 1,000 images,
    batch sizes 16 and 64, seed 0, for :data:`NONIID_METHODS` (see docs/benchmark.md for its cost);
    ``field``: the field's methods, AQR's targets and AQR composed with TENT, ETA, ROID and LAME
    (:data:`FIELD_METHODS`) on the third-party BN
    ResNet-20 (statistics from the 10,000 JPEG training images, as the zoo's models), the zoo's GN
    ResNet-20 and ViT: the continual stream at severity 5, blocks of 500 images, batch 64 (and 16 on the
    BN model), online, in the continual, correlated (delta 0.1), mixed_domains and mixed_domains_correlated
    (delta 0.1) settings, each also under the realtime protocol (:mod:`aqr.harness.realtime`; see
    docs/results/field);
    ``field-batch1``: the field's batch-1 column, on the BN model in the continual setting, the methods that
    adapt on batches through a sliding window of 64 images (see :data:`FIELD_BATCH1_METHODS`).
    """
    methods = tuple(MethodSpec(m) for m in BASELINES)
    if name == "imagenet":
        root = Path(imagenet_dir) if imagenet_dir is not None else resolve_data_dir(data_dir) / "imagenet"
        return GridSpec("imagenet", tuple(imagenet_models(root).values()), imagenet_data(root, imagenet_c), methods,
                        severities=(1, 3, 5), batch_sizes=(64,), seeds=(0,), n_images=5000, protocol="episodic")
    models = default_models(data_dir)
    data = default_data(data_dir, cifar_c)
    if name == "main":
        return GridSpec("main", tuple(models[n] for n in ("resnet20", "resnet20_bn", "resnet20_gn", "vit_ln")), data,
                        methods, protocol="episodic")
    if name == "tails":
        return GridSpec("tails", (models["resnet20"],), data,
                        tuple(MethodSpec("aqr", {"tail": t}) for t in TAILS)
                        # the other reading of the paper's "batch of 100": 100 values, not 100 images
                        + (MethodSpec("aqr", {"tail": "average", "tail_unit": "values"}),), severities=(3, 5),
                        protocol="episodic")
    if name == "granularity":
        return GridSpec("granularity", (models["resnet20"],), data,
                        tuple(MethodSpec("aqr", {"K": k}) for k in (11, 101)), severities=(3, 5), protocol="episodic")
    if name == "vit-blocks":
        return GridSpec("vit-blocks", (models["vit_ln"],), data,
                        tuple(MethodSpec("aqr", {"layers": s}) for s in ("all", "top-half", "bottom-half")),
                        severities=(3, 5), protocol="episodic")
    if name == "stream":
        return GridSpec("stream", tuple(models[n] for n in ("resnet20", "resnet20_gn", "vit_ln")), data, tuple(MethodSpec.parse(m) for m in STREAM_METHODS),
                        corruptions=(CONTINUAL,), severities=(5,), batch_sizes=(1, 4, 16, 64, 128), seeds=(0,),
                        n_images=2000, protocol="online")
    if name == "stream-noniid":
        return GridSpec("stream-noniid", tuple(models[n] for n in ("resnet20", "resnet20_gn", "vit_ln")), data,
                        tuple(MethodSpec.parse(m) for m in NONIID_METHODS), corruptions=(CONTINUAL,), severities=(5,),
                        batch_sizes=(16, 64), seeds=(0,), n_images=1000, protocol="online", orders=NONIID_ORDERS)
    if name == "field":
        return field_grid(models, data)
    if name == "field-batch1":
        return field_batch1_grid(models, data)
    if name == "smoke":
        smoke_data = replace(data, root=str(Path(cifar_c).parent / "cifar10c-smoke"))
        return GridSpec("smoke", (models["resnet20"],), smoke_data, methods,
                        corruptions=("gaussian_noise", "defocus_blur"), severities=(5,), batch_sizes=(128,),
                        seeds=(0,), n_images=256, protocol="episodic")
    raise KeyError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}")
