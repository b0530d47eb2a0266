"""A quiet, quick start (issue 39, item 6): `quantdyn -h` and usage errors (a mistyped quantizer label included)
answer without importing torch; the label catalogue that makes that possible is the registry's; drawing a report
leaves the process's matplotlib backend alone and ``import quantdyn.api`` imports no plotting library; and a normal
run's stderr holds quantdyn's own lines only, whichever optional libraries transformers finds installed.
bench/start_time.py times the start."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, **kw)


# Each command line, the exit status and a piece of its one line on stderr; run in one fresh interpreter that then
# says whether torch was imported.
USAGE = [
    (["-h"], 0, ""),
    (["quantize", "-h"], 0, ""),
    (["quantize", "some/model", "--quantizers", "gptqx3"], 2, "unknown quantizer 'gptqx3' (did you mean 'gptq'?)"),
    (["quantize", "some/model", "--quantizers", "q4_k_mm"], 2, "cannot read quantizer 'q4_k_mm' (did you mean 'q4_k_m'?)"),
    (["quantize", "some/model", "--quantizers", "q8_0-imatrix"], 2, "q8_0 takes no importance matrix"),
    (["quantize", "some/model", "--method", "gtpq"], 2, "unknown quantizer 'gtpq' (did you mean 'gptq'?)"),
    (["quantize", "some/model", "--quantizers", "rtn4", "--bits", "3"], 2, "give the quantizer once"),
    (["quantize", "some/model", "--bits", "four"], 2, "invalid value for --bits: 'four' is not an integer"),
    (["sweep", "--run", "some/run", "--quantizers", "rtm4"], 2, "did you mean 'rtn'?"),
    (["analyze", "some/ckpt", "--quantizers", "gptq3,awq9"], 2, "quantizer bits=9 is not supported"),
    (["frobnicate"], 2, "no such command 'frobnicate'"),
]


def test_help_and_usage_errors_import_no_torch():
    code = f"""
import contextlib, io, json, sys
from quantdyn.cli import main
out = []
for argv, _, _ in {USAGE!r}:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
            code = 0
        except SystemExit as e:
            code = e.code
    out.append([code, err.getvalue()])
