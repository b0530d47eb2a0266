"""``quantdyn trajectories``: the public-trajectory presets that `sweep --preset` visits."""
from __future__ import annotations

import typer

from quantdyn.cli import options as opt
from quantdyn.cli.app import command, echo_json


def _revisions_known(p) -> str:
    n = len(p.revisions.all_names())
    if p.revisions.complete:
        return str(n)
    return f"hub ({n} listed)" if n else "hub"


def _summary(p) -> dict:
    return {"preset": p.name, "family": p.family, "size": p.size, "repos": list(p.repos),
            "revisions": len(p.revisions.all_names()), "complete": p.revisions.complete,
            "tokens_per_step": p.tokens_per_step, "peak_lr": p.peak_lr, "schedule": p.schedule_line(),
            "unverified": len(p.unverified)}


@command()
def trajectories(
    name: str | None = typer.Argument(None, help="A preset to show in full (revisions, phases, sources)."),
    as_json: bool = opt.as_json("the presets as JSON"),
):
    """List the public-trajectory presets, or show one in full.

    The list gives each preset's family, size, revisions known and schedule in one line. Sweep one with `quantdyn sweep --preset NAME [--every N | --log-spaced K | --tokens-range A:B] [--dry-run]`,
    or in a sweep spec: `trajectory: {preset: NAME, select: {log_spaced: 12}}`."""
    from quantdyn.sources.presets import get_preset, load_presets
    from quantdyn.sources.trajectory import format_count
    from quantdyn.schedules import lr_text

    if name:
        p = get_preset(name)
        if as_json:
            from quantdyn.config import to_dict

            echo_json(to_dict(p))
            return
        for line in _detail(p):
            typer.echo(line)
        return
    rows = [_summary(p) for p in load_presets().values()]
    rows.sort(key=lambda r: (r["family"], r["preset"]))
    if as_json:
        echo_json(rows)
        return
    table = [("preset", "family", "size", "revisions", "tokens/step", "peak LR", "repo", "schedule")]
    for r, p in zip(rows, (get_preset(r["preset"]) for r in rows)):
        repo = (p.repos[0] + (f" (+{len(p.repos) - 1})" if len(p.repos) > 1 else "")) if p.repos else "(give --hub)"
        table.append((r["preset"], r["family"], r["size"], _revisions_known(p), format_count(p.tokens_per_step),
                      "?" if p.peak_lr is None else lr_text(p.peak_lr), repo,
                      r["schedule"]))
    widths = [max(len(row[k]) for row in table) for k in range(len(table[0]) - 1)]
    for row in table:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
    typer.echo(f"({len(rows)} presets; `quantdyn trajectories NAME` shows one with its sources and what is unverified)")


def _detail(p) -> list[str]:
    from quantdyn.sources.trajectory import format_count
    from quantdyn.schedules import describe_phase, describe_schedule

    out = [f"{p.name}: {p.description}", f"  repos: {', '.join(p.repos) or '(none: give --hub with the run id)'}",
           f"  tokens/step: {p.tokens_per_step if p.tokens_per_step is not None else 'unknown'}",
           f"  peak LR: {p.peak_lr if p.peak_lr is not None else 'unknown'}",
           f"  revision pattern: {p.revisions.pattern}"]
    names = p.revisions.all_names()
    if names:
        shown = ", ".join(names[:4]) + (f", ..., {', '.join(names[-2:])}" if len(names) > 6 else
                                        (", " + ", ".join(names[4:]) if len(names) > 4 else ""))
        kind = (f"all {len(names)} revisions" if p.revisions.complete
                else f"{len(names)} revisions known here (the rest are listed on the hub)")
        out.append(f"  {kind}: {shown}")
    else:
        out.append("  revisions: listed on the hub (or the local HF cache offline)")
    for s in p.revisions.special:
        out.append(f"  {s.name}: {s.kind} of {', '.join(s.of)}")
    scheds = [("schedule", p.schedule)] if p.stages == () else [(f"stage {s.name}", s.schedule) for s in p.stages]
    for label, sched in scheds:
        if sched is None:
            out.append(f"  {label}: unknown")
            continue
        out.append(f"  {label} (over {sched.unit}):")
        for ph in sched.phases:
            horizon = ("" if ph.shape == "constant" or not ph.floor else
                       f" (the {ph.shape} aims at {ph.lr_end:g} at {format_count(int(ph.end))}; min LR {ph.floor:g})")
            shape = f" ({ph.shape})" if ph.label != ph.shape else ""
            out.append(f"    {describe_phase(ph)}{shape}{horizon}")
    for s in p.stages:
        for i in s.ingredients:
            if i.schedule is not None:
                out.append(f"  stage {s.name} ingredient {i.name}: {describe_schedule(i.schedule)}")
    out.append("  sources:")
    out += [f"    - {s}" for s in p.sources]
    if p.unverified:
        out.append("  unverified / disputed:")
        out += [f"    - {u}" for u in p.unverified]
    return out
