"""``quantdyn cooldown``: branch LR cooldowns (and constant-LR controls) from a stable-phase checkpoint — of a
quantdyn run (``RUN_DIR --from-step S``) or of any Hugging Face causal LM (``MODEL ... --out DIR``)."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from quantdyn.cli import options as opt
from quantdyn.cli.app import command
from quantdyn.errors import QuantdynError

_CHECKPOINT = "From a Hugging Face checkpoint"


@command()
def cooldown(
    model: str = typer.Argument(..., help="A quantdyn run directory (with --from-step), or the checkpoint to branch "
                                          "from: a local HF directory, a hub id, id@revision or a preset point "
                                          "(smollm3-3b@REVISION)."),
    overrides: Optional[List[str]] = typer.Argument(None, help="From a checkpoint: run-config key=value overrides, "
                                                               "e.g. optim.weight_decay=0.1 train.checkpoint_every=10; "
                                                               "of a quantdyn run: optim.sam_rho, optim.sam_adaptive, "
                                                               "qat.format (named in the cooldown branch)"),
    from_step: Optional[str] = typer.Option(None, "--from-step", help="Of a quantdyn run: the stable-phase "
                                                                      "checkpoint to branch from: a step (400), "
                                                                      "-N (N steps before the run's end) or latest."),
    decay_steps: str = typer.Option(..., "--decay-steps", help="Decay lengths, comma-separated: 200,400"),
    shape: str = typer.Option("linear", "--shape", help="linear | cosine | 1-sqrt"),
    control: bool = typer.Option(False, "--control", help="Also run constant-LR control twins."),
    qat: Optional[str] = typer.Option(None, "--qat", help="Train the cooldowns with this format's fake quantization "
                                                          "(straight-through), e.g. rtn4 (int4 g128), q4_k, nvfp4; "
                                                          "= qat.format=FORMAT."),
    nodecay: Optional[str] = typer.Option(None, "--nodecay", help="Of a quantdyn run: also no-decay branches, constant "
                                                                  "LR to the end, then this average as the endpoint: "
                                                                  "lawa-kK-pP (the last K snapshots P steps apart) or "
                                                                  "ema-DECAY; comma-separated for several."),
    peak_lr: Optional[float] = typer.Option(None, "--peak-lr", rich_help_panel=_CHECKPOINT,
                                            help="The stable-phase LR the branches start at [default: a preset "
                                                 "point's LR there; required otherwise]."),
    data: str = typer.Option("builtin:kjv", "--data", rich_help_panel=_CHECKPOINT,
                             help="Training text (data.source), tokenized with the model's own tokenizer."),
    batch_size: int = typer.Option(8, "--batch-size", rich_help_panel=_CHECKPOINT,
                                   help="Sequences per micro-batch per process."),
    seq_len: int = typer.Option(512, "--seq-len", rich_help_panel=_CHECKPOINT, help="Tokens per sequence."),
    optimizer_start: str = typer.Option("estimate:20", "--optimizer-start", rich_help_panel=_CHECKPOINT,
                                        help="How the optimizer starts without saved state: estimate:K (moments "
                                             "from K steps at LR 0) or fresh."),
    out: Optional[Path] = opt.out(None, "the experiment to this directory (from a checkpoint: required; "
                                  "branches in OUT/branches/NAME).", panel=_CHECKPOINT),
    device: Optional[str] = opt.device(None, "[default: the run's; from a checkpoint: auto]"),
    quiet: bool = opt.quiet("Print nothing while training."),
    verbose: bool = opt.verbose(),
):
    """Branch LR cooldowns from a stable-phase checkpoint.

    Each branch decays the LR to lr_end over its decay length; --control adds a constant-LR twin of each.
    `quantdyn cooldown RUN_DIR --from-step S --decay-steps 200,400` branches a quantdyn run (`--qat rtn4`,
    `optim.sam_rho=0.05`: cooldowns with QAT or SAM, named for it);
    `quantdyn cooldown MODEL --peak-lr LR --decay-steps 50,100 --control --data SOURCE --batch-size B
    --seq-len L --out DIR` branches any HF causal LM (branch point = step 0 of every branch)."""
    from quantdyn.runs import RunDir
    from quantdyn.train.loggers import console_mode

    mode = console_mode(quiet, verbose)
    try:
        ds = [int(x) for x in decay_steps.split(",") if x.strip()]
    except ValueError:
        raise QuantdynError(f"--decay-steps '{decay_steps}' must be integers separated by commas, e.g. 200,400") from None
    show = dict(progress=mode != "quiet", verbose=mode == "verbose")
    if RunDir(model).is_run:
        paths = _from_run(Path(model), from_step, ds, shape, control, device, overrides, out, peak_lr, qat, nodecay,
                          show)
    else:
        if from_step is not None:
            raise QuantdynError(f"--from-step is for a quantdyn run directory; '{model}' is a checkpoint, whose weights "
                                "are the branch point (step 0 of every branch)")
        if nodecay:
            raise QuantdynError("--nodecay is for a quantdyn run directory (with --from-step); not built yet for a "
                                "cooldown from a checkpoint")
        paths = _from_checkpoint(model, ds, shape, control, peak_lr, data, batch_size, seq_len, optimizer_start, out,
                                 device, overrides or [], qat, show)
    for p in paths:
        typer.echo(f"branch: {p}")


def _from_run(run_dir: Path, from_step, ds, shape, control, device, overrides, out, peak_lr, qat, nodecay,
              show) -> list[Path]:
    from quantdyn.config import parse_override
    from quantdyn.monitor import hooks_for
    from quantdyn.train.branches import cooldown as run_cooldown
    from quantdyn.train.branches import intervention_of
    from quantdyn.train.config import load_run_config

    if from_step is None:
        raise QuantdynError(f"'{run_dir}' is a quantdyn run: give --from-step, the step of its checkpoint to branch from")
    extra = [n for n, v in (("--out", out), ("--peak-lr", peak_lr)) if v]
    if extra:
        raise QuantdynError(f"{extra[0]} is for a cooldown from a checkpoint; a quantdyn run's branches go under "
                            "RUN_DIR/branches with its own config")
    # a run's branches keep its config (so that they compare, and a name says what a branch is); the keys of an
    # intervention are the exception, since the branch's name carries them (train/branches.INTERVENTION_KEYS)
    given = {".".join(k): v for k, v in map(parse_override, overrides or [])}
    if qat is not None:
        if given.get("qat.format", qat) != qat:
            raise QuantdynError(f"--qat {qat} and qat.format={given['qat.format']} disagree; give one")
        given["qat.format"] = qat
    intervention = intervention_of(given)
    averages = [a.strip() for a in (nodecay or "").split(",") if a.strip()]
    from quantdyn.files import ensure_writable
    from quantdyn.runs import RunDir, resolve_step

    step = resolve_step(run_dir, from_step)  # -100: 100 steps before the run's end, whatever its length
    ensure_writable(RunDir(run_dir).branches, f"the branches of run '{run_dir}'")
    hooks = hooks_for(load_run_config(run_dir))  # the parent's monitor section, for every branch
    return run_cooldown(run_dir, step, ds, shape, control, device=device, hooks=hooks, intervention=intervention,
                        nodecay=averages, **show)


def _from_checkpoint(model: str, ds, shape, control, peak_lr, data, batch_size, seq_len, optimizer_start, out,
                     device, overrides, qat, show) -> list[Path]:
    from quantdyn.config import apply_overrides, from_dict
    from quantdyn.monitor import hooks_for
    from quantdyn.train.branches import Intervention, cooldown_from_checkpoint
    from quantdyn.train.config import RunConfig

    intervention = Intervention(qat_format=qat or "")  # a format without a training path: one line, first
    if out is None:
        raise QuantdynError(f"give --out DIR: the directory the cooldown experiment from '{model}' is written to")
    ref, source, known_lr = resolve_model_ref(model)
    if peak_lr is None and source.get("decaying"):
        raise QuantdynError(f"'{model}' lies in its run's decay (LR {source['lr']:.3g}, phase {source['phase']}); "
                            "branch from a stable-phase revision (`quantdyn trajectories` lists them), or give "
                            "--peak-lr to branch from it anyway")
    lr = peak_lr if peak_lr is not None else known_lr
    if lr is None:
        raise QuantdynError(f"give --peak-lr: '{model}' carries no schedule (not a preset point, no quantdyn.json), "
                            "so the LR of its stable phase is unknown")
    mode, _, k = optimizer_start.partition(":")
    start = {"mode": mode, **({"steps": k} if k else {})}
    base = {"name": Path(out).name or "cooldown", "model": {"hf": ref}, "data": {"source": data},
            "optim": {"lr": lr}, "schedule": {"name": "constant", "warmup": 0}, "optimizer_start": start,
            "train": {"batch_size": batch_size, "seq_len": seq_len, **({"device": device} if device else {})}}
    parent = from_dict(RunConfig, apply_overrides(base, overrides))
    return cooldown_from_checkpoint(parent, out, ds, shape, control, source=source, hooks=hooks_for(parent),
                                    intervention=intervention, **show)


def resolve_model_ref(model: str) -> tuple[str, dict, float | None]:
    """(what transformers loads: a directory or hub id@revision, where the checkpoint sits in its training,
    its LR there when known): a preset point gives its hub revision, step, tokens and LR; a quantdyn checkpoint
    its quantdyn.json; a local directory is recorded by its absolute path."""
    from quantdyn.runs import read_meta
    from quantdyn.sources.presets import preset_point

    point = preset_point(model)
    if point is not None:
        info = point.info
        source = {"ref": model, "preset": point.preset, "revision": info.revision, "step": info.step,
                  "tokens": info.tokens, "lr": info.lr, "phase": info.phase, "decaying": info.decaying}
        return point.hub_ref, source, info.lr
    p = Path(model).expanduser()
    if p.is_dir():
        meta = read_meta(p)
        source = {"ref": model, **{k: meta[k] for k in ("run", "step", "tokens", "lr") if meta.get(k) is not None}}
        return str(p.resolve()), source, meta.get("lr")
    return model, {"ref": model}, None
