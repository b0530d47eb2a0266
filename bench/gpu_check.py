"""The GPU runbook's driver: the GPU tests and the CUDA benchmarks, in two commands of at most 6 minutes each.

    python3 bench/gpu_check.py --part a --budget-s 320     # command 1 (after the set-up line; BENCHMARKS.md runbook)
    python3 bench/gpu_check.py --part b --budget-s 320     # command 2 (the set-up line with the race bundle too)
    python3 bench/gpu_check.py --only train_throughput     # any step on its own (a later window)
    python3 bench/gpu_check.py --device cpu --dry-run      # both parts' steps on tiny shapes (CI)

Steps, most valuable first, each a child process with a time limit (bench/common.py runs them and keeps their output):

  part a
  tests             pytest -m gpu tests/gpu: CUDA against CPU (training step, codes, flash attention, FSDP2, engine),
                    GPTQ's column loop as CUDA graphs and batched (gptq_batch) against the eager loop, bit for bit,
                    and the three fixes of the first GPU run (RTN scales, AWQ's bounds, the engine's GPTQ flips)
  gptq_speed        GPTQ per layer: eager against CUDA graphs; one gptq() per weight against gptq_batch (gptq4 and
                    gptq3 of Pythia-160M's layers, SmolLM-135M's q/k/v and gate/up), each also as graphs; whole-model
                    GPTQ 4-bit g128 of pythia-160m with the graphs (bench/gptq_speed.py)
  sweep_cost        sweep time per checkpoint for 5 quantizers (gptq3, gptq4, rtn2, rtn3, rtn4), pythia-160m shape
                    (bench/sweep_cost.py); with the column loop as CUDA graphs when the tests step passed
  part b
  race              the pipeline race against GPTQModel at equal Δ CE (bench/crosscheck_race.py; needs the race
                    bundle): pythia-70m, then pythia-160m if the budget still covers it
  train_profile     where a pythia-160m training step's time goes, for MFU (bench/train_profile.py: the kernels of
                    one step grouped, and the step with the loss inside the compiled graph)
  not in a part (run with --only, measured on the first GPU run, 2026-11-24)
  train_throughput  trainer tokens/s and MFU beside a plain nanoGPT-style loop (bench/train_throughput.py)
  sweep_memory      the engine's peak GPU memory on a Llama-2-7B-shape checkpoint (bench/sweep_memory.py --llama7b)

The budget (--budget-s, default 320 s: a 6-minute command less the set-up line and the transfers) is shared by the
steps of the run: a step starts only when the budget left covers its expected time (ESTIMATE_S: H100 figures where
measured, else estimates), and is killed when the budget runs out (the race and the profile get their own budgets,
so that they stop between sizes / variants and keep what they measured); a step left out is recorded as 'not
started' with the command that runs it later. One JSON per run, bench/results/gpu_check-<machine>-<date>.json (the
machine with GPU name, driver, torch, CUDA, transformers; the date; git SHA; every step's figures, status, seconds
and output), then a table of the figures. Where $OUT is set (the device tool's folder of files to bring back) the
JSON and the files the steps wrote under bench/results are copied there after every step, so a command killed at
its limit still brings back what it measured.
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

PARTS = {"a": ("tests", "gptq_speed", "sweep_cost"), "b": ("race", "train_profile")}
"""The runbook's two commands, each at most 6 minutes (BENCHMARKS.md, "Runbook")."""
EXTRA = ("train_throughput", "sweep_memory")
STEPS = (*PARTS["a"], *PARTS["b"], *EXTRA)

# Expected seconds of each step on an H100. Measured on an H100 80GB HBM3 (2026-11-24, BENCHMARKS.md): tests 69 s,
# train_throughput 132 s, gptq_speed 106 s (with the 1b shape), sweep_memory 75 s, sweep_cost 135 s (1,2 checkpoints,
# 27 s per checkpoint). Since then (estimates, not measurements):
#   tests: + 28 graph-vs-eager and 4 batched GPTQ cases, a few seconds: 90 s.
#   gptq_speed: the 1b shape dropped (60 s of it), the batched cases added (six cases x 4 ways x 3 repeats of
#     0.06-0.3 s eager, less batched / graphed): 70 s.
#   sweep_cost: 4 sweeps (warm-up, 1, 2 checkpoints) of 5 quantizers; at 27 s per checkpoint it was 135 s in all,
#     ~25 s of it set-up; with batched quantizers and graphs the goal is <= 5 s per checkpoint: 100 s allows 19 s.
#   race: pythia-70m's race, the set-up training included (crosscheck_race.py ESTIMATE_S): 150 s.
#   train_profile: two variants, each compiled anew (~1 min each: the first GPU run's compile took ~45 s): 130 s.
ESTIMATE_S = {"tests": 90, "gptq_speed": 70, "sweep_cost": 100, "race": 150, "train_profile": 130,
              "train_throughput": 135, "sweep_memory": 80}
