"""The streamed measurement engine against a reference path kept here, in the tests only.

The reference quantizes an in-memory copy of the whole model the naive way (for each block,
run the whole partly quantized model on the calibration set with hooks on that block's layers,
then quantize them) and measures with full-model forwards (``compare_many``). The engine reads
the checkpoint lazily one block at a time, shares the FP forward and must make the same
decisions: codes equal exactly; Δ CE / KL / agreement equal to float rounding.
"""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from quantdyn.engine.blockwise import run_model
from quantdyn.engine.lazy_model import LazyModel
from quantdyn.engine.measure import MeasureConfig, measure
from quantdyn.errors import QuantdynError
from quantdyn.evaluate.loss import window_losses
from quantdyn.evaluate.quant_error import compare_many
from quantdyn.models.adapters import adapter_for, get_weight, set_weight
from quantdyn.models.gpt import GPT, ModelConfig, resolve_model_config
from quantdyn.models.hf_io import load_causal_lm, save_hf
from quantdyn.quantize.catalogue import QUANTIZERS, parse_quantizer
from quantdyn.quantize.gptq import stats_update
from quantdyn.sources.hub import open_checkpoint

V = 128


def tiny(kind: str) -> nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    kw = dict(vocab_size=V, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128,
              max_position_embeddings=64)
    gqa = dict(kw, num_key_value_heads=2)
    if kind == "quantdyn":
        return GPT(resolve_model_config(ModelConfig(n_layer=3, d_model=64, n_head=4, max_seq_len=64, vocab_size=V)))
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**gqa)).eval()
    if kind == "olmo2":
        return tf.Olmo2ForCausalLM(tf.Olmo2Config(**gqa)).eval()
    if kind == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_embd=64, n_layer=3, n_head=4, n_positions=64,
                                                bos_token_id=0, eos_token_id=0)).eval()
    if kind == "qwen2":  # sliding-window layers get another mask than full-attention layers
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**dict(gqa, num_hidden_layers=4), use_sliding_window=True,
                                                  sliding_window=4,
                                                  layer_types=["full_attention", "sliding_attention"] * 2)).eval()
    raise ValueError(kind)


def ids(n, L, seed):
    return torch.randint(0, V, (n, L), generator=torch.Generator().manual_seed(seed))


def save(model, path: Path, **kw) -> Path:
    if isinstance(model, GPT):
        return save_hf(model, path)
    model.save_pretrained(path, **kw)
    return path


@torch.no_grad()
def reference_quantize(model: nn.Module, calib: torch.Tensor, qc) -> dict[str, torch.Tensor]:
    """Naive sequential PTQ of ``model`` in place; returns {layer: codes}. Whole-model forwards only."""
    ad = adapter_for(model)
    fn = QUANTIZERS.get(qc.method).fn
    codes = {}
    for b, block in enumerate(ad.get_blocks(model)):
        groups = ad.linear_groups(block)
        if not qc.true_sequential:
            groups = [[x for g in groups for x in g]]
        for grp in groups:
            stats = {n: None for n, _ in grp}
            hooks = [m.register_forward_hook(lambda mod, i, o, n=n: stats.__setitem__(
                n, stats_update(stats[n], i[0], need_abs=qc.method == "awq"))) for n, m in grp]
            for batch in calib.split(8):
                run_model(model, batch)
            for h in hooks:
                h.remove()
            for n, m in grp:
                r = fn(get_weight(m).float().clone(), stats[n], qc)
                set_weight(m, r.weight)
                codes[f"{ad.blocks}.{b}.{n}"] = r.codes
    if qc.quantize_head:
        head, norm = ad.get_head(model), ad.get_final_norm(model)
        if any(head.weight is p for p in ad.get_pre_block(model)[0].parameters()):
            head.weight = nn.Parameter(head.weight.detach().clone())
        st = [None]
        h = norm.register_forward_hook(lambda mod, i, o: st.__setitem__(0, stats_update(st[0], o, need_abs=False)))
        for batch in calib.split(8):
            run_model(model, batch)
        h.remove()
        r = fn(get_weight(head).float().clone(), st[0], qc)
        set_weight(head, r.weight)
        codes[ad.head] = r.codes
    return codes


