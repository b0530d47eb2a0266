"""``quantdyn sweep``: every checkpoint of a trajectory x every quantizer -> rows in a results store."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from quantdyn.cli import options as opt
from quantdyn.cli.app import command, plural
from quantdyn.errors import QuantdynError

TRAJECTORY, SELECT, QUANTIZERS, ENGINE, OUTPUT = ("Trajectory", "Checkpoint selection", "Quantizers",
                                                  "Engine", "Output")


@command()
@opt.slurm_options
def sweep(
    spec: Optional[Path] = typer.Argument(None, help="Sweep spec YAML (the options below override it)."),
    run: Optional[str] = typer.Option(None, "--run", help="A quantdyn run directory (with its branches).",
                                      rich_help_panel=TRAJECTORY),
    checkpoints: Optional[List[str]] = typer.Option(None, "--checkpoint", help="Checkpoint dirs/globs (repeatable).",
                                                    rich_help_panel=TRAJECTORY),
    hub: Optional[str] = typer.Option(None, "--hub", help="A hub model id.", rich_help_panel=TRAJECTORY),
    preset: Optional[str] = typer.Option(None, "--preset", help="A public-trajectory preset (`quantdyn "
                                         "trajectories` lists them).", rich_help_panel=TRAJECTORY),
    revisions: Optional[str] = typer.Option(None, "--revisions", help="Comma-separated hub revisions.",
                                            rich_help_panel=TRAJECTORY),
    revision_pattern: Optional[str] = typer.Option(None, "--revision-pattern", help="Regex over hub refs.",
                                                   rich_help_panel=TRAJECTORY),
    every: int = typer.Option(0, "--every", help="Keep every N-th checkpoint (and the last).", rich_help_panel=SELECT),
    log_spaced: int = typer.Option(0, "--log-spaced", help="Keep about K checkpoints log-spaced in tokens.",
                                   rich_help_panel=SELECT),
    tokens_range: Optional[str] = typer.Option(None, "--tokens-range", help="Keep checkpoints with tokens in A:B, "
                                               "e.g. 100B:1T.", rich_help_panel=SELECT),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print each checkpoint's step, tokens, LR and phase, the "
                                 "repo, the download size and the quantizers; download nothing.",
                                 rich_help_panel=SELECT),
    quantizers: Optional[str] = opt.quantizers(None, "[default: the spec's, else gptq3,gptq4,rtn4]",
                                               panel=QUANTIZERS),
    repeats: Optional[int] = typer.Option(None, "--repeats", help="Quantize each checkpoint R times per quantizer "
                                          "with different calibration draws [default: the spec's quant_repeats, "
                                          "else 1].", rich_help_panel=QUANTIZERS),
    repeat_vary: Optional[str] = typer.Option(None, "--repeat-vary", help="What differs between repeats: draw | "
                                              "order | both (spec: repeat_vary).", rich_help_panel=QUANTIZERS),
    sensitivity: Optional[str] = typer.Option(None, "--sensitivity", help="Candidate types of a per-tensor "
                                              "sensitivity pass at every checkpoint, e.g. q3_k,q4_k,q5_k,q6_k: rows "
                                              "of kind sensitivity, the report's sensitivity map (spec: sensitivity).",
                                              rich_help_panel=QUANTIZERS),
    device: Optional[str] = opt.device(None, "Blocks are onloaded one at a time [default: the spec's, else auto].",
                                       panel=ENGINE),
    dtype: Optional[str] = opt.config_option(opt.ENGINE_CONFIG, "dtype", None, panel=ENGINE),
    max_memory: Optional[str] = opt.config_option(opt.ENGINE_CONFIG, "max_memory", None, panel=ENGINE),
    spill_dir: Optional[str] = opt.config_option(opt.ENGINE_CONFIG, "spill_dir", None, panel=ENGINE),
    streams: Optional[str] = opt.config_option(opt.ENGINE_CONFIG, "streams", None, panel=ENGINE),
    store: Optional[str] = opt.store(None, "[default: the spec's, else results]", panel=OUTPUT,
                                     writes=False),
    out: Optional[str] = typer.Option(None, "--out", hidden=True, help="The same as --store (a sweep writes its rows "
                                      "to the results store; quantize, allocate and report write with --out)."),
    shard: Optional[str] = typer.Option(None, "--shard", help="Sweep shard i/n: every n-th checkpoint from the i-th "
                                        "(default: torchrun rank or SLURM array task).", rich_help_panel=OUTPUT),
    evict: bool = typer.Option(False, "--evict", help="Delete each hub revision from the HF cache once its rows are "
                               "stored.", rich_help_panel=OUTPUT),
    on_slurm: bool = typer.Option(False, "--slurm", help="Submit the sweep to SLURM instead of running it here: "
                                  "STORE/slurm/sweep.sbatch, one array task per shard, submitted with sbatch; prints "
                                  "the job id and how to follow and resume it.", rich_help_panel=opt.SLURM),
    shards: int = typer.Option(1, "--shards", help="Array tasks, each sweeping every n-th checkpoint into the store.",
                               rich_help_panel=opt.SLURM),
    slurm: opt.SlurmOptions = None,
    quiet: bool = opt.quiet("No progress; the summary line and errors only."),
    verbose: bool = opt.verbose("Also a line per decoder block and per checkpoint."),
):
    """Quantize every checkpoint of a trajectory, every quantizer.

    The trajectory is a run, checkpoint directories, hub revisions or a public-trajectory preset; rows go to
    the results store, and a rerun skips the rows already there."""
    from quantdyn.config import from_dict, load_yaml, set_dotted
    from quantdyn.files import ensure_writable
    from quantdyn.results.store import DEFAULT_STORE

    if out is not None:  # --out is what quantize, allocate and report write with; here it can only mean the store
        if store is not None and store != out:
            raise QuantdynError(f"give the store once: --store '{store}' and --out '{out}' (the same option here)")
        store = out
    data = load_yaml(spec) if spec else {}
    if not (dry_run or on_slurm or slurm.submit):  # before torch is imported; a dry run writes nothing, --slurm checks
        ensure_writable(store or data.get("store") or DEFAULT_STORE, "--store" if store else "the store (the spec's "
                        "store, else results)")
    from quantdyn.sweep.sweep import SweepConfig, run_sweep

    traj = dict(data.get("trajectory", {}))
    if run or checkpoints or hub or preset:
        traj = {k: v for k, v in traj.items() if k in ("schedule", "select")}
        traj.update({"run": run or "", "checkpoints": list(checkpoints or []), "hub": hub or "",
                     "preset": preset or "", "revisions": opt.split_list(revisions),
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
    if repeats is not None:
        data["quant_repeats"] = repeats
    if repeat_vary:
        data["repeat_vary"] = repeat_vary
    if quantizers is not None:
        data["quantizers"] = opt.split_quantizers(quantizers)
    if sensitivity is not None:
        data["sensitivity"] = opt.split_list(sensitivity)
    for key, value in (("store", store), ("device", device)):
        if value:
            data[key] = value
    for key, value in (("dtype", dtype), ("max_memory", max_memory), ("spill_dir", spill_dir), ("streams", streams)):
        if value:  # the option wins over the spec's value, wherever the spec put it (SweepConfig.MOVED)
            data.pop(key, None)
            data = set_dotted(data, ["engine", key], value)
    if not spec and not traj:
        raise QuantdynError("give a sweep spec YAML or a trajectory (--run, --checkpoint, --hub or --preset)")
    cfg = from_dict(SweepConfig, data)
    if dry_run:  # before --slurm: a dry run submits nothing either
        for line in dry_run_report(cfg):
            typer.echo(line)
        return
    if slurm.wanted(on_slurm):
        return _sweep_on_slurm(cfg, shard, shards, slurm)
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


def dry_run_report(cfg) -> list[str]:
    """What a sweep would do: one line per checkpoint (step, tokens, LR, phase), the revisions left out, then
    where the checkpoints come from, how much would be downloaded and the quantizers."""
    from quantdyn.engine.streams import fmt_bytes
    from quantdyn.sources.hub import revision_size
    from quantdyn.sources.trajectory import dry_run_lines, missing_revisions, plan_trajectory

    t = cfg.trajectory
    plan = plan_trajectory(t)
    points = list(plan.points)
    lines = dry_run_lines(points, list(plan.skipped))
    repos = list(dict.fromkeys(p.ref.partition("@")[0] for p in points if "@" in p.ref and not p.is_local))
    source = (f"preset {t.preset} from {', '.join(repos)}" if t.preset else f"hub {', '.join(repos)}" if repos
              else f"run {t.run}" if t.run else "local checkpoint directories")
    lines.append(f"{source}: {plural(len(points), 'checkpoint')} x {plural(len(cfg.quantizers), 'quantizer')} "
                 f"({', '.join(cfg.quantizers)})" + (f", each quantized {cfg.quant_repeats} times"
                                                     if cfg.quant_repeats > 1 else ""))
    if repos:
        missing = missing_revisions(points)
        if not missing:
            lines.append(f"download: nothing (all {plural(len(points), 'revision')} are in the local HF cache)")
        else:
            repo, _, rev = missing[0].ref.partition("@")
            size = revision_size(repo, rev)
            each = (f"about {fmt_bytes(size * len(missing))} ({fmt_bytes(size)} per revision)" if size
                    else "size unknown (the hub cannot be asked)")
            lines.append(f"download: {plural(len(missing), 'revision')} not in the local HF cache, {each}"
                         + ("; --evict keeps only one or two on disk" if len(missing) > 1 and not cfg.evict else ""))
    lines.append("(dry run: nothing measured)")
    return lines


def _sweep_on_slurm(cfg, shard, shards: int, slurm: opt.SlurmOptions) -> None:
    """Submit the resolved sweep (STORE/slurm/sweep.yaml) as an sbatch array over its shards; with --write-only
    write it only. Every refusal (no sbatch, a store the tasks cannot write, a job SLURM would not take) is one
    line before anything is written or submitted."""
    import dataclasses

    import yaml

    from quantdyn.config import to_dict
    from quantdyn.files import write_text_atomic
    from quantdyn.launch import slurm as launch

    if shard:
        raise QuantdynError("--slurm sets --shard itself (one shard per array task); drop --shard and give --shards")
    if shards < 1:
        raise QuantdynError(f"--shards {shards} must be >= 1")
    sl = slurm.config()
    if not slurm.write_only:
        launch.require_sbatch()
    store = launch.check_writable(cfg.store, "store", "--store")
    folder = store / "slurm"
    spec, script, logs = folder / "sweep.yaml", folder / "sweep.sbatch", folder / "logs"
    name = f"sweep-{store.name}"
    text = launch.sweep_script([str(spec)], shards, sl, workdir=".", log_dir=logs, name=name)
    if not slurm.write_only:
        launch.check_submission(text)
    cfg = dataclasses.replace(cfg, store=str(store))  # the tasks write where this command was told to
    write_text_atomic(spec, "# the sweep each array task runs (written by quantdyn sweep --slurm)\n"
                      + yaml.safe_dump(to_dict(cfg), sort_keys=False))
    write_text_atomic(script, text)
    logs.mkdir(exist_ok=True)
    if slurm.write_only:
        typer.echo(f"wrote {script} ({plural(shards, 'array task')}) and {spec}; submit with: sbatch {script}")
        return
    job = launch.submit(script)
    for line in launch.submitted_lines(
            job, shards, f"sweep into {store}", logs, name, watch=f"quantdyn results --store {store}",
            resume=f"the same command again (rows already stored are skipped), or `sbatch {script}`"):
        typer.echo(line)
