"""Run grids: one base config × varied keys × seeds -> many training runs
(paper A's LR {1e-4, 1e-3, 3e-3} × WD {0.1, 0.05} sweep and its kin).

    quantdyn grid CONFIG.yaml --vary optim.lr=1e-4,1e-3,3e-3 --vary optim.weight_decay=0.1,0.05 --seeds 2

Expansion is the Cartesian product of the ``--vary`` lists in the order given
(the last key varies fastest, seeds fastest of all).  Run names are
``NAME-<alias><value>-...[-s<seed>]``, e.g. ``tiny-lr1e-4-wd0.1-s0``: the
alias of a key comes from :data:`ALIASES` (else the key's last component),
the value is written as typed on the command line (characters other than
letters, digits, ``.``, ``+``, ``-`` and ``_`` become ``_``).  With
``seeds = N`` the runs use seeds base_seed .. base_seed+N-1 and the suffix is
the seed itself; with ``seeds = 0`` the base seed is kept and no suffix added.

Layout of a grid directory::

    GRID_DIR/grid.json           manifest: base config, varied keys, runs (name, dir, config, overrides, seed)
    GRID_DIR/configs/NAME.yaml   the full config of each run (out_dir = GRID_DIR/runs, name = NAME)
    GRID_DIR/runs/NAME/          the run directories
    GRID_DIR/grid.sbatch         SLURM array script, one task per run (write_launch_scripts)
    GRID_DIR/commands.txt        the same runs as plain torchrun lines
    GRID_DIR/logs/               the array tasks' output

Every expanded config is validated by building its RunConfig before anything
is written or run, so an unknown key in ``--vary`` fails at once with a
did-you-mean.  :func:`run_grid` runs the grid locally, one run after another:
finished runs are skipped, partial ones resumed from their last checkpoint.
On a SLURM cluster, :func:`write_launch_scripts` writes the array script that
``quantdyn grid --slurm`` submits (quantdyn/launch/slurm.py).
"""
from __future__ import annotations

import itertools
import json
import re
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import yaml

from quantdyn.config import check_config_key, from_dict, load_yaml, parse_override, set_dotted, to_dict
from quantdyn.errors import QuantdynError, did_you_mean
from quantdyn.files import read_json, write_json_atomic, write_text_atomic
from quantdyn.launch.slurm import SlurmConfig, array_script, quantdyn_command
from quantdyn.monitor import hooks_for
from quantdyn.runtime import git_sha
from quantdyn.runs import CHECKPOINTS, METRICS, STATE, WEIGHTS, RunDir, latest_resumable, step_name
from quantdyn.sources.presets import as_hub_ref
from quantdyn.train.config import RunConfig, check_warmdown
from quantdyn.train.trainer import train

MANIFEST = "grid.json"

ALIASES: dict[str, str] = {
    "seed": "s",
    "optim.name": "opt",
    "optim.lr": "lr",
    "optim.weight_decay": "wd",
    "optim.betas": "betas",
    "optim.eps": "eps",
    "schedule.name": "sched",
    "schedule.warmup": "wu",
    "schedule.decay": "decay",
    "schedule.decay_start": "ds",
    "schedule.decay_shape": "shape",
    "schedule.lr_end": "lrend",
    "train.steps": "steps",
    "train.batch_size": "bs",
    "train.seq_len": "seq",
    "train.grad_accum": "ga",
    "train.grad_clip": "clip",
    "model.preset": "m",
    "model.n_layer": "L",
    "model.d_model": "d",
    "model.n_head": "h",
    "averaging.lawa_window": "lawak",
    "averaging.lawa_every": "lawap",
    "averaging.ema_decay": "ema",
    "data.source": "data",
    "data.tokenizer": "tok",
}
"""Short names of config keys in run names; other keys use their last component."""


# ------------------------------------------------------------- key checks
def check_key(key: str) -> None:
    """Raise a QuantdynError with a did-you-mean if ``key`` is not a RunConfig key (config.check_config_key)."""
    check_config_key(RunConfig, key, "--vary")


