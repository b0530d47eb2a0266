"""The pipeline race: paper A's pipeline (GPTQModel: quantize -> save -> reload -> evaluate, once per quantizer)
against `quantdyn sweep` measuring the same quantizers in one streamed pass over the checkpoint.

    make race                    # the crosscheck venv (.cache/venv-crosscheck: GPTQModel pins numpy), this CPU
    GPTQMODEL_CPU_WORKERS=2 .cache/venv-crosscheck/bin/python bench/crosscheck_race.py [--sizes 70m,160m]
                                                                                        [--bits 4,3,2] [--quick]
    # on the GPU machine (set-up line with both bundles, `tools/gpu_bundle.py setup-line --race`; BENCHMARKS.md):
    python3 bench/crosscheck_race.py --device cuda --budget-s 500

Per model size (Pythia block shapes: 70m = 6 x 512, 160m = 12 x 768; a 4096-token BPE vocabulary on KJV so that
a CPU can train the model briefly, which gives the weights the structure that makes Δ CE mean something):

1. set-up, not timed: the model trained --train-steps steps with quantdyn's trainer (cached under .cache/race),
   saved as a plain HF checkpoint with its tokenizer; the token shards that both pipelines read prepared once;
2. GPTQModel, in a fresh process, as a paper-A-style script does it: the FP checkpoint's CE, then per quantizer
   GPTQModel.load -> quantize (calibration ids) -> save -> transformers.from_pretrained of the saved GPTQ
   checkpoint (GPTQModel's kernels) -> CE on the evaluation windows (bench/crosscheck_gptqmodel.py's
   gptqmodel_quantize and ce);
3. quantdyn, in a fresh process: `python -m quantdyn.cli sweep SPEC` with the same quantizers
   (gptq{b}g{group}-gptqmodel-v5: GPTQModel 7.6's defaults) over the same checkpoint, calibration windows
   (TokenData.calib_windows, seed 0) and evaluation windows, its defaults otherwise (quantize_threads 1).

Measured for each: wall time of the process (interpreter start and imports included, as a user waits for it), its
CPU time (user + system: on a shared machine the steadier figure; both tools get 2 threads) and peak memory: the
larger of the kernel's ru_maxrss of the process and the largest proportional set size (PSS) of the process with its
children, sampled every 50 ms (PSS counts pages a fork shares with its parent once).
Equal Δ CE: per quantizer |Δ CE quantdyn - Δ CE GPTQModel| <=
max(0.15 |Δ CE GPTQModel|, 0.005) nats (bench/crosscheck_gptqmodel.py's tolerance). Goal (issue 31): quantdyn
<= 0.3x the time and <= 0.3x the peak memory with 3 quantizers. /proc/loadavg is recorded before and after each
process (the machine is shared). Writes bench/results/crosscheck_race-<machine>-<date>.json (after every size, and
a copy into --out, default $OUT) and prints a table.

--device cuda: the set-up training, GPTQModel (GPTQModel.load(..., device='cuda')) and the reload/evaluation
(transformers, device_map cuda) and the sweep (spec `device: cuda`) all run on the GPU; each child also reports its
peak GPU memory (torch.cuda.max_memory_allocated and _reserved, written at exit by bench/gpu_peak_at_exit.py to a
file the parent reads). --dtype: both tools quantize and evaluate in one dtype, the fp32 checkpoint cast to it
(GPTQModel.load(dtype=...), transformers' reload with dtype=..., the sweep spec's `dtype`): float32 on a CPU (as
before), bfloat16 on a GPU, where GPTQModel 7.6's CUDA kernels for 2/3/4-bit GPTQ (torch, triton, marlin) take
only fp16/bf16 and bf16 is what a GPU user runs; Δ CE is thus compared at one precision on either device.
--budget-s: a size starts only if the budget left covers its estimate (ESTIMATE_S), a child still running when the
budget runs out is killed (recorded as 'timeout'); sizes run in the order given (70m first), results written and
copied after each, so a stopped race keeps what it measured.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(2, os.cpu_count() or 2)))  # 1 worker fails on 2 cores

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from crosscheck_gptqmodel import CE_ABS_TOL, CE_REL_TOL, ce, gptqmodel_quantize  # noqa: E402
import gpu_peak_at_exit  # noqa: E402
from gpu_check import copy_out  # noqa: E402

SHAPES = {"14m": "pythia-14m", "70m": "pythia-70m", "160m": "pythia-160m"}
TIME_GOAL = MEMORY_GOAL = 0.3
#: set-up training steps when --train-steps is not given: a CPU affords few (BENCHMARKS.md), a GPU a few hundred
#: (pythia-160m shape at 16 x 128 tokens: well under 0.1 s a step on an H100), enough for Δ CE to mean something
TRAIN_STEPS = {"cpu": "40", "cuda": "70m:600,160m:400,14m:200"}
#: expected seconds of one size's race on an H100 (set-up training, both pipelines with their interpreter starts
#: and GPTQModel's kernel set-up); a size starts only if the budget left covers it. Estimates, not measurements.
ESTIMATE_S = {"14m": 60, "70m": 150, "160m": 240}
GPU_PEAK_ENV = gpu_peak_at_exit.ENV  # the file a child writes its peak GPU memory to at exit


def spec_of(bits: int, group: int) -> str:
    """quantdyn's quantizer for GPTQModel 7.6's defaults at ``bits``/``group``."""
    return f"gptq{bits}g{group}-gptqmodel-v5"


# ----------------------------------------------------------------------------- set-up (not timed)
def data_config(tokenizer: str):
    from quantdyn.data.prepare import DataConfig

    return DataConfig(source="builtin:kjv", tokenizer=tokenizer)


def trained_checkpoint(size: str, steps: int, work: Path, device: str = "cpu") -> Path:
    """pythia-<size> block shapes, BPE 4096 on KJV, trained ``steps`` steps; saved as a plain HF checkpoint with
    its tokenizer (cached: a second call returns the directory)."""
    from quantdyn.config import from_dict
    from quantdyn.models.hf_io import load_gpt, save_hf
    from quantdyn.runs import list_checkpoints
    from quantdyn.train.config import RunConfig
    from quantdyn.train.trainer import train

    out = work / f"fp-{size}-s{steps}" if device == "cpu" else work / f"fp-{size}-s{steps}-{device}"
    if (out / "model.safetensors").is_file():
        return out
    cfg = from_dict(RunConfig, {
        "name": f"{size}-s{steps}", "out_dir": str(work / "runs"), "seed": 0,
        "model": {"preset": SHAPES[size], "vocab_size": 4096, "max_seq_len": 256},
        "data": {"source": "builtin:kjv", "tokenizer": "bpe:4096"},
        "optim": {"name": "adamw", "lr": 1.0e-3, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "schedule": {"name": "wsd", "warmup": max(1, steps // 10), "decay": max(1, steps // 5)},
        "train": {"steps": steps, "batch_size": 16, "seq_len": 128, "eval_every": 0, "eval_windows": 8,
                  "checkpoint_every": steps, "log_every": max(1, steps // 5), "device": device},
    })
    run = train(cfg, progress=False)
    final = list_checkpoints(run)[-1].path
    model = load_gpt(final)
    save_hf(model, out)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(final)).save_pretrained(str(out))
    return out


def tokens(ckpt: Path, calib: int, windows: int, seq: int):
    """(calibration ids, evaluation ids) as `quantdyn sweep` draws them for this checkpoint: its own tokenizer
    on builtin:kjv, calib_windows(calib, seq, seed 0), eval_windows(seq, windows)."""
    from quantdyn.data.prepare import prepare_data

    data = prepare_data(data_config(str(ckpt)), progress=False)
    return data.calib_windows(calib, seq, 0), data.eval_windows(seq, windows)


# ----------------------------------------------------------------------------- measured processes
def _tree_pss(pid: int) -> int:
    """Proportional set size of ``pid`` and its descendants (Linux /proc): pages shared between them (a fork's
    copy-on-write image of its parent, the libraries) are counted once, split between their sharers, where a
    sum of resident sizes would count a forked 2 GB process twice."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
            for t in Path(f"/proc/{p}/task").iterdir():
                todo += [int(k) for k in (t / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return total


def measured(cmd: list[str], env: dict | None = None, timeout: float | None = None) -> dict:
    """Run ``cmd``; its wall time, CPU time (user + system, its waited-for children included: on a shared machine
    the steadier figure), peak memory (tree-sampled PSS and ru_maxrss), peak GPU memory (what the child wrote to
    $QUANTDYN_RACE_GPU_PEAK at exit: see :func:`record_gpu_peak`), load average, output. Killed (its process
    group) after ``timeout`` seconds: then ``timed_out`` is True and the figures are those up to the kill."""
    load0 = Path("/proc/loadavg").read_text().split()[:3]
    peak_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"race-gpu-peak-{os.getpid()}-{time.monotonic_ns()}.json"
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, **(env or {}), GPU_PEAK_ENV: str(peak_file)}, start_new_session=True)
    def kill():
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:  # it ended just now
            pass
    killer = threading.Timer(timeout, kill) if timeout else None
    if killer:
        killer.start()
    peak = [0]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _tree_pss(proc.pid))
            done.wait(0.05)
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out_chunks, err_chunks = [], []
    readers = [threading.Thread(target=lambda s=s, c=c: c.append(s.read()), daemon=True)
               for s, c in ((proc.stdout, out_chunks), (proc.stderr, err_chunks))]
    for r in readers:
        r.start()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if killer:
        killer.cancel()
    done.set()
    th.join()
    for r in readers:
        r.join()
    out, err = "".join(out_chunks), "".join(err_chunks)
    rc = os.waitstatus_to_exitcode(status)
    gpu = json.loads(peak_file.read_text()) if peak_file.is_file() else {}
    peak_file.unlink(missing_ok=True)
    timed_out = bool(timeout) and rc == -9 and wall >= timeout
    if rc != 0 and not timed_out:
        raise SystemExit(f"`{' '.join(cmd[:4])} ...` failed ({rc}):\n{err[-3000:]}")
    return {"timed_out": timed_out, "wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "gpu_peak_allocated_bytes": gpu.get("allocated"), "gpu_peak_reserved_bytes": gpu.get("reserved"),
            "peak_tree_pss_bytes": peak[0], "ru_maxrss_bytes": usage.ru_maxrss * 1024,
            "peak_bytes": max(peak[0], usage.ru_maxrss * 1024), "loadavg_before": load0,
            "loadavg_after": Path("/proc/loadavg").read_text().split()[:3], "stdout": out, "stderr_tail": err[-2000:]}


