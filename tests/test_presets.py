"""Public-trajectory presets: revision lists, tokens, LR and phase per revision against hand-computed values
from the published numbers; bad input as one line; the offline path through the real huggingface_hub and
transformers code over a temporary HF cache that holds a tiny model under a preset's real repo id."""
import logging
import math
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hf_models import lay_out_hf_cache, point_hf_at

from quantdyn.config import from_dict
from quantdyn.errors import QuantdynError
from quantdyn.sources.hub import cached_refs, evict_revision, hub_refs, list_revisions
from quantdyn.sources.presets import get_preset, load_preset_text, load_presets, parse_count, preset_for_repo
from quantdyn.sources.trajectory import (
    SelectConfig,
    TrajectoryConfig,
    dry_run_lines,
    plan_points,
    plan_trajectory,
    require_available,
)

PYTHIA_TPS = 2_097_152


def neox_lr(step: int, peak: float) -> float:
    """GPT-NeoX AnnealingLR as Pythia ran it: warmup 1 % of 143,000 steps, cosine over 143,000 steps after
    warmup, clamped at min_lr = 0.1 x peak (models/*.yml; megatron/learning_rates.py)."""
    warm = 0.01 * 143_000
    if step <= warm:
        return peak * step / warm
    n = min(step, 143_000 - warm) - warm
    return max(peak / 2 * (math.cos(math.pi * n / 143_000) + 1), 0.1 * peak)


def olmo2_stage1_lr(tokens: float, peak: float) -> float:
    """OLMo CosWithWarmup over tokens: warmup 8,388,608,000 tokens from 0, cosine to 0.1 x peak at 5e12."""
    w, t_max, eta = 8_388_608_000, 5e12, 0.1 * peak
    if tokens < w:
        return peak * tokens / w
    if tokens >= t_max:
        return eta
    return eta + (peak - eta) * (1 + math.cos(math.pi * (tokens - w) / (t_max - w))) / 2


# -- the presets themselves -------------------------------------------------------------------------------------
def test_every_preset_loads_places_its_revisions_and_names_its_sources():
    presets = load_presets()
    want = {"pythia-70m", "pythia-160m", "pythia-410m", "pythia-1b", "olmo-1b", "olmo2-1b", "olmo2-7b", "olmo2-13b",
            "olmo2-32b", "smollm3-3b", "amber-7b", "opensci-1.7b", "apertus-8b"}
    assert want <= set(presets)
    for name, p in presets.items():
        assert p.name == name and p.family and p.sources, name
        p.check()  # every listed revision can be placed
        assert all(r.count("/") == 1 for r in p.repos), name


def test_pythia_revisions_tokens_lr_phase():
    p = get_preset("pythia-160m")
    names = p.revisions.all_names()
    assert len(names) == 154
    assert names[:12] == ["step0", "step1", "step2", "step4", "step8", "step16", "step32", "step64", "step128",
                          "step256", "step512", "step1000"]
    assert names[-1] == "step143000" and names[11:] == [f"step{s}" for s in range(1000, 143001, 1000)]
    assert p.peak_lr == 6e-4 and p.tokens_per_step == PYTHIA_TPS
    for step in [0, 1, 512, 1000, 1430, 2000, 72000, 115000, 116000, 143000]:
        info = p.locate(f"step{step}")
        assert info.step == step and info.tokens == step * PYTHIA_TPS
        assert info.lr == pytest.approx(neox_lr(step, 6e-4), rel=1e-9, abs=1e-15), step
    assert p.locate("step1000").phase == "warmup" and not p.locate("step1000").decaying
    assert p.locate("step72000").phase == "cosine" and p.locate("step72000").decaying
    assert p.locate("step143000").phase == "cosine-floor" and p.locate("step143000").lr == 6e-5
    main = p.locate("main")
    assert main.alias_of == "step143000" and main.tokens == 143000 * PYTHIA_TPS
    assert get_preset("pythia-70m").locate("step143000").lr == pytest.approx(1e-4)


