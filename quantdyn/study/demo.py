"""Cooldown studies end to end: `quantdyn demo` (the embedded default) and
`quantdyn study SPEC.yaml` (the same pipeline for any spec, with seeds).

train (WSD) -> cooldown branches + constant-LR controls -> sweep quantizers
over every checkpoint -> HTML report -> a summary of each decayed endpoint
against its control twin with its paired uncertainty.  Every stage resumes:
rerunning skips what is done.

Spec layout (see quantdyn/study/demo.yaml and configs/kjv_cooldown_study.yaml):
  run:        a RunConfig
  seeds:      optional list of seeds; run i is named NAME-sSEED
  cooldowns:  {from_steps: [...], decay_steps: D, shape: linear, control: true}
  sweep:      SweepConfig fields except trajectory
  report:     output directory of the HTML report
"""
from __future__ import annotations

from dataclasses import replace
from importlib import resources
from pathlib import Path

import yaml

from quantdyn.config import from_dict, load_yaml
from quantdyn.errors import QuantdynError
from quantdyn.train.config import RunConfig

SPEC_KEYS = {"run", "seeds", "cooldowns", "sweep", "report"}


def demo_spec() -> dict:
    return yaml.safe_load(resources.files("quantdyn.study").joinpath("demo.yaml").read_text())


def load_study_spec(path: str | Path) -> dict:
    spec = load_yaml(path)
    unknown = set(spec) - SPEC_KEYS
    if unknown:
        from quantdyn.errors import did_you_mean

        k = sorted(unknown)[0]
        raise QuantdynError(f"unknown study key '{k}'{did_you_mean(k, SPEC_KEYS)}; valid: {', '.join(sorted(SPEC_KEYS))}")
    if "run" not in spec:
        raise QuantdynError(f"study spec '{path}' has no 'run' section (a run config)")
    return spec


def run_study(spec: dict, progress: bool = True, echo=print) -> dict:
    from quantdyn.report.figures import rainbow_table
    from quantdyn.report.html import write_report
    from quantdyn.results.store import ResultStore
    from quantdyn.study.sweep import SweepConfig, run_sweep
    from quantdyn.train.branches import cooldown
    from quantdyn.train.checkpoint import latest_resumable, list_checkpoints
    from quantdyn.train.trainer import read_metrics, train

    base = from_dict(RunConfig, spec["run"])
    seeds = spec.get("seeds") or [None]
    cfgs = [base if s is None else replace(base, seed=int(s), name=f"{base.name}-s{s}") for s in seeds]
    sw_spec = dict(spec.get("sweep") or {})
    cd = spec.get("cooldowns") or {}
    # fail on a bad sweep spec (unknown quantizer, bad key) before any training
    from_dict(SweepConfig, {**sw_spec, "trajectory": {"run": "x"}})
    from quantdyn.quantize.config import parse_quantizer

    for q in sw_spec.get("quantizers", ()):
        parse_quantizer(q)
    summary = []
    store = sw_spec.get("store", "results")
    for cfg in cfgs:
        run_dir = Path(cfg.out_dir) / cfg.name
        if not [c for c in list_checkpoints(run_dir) if c.step >= cfg.train.steps]:
            partial = latest_resumable(run_dir)
            echo(f"[1/4] training {cfg.name} ({cfg.train.steps} steps, {cfg.schedule.name})"
                 + (f", resuming at step {partial.step}" if partial else ""))
            train(cfg, run_dir, resume=partial, progress=progress)
        if cd:
            echo(f"[2/4] {cfg.name}: cooldowns from steps {cd['from_steps']} (+{cd['decay_steps']} steps)"
                 + (" with constant-LR controls" if cd.get("control") else ""))
            for s in cd["from_steps"]:
                cooldown(run_dir, s, [cd["decay_steps"]], cd.get("shape", "linear"), cd.get("control", False),
                         progress=progress)
        echo(f"[3/4] {cfg.name}: sweeping {', '.join(sw_spec.get('quantizers', []))} over every checkpoint")
        counts = run_sweep(from_dict(SweepConfig, {**sw_spec, "trajectory": {"run": str(run_dir)}}), progress=progress)
        vals = [r["val_loss"] for r in read_metrics(run_dir) if "val_loss" in r]
        summary.append({"run_dir": run_dir, "cfg": cfg, "counts": counts, "val": (vals[0], vals[-1]) if vals else None})
    echo("[4/4] writing the report")
    out = Path(spec.get("report", "report"))
    page = write_report(store, out)
    rows = ResultStore(store).rows()
    tables = []
    echo("")
    for s in summary:
        prefix = str(s["run_dir"].resolve())
        mine = [r for r in rows if str(Path(r["checkpoint"]).resolve()).startswith(prefix)]
        table = rainbow_table(mine, s["cfg"].name)
        tables += [{"run": s["cfg"].name, **t} for t in table]
        echo(f"run directory: {s['run_dir']}")
        if s["val"]:
            echo(f"  validation loss: {s['val'][0]:.3f} -> {s['val'][1]:.3f} over {s['cfg'].train.steps} steps")
        echo(f"  result rows: {len(mine)} ({s['counts']['written']} new)")
    echo(f"results store: {store}")
    echo(f"report:        {page}")
    echo("")
    echo("Decayed endpoint minus its constant-LR control (same tokens, paired over eval windows);")
    echo("jitter = SD of ΔCE about a line through the run's stable-phase checkpoints:")
    echo(f"  {'run':<12} {'quantizer':<9} {'branch':<24} {'ΔCE decayed':>12} {'ΔCE control':>12} {'difference':>20}"
         f" {'jitter':>8}  verdict")
    for t in tables:
        jit = f"{t['stable_jitter']:.4f}" if t.get("stable_jitter") is not None else "-"
        echo(f"  {t['run']:<12} {t['quantizer']:<9} {t['branch']:<24} {t['delta_ce_decayed']:>12.4f} "
             f"{t['delta_ce_control']:>12.4f} {t['difference']:>+10.4f} ± {t['difference_se']:.4f} {jit:>8}  "
             f"{_verdict(t['z'])}")
    across = seed_summary(tables)
    if across:
        echo("")
        echo(f"Across the {across[0]['n_seeds']} seeds: mean difference ± the larger of the within-seed SE "
             "(windows) and the between-seed SE (seed spread):")
        for a in across:
            echo(f"  {a['quantizer']:<9} {a['branch']:<24} {a['difference']:>+10.4f} ± {a['difference_se']:.4f}"
                 f"  (within {a['within_se']:.4f}, between {a['between_se']:.4f}; seeds {a['min']:+.4f} .. "
                 f"{a['max']:+.4f})  {_verdict(a['z'])}" + ("" if a["same_sign"] else "  (seeds disagree in sign)"))
    return {"report": page, "table": tables, "across_seeds": across, "runs": [s["run_dir"] for s in summary]}


