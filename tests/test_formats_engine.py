"""The deployment formats through the engine, sweeps, the monitor and the report, like any quantizer:
labels, bits per weight in every row, llama.cpp's fallbacks recorded, the importance matrix from the walk's
calibration statistics, and W8A8's activation quantization inside the block walk."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_run_dict

from quantdyn.config import from_dict
from quantdyn.engine.measure import measure
from quantdyn.engine.walk import quantize_model
from quantdyn.errors import QuantdynError
from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config
from quantdyn.quantize import float_formats as ff
from quantdyn.quantize.catalogue import QUANTIZERS, grid_bits_per_weight, parse_quantizer

LABELS = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q3_k_m", "q4_k_m",
          "q5_k_m", "q4_k-imatrix", "q4_k_m-imatrix", "fp8", "fp8-channel", "w8a8-fp8", "nf4", "mxfp4", "nvfp4"]


def test_labels_parse_like_todays_and_round_trip():
    for label in LABELS:
        qc = parse_quantizer(label)
        assert qc.name == label and parse_quantizer(qc.name) == qc
        assert parse_quantizer(f"{label}-head").quantize_head and parse_quantizer(label.upper()) == qc
    assert parse_quantizer("fp8_channel").name == "fp8-channel"
    assert (parse_quantizer("q6_k").bits, parse_quantizer("q6_k").group_size) == (6, 16)
    assert parse_quantizer({"method": "nvfp4"}).group_size == 16
    for bad, msg in [("q4_km", "did you mean 'q4_k_m'"), ("nf4-sym", "takes only -head"),
                     ("q8_0-imatrix", "takes no importance matrix"), ("fp9", "did you mean 'fp8'"),
                     ({"method": "q4_k", "bits": 3}, "bits=4 by definition"),
                     ({"method": "nf4", "act_order": True}, "act_order does not apply to the format nf4")]:
        with pytest.raises(QuantdynError, match=msg):
            parse_quantizer(bad)
    # the integer grids keep their hashes: formats added no QuantConfig field
    assert parse_quantizer("gptq4").name == "gptq4"


def test_bits_per_weight_of_each_format():
    rows = {"q4_0": 4.5, "q8_0": 8.5, "q2_k": 2.625, "q3_k": 3.4375, "q4_k": 4.5, "q5_k": 5.5, "q6_k": 6.5625,
            "mxfp4": 4.25}
    W = torch.randn(8, 512)
    for label, bpw in rows.items():
        res = QUANTIZERS.get(parse_quantizer(label).method).fn(W, None, parse_quantizer(label))
        assert res.bits_per_weight == bpw, label
    nf4 = QUANTIZERS.get("nf4").fn(W, None, parse_quantizer("nf4"))
    assert nf4.bits_per_weight == pytest.approx(4 + 8 / 64 + 32 / 4096 + 32 / 4096)  # one absmax2 per 256 absmax
    assert grid_bits_per_weight(parse_quantizer("rtn4"), 8, 512) == 4 + 20 / 128
    assert grid_bits_per_weight(parse_quantizer("gptq4-sym-act"), 8, 512) == 4 + 16 / 128 + 32 / 8


def tiny(d: int = 64, n_layer: int = 2) -> GPT:
    torch.manual_seed(0)
    return GPT(resolve_model_config(ModelConfig(n_layer=n_layer, d_model=d, n_head=2, max_seq_len=64, vocab_size=128)))


def test_measure_rows_fallbacks_imatrix_and_w8a8():
    model = tiny()
    ev = torch.randint(0, 128, (6, 33), generator=torch.Generator().manual_seed(1))
    cal = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(2))
    labels = ["q4_k_m", "q4_k_m-imatrix", "fp8-channel", "w8a8-fp8", "nf4"]
    m = measure(model, {x: x for x in labels}, ev, cal)
    q = m.quantizations
    # width 64: the k-quant tensors with rows of 64 take llama.cpp's fallback (Q4_K -> Q5_0, Q6_K -> Q8_0),
    # recorded per layer; ffn_down (rows of 256) keeps its recipe type (block 1 of 2 is in the last eighth: Q6_K)
    types = {r["name"]: (r["gguf_type"], r.get("gguf_fallback_from")) for r in q["q4_k_m"].rows if r["block"] == 1}
    assert types == {"attention.query_key_value": ("q8_0", "q6_K"), "attention.dense": ("q5_0", "q4_K"),
                     "mlp.dense_h_to_4h": ("q5_0", "q4_K"), "mlp.dense_4h_to_h": ("q6_K", None)}
    assert {r["bits_per_weight"] for r in q["q4_k_m"].rows} == {4.5, 5.5, 6.5625, 8.5}
    # the importance matrix is the calibration set's: same types, other decisions
    assert q["q4_k_m-imatrix"].n_calibration == 4 and m.metrics["q4_k_m-imatrix"]["kl"] != m.metrics["q4_k_m"]["kl"]
    # W8A8: the same weights as fp8-channel, plus activations rounded to FP8 per token
    assert m.metrics["w8a8-fp8"]["kl"] != m.metrics["fp8-channel"]["kl"]
    assert all(r["bits_per_weight"] == 8 + 32 / r["in_features"] for r in q["w8a8-fp8"].rows)


def test_w8a8_quantizes_every_linear_input():
    model = tiny()
    quantize_model(model, None, "w8a8-fp8", progress=False)
    lin = model.gpt_neox.layers[0].mlp.dense_4h_to_h
    x = torch.randn(3, 5, lin.in_features) * 4
    assert torch.equal(lin(x), F.linear(ff.fp8_per_token(x), lin.weight, lin.bias))
    fp8 = tiny()
    quantize_model(fp8, None, "fp8-channel", progress=False)
    assert torch.equal(fp8.gpt_neox.layers[0].mlp.dense_4h_to_h.weight, lin.weight)  # weights alike


def test_rows_that_fit_no_format_are_one_line():
    model = GPT(resolve_model_config(ModelConfig(n_layer=1, d_model=48, n_head=2, max_seq_len=32, vocab_size=64)))
    ev = torch.randint(0, 64, (2, 17))
    with pytest.raises(QuantdynError, match=r"^layer attention.query_key_value of block 0 has 48 input features; "
                                            r"nf4 needs a multiple of 64"):
        measure(model, {"nf4": "nf4"}, ev)
    with pytest.raises(QuantdynError, match="needs calibration data"):
        measure(model, {"q4_k-imatrix": "q4_k-imatrix"}, ev)


@pytest.fixture(scope="module")
def format_run(tmp_path_factory, kjv_small):
    from quantdyn.train.config import RunConfig
    from quantdyn.train.trainer import train

    data_cfg, _ = kjv_small
    d = tiny_run_dict(tmp_path_factory.mktemp("fmt"), data_cfg, steps=8, checkpoint_every=4)
    d["name"] = "fmt"
    d["model"] = {"n_layer": 2, "d_model": 64, "n_head": 2, "max_seq_len": 64}
    return train(from_dict(RunConfig, d), progress=False)


def test_tiny_sweep_and_report_take_the_formats(format_run, tmp_path):
    from quantdyn.report.html import write_page
    from quantdyn.results.store import ResultStore
    from quantdyn.sweep.sweep import SweepConfig, run_sweep

    store = tmp_path / "store"
    quantizers = ["rtn4", "q4_k_m", "fp8", "nf4", "nvfp4"]
    cfg = from_dict(SweepConfig, {"trajectory": {"run": str(format_run)}, "quantizers": quantizers,
                                  "store": str(store), "data": {"calib_samples": 4, "calib_seq_len": 32,
                                                                "eval_windows": 8, "eval_seq_len": 32}})
    out = run_sweep(cfg, progress=False)
    assert out["written"] == 2 * (1 + len(quantizers))
    rows = [r for r in ResultStore(store).rows() if r["kind"] == "ptq"]
    assert {r["quantizer"] for r in rows} == set(quantizers)
    bpw = {r["quantizer"]: r["bits_per_weight"] for r in rows}
    # rtn4 (group 128, asymmetric): rows of 64 hold one group, the MLP's rows of 256 two; weighted by layer size
    assert bpw["rtn4"] == pytest.approx((2 * 16384 * (4 + 20 / 64) + 16384 * (4 + 20 / 128)) / 49152)
    assert bpw["fp8"] > 8 and 4.5 < bpw["nvfp4"] < 4.51 and 4.12 < bpw["nf4"] < 4.14
    fallback = {r["quantizer"]: r["format_fallbacks"] for r in rows}
    assert fallback["q4_k_m"] and all(v.endswith(("->q5_0", "->q8_0")) for v in fallback["q4_k_m"].values())
    assert fallback["nf4"] is None
    assert run_sweep(cfg, progress=False)["written"] == 0  # idempotent like any quantizer
    page = write_page(format_run, tmp_path / "rep", store=store)
    assert "q4_k_m" in page.read_text() and "nvfp4" in page.read_text()


def test_monitor_takes_format_labels(format_run):
    from quantdyn.monitor.ptq import PTQMonitor

    model = tiny()
    ev = torch.randint(0, 128, (4, 33))
    mon = PTQMonitor(["q4_k_m", "nvfp4", "w8a8-fp8"], ev, every=1)
    got = mon.measure(model)
    assert {k.split("/")[1] for k in got if k.count("/") == 2} == {"q4_k_m", "nvfp4", "w8a8-fp8"}
    with pytest.raises(QuantdynError, match="needs calibration data"):
        PTQMonitor(["q4_k_m-imatrix"], ev)


def test_imatrix_comes_from_full_precision_activations():
    """As llama-imatrix: block 1's importance matrix is the FP model's mean x^2 there, not the quantized stream's."""
    from quantdyn.quantize import gguf as qg
    from quantdyn.quantize.formats import imatrix_from_stats
    from quantdyn.quantize.gptq import stats_update

    model = tiny(d=256)
    cal = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(2))
    got = {}
    measure(model, {"q4_k-imatrix": "q4_k-imatrix"}, None, cal,
            on_layer=lambda label, full, res, m: got.setdefault(full, res.codes.clone()))
    layer = model.gpt_neox.layers[1].mlp.dense_h_to_4h
    stats = {}
    hook = layer.register_forward_hook(lambda m, i, o: stats.update(s=stats_update(None, i[0].detach())))
    with torch.no_grad():
        model(cal)
    hook.remove()
    want = qg.quantize_gguf(layer.weight.detach(), "q4_k", imatrix_from_stats(stats["s"])).codes
    assert torch.equal(got["gpt_neox.layers.1.mlp.dense_h_to_4h"], want)