def test_pythia_1b_says_its_sources_disagree():
    p = get_preset("pythia-1b")
    assert p.peak_lr == 2.5e-4  # the training config; the README/model card say 3.0e-4
    assert any("3.0e-4" in u and "2.5e-4" in u for u in p.unverified)


def test_olmo2_7b_stage1_stage2_and_soup():
    p = get_preset("olmo2-7b")
    tps = 4_194_304
    s1 = p.locate("stage1-step5000-tokens21B")
    assert s1.step == 5000 and s1.tokens == 5000 * tps and s1.branch == "main"
    assert s1.lr == pytest.approx(olmo2_stage1_lr(5000 * tps, 3e-4), rel=1e-12) and s1.phase == "cosine"
    warm = p.locate("stage1-step1000-tokens4B")
    assert warm.phase == "warmup" and warm.lr == pytest.approx(3e-4 * 1000 * tps / 8_388_608_000)
    end1 = p.locate("stage1-step928646-tokens3896B")
    assert end1.lr == pytest.approx(olmo2_stage1_lr(928646 * tps, 3e-4), rel=1e-12)  # 6.135e-5
    # stage 2: names count from 0 at stage1-step928646; LR linear from the config's 6.1499e-5 to 0 over 50B tokens
    ing = p.locate("stage2-ingredient2-step5000-tokens21B")
    assert ing.stage_step == 5000 and ing.step == 928646 + 5000
    assert ing.tokens == (928646 + 5000) * tps and ing.branch == "ingredient2"
    assert ing.lr == pytest.approx(6.1499e-5 * (1 - 5000 * tps / 50e9), rel=1e-12)
    assert ing.phase == "stage2-linear" and ing.decaying
    last = p.locate("stage2-ingredient3-step11931-tokens50B")
    assert last.lr == 0.0 and last.tokens == (928646 + 11931) * tps
    soup = p.locate("main")
    assert soup.kind == "soup" and soup.branch == "soup" and soup.lr == 0.0 and soup.phase == "soup"
    assert soup.tokens == last.tokens and len(soup.soup_of) == 3
    bad = p.locate("stage1-step5000-tokens99B")
    assert isinstance(bad, str) and "tokens_per_step does not fit" in bad


def test_olmo2_13b_longer_ingredient_and_1b_main():
    p = get_preset("olmo2-13b")
    tps = 8_388_608
    assert p.locate("stage1-step596057-tokens5001B").lr == pytest.approx(9e-5)  # past t_max: alpha_f x peak
    short = p.locate("stage2-ingredient1-step5000-tokens42B")
    long = p.locate("stage2-ingredient4-step5000-tokens42B")
    assert short.lr == pytest.approx(9e-5 * (1 - 5000 * tps / 100e9))
    assert long.lr == pytest.approx(9e-5 * (1 - 5000 * tps / 300e9))
    main = get_preset("olmo2-1b").locate("main")
    assert main.kind == "hub" and main.alias_of == "stage2-ingredient3-step23852-tokens51B"


def test_smollm3_wsd_decay_from_step_4198001():
    p = get_preset("smollm3-3b")
    tps = 2_359_296
    first = p.locate("stage1-step-40000")
    assert first.tokens == 40000 * tps and first.lr == 2e-4 and first.phase == "stable" and not first.decaying
    assert p.locate("stage1-step-1000").lr == pytest.approx(1e-4) and p.locate("stage1-step-1000").phase == "warmup"
    assert p.locate("stage2-step-4198000").lr == 2e-4  # the last step before the decay
    mid = p.locate("stage3-step-4459001")  # halfway through the 522,000 decay steps
    assert mid.lr == pytest.approx(1e-4) and mid.phase == "decay" and mid.decaying
    assert p.locate("stage3-step-4720000").lr == pytest.approx(2e-4 / 522000)
    assert isinstance(p.locate("lc-32k-to-64k-step-4000"), str)  # long-context revisions are not pre-training


