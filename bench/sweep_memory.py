"""Peak memory and wall time of sweeping one checkpoint, streamed engine vs the in-memory path, and the
engine at real size (Llama-2-7B, OLMo-2-32B shapes).

    .venv/bin/python bench/sweep_memory.py [--quick] [--sizes 14m,70m,160m,410m,1b] [--counts 1,3,5,8]
                                           [--device cpu|cuda] [--workdir DIR]
    .venv/bin/python bench/sweep_memory.py --sizes '' --counts '' --big --workdir /tmp/qd-big   # issue 30

Every case runs in a fresh child process and reports its peak resident memory (VmHWM of the child, which
includes the interpreter, its imports and the tokenized data), exact per phase (the high-water mark is
read and reset through /proc/self/clear_refs at the start, after hashing the checkpoint, after each
block and after the head), its wall time, seconds per engine phase (``Measurement.phase_seconds``) and
the load average at its start and end (wall times taken on a busy machine are inflated; memory is not):

* ``engine``    — what ``quantdyn sweep`` runs now: ``quantdyn.engine.measure.measure`` over the checkpoint,
                  read lazily one decoder block at a time, all quantizers in one pass sharing the FP forward;
* ``in-memory`` — the reference, measured in the same run: the path sweeps took before the engine
                  (the whole model loaded in float32, its FP window CE, then per group of up to 8
                  quantizers one deep copy each, ``quantize_model`` on each, ``compare_many``).

Scans: model size (Pythia shapes with random weights written here, fp32 safetensors as quantdyn
saves them; 1b = pythia-1b's shape) with 5 quantizers (gptq3, gptq4, rtn2, rtn3, rtn4), and the
number of quantizers (1, 3, 5, 8) at one size; calibration 32 x 128 tokens and 200 x 128 evaluation
windows of builtin:kjv (gpt2 tokenizer, ids folded into smaller vocabularies), quantize_threads 1, as the
sweep's defaults; ``--quick`` uses 14m/70m, 1/3 quantizers, 50 windows.

Real size (issue 30; engine only: the in-memory path would need 27 GB at 7B). Checkpoints with random bf16
weights are written tensor by tensor (never a model in memory), measured, and deleted (``--keep`` keeps
them); 8 calibration and 8 evaluation windows of 128 tokens, 4 per forward (``--big-*``):

* ``--layouts 1,3,7,15`` — the same Llama-2-7B-shape weights (13.5 GB) as 1, 3, 7 and 15 safetensors
  shards, swept with ``--layout-quantizers`` (rtn4,rtn3): the peak must not depend on the layout;
  ``--layout-calib no|yes|both``: without calibration passes (default), with them, or both;
* ``--gptq7b``   — the 7B shape swept with ``--gptq-quantizers`` (gptq4,gptq3,rtn4);
* ``--block32b`` — one OLMo-2-32B-shape block (hidden 5120, MLP 27,648, 40/8 heads, vocab 100,352) alone,
  same quantizers: the per-block figure of the 32B model;
* ``--dtype-block`` — one 7B-shape block computed in bf16 and in float32, natively and with oneDNN limited
  to AVX-512 without its bf16 instructions (``ONEDNN_MAX_CPU_ISA=AVX512_CORE``: a CPU without native bf16).

``--blocks N`` measures only the first N decoder blocks of the written 7B checkpoint (``--layouts``,
``--gptq7b``): its real shard files through a view whose config says N blocks, since the peak is per block and
a whole 7B sweep takes hours on 2 cores. ``--big`` runs all four. ``--llama7b`` (gpu_check's step; ``--llama-shape tiny`` for its CPU dry run) sweeps the
7B shape in 7 shards with rtn4 (and rtn3), no calibration passes, and reports the peak GPU memory on cuda. Results are printed as tables and written to
bench/results/sweep_memory-<machine>-<date>-<cases>.json (with the machine and the date).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record, results_path, write_results

SIZES = {"14m": "pythia-14m", "70m": "pythia-70m", "160m": "pythia-160m", "410m": "pythia-410m", "1b": "pythia-1b"}
PYTHIA_1B = {"n_layer": 16, "d_model": 2048, "n_head": 8, "max_seq_len": 2048, "vocab_size": 50304}
QUANTIZERS = ["gptq3", "gptq4", "rtn2", "rtn3", "rtn4", "gptq2", "awq4", "rtn8"]


# ----------------------------------------------------------------------------- checkpoints
def model_config(size: str):
    """The ModelConfig of a Pythia size of SIZES (1b: pythia-1b's shape)."""
    from quantdyn.models.gpt import ModelConfig

    return ModelConfig(**PYTHIA_1B) if size == "1b" else ModelConfig(preset=SIZES[size])


def write_pythia(size: str, out: Path) -> Path:
    """A Pythia-shaped checkpoint with random weights (fp32 safetensors, as quantdyn saves them)."""
    from quantdyn.models.gpt import GPT, resolve_model_config
    from quantdyn.models.hf_io import save_hf

    if (out / "model.safetensors").is_file():
        return out
    torch.manual_seed(0)
    save_hf(GPT(resolve_model_config(model_config(size))), out)
    return out


BIG_SHAPES = {  # HF configs of the real-size shapes (random bf16 weights; only the shapes matter)
    "llama2-7b": dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, vocab_size=32000),
    "olmo2-32b": dict(model_type="olmo2", hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                      num_attention_heads=40, num_key_value_heads=8, vocab_size=100352),
    # the same code path as llama2-7b in seconds (gpu_check's CPU dry run)
    "llama2-tiny": dict(model_type="llama", hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, vocab_size=512),
}
LLAMA7B_SHAPES = {"7b": ("llama2-7b", 7), "tiny": ("llama2-tiny", 1)}
"""--llama-shape -> (BIG_SHAPES shape, shards) of the --llama7b cases (7 shards of <= 2 GB, as before issue 30)."""


