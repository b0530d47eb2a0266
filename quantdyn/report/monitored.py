"""A monitored run's quantization error, read from its metrics.jsonl.

The in-training monitor (``monitor: {every: N, quantizers: [...]}``) writes, on the steps it measures,
``dce_<quantizer>`` and ``dce_<quantizer>_se``; loggers that follow the shared metric names write
``ptq/<quantizer>/<metric>`` (``delta_ce``, ``delta_ce_se``, ``rel_delta_ce``, ``kl``, ``kl_se``,
``top1_agree``, ``delta_ppl``, ...).  Both are accepted (the ``ptq/`` name wins where a step has both).
The FP loss is the step's ``val_loss`` (or ``val/loss``), the LR its ``lr`` (or ``train/lr``). A value is
read as a stored number is (``results.schema.number``: finite reals only).

:func:`monitored_points` turns them into the points :func:`quantdyn.report.figures.metric_panels` draws,
so a monitored run and a sweep over its checkpoints get the same figure.
"""
from __future__ import annotations

import re

from quantdyn.errors import QuantdynError
from quantdyn.quantize.catalogue import parse_quantizer
from quantdyn.results.schema import number

_PTQ = re.compile(r"^ptq/(.+)/([A-Za-z0-9_]+)$")
_DCE = re.compile(r"^dce_(.+?)(_se)?$")


def canonical(spec: str) -> str:
    """The canonical label of a monitor quantizer spec (so its colour matches the sweep's rows); the spec
    itself when it does not parse."""

    try:
        return parse_quantizer(spec).name
    except (QuantdynError, ValueError, TypeError):
        return spec


def _first(row: dict, *keys):
    for k in keys:
        if number(row.get(k)) is not None:
            return float(row[k])
    return None


def monitored_points(metrics: list[dict]) -> tuple[list[dict], dict[str, list[dict]], list[tuple[float, float]]]:
    """(FP points, {quantizer label: points}, LR curve) of a monitored run's metrics rows.

    Points carry step, tokens, lr and the metrics found (delta_ce, delta_ce_se, ...), plus quantizer_spec
    (the spec as the monitor wrote it); FP points carry ce_fp.  The LR curve is (tokens, lr) of every row
    with both (step where tokens are missing)."""
    fp, series, lr = [], {}, []
    for row in metrics:
        step = number(row.get("step"))
        if step is None:
            continue
        tokens = _first(row, "tokens", "train/tokens")
        lr_v = _first(row, "lr", "train/lr")
        where = {"step": int(step), "tokens": tokens, "lr": lr_v}
        if lr_v is not None:
            lr.append((tokens if tokens is not None else step, lr_v))
        val = _first(row, "val_loss", "val/loss")
        if val is not None:
            fp.append({**where, "ce_fp": val})
        found: dict[str, dict] = {}
        legacy: dict[str, dict] = {}
        for k, v in row.items():
            if number(v) is None:
                continue
            m = _PTQ.match(k)
            if m:
                found.setdefault(m.group(1), {})[m.group(2)] = float(v)
                continue
            m = _DCE.match(k)
            if m:
                legacy.setdefault(m.group(1), {})["delta_ce_se" if m.group(2) else "delta_ce"] = float(v)
        for spec, vals in legacy.items():
            if "delta_ce" not in vals:  # e.g. a quantizer spec that itself ends in "_se": keep it whole
                continue
            found[spec] = {**vals, **found.get(spec, {})}
        for spec, vals in found.items():
            if vals.get("delta_ce") is None:
                continue
            # rel. Δ CE is not derived from val_loss: the monitor's CE(FP) is on windows of its own
            series.setdefault(canonical(spec), []).append({**where, "quantizer_spec": spec, **vals})
    for pts in series.values():
        pts.sort(key=lambda p: p["step"])
    fp.sort(key=lambda p: p["step"])
    return fp, series, sorted(lr)
