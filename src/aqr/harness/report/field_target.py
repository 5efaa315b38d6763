"""AQR's default configuration per setting, the oracle beside it, and the ``field`` preset's target table.

The ``field`` preset runs several AQR configurations (:data:`aqr.harness.presets.FIELD_AQR_CONFIGS`: the
three targets and the four compositions). Reporting the best of them on the very run it is compared on
would flatter AQR, so one configuration per setting and protocol is fixed beforehand on another image draw
(seed 1, :func:`choose_defaults`) and frozen in :data:`aqr.harness.presets.FIELD_DEFAULTS`; the best
configuration of the run itself is shown beside it as the *oracle*.

:func:`target_table` compares, per setting, model and protocol, the default with the best field method.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from aqr.harness.cells import REALTIME
from aqr.harness.report.field_tables import field_rows, row_setting
from aqr.harness.report.tables import DIGITS, Entry, Table, method_label
from aqr.harness.results import Row

OFFLINE = "offline"
PROTOCOLS = (OFFLINE, REALTIME)


def is_aqr_config(variant: str) -> bool:
    """Whether a variant is one of AQR's configurations (``aqr[...]`` or a composition ``aqr+<method>``)."""
    method = variant.partition("[")[0]
    return method == "aqr" or method.startswith("aqr+")


def is_field_method(variant: str) -> bool:
    """Whether a variant is a method AQR is compared against: not AQR's and not its moment-matching control."""
    return not is_aqr_config(variant) and variant.partition("[")[0] != "moments"


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
                field = {v: a for v, a in here.items() if is_field_method(v)}
                ours = {v: a for v, a in here.items() if is_aqr_config(v)}
                best = max(field, key=field.__getitem__) if field else None
                oracle = max(ours, key=ours.__getitem__) if ours else None
                row = [Entry(method_label(default)),
                       Entry(f"{here[default]:.{DIGITS}f}", here[default], None, 1) if default in here else Entry(""),
                       _named(best, field[best]) if best else Entry(""),
                       _named(oracle, ours[oracle]) if oracle else Entry("")]
                if best and default in here:
                    gap = here[default] - field[best]
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
