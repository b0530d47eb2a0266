"""Commands that quantize and measure: quantize, sweep, eval, interpolate, analyze."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from quantdyn.cli import slurm_options as so
from quantdyn.cli.app import app, echo_json
from quantdyn.errors import QuantdynError


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
    out: Optional[Path] = typer.Option(None, "--out", help="Write the fake-quantized model + codes to this directory."),
    save: Optional[Path] = typer.Option(None, "--save", hidden=True, help="Old spelling of --out."),
    export: Optional[str] = typer.Option(None, "--export", help="Write --out as a deployable checkpoint: gptq | compressed-tensors."),
    export_option: Optional[List[str]] = typer.Option(None, "--export-option", help="KEY=VALUE option of the export "
                                                      "format (repeatable): checkpoint_format=gptq_v2, scale_dtype=float16."),
    push_to_hub: Optional[str] = typer.Option(None, "--push-to-hub", help="Upload the export to this hub repo (needs a token)."),
    device: str = typer.Option("auto", "--device", help="cpu | cuda | cuda:N | auto; blocks are onloaded one at a time."),
    dtype: str = typer.Option("auto", "--dtype", help="Compute dtype: auto (the checkpoint's) | float32 | bfloat16 | float16."),
    max_memory: str = typer.Option("", "--max-memory", help="Memory for one block + activations, e.g. 8GB (default: half the free memory)."),
    threads: int = typer.Option(1, "--threads", help="torch threads while quantizing on CPU (1: codes independent of the core count; 0: torch's setting)."),
    repeats: int = typer.Option(1, "--repeats", help="Quantize R times with different calibration draws: mean, SD over repeats, combined uncertainty."),
    repeat_vary: str = typer.Option("draw", "--repeat-vary", help="What differs between repeats: draw | order | both."),
    as_json: bool = typer.Option(False, "--json", help="Print the result row as one JSON object."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress lines; the result table and errors only."),
):
    """Quantize one model and measure Δ CE, Δ PPL, KL and agreement on held-out text."""
    from quantdyn.sweep.quantize_one import quantize_one

    if out and save and out != save:
        raise QuantdynError("give the output directory once: --out (--save is its old spelling)")
    save = out or save
    options = {}
    for item in export_option or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise QuantdynError(f"--export-option '{item}' must look like KEY=VALUE, e.g. checkpoint_format=gptq_v2")
        options[key.strip()] = value.strip()
    row = quantize_one(model, method=method, bits=bits, group_size=group_size, preset=preset, calib_data=calib_data,
                       calib_samples=calib_samples, calib_seq_len=calib_seq_len, eval_data=eval_data,
                       eval_tokens=eval_tokens, eval_seq_len=eval_seq_len, tokenizer=tokenizer, save=save,
                       device=device, progress=not (as_json or quiet), threads=threads, dtype=dtype, max_memory=max_memory,
                       repeats=repeats, repeat_vary=repeat_vary, export=export, push_to_hub=push_to_hub,
                       export_options=options)
    if as_json:
        echo_json({k: v for k, v in row.items() if k != "window_delta"})
        return
    typer.echo(f"model {model}  quantizer {row['quantizer']}  ({row['n_windows']} windows x {eval_seq_len} tokens)")
    typer.echo(f"  {'':<12}{'FP':>10}{'quantized':>12}{'delta':>12}")
    typer.echo(f"  {'CE (nats)':<12}{row['ce_fp']:>10.4f}{row['ce_q']:>12.4f}{row['delta_ce']:>+12.4f}  ± {row['delta_ce_total_se']:.4f}")
    if row["quant_repeats"] > 1:
        typer.echo(f"  {row['quant_repeats']} quantizations ({row['repeat_vary']}): SD over repeats {row['delta_ce_run_sd']:.4f}, "
                   f"evaluation SE {row['delta_ce_se']:.4f}; the {row['uncertainty_dominant']} dominate(s) the uncertainty")
    import math as _m
    typer.echo(f"  {'perplexity':<12}{_m.exp(row['ce_fp']):>10.3f}{_m.exp(row['ce_q']):>12.3f}{row['delta_ppl']:>+12.3f}")
    typer.echo(f"  KL(FP||Q) {row['kl']:.5f} nats/token   top-1 agreement {row['top1_agree']:.4f}   "
               f"quantize {row['t_quantize']:.1f}s")
    if save:
        typer.echo(f"{'exported (' + export + ')' if export else 'saved'}: {save}"
                   + (f" and pushed to {row['export']['hub']}" if push_to_hub else ""))


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
    device: Optional[str] = typer.Option(None, "--device", help="cpu | cuda | cuda:N | auto; blocks are onloaded one at a time."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Compute dtype: auto (the checkpoint's) | float32 | bfloat16 | float16."),
    max_memory: Optional[str] = typer.Option(None, "--max-memory", help="Memory for one block + activations, e.g. 8GB."),
    spill_dir: Optional[str] = typer.Option(None, "--spill-dir", help="Where activations beyond --max-memory spill (default: the temporary directory)."),
    streams: Optional[str] = typer.Option(None, "--streams", help="Where activation streams live: auto (by --max-memory; on CPU over 256 MiB to disk) | memory | disk."),
    preset: Optional[str] = typer.Option(None, "--preset", help="Trajectory: a public-trajectory preset (quantdyn trajectories)."),
    every: int = typer.Option(0, "--every", help="Keep every N-th checkpoint (and the last)."),
    log_spaced: int = typer.Option(0, "--log-spaced", help="Keep about K checkpoints log-spaced in tokens."),
    tokens_range: Optional[str] = typer.Option(None, "--tokens-range", help="Keep checkpoints with tokens in A:B, e.g. 100B:1T."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print each checkpoint's step, tokens, LR and phase; download nothing."),
    evict: bool = typer.Option(False, "--evict", help="Delete each hub revision from the HF cache once its rows are stored."),
    repeats: int = typer.Option(0, "--repeats", help="Quantize each checkpoint R times per quantizer (spec: quant_repeats)."),
    repeat_vary: Optional[str] = typer.Option(None, "--repeat-vary", help="What differs between repeats: draw | order | both (spec: repeat_vary)."),
    slurm: bool = typer.Option(False, "--slurm", help="Write STORE/slurm/sweep.sbatch (one array task per shard) instead of running."),
    shards: int = typer.Option(1, "--shards", help="With --slurm: array tasks, each sweeping every n-th checkpoint into the store."),
    submit: bool = so.SUBMIT,
    partition: str = so.PARTITION,
    time_limit: str = so.TIME,
    account: str = so.ACCOUNT,
    qos: str = so.QOS,
    gpus: int = so.GPUS,
    cpus: int = so.CPUS,
    mem_gb: int = so.MEM_GB,
    max_parallel: int = so.MAX_PARALLEL,
    constraint: str = so.CONSTRAINT,
    sbatch_extra: Optional[List[str]] = so.SBATCH,
    setup: Optional[List[str]] = so.SETUP,
    cluster: str = so.CLUSTER,
    quiet: bool = typer.Option(False, "--quiet", help="No progress; the summary line and errors only."),
    verbose: bool = typer.Option(False, "--verbose", help="Also a line per decoder block and per checkpoint."),
):
    """Quantize every checkpoint of a trajectory with a grid of quantizers; rows go to the store."""
    from quantdyn.config import from_dict, load_yaml
    from quantdyn.sources.trajectory import dry_run_lines, plan_trajectory
    from quantdyn.sweep.sweep import SweepConfig, run_sweep

    data = load_yaml(spec) if spec else {}
    traj = dict(data.get("trajectory", {}))
    if run or checkpoints or hub or preset:
        traj = {k: v for k, v in traj.items() if k in ("schedule", "select")}
        traj.update({"run": run or "", "checkpoints": list(checkpoints or []), "hub": hub or "",
                     "preset": preset or "", "revisions": [r for r in (revisions or "").split(",") if r],
                     "revision_pattern": revision_pattern or ""})
        if preset:
            traj.pop("schedule", None)
    select = dict(traj.get("select") or {})
    for key, value in (("every", every), ("log_spaced", log_spaced), ("tokens_range", tokens_range)):
        if value:
            select[key] = value
    if select:
        traj["select"] = select
    if traj:
        data["trajectory"] = traj
    if evict:
        data["evict"] = True
    if repeats:
        data["quant_repeats"] = repeats
    if repeat_vary:
        data["repeat_vary"] = repeat_vary
    if quantizers:
        data["quantizers"] = [q for q in quantizers.split(",") if q]
    for key, value in (("store", store), ("device", device), ("dtype", dtype), ("max_memory", max_memory),
                       ("spill_dir", spill_dir), ("streams", streams)):
        if value:
            data[key] = value
    if not spec and not traj:
        raise QuantdynError("give a sweep spec YAML or a trajectory (--run, --checkpoint, --hub or --preset)")
    cfg = from_dict(SweepConfig, data)
    if slurm or submit:
        return _sweep_on_slurm(cfg, shard, shards, submit, cluster, so.slurm_config(
            partition, time_limit, account, qos, gpus, cpus, mem_gb, max_parallel, constraint, sbatch_extra, setup))
    if dry_run:
        plan = plan_trajectory(cfg.trajectory)
        for line in dry_run_lines(list(plan.points), list(plan.skipped)):
            typer.echo(line)
        typer.echo(f"{len(plan.points)} checkpoints x {len(cfg.quantizers)} quantizers (dry run: nothing measured)")
        return
    from quantdyn.train.loggers import console_mode

    mode = console_mode(quiet, verbose)
    out = run_sweep(cfg, shard=shard, progress=mode != "quiet", echo=lambda line: typer.echo(line, err=True),
                    verbose=mode == "verbose")
    typer.echo(f"sweep: {out['written']} rows written, {out['skipped']} already done, store {cfg.store}")
    if out["failed"]:
        names = ", ".join(ref for ref, _ in out["failed"][:5])
        more = f" and {len(out['failed']) - 5} more" if len(out["failed"]) > 5 else ""
        raise QuantdynError(f"{len(out['failed'])} checkpoint(s) could not be measured and have no rows: {names}{more} "
                            "(reasons above); fix them and rerun the same command to add their rows")


def _sweep_on_slurm(cfg, shard, shards: int, submit: bool, cluster: str, slurm_cfg) -> None:
    """Write the resolved sweep as STORE/slurm/sweep.yaml and an sbatch array over its shards, or submit it."""
    import yaml

    from quantdyn.config import to_dict
    from quantdyn.files import write_text_atomic
    from quantdyn.launch.slurm import submit_sweep, sweep_script

    if shard:
        raise QuantdynError("--slurm sets --shard itself (one shard per array task); drop --shard and give --shards")
    if shards < 1:
        raise QuantdynError(f"--shards {shards} must be >= 1")
    so.require_sbatch(submit, cluster)
    folder = Path(cfg.store) / "slurm"
    spec = folder / "sweep.yaml"
    write_text_atomic(spec, "# the sweep each array task runs (written by quantdyn sweep --slurm)\n"
                      + yaml.safe_dump(to_dict(cfg), sort_keys=False))
    args = [str(spec.resolve()), "--quiet"]
    if submit:
        jobs = submit_sweep(args, shards, slurm_cfg, folder / "submitit", cluster=cluster)
        typer.echo(f"submitted {len(jobs)} shards; rows go to {cfg.store}; logs in {folder / 'submitit'}")
        return
    script = folder / "sweep.sbatch"
    write_text_atomic(script, sweep_script(args, shards, slurm_cfg, workdir="."))
    typer.echo(f"wrote {script} ({shards} array tasks) and {spec}; submit with: sbatch {script}")


@app.command()
def analyze(
    checkpoints: List[str] = typer.Argument(..., help="Checkpoint directories or run directories."),
    metrics: str = typer.Option("hessian,outliers,propagation", "--metrics", help="Comma-separated analyses."),
    quantizers: str = typer.Option("gptq3,rtn4", "--quantizers", help="Quantizers for the propagation analysis."),
    store: str = typer.Option("results", "--store"),
    windows: int = typer.Option(8, "--windows", help="Windows per analysis (held-out / calibration)."),
    probes: int = typer.Option(50, "--probes", help="Hutchinson probe budget."),
    seq_len: int = typer.Option(128, "--seq-len", help="Tokens per window."),
    device: str = typer.Option("auto", "--device", help="cpu | cuda | cuda:N | auto."),
    as_json: bool = typer.Option(False, "--json", help="Also print the rows as a JSON array."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress; the rows and errors only."),
):
    """Hessian trace / top eigenvalue, outlier metrics and error propagation -> result rows."""
    from quantdyn.sweep.analyze import analyze as run_analyze

    rows = run_analyze(checkpoints, [m for m in metrics.split(",") if m], [q for q in quantizers.split(",") if q],
                       store=store, budget={"windows": windows, "hessian_probes": probes},
                       data={"calib_seq_len": seq_len, "eval_seq_len": seq_len, "eval_windows": max(windows, 8),
                             "calib_samples": max(windows, 8)}, progress=not quiet, device=device)
    if as_json:
        echo_json(rows)
        return
    for r in rows:
        vals = {k: v for k, v in r.items() if k.startswith(("hessian_", "weight_", "act_", "prop_")) and v is not None
                and k != "weight_decay"}
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in list(vals.items())[:8])
        typer.echo(f"{r['checkpoint']} [{r['analysis']}] {shown}")
    typer.echo(f"{len(rows)} analysis rows in {store}")


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
    device: str = typer.Option("auto", "--device", help="cpu | cuda | cuda:N | auto."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Linear interpolation between two checkpoints: FP loss and Δ CE at each alpha."""
    from quantdyn.results.store import ResultStore
    from quantdyn.sweep.interpolation import interpolate_checkpoints

    rows = interpolate_checkpoints(a, b, steps, quantizers=[q for q in quantizers.split(",") if q], out=out,
                                   eval_seq_len=seq_len, calib_seq_len=seq_len, n_eval_windows=eval_windows,
                                   device=device)
    ResultStore(store).append(rows)  # rows already stored are skipped
    if as_json:
        echo_json([{k: v for k, v in r.items() if k != "window_delta"} for r in rows])
        return
    for r in rows:
        typer.echo(f"alpha {r['alpha']:.3f}  {r.get('quantizer', ''):<6} FP {r['ce_fp']:.4f}  "
                   f"ΔCE {r['delta_ce']:+.4f} ± {r['delta_ce_se']:.4f}")