QUANTIZERS_UNDER_TEST = {
    "gptq3": "gptq3",
    "rtn4": "rtn4g32",
    "awq4": "awq4",
    "gptq4-act-seq": {"method": "gptq", "bits": 4, "group_size": 32, "act_order": True, "true_sequential": True},
    "rtn2-head": {"method": "rtn", "bits": 2, "quantize_head": True},
}


def _close(a: float, b: float, scale: float = 1.0) -> bool:
    # same operations on the same machine and thread count: equal up to a few float64/float32 roundings
    return abs(a - b) <= 1e-6 * max(scale, abs(a), abs(b))


@pytest.mark.parametrize("kind", ["quantdyn", "llama", "gpt2", "qwen2", "olmo2"])
def test_engine_equals_reference_path(kind, tmp_path):
    model = tiny(kind)
    ck = save(model, tmp_path / "ck")
    fp = load_causal_lm(ck)
    calib, ev = ids(12, 24, 1), ids(20, 25, 2)
    specs = QUANTIZERS_UNDER_TEST if kind in ("quantdyn", "llama") else {k: QUANTIZERS_UNDER_TEST[k]
                                                                          for k in ("gptq3", "rtn2-head")}
    codes: dict[str, dict] = {label: {} for label in specs}
    m = measure(ck, specs, ev, calib, device="cpu", cfg=MeasureConfig(batch_size=8),
                on_layer=lambda label, full, res, mod: codes[label].__setitem__(full, res.codes.clone()))
    ref_models, ref_codes = {}, {}
    for label, spec in specs.items():
        ref_models[label] = copy.deepcopy(fp)
        ref_codes[label] = reference_quantize(ref_models[label], calib, parse_quantizer(spec))
    fp_ce = window_losses(fp, ev, 8)
    ref = compare_many(fp, ref_models, ev, fp_window_ce=fp_ce, batch_size=8)
    assert _close(float(fp_ce.mean()), m.ce_fp)
    for label in specs:
        assert codes[label].keys() == ref_codes[label].keys(), label
        for layer, c in ref_codes[label].items():
            assert torch.equal(codes[label][layer], c), (label, layer)  # the same decisions
        got, want = m.metrics[label], ref[label]
        for key in ("ce_q", "delta_ce", "kl", "top1_agree", "kl_reverse", "kl_median", "kl_p99", "kl_max",
                    "top5_agree", "delta_p", "delta_p_rms", "delta_p_p1", "logprob_corr"):
            assert _close(got[key], want[key], 1e-3 if key.startswith("kl_") else 1.0), (label, key, got[key],
                                                                                         want[key])
        assert [v is None for v in got["kl_by_confidence"]] == [v is None for v in want["kl_by_confidence"]]
        assert all(_close(a, b, 1e-3) for a, b in zip(got["kl_by_confidence"], want["kl_by_confidence"]) if a is not None)
        assert got["confidence_fraction"] == want["confidence_fraction"]
        n_blocks = len(adapter_for(fp).get_blocks(fp))
        assert len(got["block_rel_fro"]) == len(got["block_cos_err"]) == len(got["block_sqnr"]) == n_blocks
        assert all(v > 0 for v in got["block_rel_fro"])
        assert got["n_windows"] == len(ev) and got["delta_ce_se"] > 0
        assert got["rel_delta_ce"] == pytest.approx(got["delta_ce"] / got["ce_fp"])
        # calibration-free quantizers skip the calibration set unless layer diagnostics are asked for
        calibrated = QUANTIZERS.get(parse_quantizer(specs[label]).method).needs_calibration
        assert m.quantizations[label].n_calibration == (len(calib) if calibrated else 0)