def _verdict(z: float) -> str:
    return ("decay raises the error" if z > 2 else "decay lowers the error" if z < -2
            else "within uncertainty (|z| <= 2)")


def seed_summary(tables: list[dict]) -> list[dict]:
    """Per (quantizer, branch) over runs that differ only by seed: the mean decayed-minus-control difference.

    Two uncertainties of the mean: ``within_se`` = sqrt(sum SE_i^2)/k from the evaluation windows, and
    ``between_se`` = SD over seeds / sqrt(k) from the seeds' spread (with k = 2, |a − b| / 2 — itself a
    rough estimate).  ``difference_se`` is the larger of the two, and z uses it, so a difference that
    holds within each seed but changes a lot between seeds is not over-claimed.
    Empty unless at least two runs have the same (quantizer, branch)."""
    import math
    import statistics

    groups: dict[tuple[str, str], list[dict]] = {}
    for t in tables:
        groups.setdefault((t["quantizer"], t["branch"]), []).append(t)
    out = []
    for (q, b), ts in groups.items():
        if len(ts) < 2:
            continue
        k = len(ts)
        diffs = [t["difference"] for t in ts]
        d = statistics.fmean(diffs)
        within = math.sqrt(sum(t["difference_se"] ** 2 for t in ts)) / k
        between = statistics.stdev(diffs) / math.sqrt(k)
        se = max(within, between)
        out.append({"quantizer": q, "branch": b, "n_seeds": k, "difference": d, "difference_se": se,
                    "within_se": within, "between_se": between, "z": d / se if se > 0 else float("nan"),
                    "min": min(diffs), "max": max(diffs),
                    "same_sign": all(x > 0 for x in diffs) or all(x < 0 for x in diffs)})
    return out


def run_demo(progress: bool = True, echo=print) -> dict:
    return run_study(demo_spec(), progress=progress, echo=echo)
