"""Figures of public training trajectories (paper A's Pythia, OLMo, OLMo-2, SmolLM3, ... sweeps), drawn from
result rows (``ResultStore.rows()``) and the trajectory presets; each writes PNG and SVG and returns the table
of numbers behind it.

  error_vs_tokens       Δ CE, Δ CE / CE(FP) (and Δ PPL, KL, top-1 agreement where measured) against tokens
                        for one trajectory, LR overlaid
  families_side_by_side Δ CE / CE(FP) against tokens, one panel per trajectory (family and size)
  soup_vs_ingredients   OLMo-2 stage 2: each ingredient's error along its own tokens, the soup beside them
  sections              the three above as report sections, for the rows a store holds

The LR overlay is drawn from the preset's schedule (the functions quantdyn trains with); without a preset
it joins the rows' own ``lr`` values.  The relative error is the row's ``rel_delta_ce`` or, for rows written
before it existed, ``delta_ce / ce_fp``.  Quantizer and branch colours come from ``palette.py`` (the same as
in every other figure of the report), error bars and the relative error from ``results/schema.py`` (combined
with the run-to-run spread where the quantization was repeated).
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from quantdyn.errors import QuantdynError
from quantdyn.report import uncertainty
from quantdyn.report.figures import y_layout
from quantdyn.report.output import overlay_lr, panel_grid, save_figure, tokens_axis
from quantdyn.report.palette import Palette, quantizer_color
from quantdyn.results.schema import PTQ
from quantdyn.results.stats import rel_delta_ce, rel_delta_ce_se, total_se
from quantdyn.schedules import PhaseSchedule, schedule_curve
from quantdyn.sources.presets import Preset, get_preset, preset_for_repo

PUBLIC_KINDS = ("hub", "soup")


def preset_of_rows(rows: Iterable[dict]) -> Preset | None:
    """The preset of a trajectory's rows: their ``preset`` field, else the preset whose repos hold their run."""
    for r in rows:
        name = r.get("preset")
        if name:
            try:
                return get_preset(name)
            except QuantdynError:  # a preset renamed since the rows were written: fall back to the repo
                pass
        if r.get("run"):
            found = preset_for_repo(r["run"])
            if found is not None:
                return found
    return None


def public_runs(rows: list[dict]) -> list[str]:
    """Runs (hub repos) with PTQ rows of public checkpoints, in order of first appearance."""
    out: list[str] = []
    for r in rows:
        public = PTQ.matches(r) and (r.get("ckpt_kind") in PUBLIC_KINDS or r.get("preset"))
        if public and r.get("run") and r["run"] not in out:
            out.append(r["run"])
    return out


def _label(run: str, pre: Preset | None) -> str:
    return pre.name if pre is not None else run


def _quantizers(rows: list[dict]) -> list[str]:
    def key(q):
        bits = next((r.get("bits") for r in rows if r.get("quantizer") == q), 0)
        return (-(bits or 0), q)

    return sorted({r["quantizer"] for r in rows if PTQ.matches(r) and r.get("quantizer")}, key=key)


def _ptq(rows: list[dict], run: str, quantizers: list[str] | None = None) -> list[dict]:
    pts = [r for r in rows if PTQ.matches(r) and r.get("run") == run and r.get("tokens") is not None
           and r.get("delta_ce") is not None and (quantizers is None or r.get("quantizer") in quantizers)]
    return sorted(pts, key=lambda r: r["tokens"])


def _schedule_tokens_curve(pre: Preset, sched: PhaseSchedule, lo: float, hi: float, offset: float = 0.0,
                           n: int = 300) -> list[tuple[float, float]]:
    """(tokens, LR) of ``sched`` over [lo, hi] global tokens; ``offset`` = tokens where the stage starts."""
    if sched.unit == "tokens":
        return [(x + offset, y) for x, y in schedule_curve(sched, max(0.0, lo - offset), hi - offset, n)]
    if not pre.tokens_per_step:
        return []
    tps = pre.tokens_per_step
    return [(x * tps + offset, y) for x, y in schedule_curve(sched, max(0.0, (lo - offset) / tps), (hi - offset) / tps, n)]


