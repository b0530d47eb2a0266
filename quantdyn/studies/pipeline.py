"""Studies end to end: `quantdyn study SPEC.yaml [key=value ...]` and `quantdyn demo` (the embedded spec).

    train (seeds x grid) -> cooldown branches + constant-LR controls -> weight averages (LAWA, soup of
    cooldown branches) -> sweep quantizers and analyses over every checkpoint -> what to ship at ship.budget
    (quantdyn/ship/, when the spec has a budget) -> findings (effect, uncertainty, verdict) -> the HTML report,
    which opens with the decision and the findings, and the same summary printed (studies/section.py)

Every stage resumes: rerunning skips finished runs, branches, averages and stored rows.  A run whose
training diverges (a peak LR too high) is recorded in REPORT/study.json, reported, and left out of the
later stages and of the findings; a rerun does not train it again.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from quantdyn.config import from_dict, to_dict
from quantdyn.errors import QuantdynError
from quantdyn.evaluate.loss import window_losses
from quantdyn.files import write_json_atomic
from quantdyn.launch.grid import expand_grid
from quantdyn.models.hf_io import checkpoint_hash, load_causal_lm
from quantdyn.monitor import hooks_for
from quantdyn.results.schema import PTQ, SHIP
from quantdyn.results.store import ResultStore
from quantdyn.runs import SOUP_OF_COOLDOWNS, RunDir, has_weights, lawa_name, latest_resumable
from quantdyn.runtime import git_sha, hardware, resolve_device
from quantdyn.ship.candidates import CandidateSpec
from quantdyn.ship.ship import ShipConfig, ShipResult, ship
from quantdyn.sources.presets import as_hub_ref
from quantdyn.sources.trajectory import TrajectoryConfig
from quantdyn.studies import findings as fd
from quantdyn.studies import section
from quantdyn.studies.spec import StudySpec, demo_spec, spec_from_dict
from quantdyn.sweep.sweep import run_sweep, sweep_data
from quantdyn.train.branches import cooldown
from quantdyn.train.checkpoint import read_metrics
from quantdyn.train.config import RunConfig, load_run_config
from quantdyn.train.offline_averaging import average_lawa, make_soup
from quantdyn.train.trainer import train

Echo = Callable[[str], None]
STATE = "study.json"


def plan_runs(spec: StudySpec) -> list[RunConfig]:
    """The study's training runs: the base run expanded over ``vary`` (names as `quantdyn grid`), each once
    per seed (name suffix -sSEED)."""
    base = to_dict(spec.run)
    combos = expand_grid(base, list(spec.vary), seeds=0) if spec.vary else [(spec.run.name, base)]
    out = []
    for name, d in combos:
        cfg = from_dict(RunConfig, d)
        if cfg.model.hf:  # a preset point: the hub id@revision it names
            cfg = replace(cfg, model=replace(cfg.model, hf=as_hub_ref(cfg.model.hf)))
        if spec.seeds:
            out += [replace(cfg, seed=int(s), name=f"{name}-s{s}") for s in spec.seeds]
        else:
            out.append(cfg)
    return out


def run_dir_of(cfg: RunConfig) -> Path:
    return Path(cfg.out_dir) / cfg.name


def _load_state(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError:
        return {}


def _finished(cfg: RunConfig, run_dir: Path) -> bool:
    return RunDir(run_dir).status(cfg.train.steps) == "finished"


def _train(cfg: RunConfig, run_dir: Path, progress: bool, echo: Echo) -> str | None:
    """Train (or resume) one run; returns the divergence message when training diverged."""
    partial = latest_resumable(run_dir)
    echo(f"[1/4] training {cfg.name} ({cfg.train.steps} steps, {cfg.schedule.name}, peak LR {cfg.optim.lr:g}, "
         f"{cfg.optim.name})" + (f", resuming at step {partial.step}" if partial else ""))
    try:
        train(cfg, run_dir, resume=partial, progress=progress, hooks=hooks_for(cfg))  # the run's monitor: section
    except QuantdynError as e:
        if "diverged" not in str(e):  # the trainer's divergence check; anything else is the user's to fix
            raise
        return str(e)
    return None


def _cooldowns(spec: StudySpec, run_dir: Path, name: str, progress: bool, echo: Echo) -> None:
    cd = spec.cooldowns
    if not cd.enabled:
        return
    ends = sorted({s + cd.decay_of(s) for s in cd.from_steps})
    echo(f"[2/4] {name}: cooldowns from steps {list(cd.from_steps)} to step{'s' if len(ends) > 1 else ''} "
         f"{', '.join(map(str, ends))}" + (" with constant-LR controls" if cd.control else ""))
    hooks = hooks_for(load_run_config(run_dir))  # the run's monitor: section, in every branch as in `quantdyn cooldown`
    for s in cd.from_steps:
        cooldown(run_dir, s, [cd.decay_of(s)], cd.shape, cd.control, progress=progress, nodecay=cd.nodecay,
                 hooks=hooks)
        for text in cd.interventions:  # issue 48: the same start and length, with SAM or QAT in a format
            echo(f"[2/4] {name}: cooldown from step {s} with {text}")
            cooldown(run_dir, s, [cd.decay_of(s)], cd.shape, progress=progress, intervention=cd.intervention(text),
                     hooks=hooks)


def lawa_at_step(run_dir: Path, window: int, every: int, step: int) -> Path:
    """Offline LAWA (train/offline_averaging.average_lawa) of ``run_dir`` ending at ``step`` only, written to
    RUN/averages/lawa-kK-pP-offline/step-N; an existing one is kept.

    average_lawa writes every step of its grid; they are written to a temporary directory beside the run's
    averages and only ``step`` is moved into place (a sweep visits every stored average)."""
    final = RunDir(run_dir).average(lawa_name(window, every, offline=True), step)
    if has_weights(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".lawa-", dir=final.parent.parent) as tmp:
        written = average_lawa(run_dir, window, every, out=Path(tmp) / "all")
        mine = [p for p in written if p.name == final.name]
        if not mine:
            raise QuantdynError(f"LAWA k={window} p={every} of '{run_dir}' wrote no average at step {step}; "
                                "is that step a stored checkpoint on the LAWA grid?")
        os.replace(mine[0], final)
    return final


def soup_of_cooldowns(spec: StudySpec, run_dir: Path) -> Path:
    """A uniform soup of the endpoints of every cooldown branch (all end at cooldowns.end_step), written to
    RUN/averages/soup-cooldowns/step-N; an existing one is kept."""
    cd = spec.cooldowns
    end = cd.end_step
    out = RunDir(run_dir).average(SOUP_OF_COOLDOWNS, end)
    if has_weights(out):
        return out
    ingredients = [RunDir(run_dir).branch(cd.branch_name(s)).checkpoint(end) for s in cd.from_steps]
    return make_soup(ingredients, out=out)


def _averages(spec: StudySpec, cfg: RunConfig, run_dir: Path, echo: Echo) -> None:
    av = spec.averaging
    if not av.enabled:
        return
    at = av.at_step or cfg.train.steps
    what = [x.name for x in av.lawa] + (["soup of the cooldown branches"] if av.soup_cooldowns else [])
    echo(f"[2/4] {cfg.name}: averages at step {at}: {', '.join(what)}")
    for x in av.lawa:
        lawa_at_step(run_dir, x.window, x.every, at)
    if av.soup_cooldowns:
        soup_of_cooldowns(spec, run_dir)


def _sweep(spec: StudySpec, run_dir: Path, name: str, progress: bool, echo: Echo) -> dict:
    sw = spec.sweep
    R = sw.quant_repeats
    echo(f"[3/4] {name}: sweeping {', '.join(map(str, sw.quantizers))} over every checkpoint "
         f"(quantization repeated R = {R} time{'s' if R > 1 else ''}"
         + (", run-to-run spread measured" if R > 1 else ", run-to-run spread not measured")
         + (f"; analyses: {', '.join(sw.analysis)}" if sw.analysis else "") + ")")
    counts = run_sweep(replace(sw, trajectory=TrajectoryConfig(run=str(run_dir))), progress=progress, echo=echo)
    for ref, msg in counts.get("failed", []):
        echo(f"  skipped checkpoint {ref}: {msg}")
    return counts


def ship_config(spec: StudySpec, run_dir: Path, name: str) -> ShipConfig:
    """`quantdyn ship RUN --budget B --out SHIP/<run>-<B>` as the study asks it: on the sweep's evaluation and
    calibration windows, into the sweep's store."""
    sh, sw = spec.ship, spec.sweep
    return ShipConfig(source=(str(run_dir),), budget=sh.budget, out=sh.out_of(name), quantizers=sh.quantizers,
                      formats=sh.formats, auto=sh.auto, candidates=CandidateSpec(last=sh.last, lawa=sh.lawa,
                                                                                 soup=sh.soup),
                      eval_data=sw.data.source, eval_tokens=sw.data.eval_windows * sw.data.eval_seq_len,
                      eval_seq_len=sw.data.eval_seq_len, calib_samples=sw.data.calib_samples,
                      calib_seq_len=sw.data.calib_seq_len, screen_windows=sh.screen_windows, repeats=sh.repeats,
                      store=sw.store, device=sw.device, engine=sw.engine)


