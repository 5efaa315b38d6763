"""AQR's default configuration per setting, the oracle beside it, and the ``field`` preset's target table.

The ``field`` preset runs several AQR configurations (:data:`aqr.harness.presets.FIELD_AQR_CONFIGS`: the
three targets and the four compositions). Reporting the best of them on the very run it is compared on
would flatter AQR, so one configuration per setting and protocol is fixed beforehand on another image draw
(seed 1, :func:`choose_defaults`) and frozen in :data:`aqr.harness.presets.FIELD_DEFAULTS`; the best
configuration of the run itself is shown beside it as the *oracle*.

:func:`target_table` compares, per setting, model and protocol, the default with the best field method.

A user who does not know their stream gets one configuration per protocol for every setting and model:
:func:`choose_recommended` picks it on the same seed-1 draw, over all the settings of
:data:`RECOMMENDED_SETTINGS` at once, and :data:`aqr.methods.RECOMMENDED` holds its choice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from aqr.harness.cells import REALTIME
from aqr.harness.presets import FIELD_MODELS
from aqr.harness.report.field_tables import field_rows, method_costs, row_setting
from aqr.harness.report.tables import DIGITS, Entry, Table, method_label
from aqr.harness.results import Row

OFFLINE = "offline"
PROTOCOLS = (OFFLINE, REALTIME)
#: The settings (as :func:`~aqr.harness.report.field_tables.row_setting` names them) the recommended
#: configuration is chosen over: the field's four, each on the three models of the ``field`` preset.
RECOMMENDED_SETTINGS = ("continual", "correlated (delta=0.1)", "mixed_domains", "mixed_domains_correlated (delta=0.1)")


def is_aqr_config(variant: str) -> bool:
    """Whether a variant is one of AQR's configurations (``aqr[...]`` or a composition ``aqr+<method>``)."""
    method = variant.partition("[")[0]
    return method == "aqr" or method.startswith("aqr+")


def is_field_method(variant: str) -> bool:
    """Whether a variant is a method AQR is compared against: not AQR's and not its moment-matching control."""
    return not is_aqr_config(variant) and variant.partition("[")[0] != "moments"


def best_field(accuracies: Mapping[str, float]) -> str | None:
    """The variant of ``accuracies`` (variant -> accuracy) that leads among the field's methods
    (:func:`is_field_method`); ``None`` where none of them is there."""
    field = [v for v in accuracies if is_field_method(v)]
    return max(field, key=accuracies.__getitem__) if field else None


def protocol_of(row: Row) -> str:
    """``"offline"`` (every batch adapted on) or ``"realtime"``."""
    return REALTIME if row.protocol == REALTIME else OFFLINE


def _accuracies(rows: Sequence[Row], batch_size: int) -> dict[tuple[str, str, str, str], float]:
    """``(setting, protocol, model, variant)`` -> accuracy of the ok rows at ``batch_size``."""
    out = {}
    for r in field_rows(rows):
        if r.batch_size == batch_size and r.status == "ok" and r.accuracy is not None:
            out[(row_setting(r), protocol_of(r), r.model, r.variant)] = float(r.accuracy)
    return out


def choose_defaults(rows: Sequence[Row], batch_size: int = 64) -> dict[str, dict[str, str]]:
    """setting -> protocol -> the AQR configuration of highest mean accuracy over the models.

    Only configurations with a result on every model of that setting and protocol compete (a failed or
    missing cell must not help); ties go to the first in variant order. Meant for the selection run (seed 1).
    """
    acc = _accuracies(rows, batch_size)
    chosen: dict[str, dict[str, str]] = {}
    for setting, protocol in sorted({(s, p) for s, p, _, _ in acc}):
        here = {(m, v): a for (s, p, m, v), a in acc.items() if (s, p) == (setting, protocol) and is_aqr_config(v)}
        models = {m for m, _ in here}
        scores = {v: float(np.mean([here[(m, v)] for m in models]))
                  for v in sorted({v for _, v in here}) if all((m, v) in here for m in models)}
        if scores:
            best = max(scores.values())
            chosen.setdefault(setting, {})[protocol] = min(v for v, s in scores.items() if s == best)
    return chosen