#: the quantdyn child: `python -m quantdyn.cli sweep SPEC` with the peak GPU memory hook installed first, and
#: nothing else imported (its host memory is the sweep's own). argv: bench folder, spec.
QUANTDYN_CHILD = ("import runpy, sys; sys.path.insert(0, sys.argv[1]); import gpu_peak_at_exit; "
                  "gpu_peak_at_exit.install(); sys.argv = ['quantdyn', 'sweep', sys.argv[2]]; "
                  "runpy.run_module('quantdyn.cli', run_name='__main__', alter_sys=True)")


def gptqmodel_child(a) -> None:
    """Paper A's pipeline over the quantizers, in this process (spawned by :func:`race`)."""
    from transformers import AutoModelForCausalLM, GPTQConfig

    gpu_peak_at_exit.install()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    dev = {"device_map": a.device} if a.device != "cpu" else {}
    dtype = getattr(torch, a.dtype)
    ids = torch.load(a.ids, weights_only=True)
    calib, windows = ids["calib"], ids["eval"]
    phases: dict = {}
    t = time.perf_counter()
    fp = AutoModelForCausalLM.from_pretrained(a.ckpt, dtype=dtype, **dev).eval()
    ce_fp = ce(fp, windows)
    del fp
    phases["fp_eval_s"] = time.perf_counter() - t
    out = {"ce_fp": ce_fp, "quantizers": {}, "phases": phases}
    print("RESULT " + json.dumps(out), flush=True)  # after every step: a child killed at the budget keeps what it did
    for bits in (int(b) for b in a.bits.split(",")):
        dst = Path(a.work) / f"gptqmodel-{bits}bit"
        q_s, _ = gptqmodel_quantize(Path(a.ckpt), dst, calib, bits, a.group_size, v5_defaults=True,  # + save
                                    device=a.device, dtype=dtype)
        t = time.perf_counter()
        kernel = {} if a.gptqmodel_backend == "auto" else {
            "quantization_config": GPTQConfig(bits=bits, backend=a.gptqmodel_backend)}  # a loading attribute
        model = AutoModelForCausalLM.from_pretrained(str(dst), dtype=dtype, **dev, **kernel).eval()
        reload_s = time.perf_counter() - t
        used = sorted({type(m).__name__ for m in model.modules() if hasattr(m, "qweight")})  # the kernel chosen
        t = time.perf_counter()
        ce_q = ce(model, windows)
        eval_s = time.perf_counter() - t
        del model
        out["quantizers"][spec_of(bits, a.group_size)] = {"delta_ce": ce_q - ce_fp, "quantize_save_s": q_s,
                                                          "reload_s": reload_s, "eval_s": eval_s,
                                                          "kernel": used}
        print("RESULT " + json.dumps(out), flush=True)