def test_amber_checkpoint_index_to_steps_and_tokens():
    p = get_preset("amber-7b")
    names = p.revisions.all_names()
    assert len(names) == 360 and names[0] == "ckpt_000" and names[-1] == "ckpt_359"
    first, last = p.locate("ckpt_000"), p.locate("ckpt_359")
    assert first.step == 762 and first.tokens == 762 * 4_587_520 and first.phase == "warmup"
    assert last.step == 360 * 762 and last.lr == pytest.approx(3e-5)
    # the repo moved to IFM/Amber (the old id redirects): the current id first, the old one still recognised;
    # whether ckpt_359 is on the hub is contradicted between sources, so the list is not claimed complete
    assert p.repos == ("IFM/Amber", "LLM360/Amber") and not p.revisions.complete
    assert preset_for_repo("IFM/Amber").name == preset_for_repo("LLM360/Amber").name == "amber-7b"


def test_unknowns_are_null_not_invented():
    o = get_preset("opensci-1.7b")
    # filled from the project's sources (batch 1008 x 4096, peak 4e-3) and marked unverified; each run's cooldown
    # depends on its token budget and is unknown: no schedule, so no LR is invented
    assert o.repos == () and o.peak_lr == 4e-3 and o.tokens_per_step == 1008 * 4096 and o.schedule is None
    assert any("1008 x 4096" in u and "issue #27" in u for u in o.unverified)
    info = o.locate("iter_0001000")
    assert info.step == 1000 and info.tokens == 1000 * 1008 * 4096 and info.lr is None and info.phase is None
    a = get_preset("apertus-8b")
    assert a.tokens_per_step is None  # the batch doubled mid-run: tokens come from the names
    assert a.locate("step100000-tokens419B").tokens == 419_000_000_000
    assert isinstance(a.locate("step100000-tokens419"), str)  # a plain number has no known unit


def test_parse_count_and_repo_lookup():
    assert parse_count("4001B") == (4_001_000_000_000, 1e9)
    assert parse_count("1.5T")[0] == 1_500_000_000_000 and parse_count("7", None) is None
    assert preset_for_repo("EleutherAI/pythia-160m-deduped").name == "pythia-160m"
    assert preset_for_repo("nobody/nothing") is None


# -- bad input ---------------------------------------------------------------------------------------------------
def test_unknown_preset_is_one_line_with_the_closest_names():
    with pytest.raises(QuantdynError) as e:
        TrajectoryConfig(preset="pythia-16m")
    msg = str(e.value)
    assert "\n" not in msg and "unknown trajectory preset 'pythia-16m'" in msg and "did you mean 'pythia-160m'" in msg
    with pytest.raises(QuantdynError, match="did you mean 'olmo2-7b'"):
        get_preset("olmo2-7")


def test_bad_trajectory_specs():
    with pytest.raises(QuantdynError, match="exactly one of run, checkpoints, hub or preset"):
        TrajectoryConfig(preset="pythia-70m", run="runs/x")
    with pytest.raises(QuantdynError, match="give trajectory.hub"):
        TrajectoryConfig(preset="opensci-1.7b")
    with pytest.raises(QuantdynError, match="defines the schedule"):
        from_dict(TrajectoryConfig, {"preset": "pythia-70m", "schedule": {"peak_lr": 1e-3}})
    with pytest.raises(QuantdynError, match="unknown config key 'select.evry' \\(did you mean 'every'"):
        from_dict(TrajectoryConfig, {"preset": "pythia-70m", "select": {"evry": 3}})
    with pytest.raises(QuantdynError, match="either every or log_spaced"):
        SelectConfig(every=2, log_spaced=5)
    with pytest.raises(QuantdynError, match="must look like A:B"):
        SelectConfig(tokens_range="100B-1T")


