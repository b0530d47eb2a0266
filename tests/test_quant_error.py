"""compare_models / compare_many against a direct computation of each metric."""
import copy
import math

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
