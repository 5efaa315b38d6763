"""Grids written as YAML/JSON: a mapping of grid keys over a preset, read from a file or given parsed."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from aqr.data.corruption_params import CORRUPTIONS
from aqr.data.location import DataDirError, resolve_data_dir
from aqr.harness.cells import DataSpec, ModelSpec
from aqr.harness.presets import BASELINES, default_models, preset
from aqr.harness.specs import GridSpec, MethodSpec


def grid_from_mapping(spec: Mapping[str, Any], data_dir: str | Path | None = None,
                      cifar_c: str | Path = "cache/cifar10c") -> GridSpec:
    """Build a grid from a parsed YAML/JSON mapping.

    Keys: ``name``, ``preset`` (start from a preset and override the rest), ``models`` (names of
    :func:`~aqr.harness.presets.default_models` or mappings with :class:`~aqr.harness.cells.ModelSpec`
    fields), ``data`` (a mapping with :class:`~aqr.harness.cells.DataSpec` fields), ``methods`` (``"tent"``, ``"aqr:tail=clip"`` or mappings with a
    ``method`` key), ``corruptions`` (``"all"`` or a list), ``severities``, ``batch_sizes``,
    ``seeds``, ``n_images``, ``protocol``, ``orders`` (a list of stream orders such as ``"delta=0.1"``,
    ``null`` for none) or ``order`` (one of them).

    Defaults come from the preset (``main`` when none is named), which reads the data folder
    (``data_dir`` or ``$AQR_DATA_DIR``). A grid that names no preset and lists only its own models
    needs no data folder when none is set: its data then defaults to ``cifar_c`` without a clean
    source to generate from.
    """
    allowed = {"name", "preset", "models", "data", "methods", "corruptions", "severities", "batch_sizes",
               "seeds", "n_images", "protocol", "order", "orders"}
    unknown = set(spec) - allowed
    if unknown:
        raise ValueError(f"unknown grid keys {sorted(unknown)}; allowed: {sorted(allowed)}")
    if "order" in spec and "orders" in spec:
        raise ValueError("give a grid either 'order' (one stream order) or 'orders' (a list), not both")
    own_models = "models" in spec and all(isinstance(m, Mapping) for m in spec["models"])
    try:
        resolve_data_dir(data_dir)
    except DataDirError:
        if "preset" in spec or not own_models:
            raise
        base = GridSpec("custom", (), DataSpec(root=str(cifar_c)), tuple(MethodSpec(m) for m in BASELINES),
                        protocol="episodic")  # the main preset's protocol
        known_models: dict[str, ModelSpec] = {}
    else:
        base = preset(spec.get("preset", "main"), data_dir, cifar_c)
        known_models = default_models(data_dir)
    changes: dict[str, Any] = {"name": spec.get("name", spec.get("preset", "custom"))}
    if "models" in spec:
        models = []
        for entry in spec["models"]:
            if isinstance(entry, str):
                if entry not in known_models:
                    raise ValueError(f"unknown model {entry!r}; give a mapping with ModelSpec fields "
                                     f"or one of {', '.join(known_models)}")
                models.append(known_models[entry])
            else:
                models.append(ModelSpec(**entry))
        changes["models"] = tuple(models)
    if "data" in spec:
        changes["data"] = DataSpec(**{**asdict(base.data), **spec["data"]})
    if "methods" in spec:
        changes["methods"] = tuple(MethodSpec.parse(m) for m in spec["methods"])
    if "corruptions" in spec:
        c = spec["corruptions"]
        changes["corruptions"] = CORRUPTIONS if c == "all" else tuple(c)
    for key in ("severities", "batch_sizes", "seeds"):  # checked as written by GridSpec: 2.7 or true is refused
        if key in spec:
            value = spec[key]
            changes[key] = tuple(value) if isinstance(value, (list, tuple)) else value
    if "n_images" in spec:
        changes["n_images"] = None if spec["n_images"] in (None, "all") else spec["n_images"]
    if "protocol" in spec:
        changes["protocol"] = spec["protocol"]
    if "order" in spec:
        changes["orders"] = (spec["order"],)
    if "orders" in spec:
        if isinstance(spec["orders"], str) or not isinstance(spec["orders"], Sequence):
            raise ValueError(f"grid key 'orders' must be a list of stream orders, got {spec['orders']!r}")
        changes["orders"] = tuple(spec["orders"])
    return replace(base, **changes)


def load_grid(path: str | Path, data_dir: str | Path | None = None,
              cifar_c: str | Path = "cache/cifar10c") -> GridSpec:
    """Read a grid from a ``.yaml``/``.yml`` (needs PyYAML, ``aqr[bench]``) or ``.json`` file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"grid file {path} does not exist")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as err:
            raise ImportError("reading YAML grids needs PyYAML: pip install 'aqr[bench]'") from err
        spec = yaml.safe_load(text)
    else:
        spec = json.loads(text)
    if not isinstance(spec, Mapping):
        raise ValueError(f"{path}: a grid file must hold a mapping, got {type(spec).__name__}")
    return grid_from_mapping(spec, data_dir, cifar_c)