def test_bad_preset_files_are_one_line():
    good = (Path(__file__).parents[1] / "quantdyn/sources/presets/pythia-70m.yaml").read_text()
    with pytest.raises(QuantdynError, match=r"x.yaml: unknown config key 'tokens_per_stepp' \(did you mean"):
        load_preset_text(good.replace("tokens_per_step:", "tokens_per_stepp:"), "x.yaml")
    with pytest.raises(QuantdynError, match="unknown revision pattern group 'stp'"):
        load_preset_text(good.replace("(?P<step>", "(?P<stp>"), "x.yaml")
    with pytest.raises(QuantdynError, match="did you mean 'cosine'"):
        load_preset_text(good.replace("shape: cosine", "shape: cosin"), "x.yaml")
    with pytest.raises(QuantdynError, match="not valid YAML"):
        load_preset_text("name: [unclosed", "x.yaml")


def test_unparseable_revision_is_skipped_with_the_reason_and_the_rest_goes_on():
    plan = plan_trajectory(TrajectoryConfig(preset="pythia-160m", revisions=("step1000", "checkpoint-7", "step2000")))
    assert [p.revision for p in plan.points] == ["step1000", "step2000"]
    assert len(plan.skipped) == 1 and plan.skipped[0][0] == "checkpoint-7"
    assert "does not match the pythia-160m revision pattern" in plan.skipped[0][1]
    pts = plan_points(TrajectoryConfig(preset="pythia-160m", revisions=("step1000", "checkpoint-7")))
    assert isinstance(pts, list) and len(pts) == 1 and pts.skipped == list(plan.skipped[:1])
    with pytest.raises(QuantdynError, match="no checkpoints .*checkpoint-7"):
        plan_points(TrajectoryConfig(preset="pythia-160m", revisions=("checkpoint-7",)))


# -- selection and the dry run -----------------------------------------------------------------------------------
def test_full_pythia_plan_needs_no_hub_and_selections_thin_it(monkeypatch):
    import huggingface_hub

    def no_network(*a, **k):
        raise AssertionError("a preset with a fixed revision list must not ask the hub")

    monkeypatch.setattr(huggingface_hub, "list_repo_refs", no_network)
    full = plan_points(TrajectoryConfig(preset="pythia-160m"))
    assert len(full) == 154 and full[0].revision == "step0" and full[-1].revision == "step143000"
    assert full.skipped == [("main", "the same weights as step143000 (planned under that name)")]
    every = plan_points(TrajectoryConfig(preset="pythia-160m", select=SelectConfig(every=10)))
    assert [p.step for p in every[:3]] == [0, 512, 10000] and every[-1].step == 143000 and len(every) == 17
    logs = plan_points(TrajectoryConfig(preset="pythia-160m", select=SelectConfig(log_spaced=6)))
    assert len(logs) == 6 and logs[0].step == 1 and logs[-1].step == 143000
    ratios = [b.tokens / a.tokens for a, b in pairwise(logs)]
    assert max(ratios) / min(ratios) < 3  # roughly even on a log scale
    rng = plan_points(TrajectoryConfig(preset="pythia-160m", select=SelectConfig(tokens_range="100B:200B")))
    assert all(100e9 <= p.tokens <= 200e9 for p in rng) and len(rng) == 48


def test_dry_run_lines_one_per_revision():
    pts = plan_points(TrajectoryConfig(preset="pythia-160m", revisions=("step1000", "step72000", "x")))
    lines = dry_run_lines(pts)
    assert len(lines) == 3
    assert lines[0].split() == ["step1000", "step", "1000", "tokens", "2.097B", "lr", "0.0004196", "phase", "warmup"]
    assert "151B" in lines[1].split() and "phase cosine  decaying" in lines[1]
    assert lines[2].startswith("skipped x: ")
    soup = dry_run_lines(plan_points(TrajectoryConfig(preset="olmo2-7b", revisions=("main",))))
    assert soup[0].split()[:2] == ["main", "step"] and "phase soup" in soup[0] and "[soup]" in soup[0]