def quantdyn_command(ckpt: Path, bits: list[int], group: int, calib: int, windows: int, seq: int,
                     work: Path, device: str = "cpu", dtype: str = "float32") -> tuple[list[str], Path]:
    """The `quantdyn sweep` command of the race (through :data:`QUANTDYN_CHILD`, which records the peak GPU
    memory) and its results store (a new, empty one). ``dtype``: the compute dtype both tools use."""
    import yaml

    store = work / f"store-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    spec = {"trajectory": {"checkpoints": [str(ckpt)]}, "quantizers": [spec_of(b, group) for b in bits],
            "store": str(store), "device": device, "dtype": dtype,
            "data": {"source": "builtin:kjv", "calib_samples": calib, "calib_seq_len": seq, "calib_seed": 0,
                     "eval_windows": windows, "eval_seq_len": seq}}
    path = work / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return [sys.executable, "-c", QUANTDYN_CHILD, str(HERE), str(path)], store


def quantdyn_rows(store: Path) -> dict[str, float]:
    from quantdyn.results.store import ResultStore

    return {r.get("quantizer_spec") or r["quantizer"]: r["delta_ce"] for r in ResultStore(store).rows()
            if r.get("kind") == "ptq"}


def steps_of(spec: str, size: str) -> int:
    """'40' -> 40 for every size; '70m:40,160m:12' -> the size's own."""
    if ":" not in spec:
        return int(spec)
    table = dict(x.split(":") for x in spec.split(",") if x)
    if size not in table:
        raise SystemExit(f"--train-steps {spec} names no steps for size {size}")
    return int(table[size])


