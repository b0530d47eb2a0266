"""`quantdyn demo`: the embedded default study, end to end on a CPU.

train (WSD) -> cooldown branches + constant-LR controls -> sweep GPTQ/RTN over
every checkpoint -> HTML report -> a summary of each decayed endpoint against
its control twin with its paired uncertainty.  Every stage resumes: rerunning
the demo skips what is done.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

import yaml

from quantdyn.config import from_dict
from quantdyn.train.config import RunConfig


def demo_spec() -> dict:
    return yaml.safe_load(resources.files("quantdyn.study").joinpath("demo.yaml").read_text())


def run_demo(progress: bool = True, echo=print) -> dict:
    from quantdyn.report.html import write_report
    from quantdyn.report.figures import rainbow_table
    from quantdyn.results.store import ResultStore
    from quantdyn.study.sweep import SweepConfig, run_sweep
    from quantdyn.train.branches import cooldown
    from quantdyn.train.checkpoint import latest_resumable, list_checkpoints
    from quantdyn.train.trainer import read_metrics, train

    spec = demo_spec()
    cfg = from_dict(RunConfig, spec["run"])
    run_dir = Path(cfg.out_dir) / cfg.name
    done = [c for c in list_checkpoints(run_dir) if c.step >= cfg.train.steps]
    if not done:
        partial = latest_resumable(run_dir)
        echo(f"[1/4] training {cfg.name} ({cfg.train.steps} steps, WSD)" + (f", resuming at {partial.step}" if partial else ""))
        train(cfg, run_dir, resume=partial, progress=progress)
    cd = spec["cooldowns"]
    echo(f"[2/4] cooldown branches from steps {cd['from_steps']} (+{cd['decay_steps']} steps) with controls")
    for s in cd["from_steps"]:
        cooldown(run_dir, s, [cd["decay_steps"]], cd["shape"], cd["control"], progress=progress)
    echo("[3/4] sweeping quantizers over every checkpoint")
    sw = from_dict(SweepConfig, {**spec["sweep"], "trajectory": {"run": str(run_dir)}})
    counts = run_sweep(sw, progress=progress)
    echo("[4/4] writing the report")
    page = write_report(run_dir, spec["report"], store=sw.store)
    rows = ResultStore(sw.store).rows()
    prefix = str(run_dir.resolve())
    rows = [r for r in rows if str(Path(r["checkpoint"]).resolve()).startswith(prefix)]
    table = rainbow_table(rows, cfg.name)
    vals = [r["val_loss"] for r in read_metrics(run_dir) if "val_loss" in r]
    echo("")
    echo(f"run directory: {run_dir}")
    echo(f"validation loss: {vals[0]:.3f} -> {vals[-1]:.3f} over {cfg.train.steps} steps")
    echo(f"results store:  {sw.store} ({len(rows)} rows for this run; {counts['written']} new)")
    echo(f"report:         {page}")
    echo("")
    echo("Decayed endpoint minus its constant-LR control (same tokens, paired over eval windows):")
    echo(f"  {'quantizer':<9} {'branch':<24} {'ΔCE decayed':>12} {'ΔCE control':>12} {'difference':>18}  verdict")
    for t in table:
        z = t["z"]
        verdict = ("decay raises the error" if z > 2 else "decay lowers the error" if z < -2
                   else "within uncertainty (|z| <= 2)")
        echo(f"  {t['quantizer']:<9} {t['branch']:<24} {t['delta_ce_decayed']:>12.4f} {t['delta_ce_control']:>12.4f} "
             f"{t['difference']:>+9.4f} ± {t['difference_se']:.4f}  {verdict}")
    return {"run_dir": run_dir, "report": page, "table": table}
