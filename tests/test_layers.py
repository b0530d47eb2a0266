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
    assert '  "report",\n' in text and '  "results",\n' in text
    swapped = text.replace('  "report",\n', '  "@@",\n').replace('  "results",\n', '  "report",\n')
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

    assert sorted(api.__all__) == sorted(n for n in vars(api) if not n.startswith("_") and n != "annotations")
    for name in api.__all__:
        obj = getattr(api, name)
        assert inspect.isclass(obj) or inspect.isfunction(obj), name
        assert obj.__module__.startswith("quantdyn."), name
        if name != "QuantdynError":
            assert obj.__doc__, f"{name} has no docstring"
