"""Figures of a trajectory study (matplotlib, PNG), each drawn from result
rows and returning the table of numbers behind it.

  trajectory   FP loss and Δ CE per quantizer against tokens, LR overlaid (paper A, Figs. 1–3)
  rainbow      cooldown branches' Δ CE against tokens, one colour per branch,
               constant-LR controls dashed beside them (paper A, Fig. 5)
  loss_vs_dce  Δ CE against FP loss, one marker per run (paper A, Fig. 6)
  seeds        runs that differ only by seed: mean Δ CE per branch, error bars = SD over seeds
Error bars are the paired standard error of Δ CE over evaluation windows,
except in ``seeds``.
"""
from __future__ import annotations

import math
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LR_STYLE = dict(color="0.55", lw=1.0, ls="-", alpha=0.8)


def _qorder(rows) -> list[str]:
    def key(q):
        bits = next((r["bits"] for r in rows if r.get("quantizer") == q), 0)
        return (-(bits or 0), q)

    return sorted({r["quantizer"] for r in rows if r.get("kind") == "ptq"}, key=key)


def _overlay_lr(ax, lr_curve):
    if not lr_curve:
        return
    ax2 = ax.twinx()
    xs, ys = zip(*sorted(lr_curve))
    ax2.plot(xs, ys, **LR_STYLE, label="LR")
    ax2.set_ylabel("LR", color="0.45", fontsize=8)
    ax2.tick_params(axis="y", labelsize=7, colors="0.45")
    ax2.set_ylim(bottom=0)


