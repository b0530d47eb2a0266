"""The ``quantdyn`` console script.  Subcommands only parse arguments and
call the library; every user error ends as one line on stderr (exit 2)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer

from quantdyn.errors import QuantdynError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="How training dynamics decide post-training quantization robustness.")


def _echo_json(obj) -> None:
    typer.echo(json.dumps(obj, default=str))


# ------------------------------------------------------------------ train
@app.command()
def train(
    config: Optional[Path] = typer.Argument(None, help="Run config YAML (see configs/)."),
    overrides: Optional[List[str]] = typer.Argument(None, help="key=value overrides, e.g. optim.lr=1e-3"),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue RUN_DIR from its last checkpoint."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
):
    """Train a model: `quantdyn train CONFIG.yaml [key=value ...]` or `--resume RUN_DIR`."""
    from quantdyn.config import apply_overrides, from_dict, load_yaml
    from quantdyn.train.branches import load_run_config
    from quantdyn.train.checkpoint import latest_resumable
    from quantdyn.train.config import RunConfig
    from quantdyn.train.trainer import train as run_train

    if resume is not None:
        if config is not None:
            raise QuantdynError("give either CONFIG.yaml or --resume RUN_DIR, not both")
        cfg = load_run_config(resume)
        ckpt = latest_resumable(resume)
        if ckpt is None:
            raise QuantdynError(f"run '{resume}' has no resumable checkpoint yet; start it again with its config")
        info = json.loads((resume / "run.json").read_text()) if (resume / "run.json").is_file() else {}
        out = run_train(cfg, resume, resume=ckpt, parent=info.get("parent"), progress=not quiet)
    else:
        if config is None:
            raise QuantdynError("missing CONFIG.yaml; e.g. `quantdyn train configs/tiny.yaml` (or --resume RUN_DIR)")
        data = apply_overrides(load_yaml(config), overrides or [])
        cfg = from_dict(RunConfig, data)
        out = run_train(cfg, progress=not quiet)
    typer.echo(f"run directory: {out}")


@app.command()
def cooldown(
    run_dir: Path = typer.Argument(..., help="Parent run directory."),
    from_step: int = typer.Option(..., "--from-step", help="Stable-phase checkpoint step to branch from."),
    decay_steps: str = typer.Option(..., "--decay-steps", help="Decay lengths, comma-separated: 200,400"),
    shape: str = typer.Option("linear", "--shape", help="linear | cosine | 1-sqrt"),
    control: bool = typer.Option(False, "--control", help="Also run constant-LR control twins."),
    quiet: bool = typer.Option(False, "--quiet"),
):
    """Branch cooldowns (LR decay to lr_end) from a stable-phase checkpoint."""
    from quantdyn.train.branches import cooldown as run_cooldown

    try:
        ds = [int(x) for x in decay_steps.split(",") if x.strip()]
    except ValueError:
        raise QuantdynError(f"--decay-steps '{decay_steps}' must be integers separated by commas, e.g. 200,400") from None
    for p in run_cooldown(run_dir, from_step, ds, shape, control, progress=not quiet):
        typer.echo(f"branch: {p}")


# --------------------------------------------------------------- quantize
@app.command()
def quantize(
    model: str = typer.Argument(..., help="Local HF dir, quantdyn checkpoint, or hub-id[@revision]."),
    method: str = typer.Option("gptq", "--method", help="rtn | gptq | awq"),
    bits: int = typer.Option(4, "--bits", help="2..8"),
    group_size: int = typer.Option(128, "--group-size", help="0 = one group per row"),
    preset: Optional[str] = typer.Option(None, "--preset", help="reference | gptqmodel | gptqmodel-v5"),
    calib_data: str = typer.Option("builtin:kjv", "--calib-data", help="Any quantdyn data source."),
    calib_samples: int = typer.Option(32, "--calib-samples"),
    calib_seq_len: int = typer.Option(128, "--calib-seq-len"),
    eval_data: Optional[str] = typer.Option(None, "--eval-data", help="Default: same as --calib-data."),
    eval_tokens: int = typer.Option(25600, "--eval-tokens", help="Held-out tokens for the error."),
    eval_seq_len: int = typer.Option(128, "--eval-seq-len"),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="Default: the model's own tokenizer."),
    save: Optional[Path] = typer.Option(None, "--save", help="Write the fake-quantized model + codes here."),
    device: str = typer.Option("auto", "--device"),
    as_json: bool = typer.Option(False, "--json", help="Print the result row as one JSON object."),
):
    """Quantize one model and measure Δ CE, Δ PPL, KL and agreement on held-out text."""
    from quantdyn.study.single import quantize_one

    row = quantize_one(model, method=method, bits=bits, group_size=group_size, preset=preset, calib_data=calib_data,
                       calib_samples=calib_samples, calib_seq_len=calib_seq_len, eval_data=eval_data,
                       eval_tokens=eval_tokens, eval_seq_len=eval_seq_len, tokenizer=tokenizer, save=save,
                       device=device, progress=not as_json)
    if as_json:
        _echo_json({k: v for k, v in row.items() if k != "window_delta"})
        return
    typer.echo(f"model {model}  quantizer {row['quantizer']}  ({row['n_windows']} windows x {eval_seq_len} tokens)")
    typer.echo(f"  {'':<12}{'FP':>10}{'quantized':>12}{'delta':>12}")
    typer.echo(f"  {'CE (nats)':<12}{row['ce_fp']:>10.4f}{row['ce_q']:>12.4f}{row['delta_ce']:>+12.4f}  ± {row['delta_ce_se']:.4f}")
    import math as _m
    typer.echo(f"  {'perplexity':<12}{_m.exp(row['ce_fp']):>10.3f}{_m.exp(row['ce_q']):>12.3f}{row['delta_ppl']:>+12.3f}")
    typer.echo(f"  KL(FP||Q) {row['kl']:.5f} nats/token   top-1 agreement {row['top1_agree']:.4f}   "
               f"quantize {row['t_quantize']:.1f}s")
    if save:
        typer.echo(f"saved: {save}")


# ------------------------------------------------------------------ sweep
@app.command()
def sweep(
    spec: Optional[Path] = typer.Argument(None, help="Sweep spec YAML."),
    run: Optional[str] = typer.Option(None, "--run", help="Trajectory: a quantdyn run directory."),
    checkpoints: Optional[List[str]] = typer.Option(None, "--checkpoint", help="Trajectory: checkpoint dirs/globs."),
    hub: Optional[str] = typer.Option(None, "--hub", help="Trajectory: hub model id."),
    revisions: Optional[str] = typer.Option(None, "--revisions", help="Comma-separated hub revisions."),
    revision_pattern: Optional[str] = typer.Option(None, "--revision-pattern", help="Regex over hub refs."),
    quantizers: Optional[str] = typer.Option(None, "--quantizers", help="e.g. gptq3,gptq4,rtn4"),
    store: Optional[str] = typer.Option(None, "--store", help="Results store directory."),
    shard: Optional[str] = typer.Option(None, "--shard", help="i/n (default: torchrun rank or SLURM array)."),
    quiet: bool = typer.Option(False, "--quiet"),
):
    """Quantize every checkpoint of a trajectory with a grid of quantizers; rows go to the store."""
    from quantdyn.config import load_yaml
    from quantdyn.study.sweep import SweepConfig, run_sweep
    from quantdyn.config import from_dict

    data = load_yaml(spec) if spec else {}
    traj = dict(data.get("trajectory", {}))
    if run or checkpoints or hub:
        traj = {k: v for k, v in traj.items() if k == "schedule"}
        traj.update({"run": run or "", "checkpoints": list(checkpoints or []), "hub": hub or "",
                     "revisions": [r for r in (revisions or "").split(",") if r], "revision_pattern": revision_pattern or ""})
    if traj:
        data["trajectory"] = traj
    if quantizers:
        data["quantizers"] = [q for q in quantizers.split(",") if q]
    if store:
        data["store"] = store
    if not spec and not traj:
        raise QuantdynError("give a sweep spec YAML or a trajectory (--run, --checkpoint or --hub)")
    cfg = from_dict(SweepConfig, data)
    out = run_sweep(cfg, shard=shard, progress=not quiet)
    typer.echo(f"sweep: {out['written']} rows written, {out['skipped']} already done, store {cfg.store}")


@app.command()
def results(
    store: str = typer.Option("results", "--store", help="Results store directory."),
    where: Optional[str] = typer.Option(None, "--where", help="SQL condition, e.g. \"bits = 3 AND branch = 'main'\""),
    csv: Optional[Path] = typer.Option(None, "--csv", help="Also write the rows as CSV."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON array of rows."),
    all_columns: bool = typer.Option(False, "--all", help="Every column (default: the main ones)."),
):
    """Print result rows (default: the store `make demo` wrote)."""
    from quantdyn.results.store import ResultStore

    st = ResultStore(store, create=False)
    main_cols = ("run, branch, kind, step, tokens, lr, quantizer, ce_fp, ce_q, delta_ce, delta_ce_se, kl, top1_agree")
    cols, rows = st.query(where, "* EXCLUDE (window_delta)" if (all_columns or as_json or csv) else main_cols,
                          order="run, branch, tokens, quantizer")
    recs = [dict(zip(cols, r)) for r in rows]
    if csv:
        import csv as _csv

        with open(csv, "w", newline="") as f:
            w = _csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            w.writerows(recs)
    if as_json:
        typer.echo(json.dumps(recs, default=str))
        return
    if not recs:
        typer.echo("no rows")
        return
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)
    widths = [max(len(c), *(len(fmt(r[c])) for r in recs)) for c in cols]
    typer.echo("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in recs:
        typer.echo("  ".join(fmt(r[c]).ljust(w) for c, w in zip(cols, widths)))
    typer.echo(f"({len(recs)} rows)")


@app.command()
def report(
    store_or_run: Path = typer.Argument(Path("results"), help="A results store or a run directory."),
    out: Path = typer.Option(Path("report"), "--out", help="Output directory for index.html and PNGs."),
    store: Optional[str] = typer.Option(None, "--store", help="Store to read when given a run directory."),
):
    """Write the static HTML report with the papers' figures."""
    from quantdyn.report.html import write_report

    page = write_report(store_or_run, out, store=store)
    typer.echo(f"report: {page}")


