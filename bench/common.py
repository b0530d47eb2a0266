"""What every benchmark shares: a description of the machine, and one JSON file per `make bench` run.

    make bench                                   # every benchmark in quick mode
    make bench BENCH_MODE=                       # the full benchmarks
    .venv/bin/python bench/common.py --quick     # what `make bench` runs

The runner gives each benchmark the path of this run's file in ``$QUANTDYN_BENCH_RESULTS``; a
benchmark stores its figures with :func:`record` (a no-op when run by hand, so a benchmark
still works on its own).  The file, ``bench/results/<machine>-<date>.json``:

    {"machine": {...}, "date": ..., "mode": "quick", "git_sha": ...,
     "benches": {"train_throughput": {"figures": {...}, "args": {...}, "status": "ok",
                                      "exit_code": 0, "seconds": 41.2, "output": "..."}, ...}}

A benchmark that does not record figures still has its printed output kept; one that fails is
recorded as such, the others still run, and the runner exits non-zero at the end.
The cross-checks (``crosscheck_*.py``) need venvs of their own and run with `make crosscheck`.
"""
from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS_ENV = "QUANTDYN_BENCH_RESULTS"
RESULTS_DIR_ENV = "QUANTDYN_BENCH_RESULTS_DIR"  # where results files go (default bench/results; tests use a tmp dir)
NOT_BENCHMARKS = {"common.py", "gpu_check.py"}  # gpu_check: `make gpu-check`, on a GPU machine
SEPARATE = ("crosscheck_",)  # run by `make crosscheck` in their own venvs