def lr_curves(pre: Preset | None, rows: list[dict]) -> list[tuple[str, list[tuple[float, float]]]]:
    """LR against global tokens for the main line (and a stage that branches off), over the rows' token range."""
    toks = [r["tokens"] for r in rows if r.get("tokens") is not None]
    if not toks:
        return []
    lo, hi = min(toks), max(toks)
    if pre is None:
        main = sorted({(r["tokens"], r["lr"]) for r in rows if r.get("lr") is not None and r.get("branch") == "main"})
        return [("main", main)] if main else []
    if pre.schedule is not None:
        return [("main", _schedule_tokens_curve(pre, pre.schedule, lo, hi))]
    out = []
    for st in pre.stages:
        if st.schedule is None:
            continue
        offset = 0.0
        if st.branches_from:
            base = pre.locate(st.branches_from)
            if isinstance(base, str) or base.tokens is None:
                continue
            offset = float(base.tokens)
            if hi <= offset:
                continue
        curve = _schedule_tokens_curve(pre, st.schedule, max(lo, offset), hi, offset)
        if curve:
            out.append((st.name, curve))
    return out


def _tokens_axis(ax) -> None:
    tokens_axis(ax)


def _log_x(tokens: list[float]) -> bool:
    pos = [t for t in tokens if t and t > 0]
    return bool(pos) and max(pos) / min(pos) > 1e3


def _save(fig, out: Path, **kw) -> list[Path]:
    return save_figure(fig, out, **kw)


def _branch_style(branch: str) -> dict:
    if branch == "main":
        return {"lw": 1.3, "alpha": 1.0}
    return {"lw": 0.9, "alpha": 0.6, "ls": "--"}


def _stage_start(pre: Preset | None) -> int | None:
    """Tokens of the checkpoint a branching stage (OLMo-2 stage 2) starts from."""
    stage = next((s for s in pre.stages if s.branches_from), None) if pre is not None else None
    base = pre.locate(stage.branches_from) if stage is not None else None
    return None if base is None or isinstance(base, str) else base.tokens


def _table_row(run: str, pre: Preset | None, branch: str, q: str, r: dict) -> dict:
    return {"run": run, "preset": pre.name if pre else None, "branch": branch, "quantizer": q,
            "revision": r.get("revision") or str(r.get("checkpoint", "")).partition("@")[2],
            "step": r.get("step"), "tokens": r["tokens"], "lr": r.get("lr"), "phase": r.get("phase"),
            "decaying": r.get("decaying"), "ce_fp": r.get("ce_fp"), "delta_ce": r["delta_ce"],
            **uncertainty.columns(r), "rel_delta_ce": rel_delta_ce(r), "delta_ppl": r.get("delta_ppl"),
            "kl": r.get("kl"), "top1_agree": r.get("top1_agree")}


PANELS = (
    ("delta_ce", "Δ CE (nats)", lambda r: r.get("delta_ce"), total_se),
    ("rel_delta_ce", "Δ CE / CE(FP)", rel_delta_ce, rel_delta_ce_se),
    ("delta_ppl", "Δ PPL", lambda r: r.get("delta_ppl"), None),
    ("kl", "KL(FP ‖ Q) (nats/token)", lambda r: r.get("kl"), lambda r: total_se(r, "kl")),
    ("top1_agree", "top-1 agreement with FP", lambda r: r.get("top1_agree"), None),
)
"""(key, label, value, error bar) of the panels of :func:`error_vs_tokens`; Δ CE and Δ CE / CE(FP) always,
the others when the rows carry them."""