# ------------------------------------------------------------- expansion
def _split_values(text: str) -> list[str]:
    """'a,b,[c,d]' -> ['a', 'b', '[c,d]'] (commas inside brackets or quotes stay)."""
    out, depth, cur, quote = [], 0, "", ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(cur)
            cur = ""
            continue
        cur += ch
    out.append(cur)
    return [v.strip() for v in out]


def parse_vary(text: str) -> tuple[str, list[str]]:
    """'optim.lr=1e-4,1e-3' -> ('optim.lr', ['1e-4', '1e-3']) after checking the key."""
    path, _ = parse_override(text)
    key = ".".join(path)
    raw = text.split("=", 1)[1]
    values = _split_values(raw)
    if not values or any(v == "" for v in values):
        raise QuantdynError(f"--vary {text}: give a comma-separated list of values, e.g. {key}=1e-4,1e-3")
    if len(set(values)) != len(values):
        raise QuantdynError(f"--vary {text}: a value is listed twice")
    check_key(key)
    return key, values


def _alias(key: str, all_keys: Sequence[str]) -> str:
    a = ALIASES.get(key, key.rsplit(".", 1)[-1])
    clash = [k for k in all_keys if k != key and ALIASES.get(k, k.rsplit(".", 1)[-1]) == a]
    return key.replace(".", "_") if clash else a


def _name_part(value: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+\-_]+", "_", value).strip("_") or "x"


def grid_values(run: str, keys: Sequence[str]) -> dict[str, str] | None:
    """The values of ``keys`` that :func:`expand_grid` spelled into ``run``'s name (``wd-decay0.33-shape1-sqrt-s0``
    with keys schedule.decay, schedule.decay_shape -> {schedule.decay: '0.33', schedule.decay_shape: '1-sqrt'}), as
    written there; None when the name does not carry every key. A value's dashes stay in it (a part that does not
    start with another key's alias continues the value before it)."""
    aliases = {_alias(k, keys): k for k in keys}
    out: dict[str, str] = {}
    current = None
    for part in re.sub(r"-s\d+$", "", run).split("-"):
        head = next((a for a in sorted(aliases, key=len, reverse=True) if part.startswith(a)), None)
        if head is not None and aliases[head] not in out:
            current = aliases[head]
            out[current] = part[len(head):]
        elif current is not None:
            out[current] += "-" + part
    return out if set(out) == set(keys) and all(out.values()) else None


def _get_dotted(cfg: Any, path: list[str]) -> Any:
    for p in path:
        cfg = cfg[p] if isinstance(cfg, dict) else getattr(cfg, p)
    return cfg


def expand_grid(base: dict, vary: Sequence[str], seeds: int = 0, grid_dir: str | Path | None = None) -> list[tuple[str, dict]]:
    """Expand ``base`` (a run-config dict) over ``vary`` ("key=v1,v2" strings) and seeds.

    Returns [(run name, config dict)] in a deterministic order; each config is
    validated by building its RunConfig (unknown keys fail with a did-you-mean
    before anything runs).  With ``grid_dir`` each run's out_dir is
    GRID_DIR/runs, so its directory is GRID_DIR/runs/NAME.
    """

    if seeds < 0:
        raise QuantdynError(f"--seeds {seeds} must be >= 0")
    parsed = [parse_vary(v) for v in vary]
    keys = [k for k, _ in parsed]
    dup = {k for k in keys if keys.count(k) > 1}
    if dup:
        raise QuantdynError(f"--vary {sorted(dup)[0]} is given twice; list all its values in one --vary")
    if seeds and "seed" in keys:
        raise QuantdynError("give --seeds N or --vary seed=..., not both")
    base_cfg = from_dict(RunConfig, base)  # the base itself must be valid
    if "schedule.decay" not in keys and "train.steps" not in keys:
        check_warmdown(base_cfg)
    aliases = [_alias(k, keys) for k in keys]
    seed_list = [base_cfg.seed + i for i in range(seeds)] if seeds else [None]
    out, names = [], set()
    for combo in itertools.product(*[vals for _, vals in parsed]):
        for seed in seed_list:
            d = dict(base)
            for key, raw in zip(keys, combo):
                _, value = parse_override(f"{key}={raw}")
                d = set_dotted(d, key.split("."), value)
            parts = [f"{a}{_name_part(raw)}" for a, raw in zip(aliases, combo)]
            if seed is not None:
                d["seed"] = seed
                parts.append(f"s{seed}")
            name = "-".join([base_cfg.name, *parts])
            if name in names:
                raise QuantdynError(f"two grid runs would both be named '{name}'; make the --vary values distinct")
            names.add(name)
            d["name"] = name
            if grid_dir is not None:
                d["out_dir"] = str(Path(grid_dir) / "runs")
            cfg = from_dict(RunConfig, d)
            check_warmdown(cfg)  # a warmdown axis (schedule.decay) longer than the run: one line, before any work
            for key in keys:  # store the typed value ('1e-4' is a string to YAML 1.1, a float to the config)
                d = set_dotted(d, key.split("."), to_dict(_get_dotted(cfg, key.split("."))))
            out.append((name, d))
    return out


