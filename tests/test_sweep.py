import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import tiny_run_dict

from quantdyn.config import from_dict, to_dict
from quantdyn.errors import QuantdynError
from quantdyn.results.store import ResultStore
from quantdyn.sweep.sweep import SweepConfig, parse_shard, run_sweep
from quantdyn.train.branches import cooldown
from quantdyn.train.config import RunConfig
from quantdyn.train.trainer import train


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, kjv_small):
    data_cfg, _ = kjv_small
    root = tmp_path_factory.mktemp("runs")
    d = tiny_run_dict(root, data_cfg, steps=12, checkpoint_every=4)
    d["name"] = "sw"
    d["schedule"] = {"name": "wsd", "warmup": 2, "decay": 4}
    run = train(from_dict(RunConfig, d), progress=False)
    cooldown(run, 8, [4], control=True, progress=False)
    return run


def _cfg(run, store, **kw):
    base = {"trajectory": {"run": str(run)}, "quantizers": ["rtn4", "gptq3"], "store": str(store),
            "data": {"calib_samples": 4, "calib_seq_len": 32, "eval_windows": 12, "eval_seq_len": 32}}
    base.update(kw)
    return from_dict(SweepConfig, base)


def test_sweep_rows_idempotent_and_report(small_run, tmp_path):
    store = tmp_path / "store"
    out = run_sweep(_cfg(small_run, store), progress=False)
    # main 3 checkpoints + cooldown 1 + control 1 = 5 checkpoints x (fp + 2 quantizers)
    assert out["written"] == 15 and out["skipped"] == 0
    again = run_sweep(_cfg(small_run, store), progress=False)
    assert again["written"] == 0 and again["skipped"] == 15
    rows = ResultStore(store).rows()
    assert len({r["key"] for r in rows}) == 15
    ptq = [r for r in rows if r["kind"] == "ptq"]
    for r in ptq:
        assert r["git_sha"] and r["hardware"] and r["checkpoint_hash"] and r["eval_hash"] and r["quant_config"]
        assert r["tokens"] == r["step"] * 4 * 32 and r["lr"] is not None
        assert abs(r["delta_ce"] - (r["ce_q"] - r["ce_fp"])) < 1e-9 and len(r["window_delta"]) == 12
    branches = {r["branch"] for r in rows}
    assert branches == {"main", "cooldown-s8-d4-linear", "control-s8-d4"}
    from quantdyn.results.schema import undocumented

    for r in rows:  # every field the sweep wrote is described in the row schema, under its kind
        assert undocumented(r) == [], r["kind"]
    # the noise floor is stored once per checkpoint, in its fp row; every ptq row is read against it
    fps = {r["checkpoint"]: r for r in rows if r["kind"] == "fp"}
    assert all(r["floor_rounding"] == "bf16 weights and block outputs" and r["floor_kl"] > 0
               and len(r["floor_window_delta"]) == 12 and len(r["floor_block_rel_fro"]) == 2 for r in fps.values())
    for r in ptq:
        assert isinstance(r["within_noise_floor"], bool) and len(r["block_sqnr"]) == 2 and r["n_tokens"] == 12 * 31
    # float-trained weights: every row says how many distinct values a 32-weight block holds (32), and no grid
    assert all(r["weight_grid_levels"] == 32 and r["weight_grid"] is None for r in [*ptq, *fps.values()])
    # adding a quantizer only computes the new one; its rows read the floor the stored fp rows carry
    more = run_sweep(_cfg(small_run, store, quantizers=["rtn4", "gptq3", "rtn2"]), progress=False)
    assert more["written"] == 5
    rtn2 = [r for r in ResultStore(store).rows() if r.get("quantizer") == "rtn2"]
    assert len(rtn2) == 5 and all(isinstance(r["within_noise_floor"], bool) for r in rtn2)
    from quantdyn.report.html import write_page

    page = write_page(small_run, tmp_path / "rep", store=store)
    names = {p.name for p in page.parent.iterdir()}
    assert {"index.html", "trajectory_sw.png", "rainbow_sw.png", "loss_vs_dce.png", "block_errors_sw.png",
            "kl_by_confidence_sw.png"} <= names
    assert "bf16 noise floor" in (page.parent / "trajectory_sw.csv").read_text()
    assert "control-s8-d4" in page.read_text()


