"""compare_models / compare_many against a direct computation of each metric."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from quantdyn.engine.walk import quantize_model
from quantdyn.evaluate.quant_error import compare_many, compare_models
from quantdyn.models.gpt import GPT, ModelConfig, logits_of, resolve_model_config

V = 96


def _direct(fp, q, windows):
    """Per-window CE of both models, KL(P_fp || P_q) and top-1 agreement, written out plainly."""
    with torch.no_grad():
        lf, lq = logits_of(fp, windows[:, :-1]).double(), logits_of(q, windows[:, :-1]).double()
    y = windows[:, 1:]
    ce_f = torch.stack([F.cross_entropy(lf[i], y[i]) for i in range(len(y))])
    ce_q = torch.stack([F.cross_entropy(lq[i], y[i]) for i in range(len(y))])
    pf, pq = lf.softmax(-1), lq.softmax(-1)
    kl = (pf * (pf.log() - pq.log())).sum(-1).mean(1)
    agree = (lf.argmax(-1) == lq.argmax(-1)).double().mean(1)
    return ce_f, ce_q, kl, agree


def test_compare_many_matches_direct_metrics_and_single_comparisons():
    torch.manual_seed(0)
    fp = GPT(resolve_model_config(ModelConfig(preset="tiny-2x64", vocab_size=V))).eval()
    windows = torch.randint(0, V, (10, 17), generator=torch.Generator().manual_seed(1))
    qs = {}
    for spec in ("rtn2", "rtn3", "rtn8"):
        qs[spec] = copy.deepcopy(fp)
        quantize_model(qs[spec], None, spec, progress=False)
    many = compare_many(fp, qs, windows, batch_size=3)
    assert list(many) == ["rtn2", "rtn3", "rtn8"]
    for spec, q in qs.items():
        ce_f, ce_q, kl, agree = _direct(fp, q, windows)
        m = many[spec]
        delta = ce_q - ce_f
        assert abs(m["delta_ce"] - float(delta.mean())) < 1e-5
        assert abs(m["delta_ce_se"] - float(delta.std() / math.sqrt(len(delta)))) < 1e-5
        assert abs(m["ce_fp"] - float(ce_f.mean())) < 1e-5 and abs(m["ce_q"] - float(ce_q.mean())) < 1e-5
        assert abs(m["kl"] - float(kl.mean())) < 1e-5 and abs(m["top1_agree"] - float(agree.mean())) < 1e-9
        assert m["n_windows"] == 10 and len(m["window_delta"]) == 10
        one = compare_models(fp, q, windows, batch_size=4)
        assert abs(one["delta_ce"] - m["delta_ce"]) < 1e-6 and abs(one["kl"] - m["kl"]) < 1e-6
    # coarser grids move the distribution further (an untrained model's Δ CE has no sign to check)
    assert many["rtn2"]["kl"] > many["rtn3"]["kl"] > many["rtn8"]["kl"] > 0
    # a precomputed FP CE is used as given
    fixed = compare_many(fp, {"rtn2": qs["rtn2"]}, windows, fp_window_ce=torch.zeros(10))["rtn2"]
    assert fixed["ce_fp"] == 0 and abs(fixed["delta_ce"] - many["rtn2"]["ce_q"]) < 1e-9


# ------------------------------------------------------------------ the detailed measures (issue 29)
def _direct_tokens(fp, q, windows):
    """Per-token values written out plainly from float32 logits (as the engine computes them) in float64."""
    with torch.no_grad():
        lf, lq = logits_of(fp, windows[:, :-1]).float(), logits_of(q, windows[:, :-1]).float()
    y = windows[:, 1:]
    lpf, lpq = F.log_softmax(lf.double(), -1), F.log_softmax(lq.double(), -1)
    pf, pq = lpf.exp(), lpq.exp()
    kl = (pf * (lpf - lpq)).sum(-1)
    rev = (pq * (lpq - lpf)).sum(-1)
    top_f, top_q = lf.topk(5, -1).indices, lq.topk(5, -1).indices
    agree = torch.stack([(top_f[..., :k] == top_q[..., :k]).all(-1) for k in range(1, 6)], -1)
    lpf_y, lpq_y = lpf.gather(-1, y[..., None])[..., 0], lpq.gather(-1, y[..., None])[..., 0]
    conf = pf.max(-1).values
    return kl, rev, agree, lpf_y, lpq_y, conf


def test_detailed_measures_match_their_definitions():
    import numpy as np

    from quantdyn.evaluate.quant_error import CONFIDENCE_EDGES

    torch.manual_seed(0)
    fp = GPT(resolve_model_config(ModelConfig(preset="tiny-2x64", vocab_size=V))).eval()
    with torch.no_grad():  # a confident model, so that several confidence buckets are filled
        fp.embed_out.weight.mul_(60)
    windows = torch.randint(0, V, (10, 17), generator=torch.Generator().manual_seed(1))
    qs = {}
    for spec in ("rtn2", "rtn3"):
        qs[spec] = copy.deepcopy(fp)
        quantize_model(qs[spec], None, spec, progress=False)
    many = compare_many(fp, qs, windows, batch_size=3)
    for spec, q in qs.items():
        m = many[spec]
        kl, rev, agree, lpf_y, lpq_y, conf = _direct_tokens(fp, q, windows)
        def tol(a, b):  # the float32 head against float64 here: ~1e-7 per log-probability, relative
            return abs(a - b) <= 1e-4 * abs(b) + 1e-7
        assert tol(m["kl"], float(kl.mean())) and tol(m["kl_reverse"], float(rev.mean()))
        for key, f in (("kl_median", 0.5), ("kl_p90", 0.9), ("kl_p99", 0.99), ("kl_p999", 0.999)):
            assert tol(m[key], float(np.quantile(kl.flatten().numpy(), f))), key
        assert tol(m["kl_max"], float(kl.max()))
        # top-K agreement is an integer decision on the same float32 logits: exact
        for k in range(1, 6):
            key = "top1_agree" if k == 1 else f"top{k}_agree"
            assert m[key] == pytest.approx(float(agree[..., k - 1].double().mean()), abs=1e-12), key
            assert m[f"top{k}_agree_se"] == pytest.approx(
                float(agree[..., k - 1].double().mean(1).std() / math.sqrt(10)), abs=1e-12)
        assert m["top1_agree"] >= m["top2_agree"] >= m["top5_agree"]
        dp = lpq_y.exp() - lpf_y.exp()
        assert tol(m["delta_p"], float(dp.mean())) and tol(m["delta_p_rms"], float(dp.pow(2).mean().sqrt()))
        assert tol(m["delta_p_se"], float(dp.mean(1).std() / math.sqrt(10)))
        assert tol(m["delta_p_p1"], float(np.quantile(dp.flatten().numpy(), 0.01)))
        assert tol(m["delta_p_p99"], float(np.quantile(dp.flatten().numpy(), 0.99)))
        assert tol(m["logprob_corr"], float(np.corrcoef(lpf_y.flatten().numpy(), lpq_y.flatten().numpy())[0, 1]))
        assert m["ppl_ratio"] == pytest.approx(math.exp(m["delta_ce"]), rel=1e-12)
        b = np.clip(np.searchsorted(CONFIDENCE_EDGES, conf.flatten().numpy(), side="right") - 1, 0, 4)
        assert m["confidence_fraction"] == pytest.approx([float((b == i).mean()) for i in range(5)])
        filled = [i for i in range(5) if (b == i).any()]
        assert len(filled) >= 2, "the test model should fill several confidence buckets"
        for i in range(5):
            want = kl.flatten().numpy()[b == i]
            assert (m["kl_by_confidence"][i] is None) == (want.size == 0)
            if want.size:
                assert tol(m["kl_by_confidence"][i], float(want.mean()))
        assert m["n_tokens"] == 10 * 16 and sum(m["confidence_fraction"]) == pytest.approx(1.0)
    assert many["rtn2"]["kl_p99"] > many["rtn3"]["kl_p99"] and many["rtn2"]["top5_agree"] <= many["rtn3"]["top5_agree"]
    # the plain measures alone: the same numbers, none of the others
    plain = compare_many(fp, qs, windows, batch_size=3, detailed=False)["rtn2"]
    assert set(plain) == {"ce_fp", "ce_q", "delta_ce", "delta_ce_se", "rel_delta_ce", "delta_ppl", "kl", "kl_se",
                          "top1_agree", "n_windows", "window_delta"}
    for key in plain:
        assert plain[key] == pytest.approx(many["rtn2"][key], rel=1e-9), key


def test_top_k_agreement_is_the_same_tokens_in_the_same_order():
    from quantdyn.evaluate.quant_error import top_k_agreement

    fp = torch.tensor([[[9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 0.0]]])
    top = fp.topk(5, -1).indices
    cases = {
        "same": ([9, 8, 7, 6, 5, 4, 0], [1, 1, 1, 1, 1]),
        "2nd and 3rd swapped": ([9, 7, 8, 6, 5, 4, 0], [1, 0, 0, 0, 0]),
        "an outsider enters at rank 5": ([9, 8, 7, 6, 4, 5, 0], [1, 1, 1, 1, 0]),
        "an outsider is first": ([8, 7, 6, 5, 4, 3, 10], [0, 0, 0, 0, 0]),
        "tied at ranks 2 and 3": ([9, 8, 8, 6, 5, 4, 0], [1, 1, 1, 1, 1]),
        "tied with an outsider at rank 1": ([9, 8, 7, 6, 5, 4, 9], [1, 0, 0, 0, 0]),
    }
    for name, (q, want) in cases.items():
        lq = torch.tensor([[q]], dtype=torch.float32)
        before = lq.clone()
        got = top_k_agreement(top, lq)
        assert got[0, 0].tolist() == [bool(w) for w in want], name
        assert torch.equal(lq, before), "the logits are restored"



def test_fp_against_itself_is_zero_error_and_the_floor_is_small():
    from quantdyn.engine.measure import MeasureConfig, measure
    from quantdyn.quantize.catalogue import BlockTransform

    class Untouched(BlockTransform):
        name = "untouched"

        def block(self, block):
            return block

    torch.manual_seed(0)
    model = GPT(resolve_model_config(ModelConfig(preset="tiny-2x64", vocab_size=V))).eval()
    ev = torch.randint(0, V, (8, 17), generator=torch.Generator().manual_seed(1))
    m = measure(model, {"same": Untouched(), "rtn2": "rtn2"}, ev, noise_floor=True, cfg=MeasureConfig(batch_size=3))
    same = m.metrics["same"]
    assert abs(same["kl"]) < 1e-9 and abs(same["kl_reverse"]) < 1e-9 and abs(same["kl_max"]) < 1e-9
    assert all(same[k] == 1.0 for k in ("top1_agree", "top2_agree", "top3_agree", "top4_agree", "top5_agree"))
    assert same["delta_ce"] == 0 and same["delta_p"] == 0 and same["delta_p_rms"] == 0
    assert same["logprob_corr"] == pytest.approx(1.0, abs=1e-12)
    assert same["block_rel_fro"] == [0.0, 0.0] and max(same["block_cos_err"]) < 1e-12
    floor = m.noise_floor
    assert floor["floor_rounding"] == "bf16 weights and block outputs"
    # bf16 keeps 8 significant bits: every block output moves by ~2^-9 of its size, far less than rtn2's error
    assert all(1e-4 < v < 1e-2 for v in floor["block_rel_fro"])
    assert 0 < floor["kl"] < m.metrics["rtn2"]["kl"] / 100 and floor["top1_agree"] > 0.9
    assert "__noise_floor__" not in m.metrics and set(m.quantizations) == {"same", "rtn2"}
    # computing in bf16, rounding to bf16 changes nothing: the floor computes the blocks in float32 instead
    m16 = measure(copy.deepcopy(model).to(torch.bfloat16), {"rtn2": "rtn2"}, ev, noise_floor=True,
                  cfg=MeasureConfig(batch_size=3))
    assert m16.noise_floor["floor_rounding"].startswith("float32 blocks") and m16.noise_floor["kl"] > 0
    assert all(v > 0 for v in m16.noise_floor["block_rel_fro"])


def test_per_block_errors_are_those_of_the_block_outputs():
    from quantdyn.engine.lazy_model import InMemoryModel
    from quantdyn.engine.measure import MeasureConfig, measure

    torch.manual_seed(0)
    model = GPT(resolve_model_config(ModelConfig(preset="tiny-2x64", vocab_size=V))).eval()
    ev = torch.randint(0, V, (6, 17), generator=torch.Generator().manual_seed(2))
    m = measure(model, ["rtn3"], ev, cfg=MeasureConfig(batch_size=4))
    q = copy.deepcopy(model)
    quantize_model(q, None, "rtn3", progress=False)

    def outputs(net):
        got = []
        hooks = [b.register_forward_hook(lambda mod, a, out: got.append(out[0] if isinstance(out, tuple) else out))
                 for b in InMemoryModel(net).blocks]
        with torch.no_grad():
            logits_of(net, ev[:, :-1])
        for h in hooks:
            h.remove()
        return [g.double() for g in got]

    for b, (hf, hq) in enumerate(zip(outputs(model), outputs(q))):
        d = hq - hf
        rel = ((d.pow(2).sum((1, 2)) / hf.pow(2).sum((1, 2))).sqrt()).mean()
        cos = F.cosine_similarity(hq, hf, dim=-1)
        sqnr = 10 * torch.log10(hf.pow(2).sum(-1) / (d.pow(2).sum(-1) + 1e-8))
        got = m.metrics["rtn3"]
        assert got["block_rel_fro"][b] == pytest.approx(float(rel), rel=1e-5)
        assert got["block_cos_err"][b] == pytest.approx(float(1 - cos.mean()), rel=1e-4)
        assert got["block_sqnr"][b] == pytest.approx(float(sqnr.mean()), rel=1e-5)