def trajectory(rows: list[dict], run: str, lr_curve: list[tuple[int, float]], out: Path) -> list[dict]:
    """FP loss and Δ CE (± SE) of the run's main trajectory against tokens, with the LR."""
    main = [r for r in rows if r.get("run") == run and r.get("branch") == "main"]
    fps = sorted((r for r in main if r["kind"] == "fp"), key=lambda r: r["tokens"] or 0)
    qs = _qorder(main)
    n = 1 + len(qs)
    fig, axes = plt.subplots(n, 1, figsize=(7.5, 1.9 * n + 0.6), sharex=True, squeeze=False)
    axes = axes[:, 0]
    table = []
    ax = axes[0]
    ax.errorbar([r["tokens"] for r in fps], [r["ce_fp"] for r in fps], yerr=[r.get("ce_fp_se") or 0 for r in fps],
                fmt="o-", color="k", ms=3, lw=1.2, capsize=2)
    ax.set_ylabel("FP loss (nats)", fontsize=8)
    ax.set_title(f"{run}: validation loss and quantization error along training", fontsize=10)
    _overlay_lr(ax, lr_curve)
    for ax, q in zip(axes[1:], qs):
        pts = sorted((r for r in main if r["kind"] == "ptq" and r["quantizer"] == q), key=lambda r: r["tokens"] or 0)
        ax.errorbar([r["tokens"] for r in pts], [r["delta_ce"] for r in pts], yerr=[r["delta_ce_se"] for r in pts],
                    fmt="o-", ms=3, lw=1.2, capsize=2, label=q)
        ax.set_ylabel(f"Δ CE {q}", fontsize=8)
        _overlay_lr(ax, lr_curve)
        for r in pts:
            table.append({"quantizer": q, "step": r["step"], "tokens": r["tokens"], "lr": r["lr"],
                          "ce_fp": r["ce_fp"], "delta_ce": r["delta_ce"], "delta_ce_se": r["delta_ce_se"]})
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    axes[-1].set_xlabel("tokens", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return table


def paired_difference(a: dict, b: dict) -> tuple[float, float]:
    """Mean and SE of (Δ CE_a − Δ CE_b) over the same evaluation windows."""
    wa, wb = a.get("window_delta"), b.get("window_delta")
    if not wa or not wb or len(wa) != len(wb):
        d = a["delta_ce"] - b["delta_ce"]
        return d, math.hypot(a["delta_ce_se"], b["delta_ce_se"])
    diffs = [x - y for x, y in zip(wa, wb)]
    m = sum(diffs) / len(diffs)
    var = sum((x - m) ** 2 for x in diffs) / max(1, len(diffs) - 1)
    return m, math.sqrt(var / len(diffs))


def rainbow(rows: list[dict], run: str, out: Path) -> list[dict]:
    """Cooldown branches (solid, one colour each) and their controls (dashed) over the main run."""
    mine = [r for r in rows if r.get("run") == run and r["kind"] == "ptq"]
    qs = _qorder(mine)
    branches = sorted({r["branch"] for r in mine if r.get("ckpt_kind") == "cooldown"},
                      key=lambda b: next((r["parent_step"] or 0 for r in mine if r["branch"] == b), 0))
    if not branches:
        return []
    cmap = plt.get_cmap("rainbow")
    fig, axes = plt.subplots(len(qs), 1, figsize=(7.5, 2.1 * len(qs) + 0.6), sharex=True, squeeze=False)
    for ax, q in zip(axes[:, 0], qs):
        main = sorted((r for r in mine if r["quantizer"] == q and r["branch"] == "main"), key=lambda r: r["tokens"])
        by_tok = {r["step"]: r for r in main}
        ax.errorbar([r["tokens"] for r in main], [r["delta_ce"] for r in main], yerr=[r["delta_ce_se"] for r in main],
                    fmt="o-", color="k", ms=2.5, lw=1, capsize=1.5, label="main run")
        for k, b in enumerate(branches):
            col = cmap(k / max(1, len(branches) - 1))
            pts = sorted((r for r in mine if r["quantizer"] == q and r["branch"] == b), key=lambda r: r["tokens"])
            start = by_tok.get(pts[0]["parent_step"]) if pts else None
            seq = ([start] if start else []) + pts
            ax.errorbar([r["tokens"] for r in seq], [r["delta_ce"] for r in seq], yerr=[r["delta_ce_se"] for r in seq],
                        fmt="s-", color=col, ms=3, lw=1.4, capsize=1.5, label=b)
            ctrl_name = b.replace("cooldown-", "control-").rsplit("-", 1)[0]
            ctrl = sorted((r for r in mine if r["quantizer"] == q and r["branch"] == ctrl_name), key=lambda r: r["tokens"])
            if ctrl:
                cs = ([start] if start else []) + ctrl
                ax.errorbar([r["tokens"] for r in cs], [r["delta_ce"] for r in cs], yerr=[r["delta_ce_se"] for r in cs],
                            fmt="^--", color=col, ms=3, lw=1, capsize=1.5, alpha=0.7, label=f"{ctrl_name} (constant LR)")
        ax.set_ylabel(f"Δ CE {q}", fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    axes[0, 0].set_title(f"{run}: cooldown branches (solid) vs constant-LR controls (dashed)", fontsize=10)
    axes[0, 0].legend(fontsize=6, ncol=2, loc="upper left")
    axes[-1, 0].set_xlabel("tokens", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return rainbow_table(rows, run)


def loss_vs_dce(rows: list[dict], out: Path, color_key: str = "run") -> list[dict]:
    """Δ CE against FP loss, one marker per run, one panel per quantizer."""
    ptq = [r for r in rows if r["kind"] == "ptq"]
    qs = _qorder(ptq)
    groups = sorted({str(r.get(color_key)) for r in ptq})
    markers = "osD^v<>pP*hX"
    fig, axes = plt.subplots(1, len(qs), figsize=(3.6 * len(qs), 3.4), squeeze=False)
    table = []
    for ax, q in zip(axes[0], qs):
        for k, g in enumerate(groups):
            pts = [r for r in ptq if r["quantizer"] == q and str(r.get(color_key)) == g]
            ax.errorbar([r["ce_fp"] for r in pts], [r["delta_ce"] for r in pts], yerr=[r["delta_ce_se"] for r in pts],
                        fmt=markers[k % len(markers)], ms=4, capsize=1.5, ls="none", label=g)
            table += [{"quantizer": q, color_key: g, "ce_fp": r["ce_fp"], "delta_ce": r["delta_ce"],
                       "delta_ce_se": r["delta_ce_se"], "checkpoint": r["checkpoint"]} for r in pts]
        ax.set_title(q, fontsize=9)
        ax.set_xlabel("FP loss (nats)", fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    axes[0, 0].set_ylabel("Δ CE", fontsize=8)
    axes[0, -1].legend(fontsize=6, title=color_key, title_fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return table


def stable_jitter(rows: list[dict]) -> float | None:
    """Checkpoint-to-checkpoint scatter of Δ CE over the main run's stable phase (peak LR, after warmup,
    not decaying): the SD of the residuals about a least-squares line in tokens (n − 2 degrees of freedom).

    Δ CE drifts over the stable phase (at constant LR it usually grows with tokens); the line removes
    that drift, which the constant-LR control already carries in a decayed-minus-control difference, so
    what is left is the noise that such a difference must exceed.  None with fewer than 4 checkpoints."""
    main = [r for r in rows if r.get("branch") == "main" and r.get("lr") is not None and not r.get("decaying")
            and r.get("tokens") is not None]
    if not main:
        return None
    peak = max(r["lr"] for r in main)
    pts = [(float(r["tokens"]), r["delta_ce"]) for r in main if r["lr"] >= peak * (1 - 1e-6)]
    if len(pts) < 4:
        return None
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx > 0 else 0.0
    res = [y - my - slope * (x - mx) for x, y in pts]
    return math.sqrt(sum(e * e for e in res) / (n - 2))


def rainbow_table(rows: list[dict], run: str) -> list[dict]:
    """The endpoint table of :func:`rainbow` without drawing (with each quantizer's stable-phase jitter)."""
    mine = [r for r in rows if r.get("run") == run and r["kind"] == "ptq"]
    table = []
    for q in _qorder(mine):
        jitter = stable_jitter([r for r in mine if r["quantizer"] == q])
        for b in sorted({r["branch"] for r in mine if r.get("ckpt_kind") == "cooldown"}):
            pts = sorted((r for r in mine if r["quantizer"] == q and r["branch"] == b), key=lambda r: r["tokens"])
            ctrl_name = b.replace("cooldown-", "control-").rsplit("-", 1)[0]
            ctrl = sorted((r for r in mine if r["quantizer"] == q and r["branch"] == ctrl_name), key=lambda r: r["tokens"])
            if pts and ctrl and pts[-1]["tokens"] == ctrl[-1]["tokens"]:
                d, se = paired_difference(pts[-1], ctrl[-1])
                table.append({"quantizer": q, "branch": b, "tokens": pts[-1]["tokens"],
                              "delta_ce_decayed": pts[-1]["delta_ce"], "delta_ce_control": ctrl[-1]["delta_ce"],
                              "difference": d, "difference_se": se, "z": d / se if se > 0 else float("nan"),
                              "stable_jitter": jitter})
    return table


VARIED_KEYS = ("peak_lr", "weight_decay", "optimizer", "seed")


def varied_key(rows: list[dict]) -> str:
    """The run-level setting that differs between runs (paper A's Figure 6 colours by it), else 'run'."""
    ptq = [r for r in rows if r.get("kind") == "ptq"]
    for k in VARIED_KEYS:
        per_run = {r["run"]: r.get(k) for r in ptq}
        if len(set(map(str, per_run.values()))) > 1:
            return k
    return "run"


def averaging_vs_decay(rows: list[dict], out: Path) -> list[dict]:
    """Per run and bit width: Δ CE of the decayed endpoint against the averaged checkpoints (LAWA, EMA, soups)."""
    ptq = [r for r in rows if r.get("kind") == "ptq"]
    avg_kinds = ("lawa", "ema", "soup")
    table = []
    for run in sorted({r["run"] for r in ptq}):
        mine = [r for r in ptq if r["run"] == run]
        main = [r for r in mine if r["branch"] == "main" and r.get("step") is not None]
        if not main or not any(r.get("ckpt_kind") in avg_kinds for r in mine):
            continue
        last = max(r["step"] for r in main)
        for q in _qorder(mine):
            end = next((r for r in main if r["step"] == last and r["quantizer"] == q), None)
            if end is None:
                continue
            table.append({"run": run, "quantizer": q, "checkpoint": f"decayed @{last}",
                          "ce_fp": end["ce_fp"], "ce_q": end["ce_q"], "delta_ce": end["delta_ce"],
                          "delta_ce_se": end["delta_ce_se"]})
            for b in sorted({r["branch"] for r in mine if r.get("ckpt_kind") in avg_kinds}):
                pts = [r for r in mine if r["branch"] == b and r["quantizer"] == q and r.get("step") is not None]
                if pts:
                    best = max(pts, key=lambda r: r["step"])
                    table.append({"run": run, "quantizer": q, "checkpoint": f"{b} @{best['step']}",
                                  "ce_fp": best["ce_fp"], "ce_q": best["ce_q"], "delta_ce": best["delta_ce"],
                                  "delta_ce_se": best["delta_ce_se"]})
    if not table:
        return []
    qs = list(dict.fromkeys(t["quantizer"] for t in table))
    fig, axes = plt.subplots(1, len(qs), figsize=(3.4 * len(qs), 3.4), squeeze=False)
    for ax, q in zip(axes[0], qs):
        ts = [t for t in table if t["quantizer"] == q]
        ax.bar(range(len(ts)), [t["delta_ce"] for t in ts], yerr=[t["delta_ce_se"] for t in ts], capsize=2,
               color=["0.3" if t["checkpoint"].startswith("decayed") else "tab:blue" for t in ts])
        ax.set_xticks(range(len(ts)))
        many = len({t["run"] for t in ts}) > 1
        ax.set_xticklabels([f"{t['run']}: {t['checkpoint']}" if many else t["checkpoint"] for t in ts],
                           rotation=45, ha="right", fontsize=7)
        ax.set_title(f"Δ CE {q}", fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return table


def seed_families(rows: list[dict]) -> dict[str, list[str]]:
    """Runs that differ only by seed, named NAME-s<seed> (as `quantdyn study` and `quantdyn grid` name
    them): {NAME: [runs]} for every NAME with at least two seeds."""
    seeds = {r["run"]: r.get("seed") for r in rows if r.get("kind") == "ptq" and r.get("run")}
    fam: dict[str, list[str]] = {}
    for run, seed in seeds.items():
        suffix = f"-s{seed}"
        if seed is not None and run.endswith(suffix):
            fam.setdefault(run[: -len(suffix)], []).append(run)
    return {k: sorted(v) for k, v in sorted(fam.items()) if len(v) >= 2}


def seeds(rows: list[dict], family: str, runs: list[str], out: Path) -> list[dict]:
    """Mean Δ CE over the seeds of one family, per quantizer and branch, at the steps every seed has;
    error bars = SD over seeds (n − 1), faint lines = the single seeds."""
    mine = [r for r in rows if r.get("kind") == "ptq" and r.get("run") in runs]
    qs = _qorder(mine)
    branches = sorted({r["branch"] for r in mine}, key=lambda b: (b != "main", b.startswith("control-"), b))
    if not qs:
        return []
    cmap = plt.get_cmap("rainbow")
    cooldowns = [b for b in branches if b != "main" and not b.startswith("control-")]
    colour = {"main": "k"}
    for k, b in enumerate(cooldowns):
        colour[b] = cmap(k / max(1, len(cooldowns) - 1))
        colour[b.replace("cooldown-", "control-").rsplit("-", 1)[0]] = colour[b]
    fig, axes = plt.subplots(len(qs), 1, figsize=(7.5, 2.1 * len(qs) + 0.6), sharex=True, squeeze=False)
    table = []
    for ax, q in zip(axes[:, 0], qs):
        mains = {run: {r["step"]: r for r in mine if r["run"] == run and r["branch"] == "main" and r["quantizer"] == q}
                 for run in runs}
        for b in branches:
            per_run = {run: {r["step"]: r for r in mine if r["run"] == run and r["branch"] == b and r["quantizer"] == q}
                       for run in runs}
            steps = sorted(set.intersection(*(set(v) for v in per_run.values())))
            if not steps:
                continue
            parent = next(iter(per_run[runs[0]].values())).get("parent_step") if b != "main" else None
            if parent is not None and all(parent in mains[run] for run in runs):
                for run in runs:  # draw the branch from the checkpoint it starts at (not a table row)
                    per_run[run] = {parent: mains[run][parent], **per_run[run]}
                lines = [parent] + steps
            else:
                lines = steps
            style = "^--" if b.startswith("control-") else "o-"
            col = colour.get(b, "0.4")
            for run in runs:
                ax.plot([per_run[run][s]["tokens"] for s in lines], [per_run[run][s]["delta_ce"] for s in lines],
                        style[1:], color=col, lw=0.6, alpha=0.3)
            xs, ms, sds = [], [], []
            for s in lines:
                vals = [per_run[run][s]["delta_ce"] for run in runs]
                m, sd = statistics.fmean(vals), statistics.stdev(vals)
                xs.append(per_run[runs[0]][s]["tokens"])
                ms.append(m)
                sds.append(sd)
                if s not in steps:
                    continue
                table.append({"family": family, "quantizer": q, "branch": b, "step": s, "tokens": xs[-1],
                              "n_seeds": len(vals), "delta_ce_mean": m, "delta_ce_seed_sd": sd,
                              "delta_ce_min": min(vals), "delta_ce_max": max(vals)})
            ax.errorbar(xs, ms, yerr=sds, fmt=style, color=col, ms=3, lw=1.2, capsize=2,
                        alpha=0.8 if b.startswith("control-") else 1.0, label=b)
        ax.set_ylabel(f"Δ CE {q}", fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    axes[0, 0].set_title(f"{family}: mean over {len(runs)} seeds (error bars: SD over seeds; faint: each seed)",
                         fontsize=10)
    axes[0, 0].legend(fontsize=6, ncol=2, loc="upper left")
    axes[-1, 0].set_xlabel("tokens", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return table
