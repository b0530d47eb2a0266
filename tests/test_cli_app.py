"""The command-line framework: usage errors are one line + a hint (exit 2), --version, -h, plain help,
a truthful Ctrl-C line, and the results commands' options."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from importlib import metadata

import pytest

from quantdyn.cli import app, main
from quantdyn.cli.app import interrupt_message
from quantdyn.results.store import QUARANTINE, ResultStore


def run(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(list(args))
        raise SystemExit(0)
    out, err = capsys.readouterr()
    return e.value.code or 0, out, err


def one_line_error(code: int, err: str) -> str:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("args, says", [
    (["zzyzx"], "no such command 'zzyzx'; commands: train,"),  # a word close to no command (frobnicate ~ allocate)
    (["trian"], "did you mean 'train'?"),
    (["quantize", "--bits", "x", "foo"], "invalid value for --bits: 'x' is not an integer; see `quantdyn quantize -h`"),
    (["quantize", "foo", "--bit", "3"], "no such option --bit for `quantdyn quantize` (did you mean '--bits'?)"),
    (["quantize"], "missing argument"),
    (["sweep", "--shard"], "option '--shard' requires an argument; see `quantdyn sweep -h`"),
    (["average", "lawa", "r", "--window", "x", "--every", "2"], "see `quantdyn average lawa -h`"),
    (["average", "frob"], "no such command 'frob'; commands: lawa, soup"),
    (["results", "--json=3"], "json"),
    (["--frob"], "no such option --frob"),
])
def test_usage_errors_are_one_line_with_a_hint(capsys, args, says):
    code, out, err = run(capsys, *args)
    line = one_line_error(code, err)
    assert says in line and "-h`" in line


def test_user_errors_from_the_library_are_one_line(capsys, tmp_path):
    code, _, err = run(capsys, "results", "--store", str(tmp_path / "nope"))
    assert "does not exist" in one_line_error(code, err)


def test_version_matches_the_package_metadata(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"quantdyn {metadata.version('quantdyn')}"


def _all_commands(group, path=()):
    import typer

    cmd = typer.main.get_command(app) if group is None else group
    for name, sub in sorted(getattr(cmd, "commands", {}).items()):
        yield (*path, name)
        yield from _all_commands(sub, (*path, name))


def test_every_command_takes_h_and_help_and_shows_plain_help(capsys):
    commands = list(_all_commands(None))
    assert {("train",), ("sweep",), ("results",), ("average", "lawa")} <= set(commands)
    for cmd in [(), *commands]:
        for flag in ("-h", "--help"):
            code, out, err = run(capsys, *cmd, flag)
            assert code == 0 and out.startswith("Usage: quantdyn"), (cmd, flag, err)
            assert "<bool>" not in out and "╭" not in out, (cmd, out)  # plain text, flags without a type
    _, out, _ = run(capsys, "results", "-h")
    assert "\"bits = 3 AND branch = 'main'\"" in out and "--where <str>" in out and "--out <path>" in out
    _, out, _ = run(capsys, "train", "-h")
    assert "[dist.strategy=fsdp2]" in out  # brackets in help texts are kept


def test_no_arguments_prints_the_help(capsys):
    code, out, err = run(capsys)
    assert code == 2 and "Commands:" in out + err


def test_interrupt_messages_are_true_for_the_command():
    assert interrupt_message(["sweep", "spec.yaml"]) == "interrupted; rerun the same command to resume (stored rows are kept)"
    assert "quantdyn train --resume RUN_DIR" in interrupt_message(["train", "configs/tiny.yaml"])
    assert "rerun the same command to resume" in interrupt_message(["train", "--resume", "runs/x"])
    assert "resume" not in interrupt_message(["quantize", "m"])  # nothing to resume there
    assert "resume" in interrupt_message(["cooldown", "runs/x", "--from-step", "4", "--decay-steps", "2"])


def test_ctrl_c_is_one_line_and_exit_130(capsys, monkeypatch):
    import quantdyn.studies.pipeline as demo

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "run_study", interrupted)
    code, out, err = run(capsys, "demo", "--quiet")
    assert code == 130 and err.strip() == interrupt_message(["demo"]) and "resume" in err


def _demo_at_work(tmp_path, work: str = "") -> subprocess.Popen:
    """`quantdyn demo` in a real process, its study replaced by ``work`` (statements indented by 8 spaces that
    may enter context managers into ``stack``, as the real code's cleanup does) and then a minute's sleep;
    returned once it prints 'working'."""
    script = tmp_path / "slow.py"
    script.write_text(
        "import contextlib, signal, sys, time, torch\n"
        # a shell that runs the suite in the background (`make test &`) starts it with SIGINT ignored, and
        # children inherit that; a user's terminal delivers it: Python's own handler, as in a foreground shell
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "import quantdyn.cli as cli\n"
        "import quantdyn.studies.pipeline as demo\n"
        "from quantdyn.engine.streams import StreamStore\n"
        "def slow(*a, **k):\n"
        "    with contextlib.ExitStack() as stack:\n"
        f"{work}"
        "        print('working', flush=True)\n"
        "        time.sleep(60)\n"
        "demo.run_study = slow\n"
        "cli.main(['demo', '--quiet'])\n"
    )
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "working"
    return p


def test_sigint_in_a_real_process_ends_in_one_line(tmp_path):
    """The real signal path: SIGINT while a command works -> one line, exit 130."""
    p = _demo_at_work(tmp_path)
    time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and err.strip() == interrupt_message(["demo"]), err


def test_sigterm_cleans_up_like_ctrl_c_and_exits_143(tmp_path):
    """SIGTERM (kill, a SLURM time limit) runs the same cleanup as Ctrl-C: streams spilled to disk by a real
    StreamStore are removed, one line on stderr, exit 143."""
    spill = tmp_path / "spill"
    spill.mkdir()
    p = _demo_at_work(tmp_path, "        store = stack.enter_context(StreamStore(torch.device('cpu'), 1 << 20, "
                                f"spill_dir={str(spill)!r}, force='disk'))\n"
                                "        store.new('fp-eval').append(torch.ones(4, 8))\n")
    assert len(list(spill.iterdir())) == 1  # the store's spill directory, with one batch in it
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 143 and err.strip() == interrupt_message(["demo"]), err
    assert list(spill.iterdir()) == []
    # in-process callers get their SIGTERM handler back
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit):
        main(["--version"])
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("module", ["quantdyn", "quantdyn.cli"])
def test_python_m_entry_points(module):
    r = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("quantdyn "), r.stderr
    r = subprocess.run([sys.executable, "-m", module, "frobnicate"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


# ---------------------------------------------------------------------- results, report, scaling, study, demo


def _store(tmp_path):
    st = ResultStore(tmp_path / "st")
    st.append([{"key": "a", "kind": "ptq", "run": "r", "branch": "main", "step": 1, "tokens": 10, "quantizer": "rtn4",
                "delta_ce": 0.5, "window_delta": [0.1, 0.2]},
               {"key": "b", "kind": "ptq", "run": "r", "branch": "main", "step": 2, "tokens": 20, "quantizer": "rtn4",
                "delta_ce": 0.25, "window_delta": [0.3]}])
    return st


def test_results_check_moves_bad_lines_to_quarantine(capsys, caplog, tmp_path):
    st = _store(tmp_path)
    part = st.parts()[0]
    with open(part, "ab") as f:
        f.write(b"garbage\n{\"key\": \"c\", \"x\":")
    code, out, err = run(capsys, "results", "--store", str(st.root), "--json")
    assert code == 0 and [r["key"] for r in json.loads(out)] == ["a", "b"]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and f"{part} line 3" in warnings[0]  # one warning naming file and line
    code, out, _ = run(capsys, "results", "--store", str(st.root), "--check")
    assert code == 0 and "moved 2 unreadable lines" in out
    assert (st.root / QUARANTINE / part.name).read_bytes() == b"garbage\n{\"key\": \"c\", \"x\":\n"
    code, out, _ = run(capsys, "results", "--store", str(st.root), "--check")
    assert "all lines readable" in out


@pytest.mark.parametrize("name, parse", [
    ("rows.csv", lambda t: t.splitlines()[0].split(",")[:2]),
    ("rows.json", lambda t: list(json.loads(t)[0])[:2]),
    ("rows.jsonl", lambda t: list(json.loads(t.splitlines()[0]))[:2]),
])
def test_results_out_writes_the_rows(capsys, tmp_path, name, parse):
    st = _store(tmp_path)
    code, out, _ = run(capsys, "results", "--store", str(st.root), "--out", str(tmp_path / name))
    assert code == 0 and out == f"wrote 2 rows (8 columns) to {tmp_path / name}\n"  # one line, not the table
    text = (tmp_path / name).read_text()
    assert parse(text) == ["key", "kind"] and "window_delta" not in text


def test_results_out_errors_and_old_csv_spelling(capsys, tmp_path):
    st = _store(tmp_path)
    code, _, err = run(capsys, "results", "--store", str(st.root), "--out", str(tmp_path / "rows.txt"))
    assert ".csv, .json, .jsonl or .parquet" in one_line_error(code, err)
    code, _, err = run(capsys, "results", "--store", str(st.root), "--out", str(tmp_path / "a.csv"),
                       "--csv", str(tmp_path / "b.csv"))
    assert "not both" in one_line_error(code, err)
    code, _, err = run(capsys, "results", "--store", str(st.root), "--csv", str(tmp_path / "old.csv"))
    assert code == 0 and (tmp_path / "old.csv").read_text().startswith("key,")
    assert err.strip() == "note: results --csv FILE is deprecated; use --out FILE.csv"
    code, _, err = run(capsys, "results", "--store", str(st.root), "--where", "nope = 1")
    assert "check the --where expression" in one_line_error(code, err)


def test_results_columns_of_an_old_store_name_what_rows_lack(capsys, tmp_path):
    """Rows written before the detailed measures (issue 29) read with those columns empty, one line each."""
    st = _store(tmp_path)
    st.append([{"key": "c", "kind": "ptq", "run": "r", "branch": "main", "step": 3, "tokens": 30, "quantizer": "rtn4",
                "delta_ce": 0.2, "kl_p99": 0.01, "top5_agree": 0.9}])
    code, out, err = run(capsys, "results", "--store", str(st.root), "--columns", "step,kl_p99,top5_agree,block_sqnr",
                         "--json")
    assert code == 0 and [r["kl_p99"] for r in json.loads(out)] == [None, None, 0.01]
    assert err.splitlines() == [
        "note: kl_p99: 2 of 3 rows lack it (written before the field existed, or of a kind that has none); shown empty",
        "note: top5_agree: 2 of 3 rows lack it (written before the field existed, or of a kind that has none); "
        "shown empty",
        "note: block_sqnr: 3 of 3 rows lack it (written before the field existed, or of a kind that has none); "
        "shown empty"]
    code, _, err = run(capsys, "results", "--store", str(st.root), "--columns", "kl_p98")
    assert "did you mean" in one_line_error(code, err)


def test_scaling_takes_store_as_option_or_old_argument(capsys, tmp_path, monkeypatch):
    import quantdyn.studies.scaling as sc

    seen = []
    monkeypatch.setattr(sc, "fit_scaling", lambda store, *a: seen.append(store) or [])
    assert run(capsys, "scaling", "--store", "s1")[:3:2] == (0, "")
    assert run(capsys, "scaling", "s2")[:3:2] == (0, "note: scaling STORE is deprecated; use --store STORE\n")
    assert run(capsys, "scaling")[0] == 0
    assert seen == ["s1", "s2", "results"]
    code, _, err = run(capsys, "scaling", "s3", "--store", "s4")
    assert "give only --store" in one_line_error(code, err)


def test_eval_old_quantizer_spelling_is_noted(capsys, monkeypatch):
    import quantdyn.sweep.accuracy as acc

    seen = []
    monkeypatch.setattr(acc, "evaluate_accuracy", lambda model, tasks, qs, **k: seen.append(qs) or [])
    monkeypatch.setattr(acc, "format_accuracy_table", lambda rows: "table")
    code, out, err = run(capsys, "eval", "m", "--tasks", "t", "--quantizer", "gptq3", "--store", "")
    assert code == 0 and seen == [["gptq3"]] and err == "note: eval --quantizer is deprecated; use --quantizers\n"
    code, out, err = run(capsys, "eval", "m", "--tasks", "t", "--quantizers", "gptq3,rtn4", "--store", "")
    assert code == 0 and seen[-1] == ["gptq3", "rtn4"] and err == ""


def test_every_command_lists_itself_in_one_whole_sentence(capsys):
    """`quantdyn -h` shows each command's first help line whole (click cuts it at the first '. ' or at the
    width), and command X lives in cli/X.py (a family such as `average lawa|soup` in cli/average.py; check-export
    in cli/check_export.py)."""
    import typer

    _, out, _ = run(capsys, "-h")
    listed = out.split("Commands:")[1].strip().splitlines()
    root = typer.main.get_command(app)
    assert len(listed) == len(root.commands)
    for line in listed:
        name, text = line.split(maxsplit=1)
        assert text.endswith(".") and not text.endswith("..."), line
        cmd = root.commands[name]
        module = (cmd.callback or next(iter(cmd.commands.values())).callback).__module__
        assert module == f"quantdyn.cli.{name.replace('-', '_')}", (name, module)


def test_shared_options_mean_the_same_on_every_command(capsys):
    """--quantizers, --store, --device: one help text wherever they appear (cli/options.py)."""
    from quantdyn.cli.options import DEVICE_HELP, QUANTIZERS_HELP, STORE_HELP

    seen = {"--quantizers": 0, "--store": 0, "--device": 0}
    for cmd in _all_commands(None):
        _, out, _ = run(capsys, *cmd, "-h")
        text = " ".join(out.split())
        for flag, help_text in (("--quantizers", QUANTIZERS_HELP), ("--store", STORE_HELP), ("--device", DEVICE_HELP)):
            if f"{flag} <" in text:
                seen[flag] += 1
                assert help_text in text, (cmd, flag)
    assert seen == {"--quantizers": 6, "--store": 11, "--device": 12}  # ship (issue 46), check-export among them


def test_sweep_help_groups_its_options(capsys):
    _, out, _ = run(capsys, "sweep", "-h")
    sections = [line[:-1] for line in out.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert sections == ["Arguments", "Trajectory", "Checkpoint selection", "Quantizers", "Engine", "Output",
                        "SLURM (with --slurm)", "Options"]
    slurm = out.split("SLURM (with --slurm):")[1].split("Options:")[0]
    assert "--partition" in slurm and "--quantizers" not in slurm
    _, quantize_help, _ = run(capsys, "quantize", "-h")
    repeats = [" ".join(h.split("--repeats <int>")[1].split("--repeat-vary")[0].split()) for h in (out, quantize_help)]
    assert all("1" in r.rsplit("default:", 1)[1] for r in repeats), repeats  # one default, said alike


def test_study_and_demo_options_override_the_spec(capsys, tmp_path, monkeypatch):
    import yaml

    import quantdyn.studies.pipeline as demo
    from quantdyn.studies.spec import demo_spec, spec_from_dict

    seen = []
    monkeypatch.setattr(demo, "run_study", lambda spec, progress=True, echo=print: seen.append(spec) or {})
    assert run(capsys, "demo", "--quiet")[0] == 0
    assert seen[-1] == demo_spec()
    assert run(capsys, "demo", "--store", "S", "--out", "R", "--device", "cpu", "--quiet")[0] == 0
    spec = seen[-1]
    assert spec.sweep.store == "S" and spec.report == "R" and spec.sweep.device == "cpu"
    assert spec.run.train.device == "cpu" and spec.run.model == demo_spec().run.model
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump({"run": {"name": "x"}}))
    assert run(capsys, "study", str(p), "--store", "T", "--quiet")[0] == 0
    assert seen[-1] == spec_from_dict({"run": {"name": "x"}, "sweep": {"store": "T"}})


def test_logging_warnings_reach_stderr_as_one_line(tmp_path):
    # main() configures logging so the store's warning is one plain line (no logger name, no level prefix)
    st = _store(tmp_path)
    with open(st.parts()[0], "ab") as f:
        f.write(b"\xff\n")
    r = subprocess.run([sys.executable, "-m", "quantdyn", "results", "--store", str(st.root)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "(2 rows" in r.stdout
    assert r.stderr.startswith("results store ") and "not UTF-8" in r.stderr and len(r.stderr.splitlines()) == 1