@app.command("eval")
def eval_cmd(
    model: str = typer.Argument(..., help="Checkpoint directory or hub-id[@revision]."),
    tasks: str = typer.Option(..., "--tasks", help="lm-eval tasks, comma-separated (offline: quantdyn_lastword,quantdyn_nextsent)."),
    quantizers: Optional[str] = typer.Option(None, "--quantizers", help="e.g. gptq3 or gptq3,rtn4 (none: FP only)."),
    quantizer: Optional[str] = typer.Option(None, "--quantizer", hidden=True, help="Old spelling of --quantizers."),
    num_fewshot: int = typer.Option(0, "--num-fewshot"),
    limit: Optional[int] = typer.Option(None, "--limit", help="Examples per task."),
    seed: int = typer.Option(0, "--seed"),
    metric: Optional[str] = typer.Option(None, "--metric", help="Default: acc, else acc_norm."),
    backend: str = typer.Option("quantdyn", "--backend", help="quantdyn (in-memory adapter) | hf (lm-eval's HFLM)"),
    store: Optional[str] = typer.Option("results", "--store", help="Append rows here ('' = don't store)."),
    device: str = typer.Option("auto", "--device", help="cpu | cuda | cuda:N | auto."),
    as_json: bool = typer.Option(False, "--json", help="Print the rows as a JSON array."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress; the table and errors only."),
):
    """Downstream accuracy of a model and its quantized twin (lm-evaluation-harness)."""
    from quantdyn.sweep.accuracy import evaluate_accuracy, format_accuracy_table

    qs = [q for q in ",".join(x for x in (quantizers, quantizer) if x).split(",") if q] or None
    rows = evaluate_accuracy(model, [t for t in tasks.split(",") if t], qs, num_fewshot=num_fewshot, limit=limit,
                             seed=seed, metric=metric, backend=backend, progress=not (as_json or quiet), device=device)
    if store:
        from quantdyn.results.store import ResultStore

        ResultStore(store).append(rows)  # rows already stored are skipped
    if as_json:
        echo_json(rows)
        return
    typer.echo(format_accuracy_table(rows))