def grid_manifest(base: dict, vary: Sequence[str], seeds: int, grid_dir: str | Path) -> dict:
    """The manifest of a grid (validated; nothing written): base, varied keys, runs."""

    grid_dir = Path(grid_dir)
    parsed = [parse_vary(v) for v in vary]
    keys = [k for k, _ in parsed]
    runs = []
    for name, d in expand_grid(base, vary, seeds, grid_dir):
        cfg = from_dict(RunConfig, d)
        runs.append({
            "name": name,
            "dir": str(grid_dir / "runs" / name),
            "config": str(grid_dir / "configs" / f"{name}.yaml"),
            "overrides": {k: to_dict(_get_dotted(cfg, k.split("."))) for k in keys},
            "seed": cfg.seed,
            "steps": cfg.train.steps,
        })
    return {
        "base": base,
        "vary": [{"key": k, "alias": _alias(k, keys), "values": vals} for k, vals in parsed],
        "seeds": seeds,
        "grid_dir": str(grid_dir),
        "runs": runs,
    }


def write_grid(base: dict, vary: Sequence[str], seeds: int, grid_dir: str | Path) -> dict:
    """Validate, then write GRID_DIR/configs/NAME.yaml and GRID_DIR/grid.json; return the manifest.

    Writing the same grid again is a no-op (runs already started are kept); a
    different grid in the same directory is refused.
    """

    grid_dir = Path(grid_dir)
    manifest = grid_manifest(base, vary, seeds, grid_dir)
    existing = grid_dir / MANIFEST
    if existing.is_file():
        old = read_grid(grid_dir)
        same = {k: old.get(k) for k in ("base", "vary", "seeds", "runs")} == \
            json.loads(json.dumps({k: manifest[k] for k in ("base", "vary", "seeds", "runs")}, default=str))
        if not same:
            raise QuantdynError(
                f"'{grid_dir}' already holds a different grid ({existing}); choose another directory or delete it"
            )
        manifest["created"] = old.get("created")

    manifest["created"] = manifest.get("created") or time.strftime("%Y-%m-%dT%H:%M:%S%z")
    manifest["git_sha"] = git_sha()
    cfg_dir = grid_dir / "configs"
    cfg_dir.mkdir(parents=True, exist_ok=True)
    for name, d in expand_grid(base, vary, seeds, grid_dir):
        write_text_atomic(cfg_dir / f"{name}.yaml", yaml.safe_dump(d, sort_keys=False))
    write_json_atomic(existing, manifest)
    return manifest


def read_grid(grid_dir: str | Path) -> dict:
    p = Path(grid_dir) / MANIFEST
    if not p.is_file():
        raise QuantdynError(f"'{grid_dir}' is not a grid directory (no {MANIFEST}); create it with `quantdyn grid`")
    return read_json(p, "delete the grid directory and create it again")