def test_shards_partition_the_work(small_run, tmp_path):
    store = tmp_path / "store"
    a = run_sweep(_cfg(small_run, store, quantizers=["rtn4"]), shard="0/2", progress=False)
    b = run_sweep(_cfg(small_run, store, quantizers=["rtn4"]), shard="1/2", progress=False)
    assert a["checkpoints"] + b["checkpoints"] == 5 and a["written"] + b["written"] == 10
    rows = ResultStore(store).rows()
    assert len(rows) == 10 and len({r["key"] for r in rows}) == 10
    os.environ["SLURM_ARRAY_TASK_ID"], os.environ["SLURM_ARRAY_TASK_COUNT"] = "3", "4"
    try:
        assert parse_shard(None) == (3, 4)
    finally:
        del os.environ["SLURM_ARRAY_TASK_ID"], os.environ["SLURM_ARRAY_TASK_COUNT"]
    with pytest.raises(QuantdynError, match="i/n"):
        parse_shard("2")


def test_bad_specs_fail_before_work(small_run, tmp_path):
    store = tmp_path / "store"
    with pytest.raises(QuantdynError, match="did you mean 'gptq'"):
        run_sweep(_cfg(small_run, store, quantizers=["gtpq3"]), progress=False)
    with pytest.raises(QuantdynError, match="bits=1"):
        run_sweep(_cfg(small_run, store, quantizers=["gptq1"]), progress=False)
    with pytest.raises(QuantdynError, match="does not exist"):
        run_sweep(from_dict(SweepConfig, {"trajectory": {"checkpoints": [str(tmp_path / "nope")]},
                                          "store": str(store)}), progress=False)
    assert not list(store.glob("part-*"))


# Killing a sweep at random points and resuming it (no row lost or duplicated) is tested deterministically,
# with seeded kill points, in tests/faults/test_kill_resume.py.


def _fake_hub_cache(cache: Path, repo: str, checkpoints: dict[str, Path]) -> None:
    """Lay out checkpoints as revisions of `repo` in a huggingface_hub cache (what a download leaves)."""
    base = cache / f"models--{repo.replace('/', '--')}"
    for k, (rev, src) in enumerate(checkpoints.items()):
        sha = f"{k + 1:040x}"
        snap = base / "snapshots" / sha
        shutil.copytree(src, snap)
        (base / "refs").mkdir(parents=True, exist_ok=True)
        (base / "refs" / rev).write_text(sha)