# -- offline: a temporary HF cache holding a tiny model under a real repo id ------------------------------------
REPO = "EleutherAI/pythia-160m"


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory, kjv_small):
    """Three tiny GPT-NeoX checkpoints (different weights) with the KJV BPE tokenizer, as HF directories."""
    from quantdyn.models.gpt import GPT, ModelConfig
    from quantdyn.models.hf_io import save_hf

    _, data = kjv_small
    tok = data.tokenizer
    vocab = -(-len(tok) // 64) * 64
    root = tmp_path_factory.mktemp("tiny")
    out = []
    for seed in range(3):
        torch.manual_seed(seed)
        d = save_hf(GPT(ModelConfig(vocab_size=vocab, n_layer=1, d_model=32, n_head=2, max_seq_len=64)), root / f"m{seed}")
        tok.save_pretrained(d)
        out.append(d)
    return out


@pytest.fixture
def hf_cache(tmp_path, tiny_models):
    cache = tmp_path / "hf" / "hub"
    lay_out_hf_cache(cache, REPO, {"step1000": tiny_models[0], "step2000": tiny_models[1],
                                   "step143000": tiny_models[2]})
    return cache


def test_offline_listing_reads_the_cache_without_the_hub(hf_cache, monkeypatch):
    import huggingface_hub

    point_hf_at(monkeypatch, hf_cache, offline=True)
    monkeypatch.setattr(huggingface_hub, "list_repo_refs", lambda *a, **k: pytest.fail("offline must not list refs"))
    assert hub_refs(REPO) == (["step1000", "step143000", "step2000"], "cache")
    assert list_revisions(REPO, r"step\d+000") == ["step1000", "step143000", "step2000"]
    with pytest.raises(QuantdynError, match="no revision of 'EleutherAI/pythia-410m' is in the local HF cache"):
        hub_refs("EleutherAI/pythia-410m")


def test_revision_size_from_the_cache_or_the_hub(hf_cache, monkeypatch):
    """What a dry run reports as the download: the cached snapshot's files, else the hub's file list (only the
    files quantdyn downloads), else unknown."""
    from types import SimpleNamespace

    import huggingface_hub

    from quantdyn.sources.hub import cached_snapshot, revision_size

    point_hf_at(monkeypatch, hf_cache, offline=False)
    snap = cached_snapshot(REPO, "step1000")
    assert revision_size(REPO, "step1000") == sum(f.stat().st_size for f in snap.iterdir())
    files = [SimpleNamespace(rfilename=n, size=z) for n, z in
             (("model.safetensors", 1000), ("config.json", 20), ("pytorch_model.bin", 999), ("tokenizer.json", 5))]
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, repo, **k: SimpleNamespace(siblings=files))
    assert revision_size(REPO, "step9000") == 1025  # the .bin is not downloaded

    def unreachable(self, repo, **k):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", unreachable)
    assert revision_size(REPO, "step9000") is None
    point_hf_at(monkeypatch, hf_cache, offline=True)
    assert revision_size(REPO, "step9000") is None


def test_unreachable_hub_is_one_warning_then_the_cache(hf_cache, monkeypatch, caplog):
    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError

    point_hf_at(monkeypatch, hf_cache, offline=False)
    calls = []

    def unreachable(repo, **k):
        calls.append(repo)
        raise ConnectionError("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub, "list_repo_refs", unreachable)
    with caplog.at_level(logging.WARNING):
        names, source = hub_refs(REPO)
    assert source == "cache" and names == cached_refs(REPO) and calls == [REPO]
    warns = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warns) == 1 and REPO in warns[0].getMessage() and "HF_HUB_OFFLINE=1" in warns[0].getMessage()
    with pytest.raises(QuantdynError, match="'EleutherAI/pythia-410m': the hub is unreachable"):
        hub_refs("EleutherAI/pythia-410m")

    def not_found(repo, **k):
        raise RepositoryNotFoundError(f"404 {repo}", response=SimpleNamespace(headers={}, status_code=404, request=None))

    monkeypatch.setattr(huggingface_hub, "list_repo_refs", not_found)
    with pytest.raises(QuantdynError, match="hub repo 'nobody/x' does not exist or is private"):
        hub_refs("nobody/x")