@app.command()
def study(spec: Path = typer.Argument(..., help="Study spec YAML (see configs/kjv_cooldown_study.yaml)."),
          quiet: bool = typer.Option(False, "--quiet")):
    """A cooldown study: train (seeds), cooldowns + controls, sweep, report, endpoint-vs-control summary."""
    from quantdyn.study.demo import load_study_spec, run_study

    run_study(load_study_spec(spec), progress=not quiet, echo=typer.echo)


@app.command()
def demo(quiet: bool = typer.Option(False, "--quiet")):
    """The embedded default study: train, cooldowns + controls, sweep, report, summary."""
    from quantdyn.study.demo import run_demo

    run_demo(progress=not quiet, echo=typer.echo)


@app.command()
def analyze(
    checkpoints: List[str] = typer.Argument(..., help="Checkpoint directories or run directories."),
    metrics: str = typer.Option("hessian,outliers,propagation", "--metrics", help="Comma-separated analyses."),
    quantizers: str = typer.Option("gptq3,rtn4", "--quantizers", help="Quantizers for the propagation analysis."),
    store: str = typer.Option("results", "--store"),
    windows: int = typer.Option(8, "--windows", help="Windows per analysis (held-out / calibration)."),
    probes: int = typer.Option(50, "--probes", help="Hutchinson probe budget."),
    seq_len: int = typer.Option(128, "--seq-len", help="Tokens per window."),
    as_json: bool = typer.Option(False, "--json", help="Also print the rows as a JSON array."),
    quiet: bool = typer.Option(False, "--quiet"),
):
    """Hessian trace / top eigenvalue, outlier metrics and error propagation -> result rows."""
    from quantdyn.study.analyze import analyze as run_analyze

    rows = run_analyze(checkpoints, [m for m in metrics.split(",") if m], [q for q in quantizers.split(",") if q],
                       store=store, budget={"windows": windows, "hessian_probes": probes},
                       data={"calib_seq_len": seq_len, "eval_seq_len": seq_len, "eval_windows": max(windows, 8),
                             "calib_samples": max(windows, 8)}, progress=not quiet)
    if as_json:
        _echo_json(rows)
        return
    for r in rows:
        vals = {k: v for k, v in r.items() if k.startswith(("hessian_", "weight_", "act_", "prop_")) and v is not None
                and k != "weight_decay"}
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in list(vals.items())[:8])
        typer.echo(f"{r['checkpoint']} [{r['analysis']}] {shown}")
    typer.echo(f"{len(rows)} analysis rows in {store}")


