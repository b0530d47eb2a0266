"""The static HTML report: figures (PNG) plus the tables behind them."""
from __future__ import annotations

import html
import json
import math
import time
from pathlib import Path

from quantdyn.errors import QuantdynError
from quantdyn.report import figures
from quantdyn.results.store import ResultStore


def _fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "–"
        return f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.3e}"
    return html.escape(str(v))


def _table(rows: list[dict], limit: int = 400) -> str:
    if not rows:
        return "<p><em>no rows</em></p>"
    cols = list(rows[0])
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(r.get(c))}</td>" for c in cols) + "</tr>" for r in rows[:limit])
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def lr_curve_of(run_dir: Path | None) -> list[tuple[int, float]]:
    if run_dir is None:
        return []
    from quantdyn.train.trainer import read_metrics

    return [(r["tokens"], r["lr"]) for r in read_metrics(run_dir) if "lr" in r and "tokens" in r]


def resolve_input(store_or_run: str | Path, store: str | Path | None) -> tuple[ResultStore, Path | None]:
    p = Path(store_or_run)
    if (p / "config.yaml").is_file():
        return ResultStore(store or "results", create=False), p
    if p.is_dir():
        return ResultStore(p, create=False), None
    raise QuantdynError(f"'{p}' is neither a results store nor a run directory; pass one (default store: results)")


def write_report(store_or_run: str | Path, out_dir: str | Path, store: str | Path | None = None) -> Path:
    st, run_dir = resolve_input(store_or_run, store)
    rows = st.rows()
    if run_dir is not None:
        prefix = str(run_dir.resolve())
        rows = [r for r in rows if str(Path(r.get("checkpoint", "")).resolve()).startswith(prefix)]
    if not rows:
        raise QuantdynError(f"no result rows found in '{st.root}'{' for ' + str(run_dir) if run_dir else ''}; run a sweep first")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sections = []
    runs = sorted({r["run"] for r in rows if r.get("kind") in ("fp", "ptq") and r.get("run")})
    for run in runs:
        rd = run_dir
        if rd is None:
            ck = next((r["checkpoint"] for r in rows if r["run"] == run and r.get("branch") == "main"), None)
            rd = Path(ck).parent.parent if ck and Path(ck).is_dir() else None
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in run)
        f1 = out / f"trajectory_{safe}.png"
        t1 = figures.trajectory(rows, run, lr_curve_of(rd) if rd and (rd / "metrics.jsonl").is_file() else [], f1)
        sections.append((f"Run {run}: loss and quantization error along training", f1.name, t1,
                         "Top: full-precision validation loss. Below: Δ CE = CE(quantized) − CE(FP) per quantizer "
                         "(error bars: paired SE over evaluation windows). Grey: learning rate."))
        f2 = out / f"rainbow_{safe}.png"
        t2 = figures.rainbow(rows, run, f2)
        if t2:
            sections.append((f"Run {run}: cooldown branches vs constant-LR controls", f2.name, t2,
                             "Each colour is a cooldown branch started from a stable-phase checkpoint; the dashed line "
                             "of the same colour is its control twin at constant LR for the same tokens. The table "
                             "gives the decayed endpoint minus its control, paired over windows, and z = difference/SE. "
                             "A control branched while the main run is itself at constant LR coincides with it "
                             "(same weights, data and LR), so it hides behind the black line."))
    for family, members in figures.seed_families(rows).items():
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in family)
        f5 = out / f"seeds_{safe}.png"
        t5 = figures.seeds(rows, family, members, f5)
        if t5:
            sections.append((f"{family}: spread over {len(members)} seeds", f5.name, t5,
                             f"Runs {', '.join(members)} differ only by seed. Mean Δ CE over the seeds at the steps "
                             "they all have; error bars are the SD over seeds (with two seeds, |a − b|/√2), faint "
                             "lines the single seeds. Solid: main run and cooldown branches; dashed: controls."))
    if any(r.get("kind") == "ptq" for r in rows):
        f3 = out / "loss_vs_dce.png"
        color_key = figures.varied_key(rows) if len(runs) > 1 else "branch"
        t3 = figures.loss_vs_dce(rows, f3, color_key=color_key)
        sections.append(("Δ CE against full-precision loss", f3.name, t3,
                         f"One marker per {color_key} (paper A, Figure 6); lower-left is better."))
        f4 = out / "averaging_vs_decay.png"
        t4 = figures.averaging_vs_decay(rows, f4)
        if t4:
            sections.append(("Weight averaging against the decayed endpoint", f4.name, t4,
                             "Per bit width: Δ CE of each run's decayed endpoint (grey) and of its latest averaged "
                             "checkpoints (LAWA, EMA, soups; blue). The table also gives FP and quantized CE: a lower "
                             "Δ CE at a much higher loss is not a better model."))
    for extra in _extra_sections(rows, out):
        sections.append(extra)
    parts = [f"<h2>{html.escape(t)}</h2><p>{html.escape(cap)}</p><img src='{img}' style='max-width:100%'>"
             f"<details><summary>numbers ({len(tab)} rows)</summary>{_table(tab)}</details>"
             for t, img, tab, cap in sections]
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>quantdyn report</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}}
table{{border-collapse:collapse;font-size:12px}}td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}}
h2{{margin-top:2em;border-bottom:1px solid #ddd}}</style></head><body>
<h1>quantdyn report</h1><p>store: {html.escape(str(st.root))} · {len(rows)} rows · written {time.strftime('%Y-%m-%d %H:%M')}</p>
{''.join(parts)}
</body></html>"""
    (out / "index.html").write_text(page)
    (out / "rows.json").write_text(json.dumps([{k: v for k, v in r.items() if k not in ("window_delta",)} for r in rows],
                                              default=str))
    return out / "index.html"


def _extra_sections(rows: list[dict], out: Path):
    """Sections contributed by other studies (predictors, accuracy, optimizers, public trajectories) when their
    rows exist."""
    from quantdyn.report import trajectories
    from quantdyn.report.extra import sections

    return sections(rows, out) + trajectories.sections(rows, out)
