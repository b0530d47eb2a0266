"""How long quantdyn takes to start (issue 39, item 6): `quantdyn -h`, a usage error (a mistyped quantizer label)
and ``import quantdyn.api``, against ``python -c "import torch, transformers"`` in the same run.

    .venv/bin/python bench/start_time.py [--reps 7] [--quick]

Each case is a fresh interpreter. The cases are interleaved, ``--reps`` times in rotated order, under the same
load (the machine may be shared: the load average is recorded before and after); each figure is the minimum over
repetitions (the run least disturbed by other work), wall and CPU seconds (user + system of the child) alike.

    help          quantdyn -h
    usage_error   quantdyn quantize MODEL --quantizers gptqx3    (exit status 2, one line; MODEL is not read)
    api           python -c "import quantdyn.api"
    reference     python -c "import torch, transformers"
    python        python -c "pass"                                (the interpreter alone)

Goals: help and usage_error <= 1 s (they import no torch); api <= 1.2 x reference.
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import record, write_results  # noqa: E402


def _quantdyn() -> list[str]:
    script = Path(sys.executable).with_name("quantdyn")  # the console script of this interpreter's environment
    return [str(script)] if script.exists() else [sys.executable, "-m", "quantdyn.cli"]


CASES: dict[str, tuple[list[str], int]] = {
    "help": ([*_quantdyn(), "-h"], 0),
    "usage_error": ([*_quantdyn(), "quantize", "some/model", "--quantizers", "gptqx3"], 2),
    "api": ([sys.executable, "-c", "import quantdyn.api"], 0),
    "reference": ([sys.executable, "-c", "import torch, transformers"], 0),
    "python": ([sys.executable, "-c", "pass"], 0),
}
GOALS = {"help_s": 1.0, "usage_error_s": 1.0, "api_over_reference": 1.2}


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def one(case: str) -> tuple[float, float]:
    """(wall, cpu) seconds of one fresh run of ``case``; its exit status is checked."""
    cmd, code = CASES[case]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != code:
        raise SystemExit(f"{case}: exit {proc.returncode}, expected {code}: {proc.stderr[-500:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7, help="interleaved repetitions of every case (minimum kept)")
    ap.add_argument("--quick", action="store_true", help="3 repetitions")
    ap.add_argument("--out", default="", help="results JSON (default bench/results/start_time-<machine>-<date>.json)")
    a = ap.parse_args()
    reps = 3 if a.quick else a.reps
    names = list(CASES)
    load0 = loadavg()
    for name in names:  # warm the file cache: the first import of torch after boot reads ~1 GB
        one(name)
    runs: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            runs[name].append(one(name))
    load1 = loadavg()
    best = {n: {"wall_s": round(min(w for w, _ in v), 3), "cpu_s": round(min(c for _, c in v), 3)}
            for n, v in runs.items()}
    ratio = {k: round(best["api"][k] / best["reference"][k], 3) for k in ("wall_s", "cpu_s")}
    figures = {"cases": best, "api_over_reference": ratio, "reps": reps, "load_before": load0, "load_after": load1,
               "goals": GOALS,
               "met": {"help": best["help"]["wall_s"] <= GOALS["help_s"],
                       "usage_error": best["usage_error"]["wall_s"] <= GOALS["usage_error_s"],
                       "api": ratio["wall_s"] <= GOALS["api_over_reference"]}}
    print(f"load {load0} -> {load1}; best of {reps} interleaved runs (wall / CPU seconds):")
    for n in names:
        print(f"  {n:<12} {best[n]['wall_s']:7.3f} / {best[n]['cpu_s']:7.3f}   {' '.join(CASES[n][0][-4:])}")
    print(f"  api / reference: {ratio['wall_s']:.3f} wall, {ratio['cpu_s']:.3f} CPU (goal <= "
          f"{GOALS['api_over_reference']}); goals met: {figures['met']}")
    record("start_time", figures, a)
    print(f"results: {write_results('start_time', figures, a.out)}")


if __name__ == "__main__":
    main()