def big_tensor_shapes(shape: str, layers: int | None = None) -> tuple[dict, list[tuple[str, tuple[int, ...]]]]:
    """(config.json dict, [(tensor name, shape)] in the model's parameter order) of a BIG_SHAPES shape with
    ``layers`` decoder blocks (default: the real count); the model is built on the meta device only."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantdyn.engine.lazy_model import params_on_meta

    d = dict(BIG_SHAPES[shape], max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
             torch_dtype="bfloat16")
    if layers is not None:
        d["num_hidden_layers"] = layers
    cfg = AutoConfig.for_model(**d)
    with params_on_meta():
        skel = AutoModelForCausalLM.from_config(cfg)
    return cfg.to_dict(), [(n, tuple(p.shape)) for n, p in skel.named_parameters()]


def _split_shards(tensors: list[tuple[str, tuple[int, ...]]], shards: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Cut the tensor list, in order, into ``shards`` non-empty runs of about equal bytes (at tensor boundaries;
    a tensor larger than a share gets a shard of its own)."""
    n = len(tensors)
    if n < shards:
        raise SystemExit(f"cannot cut {n} tensors into {shards} shards")
    sizes = [2 * math.prod(s) for _, s in tensors]
    total, out, acc, k = sum(sizes), [[] for _ in range(shards)], 0, -1
    for i, (t, size) in enumerate(zip(tensors, sizes)):
        k = min(max(acc * shards // total, k, shards - (n - i)), k + 1)
        out[k].append(t)
        acc += size
    return out


def _write_safetensors_streamed(path: Path, tensors: list[tuple[str, tuple[int, ...]]], g: torch.Generator) -> None:
    """A bf16 safetensors file written tensor by tensor (header first, then the data in header order), so the
    writer holds one slice of one tensor, not the shard (safetensors' save_file needs the whole shard in RAM).
    The random numbers are drawn on ``g``'s device (cuda: seconds instead of minutes for 6.7 B values)."""
    header, off = {}, 0
    for name, shape in tensors:
        n = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
    tmp = path.with_name(path.name + ".part")
    with tmp.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape in tensors:
            if len(shape) == 1:
                f.write(torch.ones(shape, dtype=torch.bfloat16).view(torch.int16).numpy().tobytes())
                continue
            rows = max(1, (64 * 2**20) // (4 * shape[1]))  # 64 MiB of float32 at a time
            for a in range(0, shape[0], rows):
                part = torch.randn((min(rows, shape[0] - a), shape[1]), generator=g, device=g.device) * 0.02
                f.write(part.to(torch.bfloat16).cpu().view(torch.int16).numpy().tobytes())
    tmp.rename(path)


def write_big(out: Path, shape: str = "llama2-7b", shards: int = 3, layers: int | None = None,
              gen_device: str = "cpu") -> Path:
    """A BIG_SHAPES checkpoint with random bf16 weights in ``shards`` safetensors files of about equal size
    (1 = a single ``model.safetensors``, else ``model-0000k-of-0000n.safetensors`` with the index), written
    tensor by tensor (the writer's memory is one 64 MiB slice). The same seed gives the same weights whatever
    the layout (``gen_device`` cuda draws another stream: other values, the same shapes). Reused when ``out``
    already holds a complete one (``.complete`` is written last)."""
    if (out / ".complete").is_file():
        return out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cfg, tensors = big_tensor_shapes(shape, layers)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    g = torch.Generator(device=gen_device).manual_seed(0)
    if shards == 1:
        _write_safetensors_streamed(out / "model.safetensors", tensors, g)
    else:
        weight_map = {}
        for k, part in enumerate(_split_shards(tensors, shards), 1):
            name = f"model-{k:05d}-of-{shards:05d}.safetensors"
            _write_safetensors_streamed(out / name, part, g)
            weight_map.update({t: name for t, _ in part})
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / ".complete").write_text("")
    return out


def first_blocks(ck: Path, blocks: int) -> Path:
    """A view of checkpoint ``ck`` holding only its first ``blocks`` decoder blocks: a directory beside it whose
    config.json says ``num_hidden_layers = blocks`` and whose shard files (and index) are links to ``ck``'s. The
    engine then reads the real files of the real layout (the later blocks' tensors are never read) and runs the
    embedding, those blocks, the final norm and the head: the per-block peak of the whole model, in less time.
    0 (or all of them): ``ck`` itself."""
    cfg = json.loads((ck / "config.json").read_text())
    if not blocks or blocks >= cfg["num_hidden_layers"]:
        return ck
    view = ck.with_name(f"{ck.name}-first{blocks}-{os.getpid()}")  # its own: other runs may read the same ck
    shutil.rmtree(view, ignore_errors=True)
    view.mkdir()
    for f in ck.iterdir():
        if f.suffix == ".safetensors" or f.name.endswith(".index.json"):
            (view / f.name).symlink_to(f.resolve())
    (view / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": blocks}, indent=2))
    return view


# ----------------------------------------------------------------------------- the measured child
def _status_bytes(*keys: str) -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in keys:
            out[k] = int(v.split()[0]) * 1024
    return out


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages (how busy the machine was while a time was taken)."""
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


class PhasePeaks:
    """Peak resident memory per phase of the child: at each mark, VmHWM (the high-water mark since the last
    mark) is recorded and reset through /proc/self/clear_refs ("5" resets the peak RSS, Linux >= 4.0), so the
    peak of every phase is exact and the process's peak is their maximum. ``samples_ms`` > 0 also samples VmRSS
    in a thread (to see the shape inside a phase)."""

    def __init__(self, samples_ms: int = 0):
        self.t0 = time.perf_counter()
        self.phases: list[dict] = []
        self.samples: list[tuple[float, int]] = []
        self._resettable = True
        self._stop = None
        if samples_ms > 0:
            import threading

            self._stop = threading.Event()

            def sample():
                while not self._stop.wait(samples_ms / 1000):
                    self.samples.append((round(time.perf_counter() - self.t0, 2), _status_bytes("VmRSS")["VmRSS"]))
            threading.Thread(target=sample, daemon=True).start()

    def mark(self, phase: str) -> None:
        st = _status_bytes("VmHWM", "VmRSS")
        self.phases.append({"phase": phase, "t": round(time.perf_counter() - self.t0, 2), "hwm": st["VmHWM"],
                            "rss_after": st["VmRSS"]})
        print(f"[{self.phases[-1]['t']:8.1f}s] {phase}: peak {st['VmHWM'] / 2**30:.2f} GiB, now "
              f"{st['VmRSS'] / 2**30:.2f} GiB", file=sys.stderr, flush=True)
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self._resettable = False  # the peaks are then cumulative (still an exact overall peak)

    def close(self) -> dict:
        if self._stop is not None:
            self._stop.set()
        return {"peak_rss_bytes": max(p["hwm"] for p in self.phases), "phases": self.phases,
                "per_phase": self._resettable, "rss_samples": self.samples}


def forward_child(a) -> None:
    """Best-of-N wall time of the whole model's forward (every block and the head) on one batch of windows, in
    the compute dtype asked, at 1 and at 2 threads: the part of a sweep that the compute dtype changes. The
    minimum over repeats is what the code costs when it gets a core; on a shared machine the mean is not."""
    from quantdyn.engine.blockwise import run_model
    from quantdyn.engine.lazy_model import LazyModel, compute_dtype_of
    from quantdyn.models.weights import CheckpointWeights

    source = LazyModel(CheckpointWeights(a.ckpt), compute_dtype_of(a.dtype), "cpu")
    for name, m in source.model.named_children():
        source.load(m, torch.device("cpu"))
    vocab = source.weights.config["vocab_size"]
    ids = torch.randint(0, vocab, (a.batch, 128), generator=torch.Generator().manual_seed(0))
    out = {"dtype": str(source.dtype)[6:], "batch": a.batch, "tokens": a.batch * 128, "loadavg_start": loadavg()}
    with torch.no_grad():
        for threads in (1, 2):
            torch.set_num_threads(threads)
            run_model(source.model, ids)  # warm-up (oneDNN primitive creation)
            times = []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                run_model(source.model, ids)
                times.append(time.perf_counter() - t0)
            out[f"threads{threads}"] = {"min": min(times), "median": sorted(times)[len(times) // 2], "all": times}
    out["loadavg_end"] = loadavg()
    print("RESULT " + json.dumps(out))


def child(a) -> None:
    if a.child == "forward":
        return forward_child(a)
    trace = PhasePeaks(a.sample_ms)
    load0 = loadavg()
    from quantdyn.data.prepare import DataConfig, prepare_data

    data = prepare_data(DataConfig(source="builtin:kjv", tokenizer="gpt2"), progress=False)
    calib = data.calib_windows(a.calib, 128, 0)
    ev = data.eval_windows(128, a.windows)
    vocab = json.loads((Path(a.ckpt) / "config.json").read_text()).get("vocab_size")
    if vocab and max(int(calib.max()), int(ev.max())) >= vocab:
        # the Llama-2 shape has 32,000 tokens, gpt2's ids go to 50,256: fold them into the model's vocabulary
        # (random weights: the text does not matter, only the shapes and the token count)
        calib, ev = calib % vocab, ev % vocab
    qs = {q: q for q in a.quantizers.split(",") if q}
    dev = torch.device(a.device)
    trace.mark("start")
    t0 = time.perf_counter()
    extra: dict = {}
    if a.child == "engine":
        from quantdyn.engine.measure import MeasureConfig, measure
        from quantdyn.models.hf_io import checkpoint_hash

        checkpoint_hash(a.ckpt)  # a sweep hashes the weights for its row keys
        trace.mark("hash")
        cfg = MeasureConfig(layer_diagnostics=not a.no_calib, streams=a.streams, dtype=a.dtype,
                            batch_size=a.batch, calib_batch_size=min(a.batch, 8))
        import inspect

        per_block = "on_block" if "on_block" in inspect.signature(measure).parameters else "progress"  # older engines
        m = measure(a.ckpt, qs, ev, None if a.no_calib else calib, device=dev, cfg=cfg,
                    **{per_block: lambda line: trace.mark(line.split(" (")[0])})
        trace.mark("head")
        dce = {k: v["delta_ce"] for k, v in m.metrics.items()}
        extra = {"streams": m.streams, "dtype": m.dtype, "ce_fp": m.ce_fp,
                 "phase_seconds": getattr(m, "phase_seconds", {}),  # {}: an engine from before issue 30
                 "quantize_seconds": {k: v.seconds for k, v in m.quantizations.items()}}
    else:
        import copy

        from quantdyn.engine.walk import num_threads, quantize_model
        from quantdyn.evaluate.loss import window_losses
        from quantdyn.evaluate.quant_error import compare_many
        from quantdyn.models.hf_io import checkpoint_hash, load_causal_lm

        checkpoint_hash(a.ckpt)
        model = load_causal_lm(a.ckpt, device=dev)
        fp = window_losses(model, ev, 16)
        dce, labels = {}, list(qs)
        for g in range(0, len(labels), 8):
            qmodels = {}
            for label in labels[g : g + 8]:
                qmodels[label] = copy.deepcopy(model)
                with num_threads(1 if dev.type == "cpu" else torch.get_num_threads()):
                    quantize_model(qmodels[label], calib, label, device=dev, progress=False)
            for k, v in compare_many(model, qmodels, ev, fp_window_ce=fp, batch_size=16).items():
                dce[k] = v["delta_ce"]
            del qmodels
        trace.mark("in-memory")
    out = {"seconds": time.perf_counter() - t0, "delta_ce": dce, "loadavg_start": load0, "loadavg_end": loadavg(),
           **extra, **trace.close()}
    if dev.type == "cuda":
        out["gpu_peak_bytes"] = torch.cuda.max_memory_allocated(dev)
    print("RESULT " + json.dumps(out))


def run_case(path: str, mode: str, quantizers: list[str], a, no_calib: bool = False, dtype: str = "auto",
             env: dict | None = None) -> dict:
    """One measured child (``--child``) on ``path``; its peak memory per phase and timings."""
    cmd = [sys.executable, __file__, "--child", mode, "--ckpt", path, "--quantizers", ",".join(quantizers),
           "--windows", str(a.windows), "--calib", str(a.calib), "--device", a.device, "--streams", a.streams,
           "--batch", str(a.batch), "--dtype", dtype, "--sample-ms", str(a.sample_ms), "--repeats", str(a.repeats)]
    if no_calib:
        cmd.append("--no-calib")
    t0 = time.perf_counter()
    # the child's log (its phases as they end) is kept beside the checkpoints: `tail -f` it to follow a long case
    log = Path(a.workdir or tempfile.gettempdir()) / f"child-{Path(path).name}-{mode}-{os.getpid()}-{int(t0)}.log"
    with tempfile.TemporaryFile("w+") as out, log.open("w+") as err:  # files: pipes could fill up
        print(f"  (child log: {log})", flush=True)
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env={**os.environ, **(env or {})})
        status = proc.wait()
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    wall = time.perf_counter() - t0
    if status != 0:
        raise SystemExit(f"child {mode} on {path} failed:\n{stderr[-3000:]}")
    res = json.loads(next(line[7:] for line in stdout.splitlines() if line.startswith("RESULT ")))
    return {"mode": mode, "process_wall": wall, "env": env or {}, **res}


def file_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


# ----------------------------------------------------------------------------- the real-size cases (issue 30)
NO_BF16_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}
"""oneDNN (torch's bf16 matmul on x86) limited to AVX-512 without the bf16 instructions: how a CPU without native
bf16 units (Skylake/Cascade Lake, Zen 3) computes in bf16; float32 matmuls go through MKL and are unaffected."""


def phase_summary(e: dict) -> dict:
    """Peaks of the engine child's phases: process start, checkpoint hash, the largest block (and which), the
    head; with the wall time and load averages."""
    phases = {p["phase"]: p["hwm"] for p in e["phases"]}
    blocks = {k: v for k, v in phases.items() if k.startswith("block ")}
    worst = max(blocks, key=blocks.get) if blocks else None
    return {"peak": e["peak_rss_bytes"], "start": phases.get("start"), "hash": phases.get("hash"),
            "block_peak": blocks.get(worst), "block_peak_at": worst,
            "block_peaks": [blocks[k] for k in sorted(blocks, key=lambda k: int(k.split()[1].split("/")[0]))],
            "head": phases.get("head"), "seconds": e["seconds"], "loadavg": [e["loadavg_start"], e["loadavg_end"]]}


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}G"


def phase_times(e: dict) -> str:
    t = e.get("phase_seconds", {})
    return " ".join(f"{k}={v:.0f}" for k, v in t.items() if v >= 0.5)


def big_cases(a, work: Path, out: dict, save) -> None:
    """Issue 30: the Llama-2-7B shape written in several shard layouts, GPTQ at 7B, one OLMo-2-32B block alone,
    and fp32 vs bf16 compute on one 7B block. Each checkpoint is written here (random bf16 weights, the same
    values whatever the layout), measured by one engine child and deleted unless --keep; ``save()`` after each case
    keeps what was measured if a later case fails or is stopped."""
    b = argparse.Namespace(**vars(a))
    b.windows, b.calib, b.batch = a.big_windows, a.big_calib, a.big_batch
    out.update(windows=b.windows, calib=b.calib, batch=b.batch, blocks=a.blocks or "all")

    def measured(ck: Path, quantizers: str, **kw) -> dict:  # the engine child on the first --blocks blocks of ck
        view = first_blocks(ck, a.blocks)
        try:
            return {**run_case(str(view), "engine", quantizers.split(","), b, **kw), "blocks": a.blocks or "all"}
        finally:
            if view != ck:
                shutil.rmtree(view, ignore_errors=True)

    print(f"\n{'case':<34}{'file':>8}{'peak':>8}{'x file':>7}{'block':>8}{'head':>8}{'engine s':>10}  load  phases (s)")

    def show(label: str, fb: int, e: dict) -> dict:
        label += f" ({e['blocks']} blk)" if isinstance(e.get("blocks"), int) else ""
        save()
        ps = phase_summary(e)
        print(f"{label:<34}{gib(fb):>8}{gib(ps['peak']):>8}{ps['peak'] / fb:>7.2f}{gib(ps['block_peak']):>8}"
              f"{gib(ps['head']):>8}{e['seconds']:>10.0f}  {e['loadavg_start'][0]:.1f}  {phase_times(e)}", flush=True)
        return {"case": label, "file_bytes": fb, "summary": ps, "engine": e}

    def done_with(ck: Path) -> None:
        if not a.keep:
            shutil.rmtree(ck, ignore_errors=True)

    def add(key: str, record: dict) -> None:
        out.setdefault(key, []).append(record)
        save()

    layouts = [int(x) for x in a.layouts.split(",") if x]
    ck = None
    for n in layouts:
        ck = write_big(work / f"llama2-7b-{n}shards", "llama2-7b", n)
        for calib in {"yes": (True,), "no": (False,), "both": (True, False)}[a.layout_calib]:
            e = measured(ck, a.layout_quantizers, no_calib=not calib)
            add("layouts", {"shards": n, "calibrated": calib,
                            **show(f"7b {n} shards {a.layout_quantizers}" + ("" if calib else " no calib"),
                                   file_bytes(ck), e)})
        if n != layouts[-1] or not a.gptq7b:
            done_with(ck)
    if a.gptq7b:
        ck = ck if layouts else write_big(work / "llama2-7b-3shards", "llama2-7b", 3)
        e = measured(ck, a.gptq_quantizers)
        out["gptq7b"] = {"shards": len(list(ck.glob("*.safetensors"))),
                         **show(f"7b {a.gptq_quantizers}", file_bytes(ck), e)}
        save()
        done_with(ck)
    if a.block32b:
        ck = write_big(work / "olmo2-32b-1block", "olmo2-32b", 1, layers=1)
        e = run_case(str(ck), "engine", a.gptq_quantizers.split(","), b)
        # the whole 64-layer checkpoint's bytes, from the same shapes (for the ratio: not written)
        _, tensors = big_tensor_shapes("olmo2-32b")
        full = sum(2 * math.prod(s) for _, s in tensors)
        out["block32b"] = {"checkpoint_bytes_64_layers": full, **show(f"32b 1 block {a.gptq_quantizers}",
                                                                      file_bytes(ck), e)}
        save()
        done_with(ck)
    if a.dtype_block:
        ck = write_big(work / "llama2-7b-1block", "llama2-7b", 1, layers=1)
        # the compute dtype changes the forwards (and the bf16 -> fp32 conversion), not the quantizers, which
        # work in float32 either way: RTN without calibration isolates them (every phase is still timed)
        for isa, env in (("native", None), ("no native bf16", NO_BF16_ENV)):
            for dtype in ("bfloat16", "float32"):
                e = run_case(str(ck), "engine", a.dtype_quantizers.split(","), b, no_calib=True, dtype=dtype, env=env)
                add("dtype_block", {"dtype": dtype, "isa": isa,
                                    **show(f"7b 1 block {dtype} ({isa})", file_bytes(ck), e)})
        print(f"\n{'forward, 7b 1 block + head, 4 x 128 tokens':<46}{'1 thread (best, median)':>26}"
              f"{'2 threads (best, median)':>26}  load")
        for isa, env in (("native", None), ("no native bf16", NO_BF16_ENV)):
            for dtype in ("bfloat16", "float32"):
                f = run_case(str(ck), "forward", [], b, dtype=dtype, env=env)
                add("dtype_forward", {"dtype": dtype, "isa": isa, **f})
                print(f"{dtype + ' (' + isa + ')':<46}" + "".join(
                    f"{f[k]['min']:>14.2f} s {f[k]['median']:>7.2f} s  " for k in ("threads1", "threads2"))
                      + f"{f['loadavg_start'][0]:.1f}", flush=True)
        done_with(ck)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", default="14m,70m,160m,410m")
    ap.add_argument("--counts", default="1,3,5,8")
    ap.add_argument("--count-size", default="160m", help="model size of the quantizer-count scan")
    ap.add_argument("--no-reference", action="store_true", help="skip the in-memory reference path")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workdir", default="", help="where checkpoints are written (default: a new temporary dir)")
    ap.add_argument("--windows", type=int, default=200)
    ap.add_argument("--calib", type=int, default=32)
    ap.add_argument("--out", default="", help="results JSON (default bench/results/sweep_memory-<machine>-<date>"
                                             "-<cases>.json)")
    big = ap.add_argument_group("real-size cases (issue 30): Llama-2-7B / OLMo-2-32B shapes, bf16, random weights")
    big.add_argument("--big", action="store_true", help="all of them: --layouts 1,3,7,15 --gptq7b --block32b "
                                                       "--dtype-block")
    big.add_argument("--layouts", default="", help="7B written in these shard counts, e.g. 1,3,7,15")
    big.add_argument("--layout-quantizers", default="rtn4,rtn3")
    big.add_argument("--layout-calib", default="no", choices=("yes", "no", "both"),
                     help="calibration passes in the layout cases (no: as the earlier 7B row; GPTQ runs calibrate)")
    big.add_argument("--gptq7b", action="store_true", help="7B swept with --gptq-quantizers")
    big.add_argument("--block32b", action="store_true", help="one OLMo-2-32B block alone, --gptq-quantizers")
    big.add_argument("--gptq-quantizers", default="gptq4,gptq3,rtn4")
    big.add_argument("--dtype-block", action="store_true", help="one 7B block in bf16 and in fp32, with and "
                                                               "without the CPU's native bf16 (oneDNN ISA)")
    big.add_argument("--dtype-quantizers", default="rtn4", help="without calibration (the forwards are timed)")
    big.add_argument("--big-windows", type=int, default=8, help="evaluation windows of 128 tokens")
    big.add_argument("--big-calib", type=int, default=8, help="calibration windows of 128 tokens")
    big.add_argument("--big-batch", type=int, default=4, help="windows per forward")
    big.add_argument("--blocks", type=int, default=0, help="--layouts/--gptq7b: measure only the first N decoder "
                     "blocks of the written 7B checkpoint (its real files and layout; the peak is per block)")
    big.add_argument("--keep", action="store_true", help="keep the written checkpoints (13.5 GB each at 7B)")
    ap.add_argument("--llama7b", action="store_true", help="the 7B case of gpu_check: 7 shards, no calibration "
                    "passes, --llama-counts quantizers, --windows (at most 8) evaluation windows")
    ap.add_argument("--llama-counts", default="1,2", help="--llama7b cases: 1 = rtn4, 2 = rtn4,rtn3")
    ap.add_argument("--llama-shape", default="7b", choices=sorted(LLAMA7B_SHAPES),
                    help="--llama7b: the shape (tiny: the same code path in seconds, for the CPU dry run)")
    ap.add_argument("--child", default="")
    ap.add_argument("--ckpt", default="")
    ap.add_argument("--quantizers", default="")
    ap.add_argument("--no-calib", action="store_true")
    ap.add_argument("--batch", type=int, default=16, help="evaluation windows per forward (calibration: up to 8)")
    ap.add_argument("--dtype", default="auto", help="MeasureConfig.dtype of the engine child")
    ap.add_argument("--sample-ms", type=int, default=0, help="also sample VmRSS every N ms (0 = per phase only)")
    ap.add_argument("--repeats", type=int, default=7, help="forward child: timed repeats (best of)")
    ap.add_argument("--streams", default="auto", choices=("auto", "memory", "disk"),
                    help="where the engine keeps activation streams (MeasureConfig.streams)")
    a = ap.parse_args()
    if a.child:
        return child(a)
    if a.quick:
        a.sizes, a.counts, a.count_size, a.windows = "14m,70m", "1,3", "14m", 50
    if a.big:
        a.layouts, a.gptq7b, a.block32b, a.dtype_block = a.layouts or "1,3,7,15", True, True, True
    work = Path(a.workdir or tempfile.mkdtemp(prefix="qd-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    counts = [int(c) for c in a.counts.split(",") if c]
    cases = "_".join([f"s{s}" for s in a.sizes.split(",") if s] + [f"n{a.count_size}x{c}" for c in counts]
                     + ([f"layouts{a.layouts.replace(',', '-')}"] if a.layouts else [])
                     + [k.replace("_", "") for k in ("gptq7b", "block32b", "dtype_block") if getattr(a, k)]
                     + ([f"llama{a.llama_shape}"] if a.llama7b else []))
    out = Path(a.out) if a.out else results_path(name="sweep_memory", suffix=cases)  # rewritten after each case
    print(f"results: {out}", flush=True)
    results = {"device": a.device, "windows": a.windows, "calib": a.calib, "sizes": [], "counts": [], "big": {}}
    if a.sizes or a.counts:
        print(f"{'case':<22}{'file':>10}{'engine RSS':>12}{'x file':>8}{'in-mem RSS':>12}{'x file':>8}"
              f"{'engine s':>10}{'in-mem s':>10}{'time ratio':>11}")

    def row(label, ck, quantizers):
        ck = Path(ck)
        fb = file_bytes(ck)
        e = run_case(str(ck), "engine", quantizers, a)
        r = None if a.no_reference else run_case(str(ck), "in-memory", quantizers, a)
        same = r is None or all(abs(e["delta_ce"][k] - r["delta_ce"][k]) <= 1e-6 * max(1, abs(r["delta_ce"][k]))
                                for k in r["delta_ce"])
        print(f"{label:<22}{fb / 2**30:>9.2f}G{e['peak_rss_bytes'] / 2**30:>11.2f}G{e['peak_rss_bytes'] / fb:>8.2f}"
              + (f"{r['peak_rss_bytes'] / 2**30:>11.2f}G{r['peak_rss_bytes'] / fb:>8.2f}" if r else f"{'-':>12}{'-':>8}")
              + f"{e['seconds']:>10.1f}" + (f"{r['seconds']:>10.1f}{e['seconds'] / r['seconds']:>11.2f}" if r else "")
              + ("" if same else "  (Δ CE differs!)"), flush=True)
        return {"case": label, "file_bytes": fb, "quantizers": quantizers, "engine": e, "in_memory": r,
                "same_delta_ce": same}

    for size in [s for s in a.sizes.split(",") if s]:
        ck = write_pythia(size, work / f"pythia-{size}")
        results["sizes"].append(row(f"pythia-{size} x5", ck, QUANTIZERS[:5]))
    ck = write_pythia(a.count_size, work / f"pythia-{a.count_size}") if counts else None
    for n in counts:
        results["counts"].append(row(f"pythia-{a.count_size} x{n}", ck, QUANTIZERS[:n]))
    if a.llama7b:
        shape, shards = LLAMA7B_SHAPES[a.llama_shape]
        ck = write_big(work / f"llama2-{a.llama_shape}-shape", shape, shards,
                       gen_device="cuda" if a.device.startswith("cuda") else "cpu")
        fb = file_bytes(ck)
        keep = a.no_reference
        a.no_reference, a.windows = True, min(a.windows, 8)
        llama_cases = {1: ["rtn4"], 2: ["rtn4", "rtn3"]}
        for n, qs in ((int(c), llama_cases[int(c)]) for c in a.llama_counts.split(",") if c):
            e = run_case(str(ck), "engine", qs, a, no_calib=True)
            label = f"llama2-{a.llama_shape}-shape bf16 x{n}"
            print(f"{label:<22}{fb / 2**30:>9.2f}G{e['peak_rss_bytes'] / 2**30:>11.2f}G"
                  f"{e['peak_rss_bytes'] / fb:>8.2f}{'-':>12}{'-':>8}{e['seconds']:>10.1f}"
                  + (f"   peak GPU memory {e['gpu_peak_bytes'] / 2**30:.2f} GiB" if e.get("gpu_peak_bytes") else ""),
                  flush=True)
            results.setdefault("llama7b_runs", []).append({"file_bytes": fb, "quantizers": qs, "engine": e,
                                                           "windows": a.windows})
        a.no_reference = keep
    if a.layouts or a.gptq7b or a.block32b or a.dtype_block:
        big_cases(a, work, results["big"], lambda: write_results("sweep_memory", results, out))
    print(f"wrote {write_results('sweep_memory', results, out)}")
    record("sweep_memory", results, a)  # the same figures in a `make bench` / gpu_check run's file


if __name__ == "__main__":
    main()