def test_hub_revisions_from_local_cache(small_run, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    ck = small_run / "checkpoints"
    _fake_hub_cache(cache, "local/tiny", {"step4": ck / "step-0000004", "step8": ck / "step-0000008",
                                          "step12": ck / "step-0000012"})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    import transformers.utils.hub as th

    monkeypatch.setattr(th, "HF_HUB_CACHE", str(cache), raising=False)
    monkeypatch.setattr(th, "TRANSFORMERS_CACHE", str(cache), raising=False)
    cfg = from_dict(SweepConfig, {
        "trajectory": {"hub": "local/tiny", "revision_pattern": r"step\d+",
                       "schedule": {"schedule": {"name": "wsd", "warmup": 2, "decay": 4}, "peak_lr": 3e-3,
                                    "total_steps": 12, "tokens_per_step": 128}},
        "quantizers": ["rtn4"], "store": str(tmp_path / "store"),
        "data": {"calib_samples": 4, "calib_seq_len": 32, "eval_windows": 8, "eval_seq_len": 32},
    })
    out = run_sweep(cfg, progress=False)
    rows = [r for r in ResultStore(tmp_path / "store").rows() if r["kind"] == "ptq"]
    assert out["written"] == 6 and sorted(r["step"] for r in rows) == [4, 8, 12]
    by = {r["step"]: r for r in rows}
    assert by[8]["lr"] == pytest.approx(3e-3) and by[12]["lr"] == pytest.approx(0.0)
    assert by[12]["tokens"] == 12 * 128 and by[4]["checkpoint"] == "local/tiny@step4"


@pytest.mark.e2e
def test_sweep_eval_tasks_and_accuracy_panel(tmp_path, kjv_small):
    data_cfg, _ = kjv_small
    d = tiny_run_dict(tmp_path, data_cfg, steps=8, checkpoint_every=4)
    d["model"]["max_seq_len"] = 256
    run = train(from_dict(RunConfig, d), progress=False)
    store = tmp_path / "store"
    cfg = _cfg(run, store, quantizers=["rtn2"], eval_tasks=["quantdyn_nextsent"], eval_limit=12)
    run_sweep(cfg, progress=False)
    rows = ResultStore(store).rows()
    acc = [r for r in rows if r["kind"] == "accuracy"]
    ptq = {r["checkpoint_hash"] for r in rows if r["kind"] == "ptq"}
    assert len(acc) == 2 and {r["checkpoint_hash"] for r in acc} == ptq
    assert all(r["n"] == 12 and r["quantizer"] == "rtn2" for r in acc)
    assert run_sweep(cfg, progress=False)["written"] == 0
    # a sweep killed between a PTQ row and its accuracy rows: the rerun adds only the accuracy rows
    n_ptq = len([r for r in rows if r["kind"] == "ptq"])
    acc_parts = [p for p in ResultStore(store).parts() if '"kind": "accuracy"' in p.read_text()]
    assert acc_parts
    for p in acc_parts:
        p.unlink()
    assert not [r for r in ResultStore(store).rows() if r["kind"] == "accuracy"]
    assert run_sweep(cfg, progress=False)["written"] == 2
    rows = ResultStore(store).rows()
    assert len([r for r in rows if r["kind"] == "accuracy"]) == 2
    assert len([r for r in rows if r["kind"] == "ptq"]) == n_ptq
    assert run_sweep(cfg, progress=False)["written"] == 0
    from quantdyn.report.html import write_page

    write_page(store, tmp_path / "rep")
    assert (tmp_path / "rep" / "accuracy_vs_dce.png").is_file()


def test_sweep_slurm_writes_an_array_over_shards_of_one_resolved_spec(small_run, tmp_path, cli):
    """`sweep --slurm --shards 2`: the resolved sweep is written once and each array task runs one shard of it
    into the same store; running the two shards' commands gives every row once."""
    store = tmp_path / "store"
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"data": {"calib_samples": 4, "calib_seq_len": 32, "eval_windows": 8,
                                             "eval_seq_len": 32}}))
    r = cli("sweep", base, "--run", small_run, "--quantizers", "rtn4", "--store", store, "--slurm", "--write-only",
            "--shards", "2", "--partition", "gpu", "--time", "01:00:00", "--max-parallel", "1", "--cpus-per-task", "4")
    assert r.returncode == 0, r.stderr
    script = (store / "slurm" / "sweep.sbatch").read_text()
    assert "#SBATCH --array=0-1%1" in script and "#SBATCH --partition=gpu" in script
    assert "#SBATCH --time=01:00:00" in script and '--shard "$SLURM_ARRAY_TASK_ID/2"' in script
    spec = store / "slurm" / "sweep.yaml"
    assert str(spec.resolve()) in script and not list(store.glob("part-*.jsonl"))  # nothing measured yet
    for i in range(2):  # what the two array tasks run
        r = cli("sweep", spec, "--quiet", "--shard", f"{i}/2")
        assert r.returncode == 0, r.stderr
    rows = ResultStore(store).rows()
    assert len(rows) == len({r["key"] for r in rows}) == 2 * len({r["checkpoint"] for r in rows})
    r = cli("sweep", "--run", small_run, "--store", store, "--slurm", "--shard", "0/2")
    assert r.returncode == 2 and "--shards" in r.stderr


def test_a_bad_checkpoint_is_one_line_and_the_sweep_goes_on(small_run, tmp_path, cli):
    """A truncated checkpoint among good ones: one line naming the file, no row for it, every other checkpoint
    measured, and the command ends with exit 2 naming it."""
    good = sorted((small_run / "checkpoints").iterdir())[:2]
    bad = shutil.copytree(good[0], tmp_path / "bad")
    w = bad / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-64])
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"trajectory": {"checkpoints": [str(good[0]), str(bad), str(good[1])]},
                                    "quantizers": ["rtn4"], "store": str(tmp_path / "store"),
                                    "data": {"calib_samples": 4, "calib_seq_len": 32, "eval_windows": 8,
                                             "eval_seq_len": 32}}))
    r = cli("sweep", spec, "--quiet")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert any("model.safetensors" in x and "truncated" in x for x in lines) and len(lines) == 2, r.stderr
    assert "1 checkpoint(s) could not be measured" in lines[-1] and str(bad) in lines[-1]
    rows = ResultStore(tmp_path / "store").rows()
    assert {r["checkpoint"] for r in rows} == {str(good[0]), str(good[1])}