def test_offline_plan_from_preset_and_a_missing_revision_fails_fast(hf_cache, monkeypatch):
    point_hf_at(monkeypatch, hf_cache, offline=True)
    # an incomplete listing on the hub side: the preset still places the names the cache holds
    t = TrajectoryConfig(preset="pythia-160m", revision_pattern=r"step(1|2)000$")
    pts = plan_points(t)
    assert [p.ref for p in pts] == [f"{REPO}@step1000", f"{REPO}@step2000"]
    assert pts[1].tokens == 2000 * PYTHIA_TPS and pts[1].lr == pytest.approx(neox_lr(2000, 6e-4))
    require_available(pts)  # both are cached
    missing = plan_points(TrajectoryConfig(preset="pythia-160m", revisions=("step1000", "step3000")))
    with pytest.raises(QuantdynError) as e:
        require_available(missing)
    msg = str(e.value)
    assert "\n" not in msg and "'step3000' of 'EleutherAI/pythia-160m'" in msg and "hf download" in msg


def test_evict_revision_frees_one_revision_through_huggingface_hub(hf_cache, monkeypatch, tiny_models):
    from huggingface_hub import scan_cache_dir

    point_hf_at(monkeypatch, hf_cache, offline=True)
    before = scan_cache_dir(hf_cache)
    weights = (tiny_models[1] / "model.safetensors").stat().st_size
    freed = evict_revision(REPO, "step2000")
    assert freed >= weights  # its own weights blob; the tokenizer and config blobs are shared and stay
    after = scan_cache_dir(hf_cache)
    assert before.size_on_disk - after.size_on_disk == freed
    assert cached_refs(REPO) == ["step1000", "step143000"]
    assert evict_revision(REPO, "step2000") == 0 and evict_revision("nobody/x", "main") == 0
    # the other revisions still load through transformers, offline
    from quantdyn.models.hf_io import load_causal_lm

    from safetensors.torch import load_file

    got = load_causal_lm(f"{REPO}@step1000").state_dict()
    want = load_file(str(tiny_models[0] / "model.safetensors"))
    head = {"embed_out.weight": "lm_head.weight"}  # transformers' name for GPT-NeoX's output head
    assert all(torch.equal(got[k if k in got else head[k]], w) for k, w in want.items())  # step1000's own weights


def _kjv_text(tmp_path):
    """The first ~150k characters of the KJV as one text file (the sweeps' calibration and evaluation text)."""
    from quantdyn.data.sources import kjv_documents

    docs = []
    for d in kjv_documents():
        docs.append(d)
        if sum(map(len, docs)) > 150_000:
            break
    text = tmp_path / "kjv.txt"
    text.write_text("\n\n".join(docs))
    return text


def test_sweep_over_a_preset_offline_rows_carry_the_presets_step_tokens_lr(hf_cache, monkeypatch, tmp_path):
    from quantdyn.results.store import ResultStore
    from quantdyn.sweep.sweep import SweepConfig, SweepDataConfig, run_sweep

    point_hf_at(monkeypatch, hf_cache, offline=True)
    text = _kjv_text(tmp_path)
    cfg = SweepConfig(trajectory=TrajectoryConfig(preset="pythia-160m", revisions=("step1000", "step2000")),
                      quantizers=("rtn4",), store=str(tmp_path / "store"), device="cpu",
                      data=SweepDataConfig(source=str(text), calib_samples=4, calib_seq_len=32, eval_windows=8,
                                           eval_seq_len=32))
    out = run_sweep(cfg, progress=False)
    assert out["checkpoints"] == 2
    rows = ResultStore(tmp_path / "store").rows()
    by = {(r["kind"], r["step"]): r for r in rows}
    assert {("fp", 1000), ("fp", 2000), ("ptq", 1000), ("ptq", 2000)} <= set(by)
    for step in (1000, 2000):
        r = by[("ptq", step)]
        assert r["tokens"] == step * PYTHIA_TPS and r["checkpoint"] == f"{REPO}@step{step}" and r["run"] == REPO
        assert r["lr"] == pytest.approx(neox_lr(step, 6e-4), rel=1e-9)
        assert math.isfinite(r["delta_ce"])
    assert by[("ptq", 1000)]["decaying"] is False and by[("ptq", 2000)]["decaying"] is True
    assert by[("ptq", 1000)]["peak_lr"] == 6e-4


