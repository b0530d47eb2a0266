"""Per-tensor plans (quantize/plan.py) and the allocator (quantize/allocate.py): the knapsack against brute force,
the plan:/auto@ labels, bits per weight counted as rows count them, and what a plan cannot be used for."""
from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
from plan_models import tiny_gpt, windows

from quantdyn.config import config_hash, from_dict, to_dict
from quantdyn.engine.measure import measure
from quantdyn.engine.rows import storage_fields
from quantdyn.errors import QuantdynError
from quantdyn.quantize import gguf as qg
from quantdyn.quantize.allocate import allocate
from quantdyn.quantize.catalogue import QuantConfig, parse_quantizer
from quantdyn.quantize.plan import Plan, PlanTensor, check_types_fit, plan_of, type_bits_per_weight, write_plan


def _brute(curves, budget):
    names = sorted(curves)
    best = None
    for combo in itertools.product(*[sorted(curves[n]) for n in names]):
        cost = sum(curves[n][k][0] for n, k in zip(names, combo))
        err = sum(curves[n][k][1] for n, k in zip(names, combo))
        if cost <= budget and (best is None or err < best):
            best = err
    return best


def test_knapsack_is_the_exact_optimum_and_the_fallback_stays_feasible():
    rng = random.Random(4)
    for trial in range(30):
        curves = {}
        for t in range(rng.randint(2, 6)):
            n = rng.choice([256, 512, 768])
            # errors fall with bits, as a real sensitivity curve does, but not convexly
            curves[f"t{t}"] = {k: (n * b, rng.uniform(0.5, 1.5) * 2.0 ** -b * n / 256)
                               for k, b in (("a", 3), ("b", 4), ("c", 5), ("d", 8))}
        lo = sum(min(c for c, _ in v.values()) for v in curves.values())
        hi = sum(max(c for c, _ in v.values()) for v in curves.values())
        budget = rng.randint(lo, hi)
        exact = allocate(curves, budget)
        assert exact.method == "knapsack-dp" and exact.bits <= budget
        assert exact.error == pytest.approx(_brute(curves, budget), rel=1e-12)
        rough = allocate(curves, budget, max_cells=1)  # forces the Lagrangian + greedy fill
        assert rough.method == "lagrangian+greedy" and rough.bits <= budget
        assert rough.error >= exact.error * (1 - 1e-12)
    with pytest.raises(QuantdynError, match="below the cheapest assignment"):
        allocate({"t": {"a": (100, 1.0)}}, 99)


def _plan(model, types) -> Plan:
    tensors = []
    for b, block in enumerate(model.blocks):
        for path in ("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"):
            w = block.get_submodule(path).weight
            tensors.append(PlanTensor(f"gpt_neox.layers.{b}.{path}", b, path, tuple(w.shape),
                                      types[len(tensors) % len(types)]))
    return Plan("gpt_neox", len(model.blocks), tuple(tensors))


def test_plan_label_carries_the_digest_and_refuses_a_changed_file(tmp_path):
    model = tiny_gpt()
    plan = _plan(model, ["q4_0", "q8_0"])
    path = write_plan(plan, tmp_path / "p.json")
    qc = parse_quantizer(f"plan:{path}")
    assert qc.name == f"plan:{path}#{plan.digest}" and plan_of(qc).assignment() == plan.assignment()
    assert from_dict(QuantConfig, to_dict(qc)) == qc and config_hash(qc) == config_hash(parse_quantizer(qc.name))
    other = write_plan(_plan(model, ["q5_0", "q8_0"]), tmp_path / "o.json")
    assert config_hash(parse_quantizer(f"plan:{other}")) != config_hash(qc)  # another plan: another row key
    data = json.loads(path.read_text())
    data["tensors"][next(iter(data["tensors"]))]["type"] = "q5_0"
    path.write_text(json.dumps(data))
    with pytest.raises(QuantdynError, match=r"has changed since the label .* was written \(its digest is now"):
        parse_quantizer(qc.name)
    with pytest.raises(QuantdynError, match="does not exist; make one with `quantdyn allocate"):
        parse_quantizer(f"plan:{tmp_path / 'missing.json'}")
    (tmp_path / "bad.json").write_text('{"format": "quantdyn-plan", "version": 1, "tensors": {}}')
    with pytest.raises(QuantdynError, match="malformed plan"):
        parse_quantizer(f"plan:{tmp_path / 'bad.json'}")


