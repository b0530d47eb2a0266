"""An unwritable output is one line, exit 2, before any work (issue 50 item 1): every command that writes is tried
with places it cannot write (files.ensure_writable, called where the command line is read: cli/options.py).

The tests run as root in CI, and root passes every permission bit (a chmod 0o555 directory stays writable for it),
so the unwritable places are ones the kernel refuses to root too:
  - /proc/nope: procfs takes no new files (ENOENT on create, the traceback of the issue);
  - /sys/nope: sysfs refuses new entries (EACCES, root included);
  - a path under a regular file (ENOTDIR);
  - a read-only directory: a read-only bind mount in a private user and mount namespace (`unshare -rm`, EROFS for
    root too); where that is impossible and the tests do not run as root, the same directory chmod 0o555 instead.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from quantdyn.errors import QuantdynError
from quantdyn.files import ensure_writable

ROOT = Path(__file__).resolve().parents[1]

# Every command that writes, with PLACE where the unwritable place goes (a directory for --out/--store that name
# one, PLACE/rows.csv for a file). Each is refused while the command line is read, or (train, grid, sweep, scaling,
# study/demo places from a spec) before the command's work starts.
COMMANDS: list[tuple[str, list[str]]] = [
    ("--out", ["quantize", "m", "--quantizers", "rtn4", "--out", "PLACE"]),
    ("--save", ["quantize", "m", "--quantizers", "rtn4", "--save", "PLACE"]),
    ("--out", ["allocate", "m", "--budget", "4", "--types", "q4_0", "--out", "PLACE/plan.json"]),
    ("--store", ["allocate", "m", "--budget", "4", "--types", "q4_0", "--out", "{ok}/plan.json", "--store", "PLACE"]),
    ("--out", ["report", "{ok}", "--out", "PLACE"]),
    ("--out", ["results", "--store", "{ok}", "--out", "PLACE/rows.csv"]),
    ("--parquet", ["results", "--store", "{ok}", "--parquet", "PLACE/rows.parquet"]),
    ("--store", ["sweep", "--checkpoint", "c", "--store", "PLACE"]),
    ("--store", ["sweep", "--checkpoint", "c", "--out", "PLACE"]),  # --out: the same as --store on a sweep
    ("--store", ["demo", "--store", "PLACE"]),
    ("--out", ["demo", "--out", "PLACE"]),
    ("run.out_dir", ["demo", "run.out_dir=PLACE"]),
    ("--out", ["study", str(ROOT / "configs/studies/cooldown.yaml"), "--out", "PLACE"]),
    ("--store", ["eval", "m", "--tasks", "t", "--store", "PLACE"]),
    ("--store", ["analyze", "c", "--store", "PLACE"]),
    ("--out", ["interpolate", "a", "b", "--out", "PLACE"]),
    ("--store", ["interpolate", "a", "b", "--store", "PLACE"]),
    ("--out", ["average", "lawa", "r", "--window", "2", "--every", "2", "--out", "PLACE"]),
    ("--out", ["average", "soup", "a", "b", "--out", "PLACE"]),
    ("--out", ["cooldown", "m", "--decay-steps", "10", "--peak-lr", "1e-3", "--out", "PLACE"]),
    ("--store", ["scaling", "--store", "PLACE"]),
    ("--dir", ["grid", str(ROOT / "configs/tiny.yaml"), "--vary", "optim.lr=1e-3", "--dir", "PLACE"]),
    ("the run directory", ["train", str(ROOT / "configs/tiny.yaml"), "out_dir=PLACE"]),
]


def _args(args: list[str], place: Path, ok: Path) -> list[str]:
    return [a.replace("PLACE", str(place)).replace("{ok}", str(ok)) for a in args]


def _check_refusal(code: int, err: str, what: str, place: Path) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: cannot write "), err
    assert what in lines[0] and str(place) in lines[0] and "Traceback" not in err, err


def _places(tmp_path: Path) -> dict[str, Path]:
    afile = tmp_path / "a-file"
    afile.write_text("")
    places = {"proc": Path("/proc/nope"), "under a file": afile / "out"}
    if Path("/sys").is_dir():
        places["sys"] = Path("/sys/nope")
    return places


@pytest.mark.parametrize("what, args", COMMANDS, ids=[f"{a[0]}-{w}" if a[0] != "average" else f"{a[1]}-{w}"
                                                      for w, a in COMMANDS])
def test_every_writing_command_refuses_an_unwritable_place_in_one_line(cli, tmp_path, what, args):
    ok = tmp_path / "ok"
    ok.mkdir()
    for name, place in _places(tmp_path).items():
        r = cli(*_args(args, place, ok))
        _check_refusal(r.returncode, r.stderr, what, place)
        assert not place.exists(), name
    assert sorted(p.name for p in ok.iterdir()) == [], "nothing was written while refusing"


def test_results_check_refuses_a_store_it_cannot_repair(cli):
    r = cli("results", "--store", "/proc", "--check")
    _check_refusal(r.returncode, r.stderr, "--store", Path("/proc"))


# ------------------------------------------------------------------ a read-only directory

_IN_NAMESPACE = textwrap.dedent("""
    import contextlib, io, json, sys
    from quantdyn.cli import main
    out = []
    for args in json.loads(sys.argv[1]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                main(args)
                code = 0
            except SystemExit as e:
                code = e.code
        out.append([code, err.getvalue()])
    print(json.dumps(out))
""")


def _read_only_dir_runs(ro: Path, argvs: list[list[str]]) -> list[tuple[int, str]] | None:
    """Run each argv in one process that sees ``ro`` as a read-only bind mount (a private user and mount namespace:
    EROFS for root too); None where such a namespace cannot be made here."""
    import json

    if shutil.which("unshare") is None:
        return None
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        return None
    script = (f"mount --bind {ro} {ro} && mount -o remount,bind,ro {ro} {ro} && "
              f'exec "$0" -c "$1" "$2"')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script, sys.executable, _IN_NAMESPACE, json.dumps(argvs)],
                       capture_output=True, text=True, env=env, timeout=300)
    if r.returncode != 0 and "mount" in r.stderr:
        return None  # the namespace has no mount rights (a restricted container)
    assert r.returncode == 0, r.stderr
    return [tuple(x) for x in json.loads(r.stdout.strip().splitlines()[-1])]


def test_every_writing_command_refuses_a_read_only_directory(cli, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "kept").write_text("x")
    ok = tmp_path / "ok"
    ok.mkdir()
    place = ro / "out"
    # the options checked while the command line is read (those checked once a spec or config is read import torch
    # first, ~10 s in a fresh process; they are tried with the other places above)
    cmds = [(w, a) for w, a in COMMANDS if w.startswith("--") and a[0] not in ("study", "train", "grid")]
    argvs = [_args(a, place, ok) for _, a in cmds] + [["results", "--store", str(ro), "--check"]]
    whats = [w for w, _ in cmds] + ["--store"]
    got = _read_only_dir_runs(ro, argvs)
    if got is None:
        if os.geteuid() == 0:
            pytest.skip("root ignores chmod 0o555 and no user+mount namespace can be made here for a read-only mount")
        ro.chmod(0o555)  # not root: the permission bits hold
        try:
            got = [(r.returncode, r.stderr) for r in (cli(*a) for a in argvs)]
        finally:
            ro.chmod(0o755)
    for (code, err), what, argv in zip(got, whats, argvs):
        assert code == 2 and "Traceback" not in err, (argv, err)
        line = err.strip()
        assert line.startswith("error: cannot write ") and what in line, (argv, err)
        assert "does not take new files" in line, (argv, err)
    assert sorted(p.name for p in ro.iterdir()) == ["kept"] and not any(ok.iterdir())


# ------------------------------------------------------------------ the helper itself

def test_ensure_writable_leaves_nothing_and_names_what_is_wrong(tmp_path):
    assert ensure_writable(tmp_path / "new" / "deeper", "--out") == tmp_path / "new" / "deeper"
    assert not (tmp_path / "new").exists() and list(tmp_path.iterdir()) == []  # no directory made, probe removed
    d = tmp_path / "d"
    d.mkdir()
    assert ensure_writable(d, "--store") == d and list(d.iterdir()) == []
    f = tmp_path / "f.json"
    f.write_text("{}")
    assert ensure_writable(f, "--out", "file") == f and f.read_text() == "{}"
    with pytest.raises(QuantdynError, match=r"--store '.*f\.json' is a file; name a directory"):
        ensure_writable(f, "--store", "dir")
    assert ensure_writable(f, "--out", "new-dir") == f  # written beside and renamed over (a .gguf export)
    with pytest.raises(QuantdynError, match=r"--out '.*d' is a directory; name a file"):
        ensure_writable(d, "--out", "file")
    with pytest.raises(QuantdynError, match=r"'.*f\.json' is a file, not a directory"):
        ensure_writable(f / "x", "--out")
    with pytest.raises(ValueError):
        ensure_writable(d, "--out", "folder")


def test_every_out_and_written_store_option_is_checked_where_the_command_line_is_read():
    """A command added later (e.g. `ship`) gets the check by using cli/options.py's out()/store(): this test finds
    any --out or --store option without the callback, apart from the stores that are only read (report, results)
    or checked in the body once the spec is read (sweep)."""
    import typer

    from quantdyn.cli import app

    read_or_later = {("report", "--store"), ("results", "--store"), ("sweep", "--store"), ("sweep", "--out")}

    def walk(cmd, path=()):
        for name, sub in getattr(cmd, "commands", {}).items():
            yield from walk(sub, (*path, name))
        if not hasattr(cmd, "commands"):
            yield " ".join(path), cmd

    found = 0
    for name, cmd in walk(typer.main.get_command(app)):
        for p in cmd.params:
            flag = next((o for o in p.opts if o in ("--out", "--store")), None)
            if flag is None or (name, flag) in read_or_later:
                continue
            found += 1
            assert p.callback is not None and "writable" in p.callback.__qualname__, (name, flag)
    assert found >= 14