def error_vs_tokens(rows: list[dict], run: str, out: Path, quantizers: list[str] | None = None) -> list[dict]:
    """Δ CE (± combined SE) and Δ CE / CE(FP) against tokens of one public trajectory, with Δ PPL, KL and top-1
    agreement beside them when the rows carry them (all its branches: stage-1 main, stage-2 ingredients
    dashed, the soup as a star), with the preset's LR overlaid; filled markers = decaying; one colour per
    quantizer (``palette``); quantizers of very different size on a log axis or in panels of their own
    (:func:`quantdyn.report.figures.y_layout`).  Writes ``out``.png and .svg; returns the table behind it ([]
    and no files when the run has no rows)."""
    pts = _ptq(rows, run, quantizers)
    if not pts:
        return []
    pre = preset_of_rows(pts)
    qs = _quantizers(pts)
    curves = lr_curves(pre, pts)
    start = _stage_start(pre)
    panels = []  # (panel, its quantizers, y scale): quantizers of very different size split by y_layout's rule
    for k, p in enumerate(PANELS):
        values = {q: [v for r in pts if r["quantizer"] == q and (v := p[2](r)) is not None] for q in qs}
        if k < 2 or any(values.values()):
            lay = y_layout(values, log_ok=p[0] != "top1_agree")
            panels += [(p, g, lay.scale) for g in lay.groups or (tuple(qs),)]
    split = len(panels) > len({p[0] for p, _, _ in panels})
    cols = 1 if len(panels) <= 2 else 2
    fig, axes = panel_grid(len(panels), max_cols=cols, panel_height=2.3 if cols == 2 else 2.5, extra_height=0.3,
                           sharex=True)
    table = []
    for q in qs:
        c = quantizer_color(q)
        mine = [r for r in pts if r["quantizer"] == q]
        for branch in sorted({r.get("branch") or "main" for r in mine}, key=lambda b: (b != "main", b)):
            br = [r for r in mine if (r.get("branch") or "main") == branch]
            table += [_table_row(run, pre, branch, q, r) for r in br]
            if branch.startswith("ingredient"):  # drawn from the checkpoint the stage starts at
                br = [r for r in mine if (r.get("branch") or "main") == "main" and r["tokens"] == start] + br
            xs = [r["tokens"] for r in br]
            for k, (ax, ((_, _, value, se), group, _)) in enumerate(zip(axes, panels)):
                if q not in group:
                    continue
                named = k == 0 or split  # the legend: on the first panel, or on each of split panels
                ys = [value(r) for r in br]
                if branch == "soup":
                    ax.plot(xs, ys, "*", color=c, ms=10, label=f"{q} soup" if named else None)
                    continue
                st = _branch_style(branch)
                keep = [i for i, y in enumerate(ys) if y is not None]
                kx, ky = [xs[i] for i in keep], [ys[i] for i in keep]
                ax.errorbar(kx, ky, yerr=[se(br[i]) for i in keep] if se else None, color=c, capsize=2, ms=0,
                            label=q if branch == "main" and named else None, **st)
                ax.scatter(kx, ky, s=12, color=c, zorder=3,
                           facecolors=[c if br[i].get("decaying") else "white" for i in keep])
    for k, (ax, ((_, label, _, _), _, scale)) in enumerate(zip(axes, panels)):
        if scale == "log":
            ax.set_yscale("log")
        ax.set_ylabel(label + (" (log)" if scale == "log" else ""), fontsize=8)
        if k == 0 or split:
            ax.legend(fontsize=6 if split else 7, loc="best" if split else "upper left")
    fig.suptitle(f"{_label(run, pre)}: quantization error along training (filled = LR decaying)", fontsize=10)
    for ax in axes:
        overlay_lr(ax, [c for _, c in curves])
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    log = _log_x([r["tokens"] for r in pts])
    for k, ax in enumerate(axes):
        if log:
            ax.set_xscale("log")
        else:
            _tokens_axis(ax)
        if k >= len(axes) - cols:
            ax.set_xlabel("tokens", fontsize=8)
    _save(fig, out, top=0.25)
    return table