# ------------------------------------------------------------------ machine
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _git_sha() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=HERE, capture_output=True, text=True,
                             timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return (sha + ("-dirty" if dirty else "")) if sha else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _versions(*packages: str) -> dict[str, str | None]:
    """Installed versions of ``packages`` (None where one is not installed), read without importing them."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for p in packages:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            out[p] = None
    return out


def machine() -> dict[str, Any]:
    """CPU, memory, GPUs and software of this machine (no host name)."""
    import torch

    m: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gb": _memory_gb(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        **_versions("transformers", "numpy", "triton"),
        "gpus": [],
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            m["gpus"].append({"name": p.name, "memory_gb": round(p.total_memory / 2**30, 1),
                              "capability": f"{p.major}.{p.minor}"})
        m["cuda_driver"] = _nvidia_driver()
    return m


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
        return out.splitlines()[0] if out else None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_slug(m: dict[str, Any]) -> str:
    """A file-name-safe name of the machine: the GPU model and count, else the CPU model and cores."""
    if m["gpus"]:
        name = f"{m['gpus'][0]['name']}-x{len(m['gpus'])}"
    else:
        cpu = re.sub(r"\((R|TM)\)|CPU|Processor|@.*$|\d+-Core", "", m["cpu"], flags=re.I)
        name = f"cpu-{cpu}-{m['cpu_count']}c"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def results_dir() -> Path:
    """bench/results, or ``$QUANTDYN_BENCH_RESULTS_DIR`` when set."""
    return Path(os.environ.get(RESULTS_DIR_ENV) or HERE / "results")


def results_path(root: Path | None = None, m: dict[str, Any] | None = None, date: str | None = None,
                 name: str = "", suffix: str = "") -> Path:
    """``root/[<name>-]<machine>-<date>[-<suffix>].json`` (root: :func:`results_dir`); a second run on the same
    day gets ``-2``, ``-3``, ... (nothing is overwritten)."""
    root = root or results_dir()
    parts = (name, machine_slug(m or machine()), date or time.strftime("%Y-%m-%d"), suffix)
    stem = "-".join(x for x in parts if x)
    p, k = root / f"{stem}.json", 2
    while p.exists():
        p, k = root / f"{stem}-{k}.json", k + 1
    return p


# ------------------------------------------------------------------ recording
def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, default=str)
        f.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _update(path: Path, bench: str, **fields: Any) -> None:
    data = json.loads(path.read_text())
    data["benches"].setdefault(bench, {}).update(fields)
    _write(path, data)


def write_results(name: str, data: dict[str, Any], out: str | Path = "", suffix: str = "") -> Path:
    """A benchmark's own results file, beside what :func:`record` keeps for `make bench`: ``{"machine": ...,
    "date": ..., **data}`` written atomically to ``out``, else to
    ``bench/results/<name>-<machine>-<date>[-<suffix>].json`` (never over an earlier run's file). Returns the path."""
    m = machine()
    path = Path(out) if out else results_path(m=m, name=name, suffix=suffix)
    _write(path, {"machine": m, "date": time.strftime("%Y-%m-%d"), **data})
    return path


def record(bench: str, figures: dict[str, Any], args: Any = None) -> dict[str, Any]:
    """Store ``figures`` (numbers, lists, small dicts) of benchmark ``bench`` in this run's file;
    a no-op outside `make bench`. ``args``: the argparse namespace (or a dict) the figures came from."""
    path = os.environ.get(RESULTS_ENV)
    if path:
        a = vars(args) if hasattr(args, "__dict__") else (args or {})
        _update(Path(path), bench, figures=figures, args={k: v for k, v in a.items()})
    return figures


# ------------------------------------------------------------------ runner

def crosscheck_setup(out: str | Path):
    """The cross-checks' shared start: the output folder (created), at most 2 threads (as on the CI machine), and
    KJV tokenized with a 512-token BPE (400k tokens). Returns (out, prepared data)."""
    import torch

    from quantdyn.data.prepare import DataConfig, prepare_data

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    data = prepare_data(DataConfig(source="builtin:kjv", tokenizer="bpe:512", max_tokens=400_000,
                                   bpe_train_chars=400_000), progress=False)
    return out, data

def benchmarks() -> list[Path]:
    return [p for p in sorted(HERE.glob("*.py")) if p.name not in NOT_BENCHMARKS and not p.name.startswith(SEPARATE)]


@dataclass(frozen=True)
class Step:
    """One benchmark of a run: a child process whose figures land in the run's file under ``name``."""

    name: str
    cmd: list[str]
    """The command (``sys.executable`` first); it runs in the repo root with $QUANTDYN_BENCH_RESULTS set."""
    timeout_s: float | None = None
    """Killed after this many seconds (status 'timeout'); None = no limit."""
    ok_codes: tuple[int, ...] = (0,)
    """Exit codes that count as success (pytest's 5, 'no tests collected', where that is expected)."""


def run_step(step: Step, path: Path) -> dict[str, Any]:
    """Run ``step``, showing its output as it comes; record status, exit code, seconds and the output's tail in
    ``path`` under ``step.name``. Returns those fields."""
    print(f"\n## {step.name}: {' '.join(str(c) for c in step.cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    env = dict(os.environ, **{RESULTS_ENV: str(path)})
    proc = subprocess.Popen(step.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=HERE.parent, start_new_session=True)
    lines: list[str] = []
    timer = None
    if step.timeout_s is not None:
        import signal
        import threading

        def kill():  # the whole process group: a benchmark's own children (torchrun, measured cases) too
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        timer = threading.Timer(step.timeout_s, kill)
        timer.start()
    try:
        for line in proc.stdout:  # shown as it comes, kept for the file
            print(line, end="", flush=True)
            lines.append(line)
        rc = proc.wait()
    finally:
        if timer is not None:
            timer.cancel()
    seconds = round(time.perf_counter() - t0, 1)
    timed_out = step.timeout_s is not None and rc < 0 and seconds >= step.timeout_s - 1
    status = "timeout" if timed_out else ("ok" if rc in step.ok_codes else "failed")
    fields = dict(status=status, exit_code=rc, seconds=seconds, output="".join(lines)[-20000:])
    _update(path, step.name, **fields)
    print(f"## {step.name}: {status} in {seconds} s" + (f" (limit {step.timeout_s:.0f} s)" if timed_out else ""),
          flush=True)
    return fields


def start_run(mode: str, name: str = "", **fields: Any) -> Path:
    """A new results file ``bench/results/[<name>-]<machine>-<date>.json`` with the machine, date, mode and git
    SHA; the steps then add themselves to its ``benches``."""
    m = machine()
    path = results_path(m=m, name=name)
    _write(path, {"machine": m, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "mode": mode, "git_sha": _git_sha(),
                  **fields, "benches": {}})
    return path


def run_all(quick: bool, only: list[str] | None = None) -> Path:
    path = start_run("quick" if quick else "full")
    print(f"# make bench ({'quick' if quick else 'full'}) on {machine_slug(json.loads(path.read_text())['machine'])}"
          f" -> {path}", flush=True)
    failed = []
    for b in benchmarks():
        if only and b.stem not in only:
            continue
        if run_step(Step(b.stem, [sys.executable, str(b), *(["--quick"] if quick else [])]), path)["status"] != "ok":
            failed.append(b.stem)
    print(f"\nresults: {path}" + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    if failed:
        sys.exit(1)
    return path


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Run every benchmark in bench/ and write one JSON file per run.")
    ap.add_argument("--quick", action="store_true", help="each benchmark's quick mode (minutes on a CPU)")
    ap.add_argument("--only", default="", help="comma-separated benchmark names (default: all)")
    a = ap.parse_args()
    run_all(a.quick, [x for x in a.only.split(",") if x] or None)


if __name__ == "__main__":
    main()
