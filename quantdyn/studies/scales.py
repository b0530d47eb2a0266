"""Named sizes for study files: one ``scale:`` key moves a study from a 2-core CPU to a GPU.

A scale rewrites the study dict before it is typed:

* model: the shape keys (n_layer, d_model, n_head, d_ff, vocab_size, max_seq_len) are replaced by the
  scale's preset (other model keys, e.g. tie_embeddings, stay);
* every step count of the study is multiplied by ``step_factor`` (train.steps, eval_every,
  checkpoint_every, warmup/decay/decay_start when given in steps, cooldown from/decay/end steps, LAWA
  periods and at_step), so the study keeps its shape: branch points stay checkpoints, LAWA windows
  stay on the checkpoint grid;
* batch, sequence length and the training evaluation size are set;
* the sweep's calibration and evaluation sizes are set;
* data: a scale may name a corpus and tokenizer for its size (GPU scales read a FineWeb-Edu sample);
  ``run.data.source=...`` on the command line wins, as every override does;
* outputs: a scale asked for on the command line that is not the file's own (``scale=cpu-tiny`` on a file
  written for the CPU) writes apart, :func:`apart_paths`: run.out_dir, sweep.store, report and ship.out get
  ``-<scale>``, so a smoke run never lands in (or is refused by) the full size's runs, store and report; paths
  given on the command line win.

``cpu`` leaves the spec as written (the study files are sized for it).  The GPU scales' sizes are
choices, not measurements: no GPU was lent while they were written, so none of their timings is
stated anywhere.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

from quantdyn.errors import QuantdynError, unknown_name


@dataclass(frozen=True)
class Scale:
    """One named size."""

    description: str
    """What the scale is for."""
    preset: str = ""
    """Model preset ('' = keep the spec's model)."""
    step_factor: float = 1.0
    """Multiplier of every step count in the study."""
    batch_size: int = 0
    """train.batch_size (0 = keep)."""
    seq_len: int = 0
    """train.seq_len and the sweep's calibration/evaluation sequence length (0 = keep)."""
    eval_windows: int = 0
    """Held-out windows for the training validation loss and for the sweep's Δ CE (0 = keep)."""
    calib_samples: int = 0
    """Calibration sequences (0 = keep)."""
    data: dict = field(default_factory=dict)
    """run.data keys set by the scale (e.g. a larger corpus and its tokenizer)."""
    dtype: str = ""
    """train.dtype ('' = keep)."""

    def __post_init__(self):
        if self.step_factor <= 0:
            raise QuantdynError(f"scale step_factor={self.step_factor} must be > 0")


_FINEWEB = {"source": "hf:HuggingFaceFW/fineweb-edu:sample-10BT", "tokenizer": "EleutherAI/gpt-neox-20b"}

SCALES: dict[str, Scale] = {
    "cpu": Scale("as written: the study files are sized for an idle 2-core CPU (<= 60 min each)"),
    "cpu-tiny": Scale("seconds-to-minutes smoke size (tests, trying another corpus): 2 x 64 model, steps / 20",
                      preset="tiny-2x64", step_factor=0.05, batch_size=8, seq_len=64, eval_windows=40,
                      calib_samples=8),
    "pythia-14m": Scale("one GPU, minutes: Pythia-14M shapes, steps x 5, 32 x 512 tokens per step",
                        preset="pythia-14m", step_factor=5, batch_size=32, seq_len=512, eval_windows=400,
                        calib_samples=128, data={**_FINEWEB, "max_tokens": 2_000_000_000}, dtype="bfloat16"),
    "pythia-70m": Scale("one GPU, about an hour per run: Pythia-70M shapes, steps x 10, 32 x 1024 tokens per step",
                        preset="pythia-70m", step_factor=10, batch_size=32, seq_len=1024, eval_windows=500,
                        calib_samples=256, data={**_FINEWEB, "max_tokens": 5_000_000_000}, dtype="bfloat16"),
    "pythia-160m": Scale("one or more GPUs, hours per run: paper A's Pythia-160M shapes, steps x 10, "
                         "32 x 2048 tokens per step, 1024 calibration sequences as paper A",
                         preset="pythia-160m", step_factor=10, batch_size=32, seq_len=2048, eval_windows=500,
                         calib_samples=1024, data={**_FINEWEB, "max_tokens": 10_000_000_000}, dtype="bfloat16"),
}
"""The named sizes; ``scale: NAME`` in a study file or ``scale=NAME`` on the command line."""

_MODEL_SHAPE = ("n_layer", "d_model", "n_head", "d_ff", "vocab_size", "max_seq_len")


def _scaled(v, f: float, minimum: int = 1) -> int:
    return max(minimum, int(round(float(v) * f)))


def _steps_key(d: dict, key: str, f: float) -> None:
    """Scale d[key] when it is a step count (an int >= 1); fractions of the run (< 1) stay."""
    v = d.get(key)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 1:
        d[key] = _scaled(v, f)


def apply_scale(spec: dict, name: str) -> dict:
    """The study dict at scale ``name`` (a new dict; ``spec`` is not changed)."""
    if name not in SCALES:
        raise unknown_name("scale", name, SCALES)
    sc = SCALES[name]
    out = copy.deepcopy(spec)
    out["scale"] = name
    run = out.setdefault("run", {})
    f = sc.step_factor
    if sc.preset:
        model = {k: v for k, v in (run.get("model") or {}).items() if k not in _MODEL_SHAPE}
        run["model"] = {**model, "preset": sc.preset}
        if sc.seq_len:
            run["model"]["max_seq_len"] = max(2048 if sc.preset.startswith("pythia") else 512, sc.seq_len)
    train = run.setdefault("train", {})
    if f != 1.0:
        for k in ("steps", "eval_every", "checkpoint_every", "log_every"):
            _steps_key(train, k, f)
        if train.get("checkpoint_tokens"):
            train["checkpoint_tokens"] = [_scaled(t, f) for t in train["checkpoint_tokens"]]
        sched = run.get("schedule") or {}
        for k in ("warmup", "decay"):
            _steps_key(sched, k, f)
        if isinstance(sched.get("decay_start"), int) and sched["decay_start"] > 0:
            sched["decay_start"] = _scaled(sched["decay_start"], f)
        averaging = run.get("averaging") or {}
        for k in ("lawa_every",):
            _steps_key(averaging, k, f)
        mon = run.get("monitor") or {}
        for k in ("every", "warning_every"):
            _steps_key(mon, k, f)
        cd = out.get("cooldowns") or {}
        if cd.get("from_steps"):
            cd["from_steps"] = [_scaled(s, f) for s in cd["from_steps"]]
        for k in ("decay_steps", "end_step"):
            _steps_key(cd, k, f)
        av = out.get("averaging") or {}
        _steps_key(av, "at_step", f)
        _steps_key(av, "reference_from_step", f)
        if av.get("lawa"):
            av["lawa"] = [{**x, "every": _scaled(x.get("every", 1), f)} if isinstance(x, dict) else x
                          for x in av["lawa"]]
    if sc.batch_size:
        train["batch_size"] = sc.batch_size
    if sc.seq_len:
        train["seq_len"] = sc.seq_len
    if sc.eval_windows:
        train["eval_windows"] = sc.eval_windows
    if sc.dtype:
        train["dtype"] = sc.dtype
    if sc.data:
        run["data"] = {**(run.get("data") or {}), **sc.data}
    sweep = out.setdefault("sweep", {})
    sdata = sweep.setdefault("data", {})
    if sc.seq_len:
        sdata["calib_seq_len"] = sc.seq_len
        sdata["eval_seq_len"] = sc.seq_len
    if sc.eval_windows:
        sdata["eval_windows"] = sc.eval_windows
    if sc.calib_samples:
        sdata["calib_samples"] = sc.calib_samples
    return out


def _suffixed(path: str, name: str) -> str:
    return f"{path.rstrip('/')}-{name}"


def apart_paths(spec: dict, name: str) -> dict:
    """``spec`` (a new dict) with its outputs apart for scale ``name``: run.out_dir, sweep.store and report, each
    where the spec gives it, and ship.out where the spec ships, get ``-<name>``; a store inside run.out_dir moves
    with it (runs/x/results -> runs/x-<name>/results)."""
    out = copy.deepcopy(spec)
    run = out.get("run") or {}
    old_dir = str(run["out_dir"]).rstrip("/") if run.get("out_dir") else ""
    if old_dir:
        run["out_dir"] = _suffixed(old_dir, name)
    sweep = out.get("sweep") or {}
    store = str(sweep.get("store") or "")
    if store:
        inside = old_dir and (store + "/").startswith(old_dir + "/")
        sweep["store"] = run["out_dir"] + store[len(old_dir):] if inside else _suffixed(store, name)
    if out.get("report"):
        out["report"] = _suffixed(str(out["report"]), name)
    ship = out.get("ship") or {}
    if ship.get("budget"):
        ship["out"] = _suffixed(str(ship.get("out") or "ship"), name)
    return out