def families_side_by_side(rows: list[dict], out: Path, runs: list[str] | None = None,
                          quantizers: list[str] | None = None) -> list[dict]:
    """Δ CE / CE(FP) against tokens, one panel per trajectory (shared y: the relative error compares across
    families), each with its LR overlaid; main line and soups only.  Returns the table behind it."""
    runs = [r for r in (runs or public_runs(rows)) if _ptq(rows, r, quantizers)]
    if not runs:
        return []
    qs = _quantizers([r for r in rows if r.get("run") in runs and (quantizers is None or r.get("quantizer") in quantizers)])
    cols = min(3, len(runs))
    fig, axes = panel_grid(len(runs), max_cols=cols, panel_height=2.5, extra_height=0.0, sharey=True)
    table = []
    for k, (ax, run) in enumerate(zip(axes, runs)):
        pts = [r for r in _ptq(rows, run, quantizers) if (r.get("branch") or "main") in ("main", "soup")]
        pre = preset_of_rows(pts)
        for q in qs:
            c = quantizer_color(q)
            line = [r for r in pts if r["quantizer"] == q and (r.get("branch") or "main") == "main"]
            soup = [r for r in pts if r["quantizer"] == q and r.get("branch") == "soup"]
            if line:
                ax.plot([r["tokens"] for r in line], [rel_delta_ce(r) for r in line], "o-", color=c, ms=3, lw=1.2,
                        label=q)
            if soup:
                ax.plot([r["tokens"] for r in soup], [rel_delta_ce(r) for r in soup], "*", color=c, ms=10)
            for r in line + soup:
                table.append({"run": run, "preset": pre.name if pre else None, "quantizer": q,
                              "branch": r.get("branch") or "main", "tokens": r["tokens"], "lr": r.get("lr"),
                              "rel_delta_ce": rel_delta_ce(r), "delta_ce": r["delta_ce"]})
        overlay_lr(ax, [c for _, c in lr_curves(pre, pts)[:1]])
        ax.set_title(_label(run, pre), fontsize=9)
        ax.set_xlabel("tokens", fontsize=8)
        _tokens_axis(ax)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
        ax.tick_params(labelleft=True)
    for ax in axes[::cols]:
        ax.set_ylabel("Δ CE / CE(FP)", fontsize=8)
    axes[0].legend(fontsize=7, loc="upper left")
    _save(fig, out)
    return table