# ----------------------------------------------------------- averaging
average_app = typer.Typer(no_args_is_help=True, help="Weight averaging: LAWA over a run, model soups.")
app.add_typer(average_app, name="average")


@average_app.command("lawa")
def average_lawa_cmd(
    run_dir: Path = typer.Argument(..., help="Run directory whose checkpoints to average."),
    window: int = typer.Option(..., "--window", help="K: checkpoints per average."),
    every: int = typer.Option(..., "--every", help="P: steps between averaged checkpoints."),
    out: Optional[Path] = typer.Option(None, "--out", help="Default: RUN_DIR/averages/lawa-kK-pP-offline"),
):
    """Offline LAWA: at each step on the P grid, the mean of the last K checkpoints."""
    from quantdyn.train.offline_averaging import average_lawa

    paths = average_lawa(run_dir, window, every, out=out)
    typer.echo(f"{len(paths)} LAWA checkpoints in {paths[0].parent if paths else out}")


@average_app.command("soup")
def average_soup_cmd(
    checkpoints: List[str] = typer.Argument(..., help="Ingredient checkpoint directories."),
    out: Path = typer.Option(..., "--out"),
    greedy: bool = typer.Option(False, "--greedy", help="Add an ingredient only if held-out loss improves."),
    weights: Optional[str] = typer.Option(None, "--weights", help="Comma-separated weights (uniform if omitted)."),
):
    """Model soup over checkpoints of different runs, seeds or branches."""
    from quantdyn.train.offline_averaging import make_soup

    w = None
    if weights:
        try:
            w = [float(x) for x in weights.split(",")]
        except ValueError:
            raise QuantdynError(f"--weights '{weights}' must be numbers separated by commas") from None
    path = make_soup(checkpoints, weights=w, greedy=greedy, out=out)
    typer.echo(f"soup: {path}")