def _ship(spec: StudySpec, run_dir: Path, name: str, progress: bool, echo: Echo) -> ShipResult | None:
    """What to ship from one run at spec.ship.budget; the screen's drops are counted here (ship.json lists each
    with its z), the other lines of ship printed as they come."""
    if not spec.ship.enabled:
        return None
    cfg = ship_config(spec, run_dir, name)
    echo(f"[3/4] {name}: what to ship at {cfg.budget:g} bits per weight (quantdyn ship {run_dir} --budget "
         f"{cfg.budget:g} --out {cfg.out}" + (f" --quantizers {','.join(cfg.quantizers)}" if cfg.quantizers else "")
         + f" --last {cfg.candidates.last})")
    dropped = []

    def say(line: str) -> None:
        if line.startswith("dropped "):
            dropped.append(line)
        else:
            echo(f"  {line}")

    try:
        res = ship(cfg, echo=say, progress=progress)
    except QuantdynError as e:  # the study's key for what the command line calls --out
        raise QuantdynError(str(e).replace("--out", "ship.out")) from None
    if dropped:
        s = res.report["screen"]
        echo(f"  screen: dropped {len(dropped)} of {len(dropped) + len(res.report['options'])} options on the first "
             f"{s['screen_windows']} of {s['windows']} windows (beaten by the best at z > {cfg.z:g}; "
             f"{res.path} lists each with its z)")
    return res


