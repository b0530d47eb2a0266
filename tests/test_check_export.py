"""``quantdyn check-export EXPORT --checkpoint CKPT`` (issue 50.3): an export loads and computes the CE quantdyn
measured (exit 0), a damaged one does not (exit 1), and every usage error is one line, exit 2.

The compressed-tensors path runs here (transformers + compressed-tensors are in the main venv); GPTQ and GGUF
need GPTQModel / llama-cpp-python, whose absence must be one line naming what to install."""
from __future__ import annotations

import importlib.util
import json

import pytest

EVAL = ("--eval-tokens", 512, "--eval-seq-len", 64, "--calib-samples", 4, "--calib-seq-len", 32, "--quiet")


def _export(hf_models, out, quantizer):
    from quantdyn.sweep.quantize_one import quantize_one

    quantize_one(str(hf_models["llama"]), quantizer, out=out, export="compressed-tensors", eval_tokens=512,
                 eval_seq_len=64, calib_samples=4, calib_seq_len=32, progress=False)
    return out


@pytest.fixture(scope="module")
def ct_export(hf_models, tmp_path_factory):
    return _export(hf_models, tmp_path_factory.mktemp("ct") / "export", "rtn4g32")


@pytest.mark.parametrize("quantizer", ["rtn4g32", "gptq4g32+had"])
def test_an_export_agrees_with_quantdyns_measurement(cli, ct_export, hf_models, tmp_path, quantizer):
    """+had: transformers loads the codes but not the rotation; the command applies the transform_config."""
    if quantizer.endswith("+had"):
        pytest.importorskip("compressed_tensors.transform", reason="a +had export needs compressed_tensors.transform")
    export = ct_export if quantizer == "rtn4g32" else _export(hf_models, tmp_path / "had", quantizer)
    r = cli("check-export", export, "--checkpoint", hf_models["llama"], *EVAL)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"export {export} (compressed-tensors, quantizer {quantizer}), 8 windows"
    loaded, ours = float(lines[1].split()[2]), float(lines[2].split()[2])
    rms, tol = float(lines[3].split("RMS ")[1].split(",")[0]), float(lines[3].split("tolerance ")[1].split()[0])
    assert abs(loaded - ours) < 1e-4 and rms < 1e-4  # the same weights: equal to float rounding (test_export: 1e-5)
    assert rms <= tol and lines[-1].startswith("agrees:")
    assert "UNEXPECTED" not in r.stderr and "Applying" not in r.stderr  # --quiet: no library chatter


def test_a_damaged_export_does_not_agree(cli, ct_export, hf_models, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(ct_export, bad)
    tensors = load_file(bad / "model.safetensors")
    scales = [k for k in tensors if k.endswith("weight_scale")]
    assert scales
    for k in scales:  # every scale 1.5x: the weights the file computes with are no longer quantdyn's rtn4g32
        tensors[k] = tensors[k] * 1.5
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    r = cli("check-export", bad, "--checkpoint", hf_models["llama"], *EVAL)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1].startswith("DOES NOT AGREE")


def _one_line_exit_2(r, *words):
    assert r.returncode == 2, r.stdout + r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in err[0], err[0]


def test_usage_errors_are_one_line(cli, ct_export, hf_models, tmp_path):
    (tmp_path / "empty").mkdir()
    _one_line_exit_2(cli("check-export", tmp_path / "empty", "--checkpoint", hf_models["llama"]),
                     "is not a quantdyn export")
    _one_line_exit_2(cli("check-export", tmp_path / "nope", "--checkpoint", hf_models["llama"]), "does not exist")
    (tmp_path / "x.gguf").write_bytes(b"not gguf at all")
    _one_line_exit_2(cli("check-export", tmp_path / "x.gguf", "--checkpoint", hf_models["llama"]), "x.gguf")
    _one_line_exit_2(cli("check-export", ct_export, "--checkpoint", tmp_path / "no-checkpoint"), "no-checkpoint")
    _one_line_exit_2(cli("check-export", ct_export, "--checkpoint", hf_models["gpt2"], *EVAL),
                     "was not made from checkpoint", "model_type llama vs gpt2")
    _one_line_exit_2(cli("check-export", ct_export), "--checkpoint")


def test_a_missing_library_is_one_line_naming_it(cli, ct_export, hf_models, tmp_path, monkeypatch):
    import shutil

    gptq = tmp_path / "gptq"
    shutil.copytree(ct_export, gptq)
    prov = json.loads((gptq / "quantdyn_export.json").read_text())
    (gptq / "quantdyn_export.json").write_text(json.dumps({**prov, "format": "gptq"}))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("gptqmodel", "compressed_tensors")
                        else real(name, *a))
    _one_line_exit_2(cli("check-export", gptq, "--checkpoint", hf_models["llama"]), "gptqmodel, not installed", "pip install")
    _one_line_exit_2(cli("check-export", ct_export, "--checkpoint", hf_models["llama"]), "needs compressed_tensors",
                     "pip install compressed-tensors")


def test_a_gguf_export_names_its_quantizer_and_llama_cpp_is_asked_for(cli, hf_models, tmp_path):
    pytest.importorskip("gguf")
    from quantdyn.sweep.check_export import read_export_info
    from quantdyn.sweep.quantize_one import quantize_one

    out = tmp_path / "q4.gguf"
    quantize_one(str(hf_models["llama"]), "q4_0", out=out, export="gguf", eval_tokens=128, eval_seq_len=64,
                 calib_samples=2, calib_seq_len=32, progress=False)
    info = read_export_info(out)
    assert (info.format, info.quantizer, info.config) == ("gguf", "q4_0", {"num_hidden_layers": 2, "hidden_size": 64})
    if importlib.util.find_spec("llama_cpp") is None:
        _one_line_exit_2(cli("check-export", out, "--checkpoint", hf_models["llama"]), "llama-cpp-python")
        return
    # where llama-cpp-python is installed (make crosscheck-llamacpp): llama.cpp's own CE of the file agrees
    r = cli("check-export", out, "--checkpoint", hf_models["llama"], *EVAL)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1].startswith("agrees:"), r.stdout


def test_a_gptq_export_agrees_where_gptqmodel_loads_it(cli, hf_models, tmp_path):
    """The GPTQ path (optimum + GPTQModel, make crosscheck-load's environment; skipped where they are missing)."""
    pytest.importorskip("gptqmodel", reason="GPTQ exports load through gptqmodel (make crosscheck-load)")
    from quantdyn.sweep.quantize_one import quantize_one

    out = tmp_path / "gptq"
    quantize_one(str(hf_models["llama"]), "gptq4g32", out=out, export="gptq", eval_tokens=512, eval_seq_len=64,
                 calib_samples=4, calib_seq_len=32, progress=False)
    r = cli("check-export", out, "--checkpoint", hf_models["llama"], *EVAL)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1].startswith("agrees:"), r.stdout