def test_sweep_cli_preset_evict_dry_run_and_offline_rerun(hf_cache, monkeypatch, tmp_path, capsys):
    """`sweep --preset ... --evict`: rows stored, each measured revision deleted from the cache except the
    tokenizer's; an offline rerun needs nothing it deleted; --dry-run plans without reading weights."""
    from quantdyn.results.store import ResultStore

    point_hf_at(monkeypatch, hf_cache, offline=True)
    text = _kjv_text(tmp_path)
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"quantizers: [rtn4]\ndevice: cpu\nstore: {tmp_path / 'store'}\n"
                    f"data: {{source: {text}, calib_samples: 4, calib_seq_len: 32, eval_windows: 8, eval_seq_len: 32}}\n")
    args = ["sweep", str(spec), "--preset", "pythia-160m", "--revisions", "step1000,step2000,step143000", "--quiet"]
    code, out, _ = _cli(monkeypatch, capsys, *args, "--dry-run")
    assert code == 0 and "step2000" in out and "dry run" in out and not (tmp_path / "store").exists()
    lines = out.splitlines()
    by_rev = {ln.split()[0]: ln for ln in lines if ln.startswith("step")}
    assert "decaying" in by_rev["step2000"]  # on the cosine
    assert "phase cosine-floor" in by_rev["step143000"] and "decaying" not in by_rev["step143000"]  # held at min LR
    assert "preset pythia-160m from EleutherAI/pythia-160m: 3 checkpoints x 1 quantizer (rtn4)" in lines
    assert "download: nothing (all 3 revisions are in the local HF cache)" in lines
    code, out, err = _cli(monkeypatch, capsys, *args, "--evict")
    assert code == 0, err
    assert "6 rows written" in out
    code, out, _ = _cli(monkeypatch, capsys, *args, "--dry-run", "--quantizers", "rtn4,gptq3")
    assert code == 0 and "3 checkpoints x 2 quantizers (rtn4, gptq3)" in out
    assert "download: 2 revisions not in the local HF cache, size unknown (the hub cannot be asked)" in out
    assert cached_refs(REPO) == ["step1000"]  # the tokenizer's revision stays
    code, out, err = _cli(monkeypatch, capsys, *args, "--evict")
    assert code == 0 and "0 rows written" in out, err
    rows = ResultStore(tmp_path / "store").rows()
    assert sorted(r["step"] for r in rows if r["kind"] == "ptq") == [1000, 2000, 143000]
    assert {r["phase"] for r in rows} <= {"warmup", "cosine", "cosine-floor"} and all(r["preset"] for r in rows)


# -- the command -------------------------------------------------------------------------------------------------
def _cli(monkeypatch, capsys, *args):
    import sys

    from quantdyn.cli import main

    monkeypatch.setattr(sys, "argv", ["quantdyn", *args])
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_trajectories_command_lists_and_shows_presets(monkeypatch, capsys):
    code, out, _ = _cli(monkeypatch, capsys, "trajectories")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["preset", "family", "size", "revisions"]
    row = next(ln for ln in lines if ln.startswith("pythia-160m "))
    assert " 154 " in row and "EleutherAI/pythia-160m (+1)" in row
    assert "cosine 6e-4 -> 6e-5 over 1.43k-115.1k, then 6e-5 (floor)" in row  # the floor is where the LR ends
    assert len(lines) == len(load_presets()) + 2
    code, out, _ = _cli(monkeypatch, capsys, "trajectories", "pythia-1b")
    assert code == 0 and "all 154 revisions" in out and "3.0e-4" in out and "2.5e-4" in out
    code, out, _ = _cli(monkeypatch, capsys, "trajectories", "--json")
    import json

    assert {r["preset"] for r in json.loads(out)} == set(load_presets())
    code, out, err = _cli(monkeypatch, capsys, "trajectories", "olmo2-70b")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "did you mean 'olmo2-7b'" in err