def _rows_of(store: str, run_dirs: list[Path], repeats: int) -> list[dict]:
    prefixes = [str(d.resolve()) + os.sep for d in run_dirs]
    rows = []
    for r in ResultStore(store).rows():
        ck = r.get("checkpoint")
        if ck and any(str(Path(ck).resolve()).startswith(p) for p in prefixes):
            rows.append(r)
    return fd.with_fp_se(fd.dedupe(rows, repeats))


def fp_window_losses(spec: StudySpec, run_dir: Path, checkpoints: list[str], cache: Path) -> dict[str, list[float]]:
    """Per-window FP CE of ``checkpoints`` on the sweep's evaluation windows (the sweep stores only their mean),
    so CE(quantized) differences between checkpoints pair window by window.  Cached in ``cache`` by
    checkpoint hash and evaluation-token hash."""
    sw = replace(spec.sweep, trajectory=TrajectoryConfig(run=str(run_dir)))
    data = sweep_data(sw, [], progress=False)
    ids = data.eval_windows(sw.data.eval_seq_len, sw.data.eval_windows)
    eh = data.token_hash("val", sw.data.eval_seq_len, sw.data.eval_windows)
    stored = _load_state(cache)
    out, changed = {}, False
    device = resolve_device(sw.device)
    for ck in checkpoints:
        key = f"{checkpoint_hash(ck)}:{eh}"
        if key not in stored:
            model = load_causal_lm(ck, device=device)
            stored[key] = [round(float(v), 7) for v in window_losses(model, ids, batch_size=sw.engine.batch_size)]
            changed = True
        out[ck] = stored[key]
    if changed:
        write_json_atomic(cache, stored)
    return out