def format_grid(manifest: dict) -> str:
    """A table of the runs of a grid (what --dry-run prints)."""
    keys = [v["key"] for v in manifest["vary"]]
    head = ["name", *keys, *(["seed"] if manifest.get("seeds") else [])]
    rows = [[r["name"], *[str(r["overrides"][k]) for k in keys], *([str(r["seed"])] if manifest.get("seeds") else [])]
            for r in manifest["runs"]]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append(f"{len(rows)} runs under {Path(manifest['grid_dir']) / 'runs'}")
    return "\n".join(lines)


# ------------------------------------------------------------------ run
def run_status(run: dict) -> str:
    """'finished', 'partial' (has a resumable checkpoint) or 'new' (:meth:`RunDir.status`)."""
    return RunDir(run["dir"]).status(int(run["steps"]))


def run_grid(grid_dir: str | Path, only: Sequence[str] | None = None, progress: bool = True,
             verbose: bool = False) -> list[dict]:
    """Train the grid's runs one after another in this process.

    Finished runs are skipped, partial ones resumed exactly from their last
    checkpoint, new ones started (a metrics.jsonl left by a run that crashed
    before its first checkpoint is discarded).  ``only``: run names to run.
    A run whose config has ``monitor.every`` > 0 trains with its PTQ monitor.
    Returns [{name, dir, status}] with status skipped | resumed | trained.
    """

    manifest = read_grid(grid_dir)
    runs = manifest["runs"]
    if only:
        names = {r["name"] for r in runs}
        for n in only:
            if n not in names:
                raise QuantdynError(f"grid has no run '{n}'{did_you_mean(n, names)}")
        runs = [r for r in runs if r["name"] in set(only)]
    # validate every config before the first run starts
    cfgs = [from_dict(RunConfig, load_yaml(r["config"])) for r in runs]
    cfgs = [replace(c, model=replace(c.model, hf=as_hub_ref(c.model.hf))) if c.model.hf else c for c in cfgs]
    hooks = [hooks_for(cfg) for cfg in cfgs]  # monitor quantizers checked before the first run too
    out = []
    for r, cfg, hk in zip(runs, cfgs, hooks):
        d = Path(r["dir"])
        status = run_status(r)
        if status == "finished":
            out.append({"name": r["name"], "dir": str(d), "status": "skipped"})
            continue
        if status == "partial":
            train(cfg, d, resume=latest_resumable(d), progress=progress, hooks=hk, verbose=verbose)
            out.append({"name": r["name"], "dir": str(d), "status": "resumed"})
            continue
        RunDir(d).metrics.unlink(missing_ok=True)
        train(cfg, d, progress=progress, hooks=hk, verbose=verbose)
        out.append({"name": r["name"], "dir": str(d), "status": "trained"})
    return out


# ------------------------------------------------------------- cluster
def torchrun_command(config: str | Path, nproc_per_node: int = 1, torchrun: str = "torchrun") -> str:
    """One run's launch line: ``torchrun --standalone --nproc_per_node N -m quantdyn.cli train CONFIG``."""
    return (f"{torchrun} --standalone --nproc_per_node {nproc_per_node} -m quantdyn.cli train "
            f"{shlex.quote(str(config))} --quiet")


def _launcher(nproc_per_node: int, python: str) -> str:
    """Shell lines that set the bash array LAUNCH: how the task starts ``quantdyn`` (launch.slurm.quantdyn_command)
    -- with more than one process, torchrun with the rendezvous at the job's first node (from SLURM's
    variables; the port from the job id, so two tasks on one node do not meet). torchrun itself ignores
    SIGUSR1 (it would end it and leave its workers): the workers catch it and stop with a checkpoint."""
    if nproc_per_node == 1:
        return f"LAUNCH=({quantdyn_command(python)})"
    torchrun = (f"{shlex.quote(python)} -m torch.distributed.run --nnodes=\"$SLURM_JOB_NUM_NODES\" "
                f"--nproc_per_node={nproc_per_node} --rdzv_id=\"$SLURM_JOB_ID\" --rdzv_backend=c10d "
                "--rdzv_endpoint=\"$MASTER_ADDR:$MASTER_PORT\" -m quantdyn.cli")
    return ('MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
            "MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))\n"
            f"LAUNCH=(bash -c 'trap \"\" USR1; exec \"$@\"' quantdyn-torchrun {torchrun})")