def test_qat_deployed_form_and_in_memory_model(tmp_path):
    """QAT's W+A deployed form is a variant of the same walk; an in-memory model is measured untouched."""
    from quantdyn.evaluate.quant_error import compare_models
    from quantdyn.train.qat import QATConfig, QATDeployed, fake_quant_forward

    model = tiny("quantdyn")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    qc = QATConfig(method="quest", w_bits=4, a_bits=4)
    ev, calib = ids(16, 25, 3), ids(8, 24, 4)
    m = measure(model, {"qat": QATDeployed(qc), "rtn3": "rtn3"}, ev, calib, cfg=MeasureConfig(batch_size=8))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    q = copy.deepcopy(model)
    with fake_quant_forward(q, qc):
        want = compare_models(model, q, ev, batch_size=8)
    for key in ("ce_q", "delta_ce", "kl", "top1_agree"):
        assert _close(m.metrics["qat"][key], want[key]), key
    assert m.quantizations["qat"].config is None and m.quantizations["qat"].rows == []


def test_sharded_bf16_and_spilled_streams_and_memory_is_one_block(tmp_path):
    model = tiny("llama")
    one = save(model, tmp_path / "one")
    sharded = save(model, tmp_path / "sharded", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 3
    calib, ev = ids(8, 24, 5), ids(12, 25, 6)
    specs = {"gptq3": "gptq3", "rtn4": "rtn4"}
    a = measure(one, specs, ev, calib)
    spill = tmp_path / "spill"
    spill.mkdir()
    # disk-spilled streams, sharded weights: the same numbers; the spill directory is removed afterwards
    src = LazyModel(open_checkpoint(sharded))
    seen = []

    def count_loaded(label, full, res, mod):
        seen.append(sum(p.numel() for p in src.model.parameters() if p.device.type != "meta"))

    b = measure(src, specs, ev, calib, cfg=MeasureConfig(streams="disk", spill_dir=str(spill)), on_layer=count_loaded)
    assert "spilled" in b.streams and list(spill.iterdir()) == []
    for label in specs:
        assert a.metrics[label]["window_delta"] == b.metrics[label]["window_delta"]
    # lazily read: while quantizing, the model holds at most one block (its copy is not in the skeleton)
    block = sum(p.numel() for p in src.blocks[0].parameters())
    assert max(seen) == block
    # a bf16 checkpoint computed in bf16 (auto's choice depends on the CPU: test_auto_dtype_...)
    save(model.to(torch.bfloat16), tmp_path / "bf16")
    c = measure(tmp_path / "bf16", {"rtn4": "rtn4"}, ev, calib, cfg=MeasureConfig(dtype="bfloat16"))
    assert c.dtype == "bfloat16" and abs(c.ce_fp - a.ce_fp) < 0.05
    d = measure(tmp_path / "bf16", {"rtn4": "rtn4"}, ev, calib, cfg=MeasureConfig(dtype="float32"))
    assert d.dtype == "float32"


def test_spill_dir_is_removed_after_an_error(tmp_path):
    model = tiny("quantdyn")
    spill = tmp_path / "spill"
    spill.mkdir()

    def boom(label, full, res, mod):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        measure(model, {"rtn4": "rtn4"}, ids(8, 25, 7), ids(4, 24, 8),
                cfg=MeasureConfig(streams="disk", spill_dir=str(spill)), on_layer=boom)
    assert list(spill.iterdir()) == []


def test_budget_and_bad_checkpoints_are_one_line(tmp_path):
    model = tiny("llama")
    ck = save(model, tmp_path / "ck", max_shard_size="40KB")
    ev, calib = ids(4, 25, 9), ids(4, 24, 10)
    with pytest.raises(QuantdynError, match="too small for this model.*give at least"):
        measure(ck, {"rtn4": "rtn4"}, ev, calib, cfg=MeasureConfig(max_memory="100KB"))
    shards = sorted(ck.glob("model-*.safetensors"))
    # a truncated shard
    bad = tmp_path / "trunc"
    save(model, bad, max_shard_size="40KB")
    victim = sorted(bad.glob("model-*.safetensors"))[1]
    victim.write_bytes(victim.read_bytes()[:-100])
    with pytest.raises(QuantdynError, match=f"{victim.name}.*truncated"):
        open_checkpoint(bad)
    # a missing shard
    gone = tmp_path / "gone"
    save(model, gone, max_shard_size="40KB")
    sorted(gone.glob("model-*.safetensors"))[2].unlink()
    with pytest.raises(QuantdynError, match="missing shard"):
        open_checkpoint(gone)
    # config.json that does not match the weights
    wrong = tmp_path / "wrong"
    save(model, wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (wrong / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantdynError, match="config.json implies.*does not match the weights"):
        measure(wrong, {"rtn4": "rtn4"}, ev, calib)
    assert len(shards) > 1


def test_bin_checkpoints_load_safely(tmp_path):
    """An old pytorch_model.bin is read with weights_only (lazily, mmap); a pickle with code is refused."""
    model = tiny("gpt2")
    ck = tmp_path / "bin"  # what transformers < 4.35 wrote by default (5 writes safetensors only)
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps(model.config.to_dict()))
    torch.save(model.state_dict(), ck / "pytorch_model.bin")
    m = measure(ck, {"rtn4": "rtn4"}, ids(8, 25, 11), None)
    assert m.metrics["rtn4"]["n_windows"] == 8

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "config.json").write_text((ck / "config.json").read_text())
    torch.save({"x": Evil()}, evil / "pytorch_model.bin")
    with pytest.raises(QuantdynError, match="cannot be loaded safely"):
        open_checkpoint(evil)
    assert not (tmp_path / "pwned").exists()


