"""Where a run's metrics go (metrics.jsonl, CSV, TensorBoard, Weights & Biases) and what the console shows.

One set of names everywhere — the trainer, the PTQ monitor (quantdyn.monitor) and its HF / Lightning
adapters write the same keys to every destination:

    train/loss  train/lr  train/grad_norm  train/tokens_per_s  train/tokens      every train.log_every steps
    val/loss                                                                     every train.eval_every steps
    ptq/<quantizer>/delta_ce  ptq/<quantizer>/delta_ce_se  ptq/<quantizer>/rel_delta_ce  ptq/<quantizer>/kl
    ptq/<quantizer>/kl_se  ptq/<quantizer>/top1_agree  ptq/<quantizer>/ce_q  ptq/<quantizer>/delta_ppl
    ptq/ce_fp  ptq/seconds                                                       every monitor.every steps

metrics.jsonl rows hold ``step`` and the shared names.  Files written before 0.2 also (or only) hold the keys
from before these names existed (``tokens``, ``lr``, ``train_loss``, ``grad_norm``, ``tokens_per_s``,
``val_loss``, ``dce_<quantizer>``, ``dce_<quantizer>_se``): :func:`shared_names` reads them as the shared names
(``train.checkpoint.read_metrics`` applies it), so old run directories stay readable.

A logger is anything with ``log(metrics, step)`` and ``close()`` (:class:`MetricLogger`).  The destinations
a run config can name (``log.to``) are registered in :data:`LOGGERS`; :func:`check_destinations` says, in one
line and before anything is trained, which extra to install for a destination whose package is missing.

What a run prints while it trains is a :class:`quantdyn.progress.Progress` (a tqdm bar on a terminal, plain
periodic lines anywhere else); :func:`show_logged` puts each logged row on it (loss, LR, tokens/s; one line
per validation or monitor measurement).
"""
from __future__ import annotations

import csv
import importlib.util
import io
import json
import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence, TextIO

from quantdyn.errors import QuantdynError
from quantdyn.files import write_text_atomic
from quantdyn.progress import Progress
from quantdyn.registry import Registry
from quantdyn.runs import METRICS, RunDir

# ------------------------------------------------------------------ metric names
TRAIN_LOSS = "train/loss"
TRAIN_LR = "train/lr"
TRAIN_GRAD_NORM = "train/grad_norm"
TRAIN_TOKENS_PER_S = "train/tokens_per_s"
TRAIN_TOKENS = "train/tokens"
VAL_LOSS = "val/loss"
PTQ_CE_FP = "ptq/ce_fp"
PTQ_SECONDS = "ptq/seconds"
WARN_CURVATURE = "warn/curvature_along_update"
"""The early warning (PTQMonitor warning_every): the loss's curvature along the weights' update since the last
warning, uᵀ H u (analysis/hessian.curvature_along), on a few held-out windows."""
WARN_SECONDS = "warn/seconds"

PTQ_METRICS: tuple[str, ...] = ("delta_ce", "delta_ce_se", "rel_delta_ce", "kl", "kl_se", "top1_agree", "ce_q",
                                "delta_ppl")
"""What the monitor logs per quantizer, as ptq/<quantizer>/<metric> (the engine's row keys)."""

#: shared name -> the metrics.jsonl key written before the shared names existed (read, never written)
LEGACY_KEYS: dict[str, str] = {
    TRAIN_TOKENS: "tokens",
    TRAIN_LR: "lr",
    TRAIN_LOSS: "train_loss",
    TRAIN_GRAD_NORM: "grad_norm",
    TRAIN_TOKENS_PER_S: "tokens_per_s",
    VAL_LOSS: "val_loss",
}


def ptq_key(label: str, metric: str) -> str:
    """The shared name of one monitor metric of one quantizer: ``ptq/<label>/<metric>``."""
    return f"ptq/{label}/{metric}"


def shared_names(row: Mapping[str, Any]) -> dict[str, Any]:
    """A metrics.jsonl row with the shared names: the keys of files written before 0.2 (``val_loss``, ``lr``,
    ...; :data:`LEGACY_KEYS`) become their shared names, unless the row has those too (the same value, in the
    files that wrote both).  The monitor's old ``dce_<quantizer>`` keys are left as they are (a quantizer label
    can itself end in ``_se``; report/monitored.py reads them)."""
    out = {k: v for k, v in row.items() if k not in LEGACY_KEYS.values()}
    for new, old in LEGACY_KEYS.items():
        if old in row and new not in out:
            out[new] = row[old]
    return out


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