def warm_gptqmodel() -> dict:
    """Build GPTQModel's JIT-compiled CPU packing extension, untimed, before the race: GPTQModel compiles it at
    first use (~30 s cold by its own baseline) and caches it per machine, so a user's later runs do not pay it, and
    on a fresh GPU machine it would land in the first timed quantizer. Where it cannot be built (no compiler),
    GPTQModel packs in Python, as it then would for that user too; the result says which."""
    t = time.perf_counter()
    try:
        from gptqmodel.utils.cpp import load_pack_block_extension

        built: bool | str = load_pack_block_extension() is not None
    except Exception as e:  # GPTQModel falls back to its Python packing on any failure here
        built = f"{type(e).__name__}: {e}"
    return {"pack_block_extension": built, "seconds": time.perf_counter() - t}


def race(size: str, a, deadline: float | None = None) -> dict:
    """One size's race; ``deadline`` (time.monotonic()): its children are killed when it passes (a child stopped
    so is recorded with ``timed_out`` and the race row with ``status: timeout``)."""
    work = Path(a.work) / size
    work.mkdir(parents=True, exist_ok=True)
    bits = [int(b) for b in a.bits.split(",")]
    t = time.perf_counter()
    ckpt = trained_checkpoint(size, steps_of(a.train_steps, size), Path(a.work), a.device)
    setup_s = time.perf_counter() - t
    calib, windows = tokens(ckpt, a.calib, a.windows, a.seq_len)
    ids = work / "ids.pt"
    torch.save({"calib": calib, "eval": windows}, ids)
    print(f"\n## pythia-{size} shape on {a.device}: {ckpt} "
          f"({sum(f.stat().st_size for f in ckpt.glob('*.safetensors')) / 2**20:.0f} MiB fp32, set-up {setup_s:.0f} s)"
          f"; calibration {a.calib} x {a.seq_len}, evaluation {a.windows} x {a.seq_len} tokens; "
          f"quantizers {', '.join(spec_of(b, a.group_size) for b in bits)}", flush=True)
    row = {"size": size, "device": a.device, "checkpoint": str(ckpt), "train_steps": steps_of(a.train_steps, size),
           "setup_s": setup_s, "status": "timeout"}

    def left():
        return None if deadline is None else max(1.0, deadline - time.monotonic())
    g = measured([sys.executable, __file__, "--child", "gptqmodel", "--ckpt", str(ckpt), "--ids", str(ids),
                  "--bits", a.bits, "--group-size", str(a.group_size), "--work", str(work), "--device", a.device,
                  "--dtype", a.dtype, "--gptqmodel-backend", a.gptqmodel_backend],
                 timeout=left())
    print(f"GPTQModel pipeline: {g['wall_s']:.1f} s ({g['cpu_s']:.1f} s CPU), peak {g['peak_bytes'] / 2**30:.2f} GiB"
          f"{_gpu_gib(g)}{' (killed: budget spent)' if g['timed_out'] else ''}", flush=True)
    done = [json.loads(x[7:]) for x in g.pop("stdout").splitlines() if x.startswith("RESULT ")]
    if g["timed_out"]:
        return {**row, "gptqmodel": g, "gptqmodel_partial": done[-1] if done else None}
    gres = done[-1]
    cmd, store = quantdyn_command(ckpt, bits, a.group_size, a.calib, a.windows, a.seq_len, work, a.device,
                                  a.dtype)
    q = measured(cmd, timeout=left())
    q.pop("stdout")
    print(f"quantdyn sweep:     {q['wall_s']:.1f} s ({q['cpu_s']:.1f} s CPU), peak {q['peak_bytes'] / 2**30:.2f} GiB"
          f"{_gpu_gib(q)}{' (killed: budget spent)' if q['timed_out'] else ''}", flush=True)
    if q["timed_out"]:
        return {**row, "ce_fp_gptqmodel": gres["ce_fp"], "gptqmodel": {**g, "phases": gres["phases"]},
                "quantdyn": q}
    qres = quantdyn_rows(store)
    per = {}
    for label, gq in gres["quantizers"].items():
        d_g, d_q = gq["delta_ce"], qres.get(label)
        tol = max(CE_REL_TOL * abs(d_g), CE_ABS_TOL)
        per[label] = {"delta_ce_gptqmodel": d_g, "delta_ce_quantdyn": d_q, "tolerance": tol,
                      "equal": d_q is not None and abs(d_q - d_g) <= tol, **{f"gptqmodel_{k}": v for k, v in gq.items()
                                                                            if k != "delta_ce"}}
    time_ratio, mem_ratio = q["wall_s"] / g["wall_s"], q["peak_bytes"] / g["peak_bytes"]
    cpu_ratio = q["cpu_s"] / g["cpu_s"]
    gpu_ratio = (q["gpu_peak_allocated_bytes"] / g["gpu_peak_allocated_bytes"]
                 if q["gpu_peak_allocated_bytes"] and g["gpu_peak_allocated_bytes"] else None)
    # on a GPU the memory that matters is the GPU's: the goal is judged on it there, on host memory on a CPU
    judged = gpu_ratio if a.device != "cpu" and gpu_ratio is not None else mem_ratio
    return {**row, "status": "done", "ce_fp_gptqmodel": gres["ce_fp"],
            "gptqmodel": {**g, "phases": gres["phases"]}, "quantdyn": q, "quantizers": per,
            "time_ratio": time_ratio, "cpu_ratio": cpu_ratio, "memory_ratio": mem_ratio, "gpu_memory_ratio": gpu_ratio,
            "equal_delta_ce": all(p["equal"] for p in per.values()),
            "goal_met": time_ratio <= TIME_GOAL and judged <= MEMORY_GOAL}


