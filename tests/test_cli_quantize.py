"""`quantdyn quantize` end to end on a quantdyn checkpoint and on locally saved
HF LLaMA- and GPT-2-family models (conftest's hf_models; no hub access)."""
import json

import pytest
import torch


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_quantize_local_hf_models(hf_models, family, tmp_path, cli):
    r = cli("quantize", *[str(hf_models[family]), "--method", "gptq", "--bits", "4", "--group-size", "32", "--calib-samples", "4",
              "--eval-tokens", "2048", "--json", "--save", str(tmp_path / "q")])  # --save: the old spelling of --out
    assert r.returncode == 0, r.stderr[-1500:]
    row = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.stderr.strip().splitlines()[-1] == "note: quantize --save is deprecated; use --out"
    assert row["method"] == "gptq" and row["bits"] == 4 and row["n_windows"] == 16
    assert row["kl"] >= 0 and 0 < row["top1_agree"] <= 1 and row["git_sha"]
    assert len(row["layers"]) == (7 if family == "llama" else 4) * 2
    assert {"config.json", "model.safetensors", "quant_codes.safetensors", "quant_config.json"} <= {
        p.name for p in (tmp_path / "q").iterdir()}
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "q")  # the saved fake-quantized model loads


def test_quantize_quantdyn_checkpoint_table_and_errors(tmp_path, tiny_checkpoint, cli):
    ck = str(tiny_checkpoint)
    short = ["--calib-seq-len", "32", "--eval-seq-len", "32", "--eval-tokens", "2048"]
    r = cli("quantize", ck, "--method", "rtn", "--bits", "3", "--group-size", "0", *short)
    assert r.returncode == 0, r.stderr[-1500:]
    assert "CE (nats)" in r.stdout and "KL(FP||Q)" in r.stdout
    for args, msg in [(["--bits", "1"], "bits=1 is not supported"),
                      (["--method", "gtpq"], "did you mean 'gptq'"),
                      (["--calib-samples", "0"], "calibration set is empty")]:
        r = cli("quantize", ck, *args, *short)
        assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = cli("quantize", str(tmp_path / "missing"), "--bits", "3")
    assert r.returncode == 2 and "does not exist" in r.stderr
    # a quantizer is a label too; several are measured in one pass, each as it would be alone
    r = cli("quantize", ck, "--quantizers", "rtn3g0,rtn4", "--json", *short)
    assert r.returncode == 0, r.stderr[-1500:]
    rows = [json.loads(line) for line in r.stdout.strip().splitlines()]
    assert [x["quantizer"] for x in rows] == ["rtn3g0", "rtn4"] and rows[0]["ce_fp"] == rows[1]["ce_fp"]
    alone = json.loads(cli("quantize", ck, "--quantizers", "rtn4", "--json", *short).stdout.strip())
    # the same operations on the same windows, whatever else shares the pass
    assert alone["delta_ce"] == pytest.approx(rows[1]["delta_ce"], rel=1e-9, abs=1e-12)
    table = cli("quantize", ck, "--method", "rtn", "--bits", "3", "--group-size", "0", *short)
    assert table.returncode == 0 and "quantizer rtn3g0 " in table.stdout  # the long flags name the same quantizer
    for args, msg in [(["--quantizers", "rtn4", "--bits", "3"], "give the quantizer once: --quantizers LABELS or --bits"),
                      (["--quantizers", "rtn3,rtn4", "--out", str(tmp_path / "o")], "--out writes the model of one quantizer"),
                      (["--quantizers", "rtn4,rtn4g128"], "given twice"),
                      (["--quantizers", "rtm4"], "did you mean 'rtn'"),
                      (["--export", "gptq"], "--export and --push-to-hub need --out, the directory")]:
        r = cli("quantize", ck, *args, *short)
        assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not (tmp_path / "o").exists()
    # old spellings keep working, each with one note on stderr naming the new one
    r = cli("quantize", ck, "--method", "gptq", "--bits", "4", "--preset", "gptqmodel", "--calib-samples", "4",
            "--json", *short)
    assert r.returncode == 0 and json.loads(r.stdout.strip())["quantizer"] == "gptq4-gptqmodel"
    assert r.stderr.strip().splitlines()[-1] == ("note: quantize --preset is deprecated; write the preset into the "
                                                 "label: --quantizers gptq4-gptqmodel")
    # another checkpoint directory with the same tokenizer reuses the token cache (no re-tokenization)
    import shutil

    other = shutil.copytree(ck, tmp_path / "elsewhere")
    r = cli("quantize", str(other), "--method", "rtn", "--bits", "4", *short)
    assert r.returncode == 0 and "tokenizing" not in r.stderr


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors"])
def test_quantize_export_streams_a_deployable_checkpoint(hf_models, fmt, tmp_path, cli):
    """`quantize --export FMT --out DIR` writes the format through the streamed engine; its codes read back
    exactly as the engine's, and what the format cannot hold is refused before any work."""
    from safetensors.torch import load_file

    from quantdyn.export import read_export

    args = ["quantize", hf_models["llama"], "--method", "gptq", "--bits", "4", "--group-size", "32",
            "--calib-samples", "4", "--eval-tokens", "1024", "--json"]
    out = tmp_path / fmt
    r = cli(*args, "--export", fmt, "--out", out)
    assert r.returncode == 0, r.stderr[-1500:]
    row = json.loads(r.stdout.strip().splitlines()[-1])
    assert row["export"]["format"] == fmt and "quantization_config" in json.loads((out / "config.json").read_text())
    assert (out / "tokenizer.json").is_file()
    assert cli(*args, "--out", tmp_path / "fake").returncode == 0  # quantdyn's own layout, same run
    codes = load_file(str(tmp_path / "fake" / "quant_codes.safetensors"))
    layers = dict(read_export(out).layers())
    assert len(layers) == 7 * 2
    for name, layer in layers.items():
        assert torch.equal(layer.codes, codes[f"{name}.codes"]), name  # the engine's decisions, exactly
        assert torch.equal(layer.g_idx.long(), codes[f"{name}.g_idx"].long()), name
    cache = tmp_path / "fresh-cache"  # a refused export is refused before any data is tokenized
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QUANTDYN_CACHE", str(cache))
        r = cli("quantize", hf_models["llama"], "--method", "rtn", "--bits", "2", "--group-size", "128", "--export",
                "compressed-tensors", "--out", tmp_path / "two")  # a group size chosen: kept, and 64 wide refuses it
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "two").exists()
    assert "group_size 128 does not divide 64" in r.stderr and "quantize with rtn2g64" in r.stderr, r.stderr
    assert not cache.exists() or not any(cache.iterdir()), "the refused export tokenized its data first"
    r = cli("quantize", hf_models["llama"], "--export", "gptq")
    assert r.returncode == 2 and "--out" in r.stderr
    if fmt == "gptq":  # --export-option reaches the format: v2 zero points, read back to the same codes
        r = cli(*args, "--export", fmt, "--export-option", "checkpoint_format=gptq_v2", "--out", tmp_path / "v2")
        assert r.returncode == 0, r.stderr[-1500:]
        qcfg = json.loads((tmp_path / "v2" / "config.json").read_text())["quantization_config"]
        assert qcfg["checkpoint_format"] == "gptq_v2"
        for name, layer in read_export(tmp_path / "v2").layers():
            assert torch.equal(layer.codes, codes[f"{name}.codes"]), name
    for bad, msg in ((["--export-option", "checkpoint_format"], "KEY=VALUE"),
                     (["--export-option", "nonsense=1"], "nonsense")):
        r = cli(*args, "--export", fmt, *bad, "--out", tmp_path / "bad")
        assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not (tmp_path / "bad").exists()


def test_an_unspelled_group_size_fits_the_models_widths(hf_models, tmp_path, cli):
    """gptq4's default group of 128 does not divide the 64-wide LLaMA: the compressed-tensors export takes 64, the
    row names the quantizer measured (rtn4g64) and why, and the written config holds group 64."""
    import json

    out = tmp_path / "ct"
    r = cli("quantize", hf_models["llama"], "--quantizers", "rtn4", "--export", "compressed-tensors", "--out", out,
            "--calib-samples", "4", "--calib-seq-len", "32", "--eval-tokens", "1024", "--eval-seq-len", "32", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    row = json.loads(r.stdout.strip().splitlines()[-1])
    assert row["quantizer"] == "rtn4g64" and row["export"]["fitted"].startswith("group size 64, the largest")
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    assert [g["weights"]["group_size"] for g in groups.values()] == [64]