def soup_vs_ingredients(rows: list[dict], run: str, out: Path, quantizers: list[str] | None = None,
                        palette: Palette | None = None) -> list[dict]:
    """Stage 2 of a multi-stage trajectory (OLMo-2): per quantizer, Δ CE and Δ CE / CE(FP) of each ingredient
    against tokens since the stage-1 checkpoint it starts from, the stage-1 checkpoint at 0 and the soup as a
    star at its tokens.  Returns the table behind it ([] when the run has no ingredient rows)."""
    pts = _ptq(rows, run, quantizers)
    ings = [r for r in pts if str(r.get("branch") or "").startswith("ingredient")]
    if not ings:
        return []
    pre = preset_of_rows(pts)
    base_tokens = _stage_start(pre)
    base_rev = next((s.branches_from for s in pre.stages if s.branches_from), None) if pre is not None else None
    if base_tokens is None:  # no preset: stage 2 starts at the last main checkpoint before the ingredients
        first = min(r["tokens"] for r in ings)
        before = [r["tokens"] for r in pts if (r.get("branch") or "main") == "main" and r["tokens"] <= first]
        base_tokens = max(before) if before else first
    qs = _quantizers(ings)
    fig, flat = panel_grid(2 * len(qs), max_cols=2, panel_height=2.4, extra_height=0.0, sharex=True)
    axes = [[flat[2 * j] for j in range(len(qs))], [flat[2 * j + 1] for j in range(len(qs))]]  # [metric][quantizer]
    palette = palette or Palette.for_rows(rows)
    table = []
    for j, q in enumerate(qs):
        mine = [r for r in pts if r["quantizer"] == q]
        branches = sorted({r["branch"] for r in mine if str(r["branch"]).startswith("ingredient")})
        start = [r for r in mine if (r.get("branch") or "main") == "main" and r["tokens"] == base_tokens]
        soup = [r for r in mine if r.get("branch") == "soup"]
        for k, b in enumerate(branches):
            br = [r for r in mine if r["branch"] == b]
            xs = [r["tokens"] - base_tokens for r in start + br]
            for ax, f in ((axes[0][j], lambda r: r["delta_ce"]), (axes[1][j], rel_delta_ce)):
                ax.plot(xs, [f(r) for r in start + br], "o-", ms=3, lw=1.1, color=palette.branch(b),
                        label=b if ax is axes[0][j] else None)
            table += [{"run": run, "quantizer": q, "branch": b, "stage_tokens": r["tokens"] - base_tokens,
                       "tokens": r["tokens"], "lr": r.get("lr"), "delta_ce": r["delta_ce"],
                       "rel_delta_ce": rel_delta_ce(r)} for r in br]
        for r in soup:
            for ax, v in ((axes[0][j], r["delta_ce"]), (axes[1][j], rel_delta_ce(r))):
                ax.plot([r["tokens"] - base_tokens], [v], "*", color=palette.branch("soup"), ms=12,
                        label="soup" if ax is axes[0][j] else None)
            table.append({"run": run, "quantizer": q, "branch": "soup", "stage_tokens": r["tokens"] - base_tokens,
                          "tokens": r["tokens"], "lr": r.get("lr"), "delta_ce": r["delta_ce"],
                          "rel_delta_ce": rel_delta_ce(r)})
        for r in start:
            table.append({"run": run, "quantizer": q, "branch": "main", "stage_tokens": 0, "tokens": r["tokens"],
                          "lr": r.get("lr"), "delta_ce": r["delta_ce"], "rel_delta_ce": rel_delta_ce(r)})
        for ax, ylabel in ((axes[0][j], "Δ CE (nats)"), (axes[1][j], "Δ CE / CE(FP)")):
            ax.set_title(f"{_label(run, pre)} stage 2, {q}", fontsize=9, color=quantizer_color(q))
            ax.set_ylabel(ylabel, fontsize=8)
            _tokens_axis(ax)
        axes[0][j].legend(fontsize=7)
    for ax in flat[-2:]:
        ax.set_xlabel(f"tokens since {base_rev or 'the stage-1 checkpoint'}", fontsize=8)
    for ax in flat:
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    _save(fig, out)
    return table


def sections(rows: list[dict], out: Path, palette: Palette | None = None) -> list[tuple[str, str, list[dict], str]]:
    """Report sections (title, PNG name, table, caption) for the public trajectories among ``rows``."""
    out = Path(out)
    found = []
    runs = public_runs(rows)
    for run in runs:
        stem = "trajectory_" + run.replace("/", "_")
        table = error_vs_tokens(rows, run, out / stem)
        if table:
            name = table[0]["preset"] or run
            found.append((f"Public trajectory {name}: quantization error and LR against tokens", f"{stem}.png", table,
                          ("Δ CE (± its combined uncertainty) and Δ CE / CE(FP) of each quantizer at each revision, "
                          "with Δ PPL, KL and top-1 agreement where measured, against tokens; the LR of the "
                          "preset's schedule overlaid (grey; dashed: a "
                          "later stage); filled markers where the LR is decaying; dashed lines: stage-2 ingredients, "
                          "stars: soups (paper A, public trajectories).")))
        table = soup_vs_ingredients(rows, run, out / f"{stem}_soup", palette=palette)
        if table:
            found.append((f"{run}: stage-2 ingredients and their soup", f"{stem}_soup.png", table,
                          ("Each stage-2 ingredient's error along its own tokens from the stage-1 checkpoint it "
                          "starts from (at 0), and the soup of their final checkpoints (star): averaging the "
                          "decayed ingredients lowers the error (paper A).")))
    if len(runs) > 1:
        table = families_side_by_side(rows, out / "trajectories_families")
        if table:
            found.append(("Public trajectories side by side", "trajectories_families.png", table,
                          ("Relative error Δ CE / CE(FP) against tokens, one panel per family and size, each with "
                          "its LR: the error rises when the LR decays, whatever the token budget (paper A).")))
    return found