def variant_spec(variant: str) -> str:
    """A variant as the bench's method syntax spells it (``aqr[target=stream]`` -> ``aqr:target=stream``), the
    form :func:`aqr.methods.create` takes."""
    name, bracket, options = variant.partition("[")
    return f"{name}:{options.removesuffix(']')}" if bracket else name


def spec_variant(spec: str) -> str:
    """A spec as the results database labels its cells (``aqr:target=stream`` -> ``aqr[target=stream]``, the
    options sorted as a cell sorts them): the inverse of :func:`variant_spec`."""
    from aqr.methods.declaration import parse_spec

    name, options = parse_spec(spec)
    return f"{name}[{','.join(f'{k}={v}' for k, v in sorted(options.items()))}]" if options else name


def choose_recommended(rows: Sequence[Row], settings: Sequence[str] = RECOMMENDED_SETTINGS,
                       models: Sequence[str] = FIELD_MODELS, batch_size: int = 64, seed: int = 1) -> dict[str, str]:
    """protocol -> the one AQR configuration (a spec, :func:`variant_spec`) of highest mean accuracy over every
    (setting, model) cell of ``settings`` x ``models`` at ``batch_size`` on the draw ``seed``.

    Only a configuration with an ok result in every one of those cells is eligible; a tie goes to the lower
    mean cost C over the models (from the realtime rows; unknown: last), then to the first in variant order.
    ``ValueError`` naming what each configuration lacks when none is eligible for a protocol, and naming a
    cell with two ok rows (e.g. realtime rows of two timing rounds' costs): which one counts is not the rule's
    to guess.
    """
    drawn = [r for r in field_rows(rows) if r.seed == seed and r.batch_size == batch_size and r.status == "ok"
             and r.accuracy is not None]
    seen: dict[tuple[str, str, str, str], Row] = {}
    for r in drawn:
        cell = (row_setting(r), protocol_of(r), r.model, r.variant)
        if cell in seen:
            raise ValueError(f"two ok rows for {' / '.join(cell)} at batch {batch_size}, seed {seed} (keys "
                             f"{seen[cell].key[:12]}, {r.key[:12]}; C {seen[cell].config.get('cost')}, "
                             f"{r.config.get('cost')}): keep one")
        seen[cell] = r
    acc = _accuracies(drawn, batch_size)
    costs = method_costs(drawn)
    cells = [(s, m) for s in settings for m in models]
    chosen: dict[str, str] = {}
    for protocol in PROTOCOLS:
        variants = sorted({v for (_, p, _, v) in acc if p == protocol and is_aqr_config(v)})
        missing = {v: [f"{s} / {m}" for s, m in cells if (s, protocol, m, v) not in acc] for v in variants}
        eligible = [v for v in variants if not missing[v]]
        if not eligible:
            lacks = "; ".join(f"{v} lacks {len(c)} ({', '.join(c[:2])}{', ...' if len(c) > 2 else ''})"
                              for v, c in missing.items()) or "no AQR configuration has a row"
            raise ValueError(f"no AQR configuration has an ok {protocol} cell at batch {batch_size}, seed {seed} "
                             f"in every setting and model, so none is eligible: {lacks}")

        def rank(v: str) -> tuple[float, float, str]:
            mean = float(np.mean([acc[(s, protocol, m, v)] for s, m in cells]))
            cost = [costs.get((m, v, batch_size)) for m in models]
            return -mean, float(np.mean(cost)) if None not in cost else float("inf"), v

        chosen[protocol] = variant_spec(min(eligible, key=rank))
    return chosen


def _named(variant: str, accuracy: float) -> Entry:
    return Entry(f"{method_label(variant)} {accuracy:.{DIGITS}f}", accuracy, None, 1)