def slurm_script(manifest: dict, slurm: SlurmConfig = SlurmConfig(), python: str = sys.executable) -> str:
    """A SLURM array script with one task per run of ``manifest`` (launch.slurm.array_script).

    Task i trains run i on one node with ``slurm.nproc_per_node`` processes (GPUs per node:
    ``slurm.gpus_per_node``, else one per process, none when the base config trains on the CPU); a task
    whose run finished exits at once, one whose run has a resumable checkpoint continues it (``train
    --resume``), so requeued or resubmitted arrays pick up where they stopped. SLURM's warning before the
    time limit (``slurm.signal``) reaches the trainer as SIGUSR1: it checkpoints the step in progress and
    stops, and the task requeues itself.
    """
    runs = manifest["runs"]
    if not runs:
        raise QuantdynError("the grid has no runs")
    grid_dir = Path(manifest["grid_dir"]).resolve()
    names = "\n".join(f"  {shlex.quote(r['name'])}" for r in runs)
    finals = "\n".join(f"  {step_name(int(r['steps']))}" for r in runs)
    on_cpu = from_dict(RunConfig, manifest["base"]).train.device == "cpu"
    choose = f"""GRID_DIR={shlex.quote(str(grid_dir))}
RUNS=(
{names}
)
FINAL=(
{finals}
)
RUN="${{RUNS[$SLURM_ARRAY_TASK_ID]}}"
RUN_DIR="$GRID_DIR/runs/$RUN"
if [ -f "$RUN_DIR/{CHECKPOINTS}/${{FINAL[$SLURM_ARRAY_TASK_ID]}}/{WEIGHTS}" ]; then
  echo "quantdyn: run $RUN already finished"; exit 0
fi
{_launcher(slurm.nproc_per_node, python)}
if compgen -G "$RUN_DIR/{CHECKPOINTS}/step-*/{STATE}" > /dev/null; then
  TASK=("${{LAUNCH[@]}}" train --resume "$RUN_DIR")
else
  rm -f "$RUN_DIR/{METRICS}"
  TASK=("${{LAUNCH[@]}}" train "$GRID_DIR/configs/$RUN.yaml")
fi
"""
    gpus = slurm.gpus_per_node or (0 if on_cpu else slurm.nproc_per_node)
    return array_script(slurm, name=Path(manifest["grid_dir"]).name or "grid", n_tasks=len(runs),
                        log_dir=grid_dir / "logs", choose=choose, stop_signal="USR1", gpus=gpus,
                        about=f"Grid {grid_dir}: {len(runs)} runs, one array task each",
                        script=shlex.quote(str(grid_dir / "grid.sbatch")))


def write_launch_scripts(grid_dir: str | Path, slurm: SlurmConfig = SlurmConfig(),
                         python: str = sys.executable) -> tuple[Path, Path]:
    """Write GRID_DIR/grid.sbatch (see :func:`slurm_script`), GRID_DIR/logs/ and GRID_DIR/commands.txt
    (one torchrun line per run, to run by hand); return the script's and the command list's paths."""
    grid_dir = Path(grid_dir)
    manifest = read_grid(grid_dir)
    sbatch = grid_dir / "grid.sbatch"
    write_text_atomic(sbatch, slurm_script(manifest, slurm, python))
    sbatch.chmod(0o755)
    (grid_dir / "logs").mkdir(exist_ok=True)
    cmds = grid_dir / "commands.txt"
    write_text_atomic(cmds, "".join(
        torchrun_command(Path(r["config"]).resolve(), slurm.nproc_per_node) + "\n" for r in manifest["runs"]
    ))
    return sbatch, cmds


def unfinished_runs(manifest: dict) -> list[str]:
    """Names of the grid's runs that have not reached their last step."""
    return [r["name"] for r in manifest["runs"] if run_status(r) != "finished"]