def _gpu_gib(m: dict) -> str:
    b = m.get("gpu_peak_allocated_bytes")
    if b is None:
        return ""
    return f", GPU peak {b / 2**30:.2f} GiB allocated ({m['gpu_peak_reserved_bytes'] / 2**30:.2f} reserved)"


def _table(rows: list[dict], a, version: str) -> None:
    print(f"\nPipeline race on {a.device}, {a.dtype} (gptqmodel {version}, torch {torch.__version__}; "
          f"{len(a.bits.split(','))} quantizers; goal quantdyn <= {TIME_GOAL}x time and memory)")
    print(f"{'model':<18}{'GPTQModel s':>12}{'quantdyn s':>11}{'time x':>8}{'CPU x':>7}{'GPTQModel GiB':>14}"
          f"{'quantdyn GiB':>13}{'memory x':>9}{'GPU GiB G/q':>14}{'GPU x':>7}  equal Δ CE  goal")
    for r in rows:
        if r["status"] != "done":
            print(f"{'pythia-' + r['size'] + ' shape':<18}{r['status']}")
            continue
        g, q = r["gptqmodel"], r["quantdyn"]
        gpu = ("-" if g["gpu_peak_allocated_bytes"] is None else
               f"{g['gpu_peak_allocated_bytes'] / 2**30:.2f}/{(q['gpu_peak_allocated_bytes'] or 0) / 2**30:.2f}")
        gx = "-" if r["gpu_memory_ratio"] is None else f"{r['gpu_memory_ratio']:.2f}"
        print(f"{'pythia-' + r['size'] + ' shape':<18}{g['wall_s']:>12.1f}{q['wall_s']:>11.1f}"
              f"{r['time_ratio']:>8.2f}{r['cpu_ratio']:>7.2f}{g['peak_bytes'] / 2**30:>14.2f}"
              f"{q['peak_bytes'] / 2**30:>13.2f}{r['memory_ratio']:>9.2f}{gpu:>14}{gx:>7}  "
              f"{str(r['equal_delta_ce']):<10}  {'met' if r['goal_met'] else 'not met'}")
        for label, p in r["quantizers"].items():
            dq = "-" if p["delta_ce_quantdyn"] is None else f"{p['delta_ce_quantdyn']:.4f}"
            print(f"    {label:<26} Δ CE GPTQModel {p['delta_ce_gptqmodel']:.4f}  quantdyn {dq}  "
                  f"(tolerance {p['tolerance']:.4f})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="70m,160m", help=f"Pythia block shapes of {', '.join(SHAPES)}, raced in this "
                                                        "order")
    ap.add_argument("--bits", default="4,3,2", help="one GPTQ quantizer per bit width")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N: where both pipelines (and the set-up "
                                                    "training) run")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="what both tools quantize and evaluate in (the fp32 checkpoint cast to it): auto = float32 "
                         "on a CPU, bfloat16 on a GPU (GPTQModel's CUDA kernels take no float32)")
    ap.add_argument("--gptqmodel-backend", default=None,
                    help="GPTQModel's kernel for the reload/evaluation (its BACKEND values): default auto on a CPU, "
                         "gptq_torch on a GPU, where auto would JIT-compile Marlin first (~2 min cold, GPTQModel's own "
                         "baseline; a once-per-machine cost, not the pipeline's) and gptq_torch serves 2, 3 and 4 bits")
    ap.add_argument("--train-steps", default=None,
                    help="training steps of the set-up model: N, or SIZE:N,... per size (e.g. 70m:40,160m:12); "
                         f"default {TRAIN_STEPS['cpu']} on a CPU, {TRAIN_STEPS['cuda']} on a GPU")
    ap.add_argument("--calib", type=int, default=64, help="calibration sequences")
    ap.add_argument("--windows", type=int, default=128, help="evaluation windows")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="wall-clock budget of the whole race (0 = none): a size starts only if what is left covers "
                         "its estimate, a child still running when it is spent is killed; results are written "
                         "after every size either way")
    ap.add_argument("--out", default=os.environ.get("OUT", ""),
                    help="also copy the results there after every size (default: $OUT, the device tool's folder)")
    ap.add_argument("--work", default=str(ROOT / ".cache" / "race"))
    ap.add_argument("--quick", action="store_true", help="the 14m shape, 2 quantizers, 10 training steps (a smoke run)")
    ap.add_argument("--child", default="")
    ap.add_argument("--ckpt", default="")
    ap.add_argument("--ids", default="")
    a = ap.parse_args()
    if a.child == "gptqmodel":
        gptqmodel_child(a)
        return 0
    kind = a.device.split(":")[0]
    if kind not in TRAIN_STEPS:
        print(f"crosscheck_race: --device {a.device}: use cpu, cuda or cuda:N", file=sys.stderr)
        return 2
    if kind == "cuda" and not torch.cuda.is_available():
        print(f"crosscheck_race: --device {a.device} but torch {torch.__version__} sees no CUDA GPU here; "
              "use --device cpu", file=sys.stderr)
        return 2
    unknown = [s for s in a.sizes.split(",") if s and s not in SHAPES]
    if unknown:
        print(f"crosscheck_race: --sizes {','.join(unknown)}: known sizes are {', '.join(SHAPES)}", file=sys.stderr)
        return 2
    if a.dtype == "auto":
        a.dtype = "float32" if kind == "cpu" else "bfloat16"
    if a.gptqmodel_backend is None:
        a.gptqmodel_backend = "auto" if kind == "cpu" else "gptq_torch"
    if a.train_steps is None:
        a.train_steps = TRAIN_STEPS[kind]
    if a.quick:
        a.sizes, a.bits, a.train_steps, a.calib, a.windows = "14m", "4,3", "10", 8, 16
    t_start = time.monotonic()
    try:
        import gptqmodel
    except ImportError:  # `make bench` runs every bench script in the main venv, which has no GPTQModel
        print("crosscheck_race: skipped, gptqmodel is not installed here; run `make race` (on a GPU machine: "
              "`tools/gpu_bundle.py bundle --race`, BENCHMARKS.md)")
        return 0
    import platform

    import transformers

    from common import _git_sha, write_results

    rows: list[dict] = []
    path = None
    info = {"git_sha": _git_sha(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "device": a.device, "gpu": torch.cuda.get_device_name(a.device) if kind == "cuda" else None,
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "gptqmodel": gptqmodel.__version__,
            "gptqmodel_cpu_workers": os.environ.get("GPTQMODEL_CPU_WORKERS"), "dtype": a.dtype,
            "gptqmodel_backend": a.gptqmodel_backend,
            "calib": [a.calib, a.seq_len], "eval": [a.windows, a.seq_len], "group_size": a.group_size,
            "budget_s": a.budget_s or None, "goal": {"time_ratio": TIME_GOAL, "memory_ratio": MEMORY_GOAL},
            "races": rows}
    deadline = t_start + a.budget_s if a.budget_s else None
    info["gptqmodel_warmup"] = warm_gptqmodel()
    print(f"GPTQModel's packing extension, built untimed first: {info['gptqmodel_warmup']}", flush=True)
    for size in (s for s in a.sizes.split(",") if s):
        if deadline is not None and deadline - time.monotonic() < ESTIMATE_S[size]:
            print(f"\n## pythia-{size} shape: not started, {deadline - time.monotonic():.0f} s of the budget left, "
                  f"~{ESTIMATE_S[size]} s needed: run `python3 bench/crosscheck_race.py --device {a.device} "
                  f"--sizes {size}`", flush=True)
            rows.append({"size": size, "device": a.device, "status": "not started"})
        else:
            rows.append(race(size, a, deadline))
        path = write_results("crosscheck_race", info, out=path or "")  # after every size: a stopped race keeps it
        copy_out([path], a.out)
    _table(rows, a, gptqmodel.__version__)
    print(f"written: {path}" + (f" (and copied to {a.out})" if a.out else ""))
    return 0 if all(r.get("equal_delta_ce") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