# a step is killed after at most this many seconds even when the budget would allow more
CAP_S = {"tests": 150, "gptq_speed": 120, "sweep_cost": 160, "race": 300, "train_profile": 240,
         "train_throughput": 300, "sweep_memory": 200}
DEFAULT_BUDGET_S = 320.0
#: the race's own budget leaves this many seconds of the step's limit for the race to write and exit after a kill
RACE_MARGIN_S = 20

OUT_FILES = 8  # the device tool brings back at most 8 files from $OUT


def commands(device: str, dry_run: bool, work: str = "/tmp/quantdyn-gpu-check") -> dict[str, list[str]]:
    """Each step's command line. ``dry_run``: tiny shapes that run the same code paths on a CPU in seconds (the race
    skips itself where GPTQModel is not installed, as in the main venv)."""
    py = sys.executable
    if not dry_run:
        return {
            "tests": [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-rA", "tests/gpu"],
            "gptq_speed": [py, "bench/gptq_speed.py", "--device", device, "--model-sizes", "160m", "--cuda-graph",
                           "--n-calib", "64", "--seq-len", "2048", "--repeat", "3"],
            "sweep_cost": [py, "bench/sweep_cost.py", "--device", device, "--preset", "pythia-160m",
                           "--quantizers", "gptq3,gptq4,rtn2,rtn3,rtn4", "--checkpoints", "1,2", "--seq", "2048",
                           "--calib", "64", "--windows", "50", "--no-one-at-a-time"],
            "race": [py, "bench/crosscheck_race.py", "--device", device, "--sizes", "70m,160m", "--work",
                     f"{work}/race"],
            "train_profile": [py, "bench/train_profile.py", "--device", device, "--variants", "base,loss_compiled"],
            "train_throughput": [py, "bench/train_throughput.py", "--device", device, "--quick", "--large",
                                 "--gpu-preset", "pythia-160m", "--gpu-seq", "2048", "--gpu-batch", "16",
                                 "--gpu-steps", "50"],
            "sweep_memory": [py, "bench/sweep_memory.py", "--device", device, "--llama7b", "--no-reference",
                             "--sizes", "", "--counts", "", "--llama-counts", "2", "--workdir", work],
        }
    return {
        # on a CPU every test in tests/gpu is skipped with its reason: this checks they still collect
        "tests": [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "tests/gpu"],
        "gptq_speed": [py, "bench/gptq_speed.py", "--device", device, "--quick", "--model-sizes", "14m",
                       "--batched", "--n-calib", "2", "--seq-len", "32"],
        "sweep_cost": [py, "bench/sweep_cost.py", "--device", device, "--quantizers", "gptq3,rtn4",
                       "--checkpoints", "1,2", "--seq", "32", "--calib", "2", "--windows", "4",
                       "--no-one-at-a-time"],
        "race": [py, "bench/crosscheck_race.py", "--device", device, "--quick", "--work", f"{work}/race"],
        "train_profile": [py, "bench/train_profile.py", "--device", device, "--dry-run", "--variants",
                          "base,loss_compiled"],
        "train_throughput": [py, "bench/train_throughput.py", "--device", device, "--quick", "--large",
                             "--no-compile", "--gpu-preset", "tiny-2x64", "--gpu-seq", "64", "--gpu-batch", "2",
                             "--gpu-steps", "10", "--gpu-max-tokens", "100000"],
        "sweep_memory": [py, "bench/sweep_memory.py", "--device", device, "--llama7b", "--no-reference",
                         "--llama-shape", "tiny", "--sizes", "", "--counts", "", "--llama-counts", "2",
                         "--windows", "4", "--calib", "2"],
    }


def own_budget(name: str, left: float, later: list[str], dry_run: bool) -> tuple[list[str], float]:
    """Arguments that give the race and the profile a budget of their own (they stop between sizes / variants and
    write what they measured), and the step's time limit: what is left (for the race, less the expected time of the
    steps still to come in this run: it stops between sizes, so it leaves the profile its turn)."""
    reserve = 0 if dry_run or name != "race" else sum(ESTIMATE_S[s] for s in later)
    limit = max(1.0, min(CAP_S[name], left - reserve))
    if name == "race":
        return ["--budget-s", f"{max(1, limit - RACE_MARGIN_S):.0f}"], limit
    if name == "train_profile":  # starts no further variant after this; one variant takes ~1 minute
        return ["--budget-s", f"{max(1, limit - 70):.0f}"], limit
    return [], limit


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
        elif name == "gptq_speed" and (f.get("models") or f.get("batched")):
            fig = "; ".join(f"{m['model']} {m['quantizer']} ({m.get('column_loop', 'eager')}): {m['seconds']:.1f} s"
                            + (f" (peak {m['peak_gpu_bytes'] / 2**30:.2f} GiB)" if m.get("peak_gpu_bytes") else "")
                            for m in f.get("models", []))
            if f.get("layers") and "seconds_cuda_graph" in f["layers"][0]:
                fig += "; per layer eager/graph: " + ", ".join(f"{r['eager_over_graph']:.1f}x" for r in f["layers"])
            if f.get("batched"):
                key = "each_over_batch_graph" if "each_over_batch_graph" in f["batched"][0] else None
                fig += "; batched: " + ", ".join(
                    f"{r['case']} " + (f"{r[key]:.1f}x faster (graphs)" if key else f"{r['batch_over_each']:.2f}x time")
                    + ("" if r["same_codes"] else " CODES DIFFER") for r in f["batched"])
        elif name == "sweep_memory" and f.get("llama7b_runs"):
            fig = "; ".join(f"{r['file_bytes'] / 1e9:.1f} GB checkpoint x{len(r['quantizers'])} quantizers: "
                            f"{r['engine']['seconds']:.1f} s, peak GPU "
                            + (f"{r['engine']['gpu_peak_bytes'] / 1e9:.2f} GB" if r["engine"].get("gpu_peak_bytes")
                               else "- (cpu)") + " (target <= 8 GB)"
                            for r in f["llama7b_runs"])
        elif name == "sweep_cost" and f.get("large"):
            c = f["large"]
            fig = (f"{c['n']} checkpoints x {len(s.get('args', {}).get('quantizers', '').split(','))} quantizers"
                   f"{' (CUDA graphs)' if s.get('cuda_graph') else ''}: "
                   f"{c['per_ckpt']:.1f} s/ckpt (load {c['parts']['load']:.1f}, quantize {c['parts']['quantize']:.1f}, "
                   f"evaluate {c['parts']['evaluate']:.1f})")
        elif name in ("race", "train_profile"):
            fig = f"its own JSON: {'crosscheck_race' if name == 'race' else name}-<machine>-<date>.json"
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
    ap.add_argument("--part", default="ab", choices=("a", "b", "ab"),
                    help="the runbook's command 1 (a: tests, gptq_speed, sweep_cost), 2 (b: race, train_profile), or "
                         "both (ab, the default)")
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                    help="seconds for all steps together (default: a 6-minute command less set-up and transfers)")
    ap.add_argument("--only", default="", help=f"comma-separated steps of {', '.join(STEPS)} (instead of --part)")
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
    names = [s for s in STEPS if s in only] if only else [s for p in a.part for s in PARTS[p]]
    t_end = time.monotonic() + a.budget_s
    cmds = commands(a.device, a.dry_run)
    if a.results_dir:
        os.environ[RESULTS_DIR_ENV] = str(Path(a.results_dir).resolve())  # for this process and the steps
    results = results_dir()
    before = set(results.glob("*.json")) if results.is_dir() else set()
    path = start_run("dry-run" if a.dry_run else "gpu-check", name="gpu_check", device=a.device,
                     budget_s=a.budget_s, steps=names, load_avg=list(os.getloadavg()))
    data = json.loads(path.read_text())
    print(f"# gpu_check ({'dry run, ' if a.dry_run else ''}{a.device}) on {machine_slug(data['machine'])}, "
          f"steps {', '.join(names)}, budget {a.budget_s:.0f} s -> {path}", flush=True)
    failed = []
    status: dict[str, str] = {}
    for k, name in enumerate(names):
        left = t_end - time.monotonic()
        estimate = 0 if a.dry_run else ESTIMATE_S[name]
        if left < estimate:
            later = f"python3 bench/gpu_check.py --only {name}"
            print(f"\n## {name}: not started, {left:.0f} s of the budget left, expected {estimate} s; "
                  f"run it later: {later}", flush=True)
            _update(path, name, status="not started", seconds=0, later=later)
            failed.append(name)
            continue
        extra, limit = own_budget(name, left, names[k + 1:], a.dry_run)
        env_note = {}
        if name == "sweep_cost" and not a.dry_run:  # graphs once the GPU tests (graph vs eager bits) have passed
            graphs = status.get("tests") == "ok"
            os.environ["QUANTDYN_GPTQ_CUDA_GRAPH"] = "1" if graphs else "0"
            env_note = {"cuda_graph": graphs}
        step = Step(name, [*cmds[name], *extra], timeout_s=limit,
                    ok_codes=(0, 5) if name == "tests" and a.dry_run else (0,))
        fields = run_step(step, path)
        os.environ.pop("QUANTDYN_GPTQ_CUDA_GRAPH", None)
        status[name] = fields["status"]
        if env_note:
            _update(path, name, **env_note)
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