def test_hub_reference_offline(tmp_path, monkeypatch):
    """A hub id@revision resolves through huggingface_hub's real cache code; missing offline is one line."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo_dir = cache / "models--org--tiny"
    snap = repo_dir / "snapshots" / ("a" * 40)
    save(tiny("quantdyn"), snap)
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "step100").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    w = open_checkpoint("org/tiny@step100")
    assert w.path.resolve() == snap.resolve()
    m = measure("org/tiny@step100", {"rtn4": "rtn4"}, ids(4, 25, 12), None)
    assert m.metrics["rtn4"]["n_windows"] == 4
    with pytest.raises(QuantdynError, match=r"'org/tiny@step200' is not in the local Hugging Face cache.*download"):
        open_checkpoint("org/tiny@step200")


def test_repeats_vary_the_calibration_and_combine_the_uncertainty(tmp_path, kjv_small):
    """quant_repeats: RTN (no calibration in its weights) shows exactly zero spread — the mechanism's check —
    while GPTQ's repeats differ; rows carry mean, SD over repeats and sqrt(SE² + SD²/R); R = 1 keys are
    unchanged, R > 1 rows are new measurements."""
    from quantdyn.config import from_dict
    from quantdyn.engine.rows import calibration_draws
    from quantdyn.results.store import ResultStore
    from quantdyn.sweep.sweep import SweepConfig, run_sweep

    _, data = kjv_small
    torch.manual_seed(0)
    model = GPT(resolve_model_config(ModelConfig(n_layer=2, d_model=32, n_head=2, max_seq_len=64,
                                                 vocab_size=-(-data.vocab_size // 64) * 64)))
    ck = save(model, tmp_path / "ck")
    draws = calibration_draws(data, 6, 32, 0, 3, "draw")
    assert not torch.equal(draws[0], draws[1]) and torch.equal(draws[0], data.calib_windows(6, 32, 0))
    order = calibration_draws(data, 6, 32, 0, 2, "order")
    assert torch.equal(order[1].sort(0).values, order[0].sort(0).values) and not torch.equal(order[1], order[0])

    def sweep(store, repeats):
        cfg = from_dict(SweepConfig, {"trajectory": {"checkpoints": [str(ck)]}, "quantizers": ["rtn3", "gptq3"],
                                      "store": str(store), "device": "cpu", "quant_repeats": repeats,
                                      "data": {"source": "builtin:kjv", "tokenizer": data.manifest["tokenizer"],
                                               "calib_samples": 6, "calib_seq_len": 32, "eval_windows": 12,
                                               "eval_seq_len": 32}})
        return run_sweep(cfg, progress=False)

    sweep(tmp_path / "one", 1)
    sweep(tmp_path / "three", 3)
    one = {r["quantizer"]: r for r in ResultStore(tmp_path / "one").rows() if r["kind"] == "ptq"}
    three = {r["quantizer"]: r for r in ResultStore(tmp_path / "three").rows() if r["kind"] == "ptq"}
    rtn, gptq = three["rtn3"], three["gptq3"]
    assert rtn["quant_repeats"] == 3 and rtn["delta_ce_run_sd"] == 0.0 and len(set(rtn["delta_ce_repeats"])) == 1
    assert gptq["delta_ce_run_sd"] > 0 and len(set(gptq["delta_ce_repeats"])) == 3
    # repeat 0 is the unrepeated measurement
    assert gptq["delta_ce_repeats"][0] == pytest.approx(one["gptq3"]["delta_ce"], abs=1e-12)
    assert gptq["delta_ce"] == pytest.approx(sum(gptq["delta_ce_repeats"]) / 3)
    assert gptq["delta_ce_total_se"] == pytest.approx((gptq["delta_ce_se"] ** 2 + gptq["delta_ce_run_sd"] ** 2 / 3) ** 0.5)
    assert one["gptq3"]["quant_repeats"] == 1 and one["gptq3"]["delta_ce_total_se"] == one["gptq3"]["delta_ce_se"]
    assert {r["key"] for r in ResultStore(tmp_path / "one").rows()}.isdisjoint(
        {r["key"] for r in ResultStore(tmp_path / "three").rows() if r["kind"] == "ptq"})
    for r in three.values():
        assert r["calib_batch_size"] == 8 and r["quantize_threads"] == 1 and r["uncertainty_dominant"]
    # determinism: the same seeds, batch size and threads give bit-identical rows
    sweep(tmp_path / "again", 3)
    again = {r["quantizer"]: r for r in ResultStore(tmp_path / "again").rows() if r["kind"] == "ptq"}
    assert again["gptq3"]["delta_ce_repeats"] == gptq["delta_ce_repeats"]


@pytest.fixture
def _live_stats(monkeypatch):
    """A function: the ActStats objects alive now (every one made since the fixture started is tracked by a weak
    reference; a scan of gc.get_objects() per layer took seconds in a long test session)."""
    import gc
    import weakref

    from quantdyn.quantize.gptq import ActStats

    made = weakref.WeakSet()
    init = ActStats.__init__

    def tracked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.add(self)

    assert not any(isinstance(o, ActStats) for o in gc.get_objects())  # none older than the fixture
    monkeypatch.setattr(ActStats, "__init__", tracked)
    return lambda: set(map(id, made))


@pytest.mark.parametrize("true_sequential", [False, True])
def test_hessians_of_one_block_freed_layer_by_layer(true_sequential, _live_stats):
    """Calibration statistics (GPTQ's Hessians) live for one block only and each is dropped once its layers are
    quantized; layers fed the same tensor (q/k/v, gate/up) share one. Counted when each layer is done: all at once
    the block has 4 distinct inputs (q/k/v, o, gate/up, down), released in order; true-sequential keeps only
    the current group's one."""
    model = tiny("llama")
    qc = parse_quantizer({"method": "gptq", "bits": 4, "group_size": 32, "true_sequential": true_sequential})
    live: list[int] = []
    assert not _live_stats()
    measure(model, {"g": qc}, ids(4, 25, 30), ids(4, 24, 31), on_layer=lambda *a: live.append(len(_live_stats())))
    per_block = [1] * 7 if true_sequential else [4, 4, 4, 3, 2, 2, 1]
    assert live == per_block * 3
    assert not _live_stats()


def test_phase_timers_are_returned_and_in_rows(tmp_path):
    from quantdyn.engine.phases import PHASES
    from quantdyn.engine.rows import ptq_fields

    ck = save(tiny("llama"), tmp_path / "ck")
    cfg = MeasureConfig()
    m = measure(ck, {"gptq3": "gptq3", "rtn4": "rtn4"}, ids(8, 25, 32), ids(4, 24, 33), cfg=cfg)
    t = m.phase_seconds
    assert list(t) == [*PHASES, "total"]
    assert all(t[k] > 0 for k in PHASES), t
    assert sum(t[k] for k in PHASES) <= t["total"]
    row = ptq_fields("gptq3", parse_quantizer("gptq3"), m, cfg, 1)
    assert {f"t_{k}" for k in [*PHASES, "total"]} <= set(row) and row["t_read"] == t["read"]
    # phases without work stay at zero: no calibration passes (RTN without diagnostics), no evaluation windows
    m = measure(ck, {"rtn4": "rtn4"}, None, None, cfg=MeasureConfig(layer_diagnostics=False))
    t = m.phase_seconds
    assert t["calib_forward"] == t["eval_forward"] == t["head"] == t["capture"] == 0.0
    assert t["read"] > 0 and t["quantize_layers"] > 0


def test_auto_dtype_by_cpu_and_delta_ce_unchanged_beyond_rounding(tmp_path, monkeypatch):
    """auto computes a bf16 checkpoint in bf16 where the CPU multiplies bf16 natively, else in float32; the
    two give the same codes (the weights are the same numbers) and Δ CE equal up to bf16 rounding of the
    forward, whose size is measured here as the change of the full-precision CE itself."""
    import quantdyn.engine.lazy_model as lm

    torch.manual_seed(0)
    model = tiny("llama").to(torch.bfloat16)
    ck = save(model, tmp_path / "bf16")
    ev, calib = ids(16, 25, 34), ids(8, 24, 35)
    got = {}
    for native in (True, False):
        monkeypatch.setattr(lm, "cpu_has_native", lambda dtype, native=native: native or dtype == torch.float32)
        codes: dict[str, torch.Tensor] = {}
        m = measure(ck, {"rtn4": "rtn4"}, ev, calib,
                    on_layer=lambda label, full, res, mod, codes=codes: codes.__setitem__(full, res.codes.clone()))
        got[native] = (m, codes)
    (m16, c16), (m32, c32) = got[True], got[False]
    assert m16.dtype == "bfloat16" and m32.dtype == "float32"
    assert c16.keys() == c32.keys() and all(torch.equal(c16[k], c32[k]) for k in c16)
    # on the GPU auto keeps the checkpoint's dtype whatever the CPU
    assert lm.auto_compute_dtype(torch.bfloat16, "cuda") == torch.bfloat16
    assert lm.auto_compute_dtype(torch.float32, "cpu") == torch.float32
    rounding = float((m16.fp_window_ce - m32.fp_window_ce).abs().mean())
    assert 0 < rounding < 0.05  # bf16 rounding is visible, and small
    d16, d32 = m16.metrics["rtn4"]["delta_ce"], m32.metrics["rtn4"]["delta_ce"]
    # Δ CE = mean(CE_q - CE_fp): each side carries about the measured rounding of CE_fp
    assert abs(d16 - d32) <= 2 * rounding, (d16, d32, rounding)
