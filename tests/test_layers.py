"""The house rules that can be checked mechanically: imports only go down the layers (pyproject.toml's
import-linter contract, function-local imports included), ``import quantdyn`` is free of side effects,
and the public API is what quantdyn.api says."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _lint(config: Path) -> subprocess.CompletedProcess:
    """import-linter in a process of its own: it reconfigures logging (disabling every existing logger)."""
    code = ("import sys; from importlinter.cli import lint_imports; "
            "sys.exit(lint_imports(config_filename=sys.argv[1], no_cache=True))")
    return subprocess.run([sys.executable, "-c", code, str(config)], capture_output=True, text=True, cwd=ROOT)


def test_imports_only_go_down_the_layers():
    res = _lint(ROOT / "pyproject.toml")
    assert res.returncode == 0, res.stdout[-4000:]  # the broken imports, with the lines that make them


def test_the_contract_sees_the_real_imports(tmp_path):
    """The contract is not vacuous: the same contract with two layers swapped (results above report, whose
    figures read the store) is broken."""
    text = (ROOT / "pyproject.toml").read_text()
    assert '  "report | launch",\n' in text and '  "results",\n' in text
    swapped = text.replace('  "report | launch",\n', '  "@@",\n').replace('  "results",\n', '  "report | launch",\n')
    (tmp_path / "pyproject.toml").write_text(swapped.replace('  "@@",\n', '  "results",\n'))
    res = _lint(tmp_path / "pyproject.toml")
    assert res.returncode == 1 and "quantdyn.report" in res.stdout and "quantdyn.results" in res.stdout


def test_import_quantdyn_is_free_of_side_effects():
    code = ("import sys, quantdyn; print([m for m in sys.modules if m.startswith(('torch', 'transformers', 'quantdyn.'))]); "
            "print(quantdyn.__version__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[]" and out[1]


def test_public_api_names_resolve_to_their_modules():
    import inspect

    from quantdyn import api

    drawing = {"run_study", "write_report"}  # imported on first use (api.__getattr__): they import matplotlib
    assert sorted(api.__all__) == sorted({n for n in vars(api) if not n.startswith("_") and n != "annotations"} | drawing)
    for name in api.__all__:
        obj = getattr(api, name)
        assert inspect.isclass(obj) or inspect.isfunction(obj), name
        assert obj.__module__.startswith("quantdyn."), name
        if name != "QuantdynError":
            assert obj.__doc__, f"{name} has no docstring"


def _contract_layers() -> list[list[str]]:
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as f:
        (contract,) = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    return [sorted(x.strip() for x in layer.split("|")) for layer in contract["layers"]]


def test_the_package_docstring_draws_the_contract():
    """The layer picture is written once, in quantdyn/__init__.py's docstring; each of its rows names one layer of the
    contract, top to bottom, so the picture cannot drift from what lint-imports checks."""
    import quantdyn

    doc = quantdyn.__doc__
    picture = doc[doc.index("    __main__"):].split("\n\n")[0]
    rows = [line.strip().split("  ")[0] for line in picture.splitlines() if line.startswith("    ") and line[4] != " "]
    drawn = [sorted(x.strip().rstrip("/") for x in row.replace(" ", "").split("|")) for row in rows]
    assert drawn == _contract_layers()


def test_every_package_is_in_the_contract():
    """exhaustive = true in the contract; here the folder list itself: every package and top-level module of quantdyn
    is a layer (a new folder cannot be left out of the picture)."""
    names = {p.stem if p.suffix == ".py" else p.name for p in (ROOT / "quantdyn").iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    assert names == {n for layer in _contract_layers() for n in layer}


def test_modules_that_start_the_quantizer_registry_import_first_in_a_fresh_process():
    """quantdyn.export imports quantize/rotation, which imports gptq, whose registration loads every built-in
    quantizer module, quantize/plan among them, while rotation is still half imported: plan must not take a name
    from rotation at import (it did, and `import quantdyn.export` first failed with a circular ImportError)."""
    import subprocess
    import sys

    for module in ("quantdyn.export", "quantdyn.ship.quantizations", "quantdyn.quantize.rotation"):
        r = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
        assert r.returncode == 0, (module, r.stderr[-1500:])
