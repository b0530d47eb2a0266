"""``quantdyn train``: train a model from a run config, or resume a run."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from quantdyn.cli import options as opt
from quantdyn.cli.app import command
from quantdyn.errors import QuantdynError


@command()
def train(
    config: Optional[Path] = typer.Argument(None, help="Run config YAML (see configs/)."),
    overrides: Optional[List[str]] = typer.Argument(None, help="key=value overrides, e.g. optim.lr=1e-3"),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue RUN_DIR from its last checkpoint."),
    overwrite: bool = typer.Option(False, "--overwrite",
                                   help="Start again in a run directory that has checkpoints (deletes them)."),
    device: Optional[str] = opt.device(None, "Sets train.device [default: the config's]."),
    quiet: bool = opt.quiet("Print nothing while training (errors and the run directory only)."),
    verbose: bool = opt.verbose(),
):
    """Train a model from a run config, or resume a run.

    `quantdyn train CONFIG.yaml [key=value ...]` or `quantdyn train --resume RUN_DIR`. Several processes:
    `torchrun --nproc_per_node N -m quantdyn.cli train CONFIG [dist.strategy=fsdp2]`.
    """
    from dataclasses import replace

    from quantdyn.config import apply_overrides, from_dict, load_yaml
    from quantdyn.monitor import hooks_for
    from quantdyn.runs import RunDir, latest_resumable
    from quantdyn.sources.hub import open_checkpoint
    from quantdyn.sources.presets import as_hub_ref
    from quantdyn.train.config import RunConfig, check_warmdown, load_run_config
    from quantdyn.train.loggers import console_mode
    from quantdyn.train.trainer import train as run_train

    mode = console_mode(quiet, verbose)

    if resume is not None:
        if config is not None:
            raise QuantdynError("give either CONFIG.yaml or --resume RUN_DIR, not both")
        if overwrite:
            raise QuantdynError("--overwrite starts a run again from CONFIG.yaml; it does not go with --resume")
        cfg = load_run_config(resume)
        if device:
            cfg = replace(cfg, train=replace(cfg.train, device=device))
        ckpt = latest_resumable(resume)
        if ckpt is None:
            raise QuantdynError(
                f"run '{resume}' has no resumable checkpoint yet; start it again with "
                f"`quantdyn train {resume / 'config.yaml'}`"
            )
        if ckpt.step >= cfg.train.steps:  # a requeued job, or a kill after the last checkpoint: nothing is lost
            open_checkpoint(ckpt.path)  # ... unless the final checkpoint is damaged: that is one line, exit 2
            typer.echo(f"run '{resume}' is already finished at step {ckpt.step} (train.steps={cfg.train.steps}); "
                       "nothing to do (raise train.steps in its config.yaml to train on)", err=True)
            typer.echo(f"run directory: {resume}")
            return
        info = RunDir(resume).read_info()
        run_dir = Path(resume)
        kwargs = dict(resume=ckpt, parent=info.get("parent"))
    else:
        if config is None:
            raise QuantdynError("missing CONFIG.yaml; e.g. `quantdyn train configs/tiny.yaml` (or --resume RUN_DIR)")
        data = apply_overrides(load_yaml(config), [*(overrides or []), *([f"train.device={device}"] if device else [])])
        cfg = from_dict(RunConfig, data)
        if any(o.split("=", 1)[0].strip() in ("schedule.decay", "train.steps") for o in overrides or []):
            check_warmdown(cfg)  # a warmdown set on the command line, longer than the run: one line
        if cfg.model.hf:  # a preset point names a hub revision: what transformers loads (and config.yaml records)
            cfg = replace(cfg, model=replace(cfg.model, hf=as_hub_ref(cfg.model.hf)))
        run_dir = Path(cfg.out_dir) / cfg.name
        kwargs = dict(overwrite=overwrite)
    from quantdyn.files import ensure_writable

    ensure_writable(run_dir, "--resume" if resume is not None else "the run directory (the config's out_dir/name)")
    hooks = hooks_for(cfg)  # the PTQ monitor of cfg.monitor (its quantizers are checked here)
    try:
        out = run_train(cfg, run_dir, progress=mode != "quiet", verbose=mode == "verbose", hooks=hooks, **kwargs)
    except KeyboardInterrupt as e:
        last = latest_resumable(run_dir)
        if last is not None:
            hint = f"continue from step {last.step} with `quantdyn train --resume {run_dir}`"
        elif resume is None:
            hint = "no checkpoint was written yet; rerun the same command to start again"
        else:
            hint = f"rerun `quantdyn train --resume {run_dir}`"
        typer.echo(f"interrupted; {hint}", err=True)
        sys.exit(getattr(e, "exit_code", 130))
    typer.echo(f"run directory: {out}")