def test_sweep_verbose_engine_settings_and_plain_progress(small_run, tmp_path, cli, monkeypatch):
    """--verbose adds a line per decoder block and per checkpoint; --spill-dir/--streams/--repeat-vary (over the
    spec's streams) and the spec's logits_budget_mb reach the engine, a bad --streams is one line before any file; off a terminal progress is plain lines, never a bar."""
    import quantdyn.sweep.sweep as sweep_mod

    seen = []
    real = sweep_mod.measure

    def spy(*a, **kw):
        seen.append(kw["cfg"])
        return real(*a, **kw)

    monkeypatch.setattr(sweep_mod, "measure", spy)
    ck = sorted((small_run / "checkpoints").iterdir())[0]
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"trajectory": {"checkpoints": [str(ck)]}, "quantizers": ["gptq3"],
                                    "streams": "memory", "logits_budget_mb": 2, "quant_repeats": 2,
                                    "data": {"calib_samples": 4, "calib_seq_len": 32, "eval_windows": 8,
                                             "eval_seq_len": 32}}))
    spill = tmp_path / "spill"
    spill.mkdir()
    bad = cli("sweep", spec, "--store", tmp_path / "st", "--streams", "fast")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "fast" in bad.stderr, bad.stderr
    assert not (tmp_path / "st").exists() and seen == []
    r = cli("sweep", spec, "--store", tmp_path / "st", "--verbose", "--spill-dir", spill, "--repeat-vary", "order",
            "--streams", "disk")
    assert r.returncode == 0, r.stderr
    assert (seen[0].streams, seen[0].logits_budget_mb, seen[0].spill_dir) == ("disk", 2, str(spill))
    n_layer = json.loads((ck / "config.json").read_text())["num_hidden_layers"]
    blocks = [x for x in r.stderr.splitlines() if f"{ck}: pass 1/1 block" in x]
    assert len(blocks) == n_layer, r.stderr
    # FP and one gptq3 row (its R = 2 repeats summarised)
    assert any(x.startswith(f"{ck}: 2 rows written, 0 already stored") for x in r.stderr.splitlines()), r.stderr
    assert "\r" not in r.stderr and "sweep: 1/1 ckpt (100%)" in r.stderr  # one shard: no shard in the prefix
    assert {x["repeat_vary"] for x in ResultStore(tmp_path / "st").rows() if x["kind"] == "ptq"} == {"order"}


def test_a_checkpoint_is_the_same_measurement_whichever_way_it_is_named(small_run, tmp_path):
    """Issue: `sweep --run R` then `sweep --checkpoint R/checkpoints/step-X` into the same store wrote the fp and
    PTQ rows of step X again (another data key, eval/calibration hashes, ckpt_kind and decaying). Named either way
    (and for a cooldown branch's checkpoint too) it is one point on the same data: its rows are found, not
    rewritten, and a new quantizer adds only its row."""
    store = tmp_path / "store"
    first = run_sweep(_cfg(small_run, store, quantizers=["rtn4"]), progress=False)
    assert first["written"] == 10
    main = small_run / "checkpoints" / "step-0000008"
    branch = next((small_run / "branches").glob("cooldown-*")) / "checkpoints"
    branch_ckpt = sorted(branch.iterdir())[-1]
    cfg = from_dict(SweepConfig, {**to_dict(_cfg(small_run, store, quantizers=["rtn4", "rtn3"])),
                                  "trajectory": {"checkpoints": [str(main), str(branch_ckpt)]}})
    again = run_sweep(cfg, progress=False)
    assert again["written"] == 2 and again["skipped"] == 4  # only rtn3 of the two checkpoints is new
    rows = ResultStore(store).rows()
    by_point = {}
    for r in rows:
        by_point.setdefault((r["branch"], r["step"], r["kind"], r.get("quantizer")), []).append(r)
    assert all(len(v) == 1 for v in by_point.values()), {k: len(v) for k, v in by_point.items() if len(v) > 1}
    new = [r for r in rows if r.get("quantizer") == "rtn3"]
    old = {(r["branch"], r["step"]): r for r in rows if r.get("quantizer") == "rtn4"}
    for r in new:
        twin = old[(r["branch"], r["step"])]
        for k in ("data_key", "eval_hash", "calib_hash", "ckpt_kind", "decaying", "run", "tokens", "lr"):
            assert r[k] == twin[k], k
    assert {r["ckpt_kind"] for r in new} == {"checkpoint", "cooldown"}


