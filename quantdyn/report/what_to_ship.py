"""The report's "What to ship" section: the decision rows of ``quantdyn ship`` (kind ``decision``, each holding its
ship.json) as a figure of bits per weight against the quantized model's CE for every option measured, with the
options tied with the best visible, the chosen one and the naive choice marked, and the answer in sentences."""
from __future__ import annotations

from pathlib import Path

from quantdyn.report.output import save_figure, subplots
from quantdyn.report.sections import Page, Section
from quantdyn.results.schema import DECISION
from quantdyn.results.stats import format_estimate

CAPTION = (
    "Every candidate (checkpoint, branch endpoint, EMA/LAWA, soup) x quantization that `quantdyn ship` measured: "
    "bits per weight of the quantized linears against the quantized model's CE on held-out windows (± SE over "
    "windows). Filled: measured on every window; open: dropped by the screen (beaten by the best at z > 2 on its "
    "first windows; CE(q) on those windows). Ringed: statistically tied with the best (|z| <= 2, paired over the "
    "same windows); star: the option shipped (the smallest file among the tied, then the simplest recipe); square: "
    "the naive choice (the final checkpoint with the uniform type closest to the budget). Dashed: the budget.")


def decisions(rows: list[dict]) -> list[dict]:
    """The ship.json of every decision row, the latest per (source, budget) first."""
    seen, out = set(), []
    for r in sorted(DECISION.select(rows), key=lambda r: str(r.get("time", "")), reverse=True):
        s = r.get("ship") or {}
        k = (s.get("commands", {}).get("ship", ""), s.get("budget"))
        if s and k not in seen:
            seen.add(k)
            out.append(s)
    return out


def draw_decision(s: dict, out: Path) -> list[dict]:
    """The figure of one decision; returns the table behind it (one row per option, dropped ones included)."""
    fig, ax = subplots(figsize=(7.0, 4.2))
    tied = {(t["candidate"], t["quantizer"]) for t in s["tied"]} | {(s["best"]["candidate"], s["best"]["quantizer"])}
    chosen = (s["artifact"]["name"], s["quantizer"])
    naive = (s["naive"]["artifact"], s["naive"]["quantizer"]) if s.get("naive") else None
    recipes = sorted({o["recipe"] for o in s["options"] + s["dropped"]})
    cmap = {r: f"C{i % 10}" for i, r in enumerate(recipes)}
    table = []
    for o, full in [(o, True) for o in s["options"]] + [(o, False) for o in s["dropped"]]:
        k = (o["candidate"], o["quantizer"])
        c = cmap[o["recipe"]]
        ax.errorbar([o["bits_per_weight"]], [o["ce_q"]], yerr=[o["ce_q_se"]], fmt="o", ms=5, color=c,
                    mfc=c if full else "none", alpha=1.0 if full else 0.5, lw=0.8)
        if full and k in tied:
            ax.plot([o["bits_per_weight"]], [o["ce_q"]], "o", ms=11, mfc="none", mec="black", mew=0.8)
        table.append({"candidate": o["candidate"], "recipe": o["recipe"], "quantizer": o["quantizer"],
                      "bits_per_weight": o["bits_per_weight"], "ce_q": o["ce_q"], "ce_q_se": o["ce_q_se"],
                      "minus_best": o.get("minus_best"), "minus_best_se": o.get("minus_best_se"), "z": o.get("z"),
                      "measured": "all windows" if full else f"dropped after {o.get('windows')} windows",
                      "tied": full and k in tied, "chosen": k == chosen, "naive": k == naive})
    ax.plot([s["bits_per_weight"]], [s["ce_q"]], "*", ms=16, color="gold", mec="black", zorder=5, label="shipped")
    if s.get("naive"):
        ax.plot([s["naive"]["bits_per_weight"]], [s["naive"]["ce_q"]], "s", ms=10, mfc="none", mec="red", mew=1.2,
                zorder=5, label="naive choice")
    ax.axvline(s["budget"], ls="--", color="grey", lw=0.8)
    for r in recipes:
        ax.plot([], [], "o", color=cmap[r], label=r)
    ax.plot([], [], "o", ms=11, mfc="none", mec="black", label="tied with the best")
    ax.set_xlabel("bits per weight (quantized linears, scales included)")
    ax.set_ylabel("CE of the quantized model (nats)")
    ax.legend(fontsize=7, loc="best")
    save_figure(fig, out)
    return table


def ship_sections(page: Page) -> list[Section]:
    """One "What to ship" section per decision in the rows (the latest per source and budget)."""
    out = []
    for i, s in enumerate(decisions(page.rows)):
        name = f"what_to_ship_{i}.png" if i else "what_to_ship.png"
        table = draw_decision(s, page.out / name)
        out.append(Section(f"What to ship at {s['budget']:g} bits per weight", name, table, CAPTION,
                           sentences=answer_sentences(s),
                           shown=[t for t in table if t["chosen"] or t["tied"] or t["naive"]]))
    return out


def answer_sentences(s: dict) -> list[tuple[str, str, str, str]]:
    """The decision as (group, statement, verdict, tone) sentences (report/sections.py Section.sentences)."""
    a = s["artifact"]
    group = f"What to ship at {s['budget']:g} bits per weight"
    out = [(group, f"Ship {a['name']} ({a['made']}) quantized {s['quantizer']} ({s['bits_per_weight']:.3f} bits per "
                   f"weight; {s['export']['format']} at {Path(s['export']['path']).name}): CE(q) {s['ce_q']:.4f} ± "
                   f"{s['ce_q_se']:.4f}, with {len(s['tied'])} other option(s) tied with the best.", "chosen", "yes")]
    nv = s.get("naive")
    if nv and s.get("gain_se"):
        e, se, z = format_estimate(s["gain"], s["gain_se"], s["z"])
        resolved = s["gain_resolved"]
        out.append((group, f"The naive choice, {nv['artifact']} x {nv['quantizer']}, would cost {e} ± {se} nats of "
                           f"CE (naive − chosen, paired over windows; z = {z}).",
                    "resolved" if resolved else f"within uncertainty (|z| <= {s['z']:g})",
                    "yes" if resolved else "unresolved"))
    return out