@pytest.mark.parametrize("label,message", [
    ("auto@x:q4_k,q5_k", "write auto@BUDGET:TYPE,TYPE"),
    ("auto@4.5:q4_k", "at least two candidate types"),
    ("auto@4.5:q4_k_m,q4_k", "chooses types per tensor itself"),
    ("auto@4.5:awq4,rtn4", "awq cannot be a plan's type"),
    ("auto@4.5:w8a8-fp8,q4_k", "quantizes activations of the whole model"),
    ("auto@4.5:q4_k-imatrix,gptq4", "calibrate differently"),
    ("auto@4.5:q4_k,gptq4-seq", "-head and -seq apply to a whole model"),
])
def test_bad_auto_labels_are_one_line(label, message):
    with pytest.raises(QuantdynError, match=message):
        parse_quantizer(label)


def test_auto_label_is_canonical():
    a = parse_quantizer("auto@4.50:Q6_K,q3_k,q4_k,q5_k")
    assert a.name == "auto@4.5:q3_k,q4_k,q5_k,q6_k" and a == parse_quantizer("auto@4.5:q3_k,q4_k,q5_k,q6_k")
    assert parse_quantizer("auto@4:gptq4g128,f16,rtn3g64").name == "auto@4:f16,gptq4,rtn3g64"


@pytest.mark.numerics
def test_plan_quantizes_each_tensor_with_its_type_and_rows_count_its_bits_exactly():
    model = tiny_gpt()
    plan = _plan(model, ["q4_0", "rtn3g32", "f16", "gptq4g32-sym", "nf4", "q8_0"])
    ids = windows(6, 33, 1)
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = write_plan(plan, Path(tmp) / "p.json")
        seen = {}
        m = measure(model, {"p": f"plan:{path}"}, ids, windows(4, 32, 2),
                    on_layer=lambda label, full, res, mod: seen.__setitem__(full, res))
    rows = m.quantizations["p"].rows
    assert {r["layer"]: r["plan_type"] for r in rows} == plan.assignment()
    assert storage_fields(rows)["plan_types"] == plan.assignment()
    bpw = storage_fields(rows)["bits_per_weight"]
    assert abs(bpw - plan.bits_per_weight()) <= 4 * torch.finfo(torch.float64).eps * bpw  # the same count
    for t in plan.tensors:
        r = next(r for r in rows if r["layer"] == t.name)
        assert r["bits_per_weight"] == type_bits_per_weight(t.type, t.shape), t
    w = dict(model.named_parameters())
    q40 = next(t for t in plan.tensors if t.type == "q4_0")
    assert torch.equal(seen[q40.name].codes, qg.quantize_gguf(w[f"{q40.name}.weight"], "q4_0").codes)
    kept = next(t for t in plan.tensors if t.type == "f16")
    assert torch.equal(seen[kept.name].weight, w[f"{kept.name}.weight"].half().float())
    assert m.metrics["p"]["kl"] > 0


def test_a_plan_for_another_model_or_with_other_tensors_is_refused_before_work(tmp_path):
    small, deep = tiny_gpt(), tiny_gpt(n_layer=3)
    plan = _plan(small, ["q4_0"])
    path = write_plan(plan, tmp_path / "p.json")
    ids = windows(2, 17, 1)
    with pytest.raises(QuantdynError, match="was made for a gpt_neox model of 2 blocks; this checkpoint is gpt_neox "
                                            "with 3 blocks"):
        measure(deep, [f"plan:{path}"], ids, None)
    renamed = Plan("gpt_neox", 2, tuple(PlanTensor(t.name.replace("dense_4h_to_h", "down_proj"), t.block, t.path,
                                                   t.shape, t.type) for t in plan.tensors))
    with pytest.raises(QuantdynError, match="names tensor gpt_neox.layers.0.mlp.down_proj, which this checkpoint "
                                            "lacks"):
        measure(small, [f"plan:{write_plan(renamed, tmp_path / 'r.json')}"], ids, None)
    short = Plan("gpt_neox", 2, plan.tensors[:-1])
    with pytest.raises(QuantdynError, match="has no type for tensor gpt_neox.layers.1.mlp.dense_4h_to_h"):
        measure(small, [f"plan:{write_plan(short, tmp_path / 's.json')}"], ids, None)


def test_a_type_a_tensor_cannot_hold_names_the_tensor_and_llama_cpps_fallback():
    with pytest.raises(QuantdynError, match=r"tensor model.layers.0.mlp.down_proj has rows of 320 weights, which "
                                            r"q4_k cannot hold \(it needs a multiple of 256; llama.cpp would store it "
                                            r"as q5_0 instead\)"):
        check_types_fit([("model.layers.0.mlp.down_proj", 0, "mlp.down_proj", (256, 320))], ("q4_k",))
    with pytest.raises(QuantdynError, match="no GGUF block type fits; llama.cpp would store it as F16"):
        check_types_fit([("x", 0, "mlp.down_proj", (256, 100))], ("q8_0",))
    check_types_fit([("x", 0, "mlp.down_proj", (256, 320))], ("q5_0", "rtn4g64"))