def test_identical_weights_are_measured_once(small_run, tmp_path, monkeypatch):
    """Issue 46.4: a checkpoint whose weights another point of the trajectory holds too (the cooldown branch from
    step 8 ends with the main run's own decayed endpoint; from an HF model, the branch point is step 0 of the
    experiment and of every branch) is measured once: every point keeps its rows, with its own place in the
    trajectory, and a copy names the measured row; a rerun and a new quantizer measure nothing twice."""
    import quantdyn.sweep.sweep as sweep_mod
    from quantdyn.models.hf_io import checkpoint_hash
    from quantdyn.sources.trajectory import plan_points

    calls = []
    real = sweep_mod.measure
    monkeypatch.setattr(sweep_mod, "measure", lambda w, variants, *a, **kw: calls.append(sorted(variants))
                        or real(w, variants, *a, **kw))
    store = tmp_path / "store"
    cfg = _cfg(small_run, store, quantizers=["rtn4"])
    points = plan_points(cfg.trajectory)
    hashes = [checkpoint_hash(p.ref) for p in points]
    assert len(points) == 5 and len(set(hashes)) == 4  # main step 12 and cooldown-s8-d4 step 12: one set of weights
    out = run_sweep(cfg, progress=False)
    assert len(calls) == 4 and out["written"] == 10 and out["skipped"] == 0
    rows = ResultStore(store).rows()
    assert len(rows) == 10 and len({r["measurement"] for r in rows}) == 8  # (fp + rtn4) x 4 sets of weights
    copies = [r for r in rows if r.get("copy_of")]
    assert len(copies) == 2 and {r["branch"] for r in copies} == {"cooldown-s8-d4-linear"}
    by_key = {r["key"]: r for r in rows}
    for c in copies:
        src = by_key[c["copy_of"]]
        assert (src["branch"], src["step"]) == ("main", 12) and c["step"] == 12 and c["ckpt_kind"] == "cooldown"
        assert c["measurement"] == src["measurement"] and c["checkpoint_hash"] == src["checkpoint_hash"]
        assert c["checkpoint"] != src["checkpoint"] and c["key"] != src["key"]
        for k in ("ce_fp", "delta_ce", "window_delta", "time", "git_sha"):
            assert c.get(k) == src.get(k), k
    from quantdyn.results.schema import undocumented

    assert all(undocumented(r) == [] for r in rows)
    # the decay table still pairs the cooldown's endpoint (a copy) with its control
    from quantdyn.results.stats import decay_table

    assert [t["branch"] for t in decay_table(rows, "sw")] == ["cooldown-s8-d4-linear"]
    # a rerun skips everything; a new quantizer is measured once per set of weights and copied to the twin
    calls.clear()
    assert run_sweep(cfg, progress=False) == {**out, "written": 0, "skipped": 10, "seconds": []}
    assert calls == []
    more = run_sweep(_cfg(small_run, store, quantizers=["rtn4", "rtn3"]), progress=False)
    assert len(calls) == 4 and all(c == ["rtn3"] for c in calls) and more["written"] == 5 and more["skipped"] == 10
    # a store whose measured row of the twin exists already (a sweep killed between the two points) copies it
    rows = ResultStore(store).rows()
    keep = [r for r in rows if not (r["branch"] == "cooldown-s8-d4-linear" and r["step"] == 12)]
    fresh = tmp_path / "fresh"
    ResultStore(fresh).append(keep)
    calls.clear()
    resumed = run_sweep(_cfg(small_run, fresh, quantizers=["rtn4", "rtn3"]), progress=False)
    assert calls == [] and resumed["written"] == 3 and resumed["skipped"] == 12


def test_the_plan_comes_before_any_measurement(small_run, tmp_path, monkeypatch):
    """Issue 50.5: a sweep says its plan (checkpoints x quantizers) before its data is prepared or any weight is
    read, and an ETA once the first block of the first checkpoint is done, before that checkpoint ends."""
    import quantdyn.sweep.sweep as sweep_mod

    lines: list[str] = []
    seen: list[tuple[str, int]] = []
    real_data, real_measure = sweep_mod.sweep_data, sweep_mod.measure

    def data(*a, **kw):
        seen.append(("data", len(lines)))
        return real_data(*a, **kw)

    def measure(*a, **kw):
        seen.append(("measure", len(lines)))
        m = real_measure(*a, **kw)
        seen.append(("measured", len(lines)))
        return m

    monkeypatch.setattr(sweep_mod, "sweep_data", data)
    monkeypatch.setattr(sweep_mod, "measure", measure)
    run_sweep(_cfg(small_run, tmp_path / "store", quantizers=["rtn4", "gptq3"]), progress=True, echo=lines.append)
    assert lines[0] == (f"sweep: 5 checkpoints x 2 quantizers (rtn4, gptq3) -> store {tmp_path / 'store'} (rows "
                        "already there are skipped)")
    assert seen[0] == ("data", 1) and seen[1] == ("measure", 1)  # the plan before the data and the first weight
    assert seen[2][0] == "measured" and seen[2][1] == 2  # the ETA during the first checkpoint, once
    assert lines[1].startswith("sweep: the first block took ") and " per checkpoint, " in lines[1] \
        and " for 5 " in lines[1]
    assert sum("the first block took" in x for x in lines) == 1
    # quiet: neither
    lines.clear()
    run_sweep(_cfg(small_run, tmp_path / "quiet", quantizers=["rtn4"]), progress=False, echo=lines.append)
    assert lines == []