print(json.dumps({{"runs": out, "torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules}}))
"""
    r = _python(code)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    for (argv, code, words), (rc, err) in zip(USAGE, got["runs"]):
        assert rc == code, (argv, rc, err)
        if code:
            assert words in err and len(err.strip().splitlines()) == 1 and err.startswith("error: "), (argv, err)
    assert not got["torch"] and not got["transformers"]


def test_a_lazy_registry_loads_once_on_first_use_and_other_threads_wait():
    import threading
    import time

    from quantdyn.registry import LazyRegistry

    calls = []

    def load():
        calls.append(1)
        reg.add("a", 1)
        time.sleep(0.2)  # another thread looks up meanwhile: it must see both entries, not half
        reg.add("b", 2)

    reg = LazyRegistry("thing", load=load)
    assert not reg.loaded and calls == []
    seen = []
    other = threading.Thread(target=lambda: seen.append(reg.names()))
    other.start()
    time.sleep(0.05)
    assert reg.names() == ["a", "b"] and "b" in reg
    other.join()
    assert seen == [["a", "b"]] and calls == [1] and reg.loaded

    def broken():
        calls.append(2)
        raise ImportError("no module named torch")

    failing = LazyRegistry("thing", load=broken)
    for _ in range(2):  # a failed load is tried again on the next lookup, not taken for an empty registry
        with pytest.raises(ImportError):
            failing.names()
    assert not failing.loaded and calls == [1, 2, 2]


def _catalogue_tool():
    spec = importlib.util.spec_from_file_location("quantizer_catalogue", ROOT / "tools" / "quantizer_catalogue.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_catalogue_file_is_the_registry():
    """quantize/catalogue.json (what a label is parsed against before the quantizers' modules are imported) lists
    every built-in quantizer of the registry with its format spec: `python tools/quantizer_catalogue.py` rewrites
    it after a quantizer or format is added."""
    from quantdyn.quantize.catalogue import CATALOGUE_FILE

    assert CATALOGUE_FILE.read_text() == _catalogue_tool().catalogue_text(), \
        "quantdyn/quantize/catalogue.json is out of date: run `python tools/quantizer_catalogue.py`"


PARSE = """
from quantdyn.config import to_dict
from quantdyn.errors import QuantdynError
from quantdyn.quantize.catalogue import parse_quantizer

def parse(label):
    try:
        qc = parse_quantizer(label)
        return [qc.name, to_dict(qc)]
    except QuantdynError as e:
        return str(e)
"""


def test_labels_parse_the_same_without_and_with_the_registry():
    """Every format label, the methods and a few spellings (presets, flags, -imatrix, -head) and bad labels give the
    same config, canonical label or error in a process without torch as with the quantizers imported."""
    from quantdyn.quantize.catalogue import QUANTIZERS, format_labels

    good = sorted(format_labels()) + ["q4_k_m-head", "fp8-nohead", "q4_0-imatrix-head", "gptq3", "rtn4g64",
                                      "awq4-sym", "gptq4-gptqmodel-v5", "gptq3-act-damp0.1", "rtn2g0", "Q4_K_M"]
    bad = ["gptqx3", "q4_k_mm", "q8_0-imatrix", "nf4-imatrix", "fp8-sym", "awq9", "rtn4g-1", "q4_k-imatrixx"]
    labels = good + bad
    r = _python(PARSE + f"""
import json, sys
print(json.dumps({{"parsed": [parse(x) for x in {labels!r}], "torch": "torch" in sys.modules}}))
""")
    assert r.returncode == 0, r.stderr[-3000:]
    without = json.loads(r.stdout)
    assert not without["torch"]
    assert QUANTIZERS.names()  # the registry's modules are imported here
    here: dict = {}
    exec(PARSE, here)
    with_registry = [here["parse"](x) for x in labels]
    assert without["parsed"] == json.loads(json.dumps(with_registry))
    assert [isinstance(p, str) for p in with_registry] == [False] * len(good) + [True] * len(bad)


def test_import_api_imports_no_plotting_and_reports_leave_the_backend_alone(tmp_path):
    """`import quantdyn.api` imports no matplotlib; importing every drawing module and drawing a figure keeps the
    backend the caller chose (they used to switch it to Agg) and writes the figure through Agg all the same."""
    code = f"""
import sys
import quantdyn.api as qd
assert "matplotlib" not in sys.modules, "import quantdyn.api imported matplotlib"
import matplotlib
matplotlib.use("svg")
import quantdyn.report.html, quantdyn.report.predictors, quantdyn.report.error_maps, quantdyn.studies.section
from quantdyn.report.output import save_figure, subplots
qd.write_report
fig, ax = subplots(figsize=(2, 2))
ax.plot([0, 1], [1, 0])
paths = save_figure(fig, {str(tmp_path / "f")!r})
print(matplotlib.get_backend(), "matplotlib.pyplot" in sys.modules, *[p.name for p in paths])
"""
    r = _python(code)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["svg", "False", "f.png", "f.svg"]
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------------ the quiet run
# quantdyn's own stderr lines in these runs: progress and summaries ("<what>: ..."), notes and errors.
OWN_LINE = re.compile(r"^(tokenizing \S+: |sweep: |note: |error: )")
_TINY = ["--calib-samples", "4", "--calib-seq-len", "32", "--eval-seq-len", "32", "--eval-tokens", "1024"]


def _quantdyn(*args, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHONWARNINGS")}
    return subprocess.run([sys.executable, "-m", "quantdyn", *map(str, args)], capture_output=True, text=True,
                          timeout=600, cwd=cwd, env=env)


@pytest.mark.e2e
def test_a_normal_run_prints_only_quantdyns_lines(tiny_checkpoint, hf_models, tmp_path):
    """`quantdyn quantize --method rtn` and `quantdyn sweep` on a tiny quantdyn checkpoint and on a tiny HF LLaMA
    checkpoint, each in a fresh process of this (the default) install: stderr holds quantdyn's own lines only. With
    torchao installed (the test extra), loading the HF model used to add six lines of import noise before them."""
    spec = tmp_path / "sweep.yaml"
    spec.write_text("data: {calib_samples: 4, calib_seq_len: 32, eval_windows: 8, eval_seq_len: 32}\n")
    runs = {}
    for name, ckpt in (("quantdyn", tiny_checkpoint), ("hf-llama", hf_models["llama"])):
        runs[f"quantize {name}"] = _quantdyn("quantize", ckpt, "--method", "rtn", *_TINY, cwd=tmp_path)
        runs[f"sweep {name}"] = _quantdyn("sweep", spec, "--checkpoint", ckpt, "--quantizers", "rtn4", "--store",
                                          tmp_path / f"store-{name}", cwd=tmp_path)
    for what, r in runs.items():
        assert r.returncode == 0, (what, r.stderr[-3000:])
        foreign = [line for line in r.stderr.splitlines() if not OWN_LINE.match(line)]
        assert not foreign, (what, foreign)
    assert "quantizer rtn4" in runs["quantize hf-llama"].stdout
    assert "sweep: 2 rows written" in runs["sweep hf-llama"].stdout


@pytest.mark.e2e
def test_the_import_noise_is_real_and_only_it_is_dropped():
    """Without quantdyn's filter, loading transformers' model code with torchao installed logs exactly the lines
    cli.app.IMPORT_NOISE names (so the filter is needed and matches them); with it, nothing; another warning of
    the same loggers still prints."""
    pytest.importorskip("torchao", reason="the noise comes from torchao; without it there is nothing to filter")
    load = ("import logging; logging.basicConfig(level=logging.WARNING, format='%(message)s'); {quiet}"
            "import transformers.modeling_utils; logging.getLogger('torchao').warning('a real torchao warning')")
    noisy = _python(load.format(quiet=""))
    quiet = _python(load.format(quiet="from quantdyn.cli.app import quiet_import_noise; quiet_import_noise(); "))
    assert noisy.returncode == 0 and quiet.returncode == 0, (noisy.stderr[-2000:], quiet.stderr[-2000:])
    from quantdyn.cli.app import IMPORT_NOISE

    patterns = [p for ps in IMPORT_NOISE.values() for p in ps]
    noise = noisy.stderr.strip().splitlines()[:-1]
    assert noise and all(any(p in line for p in patterns) for line in noise), noisy.stderr
    assert {p for p in patterns if any(p in line for line in noise)} == set(patterns)  # each pattern still occurs
    assert quiet.stderr.strip().splitlines() == ["a real torchao warning"]