# -- figures -----------------------------------------------------------------------------------------------------
def _rows_of(preset: str, revisions: tuple[str, ...], with_fields: bool = True) -> list[dict]:
    """Result rows as a sweep writes them, with a made-up error that rises when the LR decays."""
    from quantdyn.sources.trajectory import preset_row_fields

    rows = []
    for p in plan_points(TrajectoryConfig(preset=preset, revisions=revisions)):
        for q, bits in (("rtn4", 4), ("gptq3", 3)):
            d = (0.05 if bits == 3 else 0.01) * (2.0 if p.decaying else 1.0)
            r = {"kind": "ptq", "run": p.run, "branch": p.branch, "ckpt_kind": p.kind, "checkpoint": p.ref,
                 "step": p.step, "tokens": p.tokens, "lr": p.lr, "decaying": p.decaying, "quantizer": q,
                 "bits": bits, "delta_ce": d, "delta_ce_se": 0.001, "ce_fp": 2.5}
            if with_fields:
                r.update(preset_row_fields(p))
            rows.append(r)
    return rows


def test_trajectory_figures_from_rows(tmp_path):
    from quantdyn.report.public_trajectories import (
        error_vs_tokens,
        families_side_by_side,
        lr_curves,
        sections,
        soup_vs_ingredients,
    )
    from quantdyn.results.stats import rel_delta_ce

    pythia = _rows_of("pythia-160m", ("step1000", "step36000", "step72000", "step143000"), with_fields=False)
    pythia[0]["rel_delta_ce"] = 0.123  # written by newer sweeps; older rows fall back to delta_ce / ce_fp
    assert rel_delta_ce(pythia[0]) == 0.123 and rel_delta_ce(pythia[2]) == pytest.approx(pythia[2]["delta_ce"] / 2.5)
    table = error_vs_tokens(pythia, REPO, tmp_path / "pythia")
    assert (tmp_path / "pythia.png").stat().st_size > 0 and (tmp_path / "pythia.svg").stat().st_size > 0
    assert len(table) == 8 and {t["preset"] for t in table} == {"pythia-160m"}  # found through the repo
    (_, curve), = lr_curves(get_preset("pythia-160m"), pythia)
    x, y = min(curve, key=lambda xy: abs(xy[0] - 72000 * PYTHIA_TPS))
    assert y == pytest.approx(neox_lr(round(x / PYTHIA_TPS), 6e-4), rel=1e-3)

    olmo = _rows_of("olmo2-7b", ("stage1-step5000-tokens21B", "stage1-step928646-tokens3896B",
                                 "stage2-ingredient1-step5000-tokens21B", "stage2-ingredient1-step11931-tokens50B",
                                 "stage2-ingredient2-step11931-tokens50B", "main"))
    curves = lr_curves(get_preset("olmo2-7b"), olmo)
    assert [c for c, _ in curves] == ["stage1", "stage2"]
    assert curves[1][1][0] == (928646 * 4_194_304, pytest.approx(6.1499e-5))  # stage 2 starts at its branch point
    soup = soup_vs_ingredients(olmo, "allenai/OLMo-2-1124-7B", tmp_path / "soup")
    assert (tmp_path / "soup.svg").exists()
    got = {(t["quantizer"], t["branch"], t["stage_tokens"]) for t in soup}
    assert ("rtn4", "soup", 11931 * 4_194_304) in got and ("rtn4", "main", 0) in got
    assert ("gptq3", "ingredient1", 5000 * 4_194_304) in got
    assert soup_vs_ingredients(pythia, REPO, tmp_path / "none") == [] and not (tmp_path / "none.png").exists()
    fam = families_side_by_side(pythia + olmo, tmp_path / "families")
    assert {t["run"] for t in fam} == {REPO, "allenai/OLMo-2-1124-7B"} and (tmp_path / "families.png").exists()
    assert all(t["branch"] in ("main", "soup") for t in fam)
    secs = sections(pythia + olmo, tmp_path / "report")
    assert len(secs) == 4 and all((tmp_path / "report" / png).exists() for _, png, _, _ in secs)