def target_table(rows: Sequence[Row], defaults: Mapping[str, Mapping[str, str]], batch_size: int = 64) -> Table | None:
    """Per setting of ``defaults``, model and protocol: the best field method, AQR's default configuration,
    their difference, and the best AQR configuration of this run (the oracle). ``None`` without such rows."""
    acc = _accuracies(rows, batch_size)
    labels, entries = [], []
    for setting, protocols in defaults.items():
        for model in sorted({m for s, _, m, _ in acc if s == setting}):
            for protocol in PROTOCOLS:
                here = {v: a for (s, p, m, v), a in acc.items() if (s, p, m) == (setting, protocol, model)}
                default = protocols.get(protocol)
                if not here or default is None:
                    continue
                ours = {v: a for v, a in here.items() if is_aqr_config(v)}
                best = best_field(here)
                oracle = max(ours, key=ours.__getitem__) if ours else None
                row = [Entry(method_label(default)),
                       Entry(f"{here[default]:.{DIGITS}f}", here[default], None, 1) if default in here else Entry(""),
                       _named(best, here[best]) if best else Entry(""),
                       _named(oracle, ours[oracle]) if oracle else Entry("")]
                if best and default in here:
                    gap = here[default] - here[best]
                    row += [Entry(f"{gap:+.{DIGITS}f}", gap, None, 1), Entry("yes" if gap >= 0 else "no")]
                else:
                    row += [Entry(""), Entry("")]
                labels.append(f"{setting} · {model} · {protocol}")
                entries.append(tuple(row))
    if not entries:
        return None
    note = (f"Batch {batch_size}, accuracy (%) over the whole stream. Default: the AQR configuration fixed per "
            "setting and protocol before this run, on another image draw (seed 1); oracle: the best AQR "
            "configuration of this run, for reference only. Best field method: the best of the methods AQR is "
            "compared with (the source model included; AQR's moment-matching control excluded). Difference: "
            "default minus best field method; met: the default at or above it.")
    header = ("Setting · model · protocol", "AQR default", "accuracy", "best field method", "oracle (AQR)",
              "difference", "met")
    return Table("field_target", "AQR's default configuration against the best field method", header,
                 tuple(labels), tuple(entries), note)


def recommended_table(rows: Sequence[Row], recommended: Mapping[str, str],
                      batch_sizes: Sequence[int] = (64, 16)) -> Table | None:
    """:func:`target_table` for the recommended configuration (``recommended``: protocol -> spec, as
    :data:`aqr.methods.RECOMMENDED`), the same one in every setting of the rows, at each of ``batch_sizes``.
    ``None`` without such rows."""
    settings = sorted({row_setting(r) for r in field_rows(rows)})
    chosen = {protocol: spec_variant(spec) for protocol, spec in recommended.items()}
    labels: list[str] = []
    entries: list[tuple[Entry, ...]] = []
    for batch_size in batch_sizes:
        table = target_table(rows, {s: chosen for s in settings}, batch_size)
        if table is not None:
            labels += [f"{label} · batch {batch_size}" for label in table.labels]
            entries += table.entries
    if not entries:
        return None
    note = ("Accuracy (%) over the whole stream. Recommended: the one AQR configuration per protocol for every "
            "setting and model (aqr.methods.RECOMMENDED), chosen before this run on another image draw (seed 1, "
            "batch 64, over all settings and models at once); oracle: the best AQR configuration of this run, for "
            "reference only. Best field method: the best of the methods AQR is compared with (the source model "
            "included; AQR's moment-matching control excluded). Difference: recommended minus best field method; "
            "met: the recommended configuration at or above it.")
    header = ("Setting · model · protocol · batch", "recommended", "accuracy", "best field method", "oracle (AQR)",
              "difference", "met")
    return Table("field_recommended", "The recommended configuration against the best field method", header,
                 tuple(labels), tuple(entries), note)