def test_f16_is_a_registered_type_like_any_other():
    """f16, what a plan leaves unquantized, is a quantizer of the registry: parsed, quantized and counted as the other
    types are (no special case in the plans)."""
    from quantdyn.quantize.catalogue import QUANTIZERS
    from quantdyn.quantize.plan import check_candidate, fallback_of

    qc = parse_quantizer("F16")
    assert (qc.name, qc.bits, qc.group_size) == ("f16", 16, 0) and check_candidate("F16") == qc
    assert not QUANTIZERS.get("f16").needs_calibration
    W = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)) * 3
    res = QUANTIZERS.get("f16").fn(W, None, qc)
    assert torch.equal(res.weight, W.to(torch.float16).to(torch.float32)) and not torch.equal(res.weight, W)
    assert (res.bits, res.bits_per_weight, res.format) == (16, 16.0, "f16")
    assert type_bits_per_weight("f16", (8, 100)) == 16.0 and fallback_of("f16", (8, 100)) is None
    with pytest.raises(QuantdynError, match="f16 has bits=16 by definition"):
        parse_quantizer({"method": "f16", "bits": 3})
    assert parse_quantizer("auto@6:F16,q4_k").name == "auto@6:f16,q4_k"
    assert QUANTIZERS.get(parse_quantizer("auto@6:f16,q4_k").method).format.bits == 4  # f16 has no codes


def test_a_plans_main_type_holds_the_most_weights_f16_aside_ties_to_the_first():
    from quantdyn.export.llama_quantize import llama_quantize_args

    def plan(*types_shapes):
        return Plan("gpt_neox", 4, tuple(PlanTensor(f"gpt_neox.layers.{b}.mlp.dense_4h_to_h", b, "mlp.dense_4h_to_h",
                                                    shape, ty) for b, (ty, shape) in enumerate(types_shapes)))

    # f16 holds 4096 weights, q6_k and q4_k 2048 each: q6_k comes first in the tensors
    p = plan(("f16", (64, 64)), ("q6_k", (32, 64)), ("q4_k", (64, 32)))
    assert p.types_by_weight() == ["f16", "q6_k", "q4_k"] and p.main_type == "q6_k"
    assert llama_quantize_args(p)[-1] == "18"  # LLAMA_FTYPE_MOSTLY_Q6_K
    p = plan(("q4_k", (64, 32)), ("q6_k", (32, 64)), ("q4_k", (32, 32)))  # q4_k 3072 > q6_k 2048
    assert p.main_type == "q4_k" and llama_quantize_args(p)[-1] == "14"  # LLAMA_FTYPE_MOSTLY_Q4_K_S
    p = plan(("f16", (32, 32)))
    assert p.main_type is None and llama_quantize_args(p)[-1] == "1"  # LLAMA_FTYPE_MOSTLY_F16


def test_registry_families_make_entries_on_first_use_and_are_not_listed():
    from quantdyn.registry import Registry

    r: Registry = Registry("thing")
    r.add("plain", 1)
    made = []
    r.add_family("fam:", lambda name: made.append(name) or len(name), lambda name: name.lower())
    assert "fam:X" in r and "other" not in r and r.names() == ["plain"]
    assert r.canonical("fam:X") == "fam:x" and r.canonical("plain") is None
    assert r.get("fam:abc") == 7 and r.get("fam:abc") == 7 and made == ["fam:abc"]  # made once, cached
    with pytest.raises(ValueError, match="registered twice"):
        r.add_family("fam:", len, str)
    with pytest.raises(QuantdynError, match="unknown thing 'plan'"):
        r.get("plan")


def test_declaring_the_plan_families_loads_no_quantizer_and_no_torch():
    """plan: and auto@ are declared with QUANTIZERS (quantize/catalogue.py) without importing their module or the
    built-in quantizers: label parsing of every other label stays torch-free (tests/test_quiet_start.py)."""
    import subprocess
    import sys

    code = ("import sys; from quantdyn.quantize.catalogue import QUANTIZERS, parse_quantizer; parse_quantizer('gptq4'); "
            "print('auto@4:q4_0,q8_0' in QUANTIZERS, 'plan:x.json' in QUANTIZERS, QUANTIZERS.loaded, "
            "'torch' in sys.modules, 'quantdyn.quantize.plan' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "True", "False", "False", "False"], out.stderr[-2000:]