def reference_branch(spec: StudySpec) -> str:
    """The branch whose endpoint is "the decayed endpoint" of the averaging finding."""
    cd = spec.cooldowns
    return cd.branch_name(spec.averaging.reference_from_step or max(cd.from_steps))


def run_study(spec: StudySpec | dict, progress: bool = True, echo: Echo = print) -> dict:
    """Run (or resume) a study; returns the report path, the decay tables, the findings and the run dirs."""
    if isinstance(spec, dict):
        spec = spec_from_dict(spec)
    t_start = time.perf_counter()
    report_dir = Path(spec.report)
    state_path = report_dir / STATE
    state = _load_state(state_path)
    diverged: dict[str, str] = dict(state.get("diverged") or {})
    cfgs = plan_runs(spec)
    seconds = {"train": 0.0, "cooldowns": 0.0, "averages": 0.0, "sweep": 0.0, "ship": 0.0, "report": 0.0}
    if spec.title:
        echo(spec.title)
    summary = []
    for cfg in cfgs:
        run_dir = run_dir_of(cfg)
        if cfg.name in diverged:
            echo(f"[1/4] {cfg.name}: diverged before ({diverged[cfg.name]}); left out")
            continue
        t0 = time.perf_counter()
        if not _finished(cfg, run_dir):
            msg = _train(cfg, run_dir, progress, echo)
            if msg is not None:
                diverged[cfg.name] = msg
                echo(f"  {cfg.name}: {msg}; left out of the study")
                write_json_atomic(state_path, {**state, "diverged": diverged})
                continue
        t1 = time.perf_counter()
        _cooldowns(spec, run_dir, cfg.name, progress, echo)
        t2 = time.perf_counter()
        _averages(spec, cfg, run_dir, echo)
        t3 = time.perf_counter()
        counts = _sweep(spec, run_dir, cfg.name, progress, echo)
        t4 = time.perf_counter()
        shipped = _ship(spec, run_dir, cfg.name, progress, echo)
        t_ship = time.perf_counter()
        for k, a, b in (("train", t0, t1), ("cooldowns", t1, t2), ("averages", t2, t3), ("sweep", t3, t4),
                        ("ship", t4, t_ship)):
            seconds[k] += b - a
        vals = [r["val/loss"] for r in read_metrics(run_dir) if "val/loss" in r]
        summary.append({"run_dir": run_dir, "cfg": cfg, "counts": counts, "val": (vals[0], vals[-1]) if vals else None,
                        "ship": shipped})
    if not summary:
        raise QuantdynError("every run of the study diverged; lower the peak LR (run.optim.lr or vary)")
    echo("[4/4] writing the report and the findings")
    t5 = time.perf_counter()
    store = spec.sweep.store
    runs = [s["cfg"].name for s in summary]
    rows = _rows_of(store, [s["run_dir"] for s in summary], spec.sweep.quant_repeats)
    fams = spec.finding_families
    ref = reference_branch(spec) if "averaging" in fams else None
    # CE(quantized) differences between checkpoints pair window by window with their FP window losses: at the
    # tokens of the averaging family's decayed endpoint, and of the interventions league's standard endpoint
    ends_of = ([ref] if ref is not None else []) + (
        [spec.cooldowns.branch_name(spec.cooldowns.from_steps[0])] if "interventions" in fams else [])
    fp_windows = None
    if "warmdown" in fams:  # the warmdown grid compares the runs' final checkpoints
        fp_windows = {}
        for s in summary:
            last = [r for r in rows if PTQ.matches(r) and r.get("run") == s["cfg"].name and r.get("branch") == "main"]
            if last:
                tokens = max(r["tokens"] for r in last)
                cks = sorted({r["checkpoint"] for r in last if r.get("tokens") == tokens})
                fp_windows.update(fp_window_losses(spec, s["run_dir"], cks, report_dir / "fp_windows.json"))
    if ends_of:
        fp_windows = fp_windows or {}
        for s in summary:
            for end_branch in ends_of:
                ends = [r for r in rows if PTQ.matches(r) and r.get("run") == s["cfg"].name
                        and r.get("branch") == end_branch]
                if not ends:
                    continue
                tokens = max(r["tokens"] for r in ends)
                cks = sorted({r["checkpoint"] for r in rows if PTQ.matches(r) and r.get("run") == s["cfg"].name
                              and r.get("tokens") == tokens})
                fp_windows.update(fp_window_losses(spec, s["run_dir"], cks, report_dir / "fp_windows.json"))
    notes = [f"{name} diverged: {msg}" for name, msg in diverged.items()]
    answer = section.answer(rows, runs, fams, spec.findings, ref, fp_windows, notes, spec.title, to_dict(spec))
    page = section.write_report(store, report_dir, answer_of=answer)
    echo("")
    for s in summary:
        mine = [r for r in rows if r.get("run") == s["cfg"].name and not SHIP.matches(r)]  # the sweep's rows
        echo(f"run directory: {s['run_dir']}")
        if s["val"]:
            echo(f"  validation loss: {s['val'][0]:.3f} -> {s['val'][1]:.3f} over {s['cfg'].train.steps} steps")
        echo(f"  result rows: {len(mine)} ({s['counts']['written']} new)")
    echo(f"results store: {store}")
    echo("")
    for line in section.ship_lines([s["ship"].report for s in summary if s["ship"] is not None]):
        echo(line)  # the decision leads, as it leads the report (and `quantdyn report` prints the same)
    for line in section.summary_lines(answer):
        echo(line)
    echo("")
    echo(f"report:        {page}")
    seconds["report"] = time.perf_counter() - t5
    wall = time.perf_counter() - t_start
    findings_page = report_dir / "findings.html"
    echo(f"findings:      {findings_page}")
    echo(f"wall time {wall / 60:.1f} min (training {seconds['train'] / 60:.1f}, cooldowns "
         f"{seconds['cooldowns'] / 60:.1f}, averages {seconds['averages'] / 60:.1f}, sweeps "
         f"{seconds['sweep'] / 60:.1f}" + (f", ship {seconds['ship'] / 60:.1f}" if spec.ship.enabled else "")
         + f", report {seconds['report'] / 60:.1f}; stages already done are skipped)")
    history = list(state.get("invocations") or [])
    history.append({"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "wall_s": round(wall, 1),
                    "stages_s": {k: round(v, 1) for k, v in seconds.items()}, "git_sha": git_sha(),
                    "hardware": hardware(), "cpu_count": os.cpu_count(),
                    "load_avg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None})
    write_json_atomic(state_path, {"spec": to_dict(spec), "runs": [str(s["run_dir"]) for s in summary],
                                   "diverged": diverged, "invocations": history,
                                   "findings": [{k: v for k, v in x.items()} for x in answer.found]})
    return {"report": page, "table": answer.decay, "across_seeds": answer.across,
            "runs": [s["run_dir"] for s in summary], "findings": answer.found, "details": answer.details,
            "notes": notes, "section": findings_page, "seconds": seconds, "wall_s": wall,
            "ship": [s["ship"].report for s in summary if s["ship"] is not None]}


def run_demo(progress: bool = True, echo: Echo = print) -> dict:
    """`quantdyn demo`: the embedded default study."""
    return run_study(demo_spec(), progress=progress, echo=echo)