@app.command()
def interpolate(
    a: Path = typer.Argument(..., help="Checkpoint at alpha = 0."),
    b: Path = typer.Argument(..., help="Checkpoint at alpha = 1."),
    steps: int = typer.Option(11, "--steps", help="Points on the alpha grid, endpoints included."),
    quantizers: str = typer.Option("rtn4", "--quantizers"),
    out: Optional[Path] = typer.Option(None, "--out"),
    store: str = typer.Option("results", "--store"),
    seq_len: int = typer.Option(128, "--seq-len", help="Tokens per calibration/evaluation window."),
    eval_windows: int = typer.Option(200, "--eval-windows"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Linear interpolation between two checkpoints: FP loss and Δ CE at each alpha."""
    from quantdyn.results.store import ResultStore
    from quantdyn.train.offline_averaging import interpolate_checkpoints

    rows = interpolate_checkpoints(a, b, steps, quantizers=[q for q in quantizers.split(",") if q], out=out,
                                   eval_seq_len=seq_len, calib_seq_len=seq_len, n_eval_windows=eval_windows)
    st = ResultStore(store)
    done = st.keys()
    st.append([r for r in rows if r["key"] not in done])
    if as_json:
        _echo_json([{k: v for k, v in r.items() if k != "window_delta"} for r in rows])
        return
    for r in rows:
        typer.echo(f"alpha {r['alpha']:.3f}  {r.get('quantizer', ''):<6} FP {r['ce_fp']:.4f}  "
                   f"ΔCE {r['delta_ce']:+.4f} ± {r['delta_ce_se']:.4f}")


@app.command()
def grid(
    config: Path = typer.Argument(..., help="Base run config YAML."),
    vary: List[str] = typer.Option(..., "--vary", help="KEY=v1,v2,... (repeatable), e.g. optim.lr=1e-4,1e-3"),
    seeds: int = typer.Option(0, "--seeds", help="Seeds per combination (0 = the config's seed only)."),
    grid_dir: Optional[Path] = typer.Option(None, "--dir", help="Default: OUT_DIR/NAME-grid"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show the expansion only."),
    slurm: bool = typer.Option(False, "--slurm", help="Write grid.sbatch + torchrun commands instead of running."),
    nproc: int = typer.Option(1, "--nproc-per-node"),
    overrides: Optional[List[str]] = typer.Argument(None, help="key=value overrides of the base config"),
    quiet: bool = typer.Option(False, "--quiet"),
):
    """Expand a grid of runs (e.g. LR x weight decay x seeds) and run it, or write cluster launch files."""
    from quantdyn.config import apply_overrides, load_yaml
    from quantdyn.study.grid import format_grid, grid_manifest, run_grid, write_grid, write_launch_scripts

    base = apply_overrides(load_yaml(config), overrides or [])
    gdir = grid_dir or Path(base.get("out_dir", "runs")) / f"{base.get('name', 'run')}-grid"
    if dry_run:
        typer.echo(format_grid(grid_manifest(base, vary, seeds, gdir)))
        return
    write_grid(base, vary, seeds, gdir)
    if slurm:
        sb, cmds = write_launch_scripts(gdir, nproc_per_node=nproc)
        typer.echo(f"wrote {sb} (sbatch {sb}) and {cmds}")
        return
    for r in run_grid(gdir, progress=not quiet):
        typer.echo(f"{r['name']}: {r['status']} ({r['dir']})")


@app.command()
def scaling(
    store: str = typer.Argument("results", help="Results store with swept FP and QAT runs."),
    by: str = typer.Option("optim.name", "--by", help="Group runs by this key (optim.name, or a row column)."),
    all_checkpoints: bool = typer.Option(False, "--all-checkpoints", help="Every checkpoint, not only each run's last."),
    bootstrap: int = typer.Option(200, "--bootstrap", help="Bootstrap resamples for intervals."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Fit L(N, D) = A(ρN)^-α + B·D^-β + E per group for FP and QAT runs; rows go to the store."""
    from quantdyn.study.scaling_study import fit_scaling

    rows = fit_scaling(store, by, all_checkpoints, bootstrap)
    if as_json:
        _echo_json([{k: v for k, v in r.items() if k != "points"} for r in rows])
        return
    for r in rows:
        rho = f"  ρ={r['rho']:.3f}" + (f" [{r.get('rho_lo', float('nan')):.3f}, {r.get('rho_hi', float('nan')):.3f}]"
                                      if r["precision"] == "qat" else "")
        typer.echo(f"{r['group']:<16} {r['precision']:<4} A={r['A']:.3g} α={r['alpha']:.3f} B={r['B']:.3g} "
                   f"β={r['beta']:.3f} E={r['E']:.3f} ({r['n_points']} points){rho}")


@app.command("eval")
def eval_cmd(
    model: str = typer.Argument(..., help="Checkpoint directory or hub-id[@revision]."),
    tasks: str = typer.Option(..., "--tasks", help="lm-eval tasks, comma-separated (offline: quantdyn_lastword,quantdyn_nextsent)."),
    quantizer: Optional[str] = typer.Option(None, "--quantizer", help="e.g. gptq3 (comma-separated for several)."),
    num_fewshot: int = typer.Option(0, "--num-fewshot"),
    limit: Optional[int] = typer.Option(None, "--limit", help="Examples per task."),
    seed: int = typer.Option(0, "--seed"),
    metric: Optional[str] = typer.Option(None, "--metric", help="Default: acc, else acc_norm."),
    backend: str = typer.Option("quantdyn", "--backend", help="quantdyn (in-memory adapter) | hf (lm-eval's HFLM)"),
    store: Optional[str] = typer.Option("results", "--store", help="Append rows here ('' = don't store)."),
    as_json: bool = typer.Option(False, "--json", help="Print the rows as a JSON array."),
):
    """Downstream accuracy of a model and its quantized twin (lm-evaluation-harness)."""
    from quantdyn.evaluate.downstream import evaluate_accuracy, format_accuracy_table

    qs = [q for q in (quantizer or "").split(",") if q] or None
    rows = evaluate_accuracy(model, [t for t in tasks.split(",") if t], qs, num_fewshot=num_fewshot, limit=limit,
                             seed=seed, metric=metric, backend=backend, progress=not as_json)
    if store:
        from quantdyn.results.store import ResultStore

        st = ResultStore(store)
        done = st.keys()
        st.append([r for r in rows if r["key"] not in done])
    if as_json:
        _echo_json(rows)
        return
    typer.echo(format_accuracy_table(rows))


def main() -> None:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        app(standalone_mode=False)
    except QuantdynError as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):
        typer.echo("interrupted; rerun the same command to resume", err=True)
        sys.exit(130)
    except Exception as e:  # click usage errors
        import click

        if isinstance(e, click.exceptions.ClickException):
            e.show()
            sys.exit(e.exit_code)
        if isinstance(e, click.exceptions.Exit):
            sys.exit(e.exit_code)
        raise


if __name__ == "__main__":
    main()
