"""One command for a GPU machine: the GPU tests, then the CUDA benchmarks, inside one 10-minute device command.

    python3 bench/gpu_check.py                      # on the GPU machine, after the set-up line (`make gpu-check`)
    python3 bench/gpu_check.py --only train_throughput,sweep_memory      # some steps (a second command)
    python3 bench/gpu_check.py --device cpu --dry-run                    # the same steps on tiny shapes (CI)

Steps, in order, each a child process with a time limit (bench/common.py runs them and keeps their output):

  tests             pytest -m gpu tests/gpu (CUDA against CPU: training step, codes, flash attention, FSDP2, engine)
  train_throughput  trainer tokens/s and MFU, pythia-160m, seq 2048, bf16, torch.compile, fused AdamW, beside a
                    plain nanoGPT-style loop on the same shape (bench/train_throughput.py)
  gptq_speed        whole-model GPTQ 4-bit g128 of pythia-160m and of pythia-1b's shape (bench/gptq_speed.py)
  sweep_memory      the engine's peak GPU memory sweeping a Llama-2-7B-shape checkpoint of random bf16 weights with
                    2 quantizers (bench/sweep_memory.py --llama7b); target: within 8 GB
  sweep_cost        sweep time per checkpoint for 5 quantizers, pythia-160m shape (bench/sweep_cost.py)

The budget (--budget-s, default 540 s: a 10-minute command less the set-up and the transfers) is shared: a step
starts only when the budget left covers its expected time (ESTIMATE_S, from the H100 figures in the device
README: ~790 TFLOP/s bf16, ~3 TB/s; not measured), and is killed when the budget runs out; a step left out is
recorded as 'not started' with the command that runs it later. One JSON per run,
bench/results/gpu_check-<machine>-<date>.json (the machine with GPU name, driver, torch, CUDA, transformers; the
date; git SHA; every step's figures, status, seconds and output), then a table of the figures. Where $OUT is set
(the device tool's folder of files to bring back) the JSON and the files the steps wrote under bench/results are
copied there after every step, so a command killed at its limit still brings back what it measured.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import RESULTS_DIR_ENV, Step, _update, machine_slug, results_dir, run_step, start_run  # noqa: E402

STEPS = ("tests", "train_throughput", "gptq_speed", "sweep_memory", "sweep_cost")

# Expected seconds of each step on an H100 (estimates, not measurements: no GPU has run them yet):
#   tests: 7 tests, the FSDP2 one starts torchrun and trains 30 steps: ~90 s with the interpreter starts.
#   train_throughput: 2 x torch.compile of pythia-160m (~45 s each) + 2 x 60 steps of 16 x 2048 tokens: one step
#     is 6 N T + 12 L d T^2-ish = 0.97 GFLOP/token x 32768 tokens = 32 TFLOP, ~80 ms at 400 TFLOP/s; + KJV
#     tokenized with gpt2 and the small fp32 comparison: ~150 s.
#   gptq_speed: 160m (48 linears) and 1b (64 linears, d_in up to 8192) on 64 x 2048 calibration tokens: ~60 s.
#   sweep_memory: 6.7 B random bf16 values drawn on the GPU, 13.5 GB written (page cache), one engine pass
#     streaming it block by block through the GPU at PCIe/disk speed: ~90 s.
#   sweep_cost: 4 training steps of pythia-160m with 2 checkpoints, then sweeps of 1 and of 2 checkpoints, 5
#     quantizers each: ~140 s (as measured; GPTQ's per-column loop dominates on a GPU, ~24 s per checkpoint).
# Measured on an H100 80GB HBM3 (2026-11-24, BENCHMARKS.md): tests 69 s, train_throughput 132 s, gptq_speed 106 s,
# sweep_memory 75 s, sweep_cost 135 s (with 1,2 checkpoints; 1,3 ran past its 157 s): 517 s in all.
# Since then gptq_speed times the column loop eager and as CUDA graphs per layer (seconds) and the whole models with
# the graphs only (the eager whole-model figures are the H100 run's): kept at 110 s, an upper bound if the graphs
# are faster; tests gained 28 small graph-vs-eager GPTQ cases (estimated ~5 s): 75 s.
ESTIMATE_S = {"tests": 75, "train_throughput": 135, "gptq_speed": 110, "sweep_memory": 80, "sweep_cost": 140}
# a step is killed after at most this many seconds even when the budget would allow more
CAP_S = {"tests": 240, "train_throughput": 300, "gptq_speed": 180, "sweep_memory": 200, "sweep_cost": 240}

OUT_FILES = 8  # the device tool brings back at most 8 files from $OUT


def commands(device: str, dry_run: bool) -> dict[str, list[str]]:
    """Each step's command line. ``dry_run``: tiny shapes that run the same code paths on a CPU in seconds."""
    py = sys.executable
    if not dry_run:
        return {
            "tests": [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-rA", "tests/gpu"],
            "train_throughput": [py, "bench/train_throughput.py", "--device", device, "--quick", "--large",
                                 "--gpu-preset", "pythia-160m", "--gpu-seq", "2048", "--gpu-batch", "16",
                                 "--gpu-steps", "50"],
            "gptq_speed": [py, "bench/gptq_speed.py", "--device", device, "--model-sizes", "160m,1b", "--cuda-graph",
                           "--n-calib", "64", "--seq-len", "2048", "--repeat", "3"],
            "sweep_memory": [py, "bench/sweep_memory.py", "--device", device, "--llama7b", "--no-reference",
                             "--sizes", "", "--counts", "", "--llama-counts", "2", "--workdir",
                             "/tmp/quantdyn-gpu-check"],
            "sweep_cost": [py, "bench/sweep_cost.py", "--device", device, "--preset", "pythia-160m",
                           "--quantizers", "gptq3,gptq4,rtn2,rtn3,rtn4", "--checkpoints", "1,2", "--seq", "2048",
                           "--calib", "64", "--windows", "50", "--no-one-at-a-time"],
        }
    return {
        # on a CPU every test in tests/gpu is skipped with its reason: this checks they still collect
        "tests": [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "tests/gpu"],
        "train_throughput": [py, "bench/train_throughput.py", "--device", device, "--quick", "--large",
                             "--no-compile", "--gpu-preset", "tiny-2x64", "--gpu-seq", "64", "--gpu-batch", "2",
                             "--gpu-steps", "10", "--gpu-max-tokens", "100000"],
        "gptq_speed": [py, "bench/gptq_speed.py", "--device", device, "--quick", "--model-sizes", "14m",
                       "--n-calib", "2", "--seq-len", "32"],
        "sweep_memory": [py, "bench/sweep_memory.py", "--device", device, "--llama7b", "--no-reference",
                         "--llama-shape", "tiny", "--sizes", "", "--counts", "", "--llama-counts", "2",
                         "--windows", "4", "--calib", "2"],
        "sweep_cost": [py, "bench/sweep_cost.py", "--device", device, "--quantizers", "gptq3,rtn4",
                       "--checkpoints", "1,2", "--seq", "32", "--calib", "2", "--windows", "4",
                       "--no-one-at-a-time"],
    }


def copy_out(paths: list[Path], out: str | None) -> list[Path]:
    """Copy ``paths`` (newest first, at most OUT_FILES) flat into ``out``; returns what was copied."""
    if not out:
        return []
    dest = Path(out)
    dest.mkdir(parents=True, exist_ok=True)
    done = []
    for p in sorted({p for p in paths if p.is_file()}, key=lambda p: -p.stat().st_mtime)[:OUT_FILES]:
        shutil.copy2(p, dest / p.name)
        done.append(dest / p.name)
    return done


def _fmt(x, unit="", digits=1) -> str:
    if x is None:
        return "-"
    return f"{x:.{digits}f}{unit}"


def table(data: dict) -> list[str]:
    """The figures of a gpu_check run, one line each (what the issue's targets are checked against)."""
    b = data["benches"]
    lines = [f"{'step':<18}{'status':<12}{'seconds':>8}  figures"]
    for name in STEPS:
        s = b.get(name)
        if s is None:
            continue
        f = s.get("figures") or {}
        fig = ""
        if name == "tests":
            fig = s.get("summary", "")
        elif name == "train_throughput" and f.get("pythia160m"):
            g = f["pythia160m"]
            mfu_q = _fmt(g["quantdyn_mfu"] and 100 * g["quantdyn_mfu"], " %")
            mfu_p = _fmt(g["plain_mfu"] and 100 * g["plain_mfu"], " %")
            fig = (f"{g['preset']} seq {g['seq']} bf16{' compile' if g['compile'] else ''}: quantdyn "
                   f"{g['quantdyn_tokens_per_s']:.0f} tok/s (MFU {mfu_q}), plain {g['plain_tokens_per_s']:.0f} tok/s "
                   f"(MFU {mfu_p})"
                   f", ratio {g['ratio']:.3f} (goals: MFU >= 50 % on an H100, ratio >= 1.0)")
        elif name == "gptq_speed" and f.get("models"):
            fig = "; ".join(f"{m['model']} {m['quantizer']} ({m.get('column_loop', 'eager')}): {m['seconds']:.1f} s"
                            + (f" (peak {m['peak_gpu_bytes'] / 2**30:.2f} GiB)" if m.get("peak_gpu_bytes") else "")
                            for m in f["models"])
            if f.get("layers") and "seconds_cuda_graph" in f["layers"][0]:
                fig += "; per layer eager/graph: " + ", ".join(f"{r['eager_over_graph']:.1f}x" for r in f["layers"])
        elif name == "sweep_memory" and f.get("llama7b_runs"):
            fig = "; ".join(f"{r['file_bytes'] / 1e9:.1f} GB checkpoint x{len(r['quantizers'])} quantizers: "
                            f"{r['engine']['seconds']:.1f} s, peak GPU "
                            + (f"{r['engine']['gpu_peak_bytes'] / 1e9:.2f} GB" if r["engine"].get("gpu_peak_bytes")
                               else "- (cpu)") + " (target <= 8 GB)"
                            for r in f["llama7b_runs"])
        elif name == "sweep_cost" and f.get("large"):
            c = f["large"]
            fig = (f"{c['n']} checkpoints x {len(s.get('args', {}).get('quantizers', '').split(','))} quantizers: "
                   f"{c['per_ckpt']:.1f} s/ckpt (load {c['parts']['load']:.1f}, quantize {c['parts']['quantize']:.1f}, "
                   f"evaluate {c['parts']['evaluate']:.1f})")
        lines.append(f"{name:<18}{s.get('status', '?'):<12}{_fmt(s.get('seconds')):>8}  {fig}")
    return lines


def _pytest_summary(output: str) -> str:
    for line in reversed(output.strip().splitlines()):
        if any(w in line for w in ("passed", "failed", "skipped", "error", "no tests ran")):
            return line.strip("= ").strip()
    return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (a GPU machine) or cpu (with --dry-run)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes: the same code paths in seconds on a CPU")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="seconds for all steps together (default: a 10-minute command less set-up and transfers)")
    ap.add_argument("--only", default="", help=f"comma-separated steps of {', '.join(STEPS)} (default: all)")
    ap.add_argument("--results-dir", default="", help="where the results files go (default bench/results)")
    ap.add_argument("--out", default=os.environ.get("OUT", ""),
                    help="also copy the results there after every step (default: $OUT, the device tool's folder)")
    a = ap.parse_args(argv)
    only = [x for x in a.only.split(",") if x]
    unknown = sorted(set(only) - set(STEPS))
    if unknown:
        print(f"gpu_check: unknown step(s) {', '.join(unknown)}; choose from {', '.join(STEPS)}", file=sys.stderr)
        return 2
    if a.device.startswith("cuda") and not a.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: no CUDA GPU is visible (torch.cuda.is_available() is False); on a CPU run "
                  "`--device cpu --dry-run`", file=sys.stderr)
            return 2
    t_end = time.monotonic() + a.budget_s
    cmds = commands(a.device, a.dry_run)
    if a.results_dir:
        os.environ[RESULTS_DIR_ENV] = str(Path(a.results_dir).resolve())  # for this process and the steps
    results = results_dir()
    before = set(results.glob("*.json")) if results.is_dir() else set()
    path = start_run("dry-run" if a.dry_run else "gpu-check", name="gpu_check", device=a.device,
                     budget_s=a.budget_s, load_avg=list(os.getloadavg()))
    data = json.loads(path.read_text())
    print(f"# gpu_check ({'dry run, ' if a.dry_run else ''}{a.device}) on {machine_slug(data['machine'])}, "
          f"budget {a.budget_s:.0f} s -> {path}", flush=True)
    failed = []
    for name in (s for s in STEPS if not only or s in only):
        left = t_end - time.monotonic()
        estimate = 0 if a.dry_run else ESTIMATE_S[name]
        if left < estimate:
            later = f"python3 bench/gpu_check.py --only {name}"
            print(f"\n## {name}: not started, {left:.0f} s of the budget left, expected {estimate} s; "
                  f"run it later: {later}", flush=True)
            _update(path, name, status="not started", seconds=0, later=later)
            failed.append(name)
            continue
        step = Step(name, cmds[name], timeout_s=max(1.0, min(CAP_S[name], left)),
                    ok_codes=(0, 5) if name == "tests" and a.dry_run else (0,))
        fields = run_step(step, path)
        if name == "tests":
            _update(path, name, summary=_pytest_summary(fields["output"]))
        if fields["status"] != "ok":
            failed.append(name)
        copy_out([path, *(set(results.glob("*.json")) - before)], a.out)
    data = json.loads(path.read_text())
    print("\n" + "\n".join(table(data)), flush=True)
    copied = copy_out([path, *(set(results.glob("*.json")) - before)], a.out)
    print(f"\nresults: {path}" + (f"; copied to {a.out}: {', '.join(p.name for p in copied)}" if copied else "")
          + (f"; not ok: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