# ------------------------------------------------------------------ loggers
class MetricLogger(Protocol):
    """A destination for metrics: the trainer, the PTQ monitor and its adapters call ``log`` with
    {shared name: value} and the optimizer step, and ``close`` once at the end."""

    def log(self, metrics: Mapping[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def _rows_until(path: Path, truncate_after: int | None) -> list[dict] | None:
    """The rows of a metrics.jsonl up to step ``truncate_after`` (None: keep the file as it is)."""
    if truncate_after is None or not path.is_file():
        return None
    keep = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a torn last line of a killed run
            continue
        if isinstance(row, dict) and (row.get("step") or 0) <= truncate_after:
            keep.append(row)
    return keep


class JsonlLogger:
    """One JSON object per ``log`` call, appended to ``path`` (RUN_DIR/metrics.jsonl in the trainer): the
    step and the shared names.

    truncate_after: on opening, drop rows logged after this step (a resumed run logged past its last
    checkpoint before it crashed; 0 = start the file afresh); None keeps the file as it is."""

    def __init__(self, path: str | Path, truncate_after: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        keep = _rows_until(self.path, truncate_after)
        if keep is not None:
            write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in keep))

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        row = {"step": int(step), **metrics}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def close(self) -> None:
        return None


class CSVLogger:
    """A wide CSV (RUN_DIR/metrics.csv in the trainer): a ``step`` column and one column per metric name,
    empty where a step did not log that metric. A name seen for the first time adds a column (the file is
    rewritten atomically then; otherwise rows are appended)."""

    def __init__(self, path: str | Path, truncate_after: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = []
        self.columns: list[str] = ["step"]
        if self.path.is_file():
            with open(self.path, newline="") as f:
                reader = csv.DictReader(f)
                self.columns = list(reader.fieldnames or ["step"])
                for r in reader:
                    try:
                        step = int(r.get("step") or 0)
                    except ValueError:  # a torn last line
                        continue
                    if truncate_after is None or step <= truncate_after:
                        self.rows.append({k: v for k, v in r.items() if v not in ("", None)})
            if truncate_after is not None:
                self._rewrite()

    def _rewrite(self) -> None:
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=self.columns, extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        w.writerows(self.rows)
        write_text_atomic(self.path, buf.getvalue())

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        row = {"step": int(step), **{k: v for k, v in metrics.items() if _number(v) is not None}}
        self.rows.append(row)
        new = [k for k in row if k not in self.columns]
        if new or not self.path.is_file():
            self.columns += new
            self._rewrite()
            return
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.columns, extrasaction="ignore", lineterminator="\n").writerow(row)

    def close(self) -> None:
        return None


def _summary_writer():
    """TensorBoard's writer: torch.utils.tensorboard (needs the tensorboard package) or tensorboardX."""
    # optional heavy dependencies, imported only when a run logs to TensorBoard
    try:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter
    except ImportError:
        pass
    try:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    except ImportError:
        raise QuantdynError(LOGGERS.get("tensorboard").missing()) from None


class TensorBoardLogger:
    """Scalars as TensorBoard event files in ``log_dir`` (RUN_DIR/tensorboard in the trainer): one
    ``add_scalar(name, value, step)`` per metric, flushed at every ``log``.

    truncate_after: 0 removes event files of an earlier attempt; a positive step makes TensorBoard drop
    the events logged after it (``purge_step``, for a resumed run); None keeps what is there."""

    def __init__(self, log_dir: str | Path, truncate_after: int | None = None):
        SummaryWriter = _summary_writer()
        self.log_dir = Path(log_dir)
        if truncate_after == 0 and self.log_dir.is_dir():
            for p in self.log_dir.glob("events.out.tfevents.*"):
                p.unlink()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        purge = truncate_after + 1 if truncate_after else None
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        for k, v in metrics.items():
            x = _number(v)
            if x is not None:
                self.writer.add_scalar(k, x, int(step))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """Weights & Biases. Logs into the run that is already active in this process (e.g. the one the
    Hugging Face Trainer's W&B integration started), else starts one: ``project``, ``name``, ``config``,
    files under ``dir``; ``run_id`` with resume="allow" continues the same W&B run after a restart.
    ``mode`` offline (or WANDB_MODE=offline) needs no account: `wandb sync DIR` uploads later.

    W&B keeps a run's steps increasing: after a resume, the steps between the checkpoint and the crash
    that were logged before are not logged again (their values are the same: resumes are exact)."""

    def __init__(self, project: str = "quantdyn", name: str | None = None, dir: str | Path | None = None,
                 config: Mapping | None = None, mode: str = "", entity: str = "", run_id: str | None = None,
                 attach: bool = True):
        try:  # optional heavy dependency, imported only when a run logs to W&B
            import wandb
        except ImportError:
            raise QuantdynError(LOGGERS.get("wandb").missing()) from None
        self.wandb = wandb
        self.attached = attach and wandb.run is not None
        if self.attached:
            self.run = wandb.run
        else:
            if dir is not None:
                Path(dir).mkdir(parents=True, exist_ok=True)
            try:
                self.run = wandb.init(project=project, entity=entity or None, name=name,
                                      dir=str(dir) if dir is not None else None, config=dict(config or {}),
                                      id=run_id, resume="allow" if run_id else None, mode=mode or None)
            except Exception as e:  # wandb raises its own types (no API key, no network, bad entity)
                raise QuantdynError(
                    f"Weights & Biases could not start a run ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
                    "log in with `wandb login`, or log offline without an account (WANDB_MODE=offline or "
                    "log.wandb_mode=offline; `wandb sync` uploads later)"
                ) from None

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        vals = {k: x for k, v in metrics.items() if (x := _number(v)) is not None}
        if self.attached:
            # the owner of the run (e.g. transformers' WandbCallback) keeps W&B's own step counter and plots
            # against train/global_step; an explicit smaller step would be dropped
            self.run.log({**vals, "train/global_step": int(step)})
        else:
            self.run.log(vals, step=int(step))

    def close(self) -> None:
        if not self.attached:
            self.run.finish()


class PrintLogger:
    """Plain lines for a plain loop: per ``log`` call one line of the metrics that are not the monitor's
    (``step N: train/loss 4.12  train/lr 3.00e-03``) and one per monitored quantizer
    (``step N: rtn4 dCE +0.0123 +- 0.0011 (rel +0.003)  KL 0.0102  top-1 agree 97.10%``); ``full`` prints
    every metric by name instead."""

    def __init__(self, stream: TextIO | None = None, prefix: str = "", full: bool = False):
        self.stream, self.prefix, self.full = stream, prefix, full

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        head = f"{self.prefix + ': ' if self.prefix else ''}step {step}: "
        if self.full:
            lines = [format_metrics(metrics)]
        else:
            rest = {k: v for k, v in metrics.items() if not k.startswith("ptq/")}
            lines = ([format_metrics(rest)] if rest else []) + _ptq_summary(metrics)
        for line in lines:
            print(head + line, file=self.stream or sys.stderr, flush=True)

    def close(self) -> None:
        return None


def format_metrics(metrics: Mapping[str, Any]) -> str:
    """'train/loss 4.1234  train/lr 3.00e-03 ...' (4 significant digits)."""
    return "  ".join(f"{k} {_fmt(v)}" for k, v in metrics.items() if _number(v) is not None)


def _fmt(v: Any) -> str:
    x = float(v)
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    return f"{x:.3e}" if abs(x) < 1e-3 or abs(x) >= 1e6 else f"{x:.4g}"


# ------------------------------------------------------------------ destinations of a run config
@dataclass(frozen=True)
class RunLogContext:
    """What a run's loggers are built from (the trainer fills it in)."""

    run_dir: Path
    name: str
    config: dict
    truncate_after: int | None
    """0: a fresh run (earlier attempts' logs are removed); S > 0: resumed or branched at step S."""
    wandb_id: str | None = None
    wandb_project: str = "quantdyn"
    wandb_entity: str = ""
    wandb_mode: str = ""


@dataclass(frozen=True)
class Destination:
    """A ``log.to`` entry: how to build its logger for a run, and which package and extra it needs."""

    build: Callable[[RunLogContext], MetricLogger]
    modules: tuple[str, ...] = ()
    """Any one of these importable makes the destination available (none = always)."""
    extra: str = ""
    """The pip extra that installs it: quantdyn[<extra>]."""
    outputs: tuple[str, ...] = ()
    """What it writes in the run directory."""

    def available(self) -> bool:
        return not self.modules or any(importlib.util.find_spec(m) is not None for m in self.modules)

    def missing(self) -> str:
        return missing_line([self])


LOGGERS: Registry[Destination] = Registry("log destination (log.to)")
LOGGERS.add("jsonl", Destination(lambda c: JsonlLogger(RunDir(c.run_dir).metrics, c.truncate_after),
                                 outputs=(METRICS,)))
LOGGERS.add("csv", Destination(lambda c: CSVLogger(c.run_dir / "metrics.csv", c.truncate_after),
                               outputs=("metrics.csv",)))
LOGGERS.add("tensorboard", Destination(lambda c: TensorBoardLogger(c.run_dir / "tensorboard", c.truncate_after),
                                       modules=("tensorboardX", "tensorboard"), extra="tensorboard",
                                       outputs=("tensorboard",)))
LOGGERS.add("wandb", Destination(
    lambda c: WandbLogger(c.wandb_project, c.name, c.run_dir, c.config, c.wandb_mode, c.wandb_entity, c.wandb_id,
                          attach=False),
    modules=("wandb",), extra="wandb", outputs=("wandb",)))


def missing_line(dests: Sequence[Destination]) -> str:
    names = [n for n in LOGGERS if LOGGERS.get(n) in dests]
    extras = ",".join(d.extra for d in dests)
    pkgs = " / ".join(d.modules[0] for d in dests)
    return (f"log destination{'s' if len(names) > 1 else ''} {', '.join(names)} need{'' if len(names) > 1 else 's'} "
            f"{pkgs}, which is not installed; install it with pip install 'quantdyn[{extras}]' "
            f"(or drop {' and '.join(names)} from log.to)")


def check_destinations(names: Sequence[str]) -> None:
    """Every destination known and its package importable; else one line naming the extra to install."""
    dests = [LOGGERS.get(n) for n in names]
    missing = [d for d in dests if not d.available()]
    if missing:
        raise QuantdynError(missing_line(missing))


def build_loggers(names: Sequence[str], ctx: RunLogContext) -> list[MetricLogger]:
    """The loggers of a run: metrics.jsonl always (the run's own record), then the other destinations."""
    check_destinations(names)
    order = ["jsonl"] + [n for n in names if n != "jsonl"]
    return [LOGGERS.get(n).build(ctx) for n in order]


def clear_outputs(run_dir: Path) -> None:
    """Remove what any destination wrote in ``run_dir`` (a fresh start of a run that already ran)."""
    for n in LOGGERS:
        for out in LOGGERS.get(n).outputs:
            p = Path(run_dir) / out
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()


def log_all(loggers: Sequence[MetricLogger], metrics: Mapping[str, Any], step: int) -> None:
    for lg in loggers:
        lg.log(metrics, step)


def close_all(loggers: Sequence[MetricLogger]) -> None:
    for lg in loggers:
        lg.close()


# ------------------------------------------------------------------ console
def _ptq_summary(metrics: Mapping[str, Any]) -> list[str]:
    """'rtn4 dCE +0.0123 +- 0.0011 (rel +0.003)  KL 0.0102  top-1 agree 97.10%' per quantizer in ``metrics``."""
    out = []
    labels = [k[4:-len("/delta_ce")] for k in metrics if k.startswith("ptq/") and k.endswith("/delta_ce")]
    for q in labels:
        dce, se, rel, kl, agree = (_number(metrics.get(ptq_key(q, m)))
                                   for m in ("delta_ce", "delta_ce_se", "rel_delta_ce", "kl", "top1_agree"))
        s = f"{q} dCE {dce:+.4g}" + (f" +- {se:.2g}" if se is not None else "")
        if rel is not None:
            s += f" (rel {rel:+.3g})"
        if kl is not None:
            s += f"  KL {kl:.3g}"
        if agree is not None:
            s += f"  top-1 agree {agree:.2%}"
        out.append(s)
    return out


def show_logged(console: Progress, step: int, metrics: Mapping[str, Any], verbose: bool = False) -> None:
    """A row a run logged at ``step``, on its console (a Progress counting steps): loss, LR and tokens/s beside
    the count (the bar's postfix, or the periodic plain line), one line per validation or monitor measurement,
    and with ``verbose`` one line with every metric."""
    if not console.enabled:
        return
    loss, lr, tps = (_number(metrics.get(k)) for k in (TRAIN_LOSS, TRAIN_LR, TRAIN_TOKENS_PER_S))
    val = _number(metrics.get(VAL_LOSS))
    post = {}
    if loss is not None:
        post["loss"] = f"{loss:.4f}"
    if lr is not None:
        post["lr"] = f"{lr:.2e}"
    if tps is not None:
        post["tok/s"] = f"{tps:,.0f}"
    if val is not None:
        post["val"] = f"{val:.4f}"
    post.update({f"dCE {k[4:-9]}": f"{float(v):+.4f}" for k, v in metrics.items()
                 if k.startswith("ptq/") and k.endswith("/delta_ce") and _number(v) is not None})
    console.set_postfix(post)
    head = f"{console.desc}: step {step}/{console.total}"
    if val is not None:
        console.write(f"{head}  val/loss {val:.4f}")
    for s in _ptq_summary(metrics):
        console.write(f"{head}  ptq {s}")
    if verbose:
        console.write(f"{console.desc}: step {step}: {format_metrics(metrics)}")


def console_mode(quiet: bool = False, verbose: bool = False) -> str:
    """--quiet / --verbose -> quiet | normal | verbose (both at once is an error)."""
    if quiet and verbose:
        raise QuantdynError("--quiet and --verbose contradict each other; give one of them")
    return "quiet" if quiet else "verbose" if verbose else "normal"


