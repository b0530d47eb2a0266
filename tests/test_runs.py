"""quantdyn/runs.py: the one owner of the run-directory layout — paths, checkpoint listing, the names of
branches and averages — and nothing outside it builds them by hand."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from quantdyn import runs
from quantdyn.errors import QuantdynError
from quantdyn.runs import (
    RunDir,
    averaged_checkpoints,
    branch_runs,
    control_branch,
    control_of,
    cooldown_branch,
    in_checkpoints,
    interpolation_name,
    is_control,
    is_cooldown,
    lawa_name,
    latest_resumable,
    list_checkpoints,
    parse_branch,
    run_root_of,
)
from quantdyn.schedules import DECAY_SHAPES

ROOT = Path(__file__).resolve().parents[1]


def _checkpoint(d: Path, step: int | None = None, state: bool = False) -> Path:
    d.mkdir(parents=True)
    (d / runs.WEIGHTS).write_bytes(b"")
    if step is not None:
        (d / runs.META).write_text(json.dumps({"step": step, "tokens": 10 * step, "lr": 0.5}))
    if state:
        (d / runs.STATE).write_bytes(b"")
    return d


def _run(d: Path) -> RunDir:
    d.mkdir(parents=True, exist_ok=True)
    (d / runs.CONFIG).write_text("name: r\n")
    return RunDir(d)


# ------------------------------------------------------------------ the layout
def test_the_layout_names_what_the_docs_draw(tmp_path):
    rd = RunDir(tmp_path)
    assert rd.checkpoint(400) == tmp_path / "checkpoints" / "step-0000400"
    assert rd.branch("cooldown-s8-d4-linear").checkpoint(12) == \
        tmp_path / "branches" / "cooldown-s8-d4-linear" / "checkpoints" / "step-0000012"
    assert rd.average(lawa_name(4, 2), 8) == tmp_path / "averages" / "lawa-k4-p2" / "step-0000008"
    assert (rd.config, rd.info, rd.metrics) == (tmp_path / "config.yaml", tmp_path / "run.json",
                                                tmp_path / "metrics.jsonl")
    assert runs.step_of_name("step-0000400") == 400 and runs.step_of_name("step-x") is None


def test_listing_checkpoints_branches_and_averages(tmp_path):
    rd = _run(tmp_path / "r")
    _checkpoint(rd.checkpoint(8), 8, state=True)
    _checkpoint(rd.checkpoint(4), 4, state=True)
    _checkpoint(rd.checkpoint(12), 12)  # no training state: listed, not resumable
    (rd.checkpoints / "step-0000016").mkdir()  # no weights yet: not a checkpoint
    assert [c.step for c in list_checkpoints(rd.path)] == [4, 8, 12]
    assert latest_resumable(rd.path).step == 8 and runs.has_checkpoints(rd.path) == [4, 8, 12, 16]
    assert rd.status(12) == "finished" and rd.status(20) == "partial" and RunDir(tmp_path / "x").status(4) == "new"

    b = _run(rd.branch(cooldown_branch(8, 4, "linear")).path)
    _checkpoint(b.checkpoint(12), 12)
    (rd.branches / "not-a-run").mkdir()
    assert [x.path.name for x in branch_runs(rd.path)] == ["cooldown-s8-d4-linear"]

    _checkpoint(rd.average(lawa_name(2, 4, offline=True), 8), 8)
    _checkpoint(rd.average_dir("soup"), None)  # a single averaged checkpoint
    assert [(n, p.name) for n, p in averaged_checkpoints(rd.path)] == [("lawa-k2-p4-offline", "step-0000008"),
                                                                       ("soup", "soup")]
    # every checkpoint of the run, its branches and averages belongs to the main run
    for p in (rd.checkpoint(4), b.checkpoint(12), rd.average(lawa_name(2, 4, offline=True), 8)):
        assert run_root_of(p) == rd.path.resolve()
    assert run_root_of(tmp_path / "elsewhere") is None
    assert in_checkpoints(rd.checkpoint(4)) == rd.path and in_checkpoints(b.checkpoint(12)) == b.path
    assert in_checkpoints(rd.average_dir("soup")) is None


def test_step_references_follow_the_runs_length(tmp_path):
    """latest / -N / N name a run's checkpoints whatever its length: the tour's commands survive a shorter run."""
    rd = _run(tmp_path / "r")
    rd.config.write_text("name: r\ntrain:\n  steps: 400\n")
    for s in (0, 100, 200, 300, 400):
        _checkpoint(rd.checkpoint(s), s)
    assert [runs.resolve_step(rd.path, r) for r in ("latest", "LAST", "-100", -300, "200", 0)] == [400, 400, 300, 100,
                                                                                                   200, 0]
    with pytest.raises(QuantdynError, match=r"step -50 of '.*' is step 350 \(50 before its end, 400\), which has no "
                                            r"checkpoint; its checkpoints: 0, 100, 200, 300, 400$"):
        runs.resolve_step(rd.path, "-50")
    with pytest.raises(QuantdynError, match="reaches before the start"):
        runs.resolve_step(rd.path, "-500")
    with pytest.raises(QuantdynError, match=r"step 'newest' of .* must be a step \(400\), latest"):
        runs.resolve_step(rd.path, "newest")
    # the same references name a checkpoint directory; anything else passes through unchanged
    assert runs.resolve_run_reference(f"{rd.path}@latest") == str(rd.checkpoint(400))
    assert runs.resolve_run_reference(f"{rd.path}@-100") == str(rd.checkpoint(300))
    assert runs.resolve_run_reference(f"{rd.path}@100") == str(rd.checkpoint(100))
    for other in ("org/model@main", str(rd.checkpoint(100)), str(tmp_path / "no-run@latest")):
        assert runs.resolve_run_reference(other) == other
    with pytest.raises(QuantdynError, match=r"names step 150, which has no checkpoint in .*: 0, 100, 200, 300, 400$"):
        runs.resolve_run_reference(f"{rd.path}@150")
    empty = _run(tmp_path / "empty")
    with pytest.raises(QuantdynError, match="has no checkpoint for 'latest' yet"):
        runs.resolve_step(empty.path, "latest")


def test_open_checkpoint_takes_run_references_and_says_what_a_run_is(tmp_path):
    from quantdyn.sources.hub import resolve_checkpoint

    rd = _run(tmp_path / "r")
    rd.config.write_text("name: r\ntrain:\n  steps: 8\n")
    for s in (4, 8):
        _checkpoint(rd.checkpoint(s), s)
    assert resolve_checkpoint(f"{rd.path}@latest") == rd.checkpoint(8)
    assert resolve_checkpoint(f"{rd.path}@-4") == rd.checkpoint(4)
    with pytest.raises(QuantdynError, match=r"is a quantdyn run, not one checkpoint: name one, e.g. .*r@latest"):
        resolve_checkpoint(rd.path)


def test_a_directory_without_config_is_not_a_run(tmp_path):
    with pytest.raises(QuantdynError, match="not a quantdyn run directory"):
        RunDir(tmp_path).read_config()
    assert _run(tmp_path).read_config() == {"name": "r"}


def test_averaged_names():
    assert lawa_name(4, 2) == "lawa-k4-p2" and lawa_name(4, 2, offline=True) == "lawa-k4-p2-offline"
    assert runs.ema_name(0.999) == "ema-0.999" and runs.ema_name(0.99999999) == "ema-1"  # 6 significant digits
    a = Path("/x/r/checkpoints/step-0000004")
    assert interpolation_name(a, Path("/x/r/checkpoints/step-0000012")) == "interp-step-0000004-step-0000012"
    assert interpolation_name(a, Path("/x/q/checkpoints/step-0000012")) == "interp-step-0000004-q-step-0000012"
    assert interpolation_name(a, Path("/x/soups/s1")) == "interp-step-0000004-soups-s1"
    assert runs.alpha_name(0.25) == "alpha-0.2500"


# ------------------------------------------------------------------ branch names
@pytest.mark.parametrize("shape", sorted(DECAY_SHAPES))
def test_one_builder_and_one_parser_of_branch_names(shape):
    for s, d in ((1, 1), (200, 100), (143000, 7)):
        name, ctrl = cooldown_branch(s, d, shape), control_branch(s, d)
        assert parse_branch(name) == runs.BranchName("cooldown", s, d, shape)
        assert parse_branch(ctrl) == runs.BranchName("control", s, d, None)
        assert control_of(name) == ctrl and control_of(ctrl) is None
        assert is_cooldown(name) and not is_control(name) and is_control(ctrl) and not is_cooldown(ctrl)
    assert cooldown_branch(8, 4, "1-sqrt") == "cooldown-s8-d4-1-sqrt"


def test_names_that_are_not_cooldowns_or_controls_parse_to_none():
    for name in ("main", "lawa-k4-p2-offline", "soup-cooldowns", "ema", "control-s8-d4-linear", "cooldown-sx-d4-a",
                 "", None, "ingredient1"):
        assert parse_branch(name) is None and control_of(name) is None
        assert not is_control(name) and not is_cooldown(name)
    assert parse_branch("cooldown-s8-d4") == runs.BranchName("cooldown", 8, 4, None)  # unshaped: still a cooldown
    with pytest.raises(QuantdynError):
        cooldown_branch(8, 4, "")


# ------------------------------------------------------------------ one owner
_HAND_BUILT = re.compile(r'/ "(config\.yaml|branches|averages|checkpoints|run\.json|metrics\.jsonl)"|"training_state\.pt"'
                         r'|lawa-k\{|interp-\{|name [!=]= "(checkpoints|branches|averages)"|"step-"|step-\{')


def test_no_module_builds_run_paths_by_hand():
    """The names of run.py's layout appear in quantdyn/runs.py only (the sbatch script of launch/grid.py is shell)."""
    found = []
    for p in sorted((ROOT / "quantdyn").rglob("*.py")):
        if p.name == "runs.py" and p.parent.name == "quantdyn":
            continue
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if _HAND_BUILT.search(line):
                found.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)


def test_runs_and_schedules_import_no_torch():
    """The ground floor reads names and small files: importing it costs no torch."""
    code = "import sys, quantdyn.runs, quantdyn.schedules; print([m for m in sys.modules if m.startswith('torch')])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
