"""Fuzzed command lines and configs (hypothesis, derandomized so CI sees the same examples every run):
every failure is exit 2 with one `error:` line on stderr, never a traceback; a config is either built or
refused with a QuantdynError."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from faults.conftest import TALLY
from quantdyn.errors import QuantdynError

FUZZ = settings(derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def fuzz(n: int) -> settings:
    return settings(FUZZ, max_examples=n)

# commands that would start long real work when every argument happens to be valid
NOT_FUZZED = {("demo",)}

JUNK = ["0", "-1", "1", "2", "9", "-0.5", "3.5", "1e999", "nan", "inf", "", " ", "x", "a,b", ",", "=", "key=",
        "optim.lr=x", "model.n_layer=-3", "gptq4", "gptq1", "rtn4g-1", "awq4-frob", "gptq4-damp0", "1/0", "0/0",
        "2/1", "-", "--", "é", "'; DROP TABLE x; --", "bits = ", "[", "{", "null", "true", "cuda:7", "cpu"]

UNKNOWN_OPTIONS = ["--frob", "-x"]
"""Options no command has (checked in _commands): a line that holds one is a usage error, whatever else it holds."""


@dataclasses.dataclass(frozen=True)
class Command:
    path: tuple[str, ...]
    options: list[tuple[str, bool]]
    """(name, is_flag) of every option."""
    arguments: list[tuple[bool, int]]
    """(required, nargs) of every positional argument, in order (nargs -1: any number)."""


def _commands() -> list[Command]:
    import typer

    from quantdyn.cli import app

    out = []

    def walk(cmd, path):
        subs = getattr(cmd, "commands", None)
        if subs:
            for name, sub in sorted(subs.items()):
                walk(sub, (*path, name))
            return
        if path in NOT_FUZZED:
            return
        names = {o for p in cmd.params for o in p.opts + p.secondary_opts}
        assert not names & set(UNKNOWN_OPTIONS), (path, names & set(UNKNOWN_OPTIONS))
        out.append(Command(path, [(p.opts[0], bool(getattr(p, "is_flag", False))) for p in cmd.params
                                  if p.param_type_name == "option"],
                           [(p.required, p.nargs) for p in cmd.params if p.param_type_name == "argument"]))

    walk(typer.main.get_command(app), ())
    return out


COMMANDS = _commands()


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """Paths a fuzzed argument can name: missing, empty, garbage, wrong kind of YAML. ``missing`` never exists."""
    root = tmp_path_factory.mktemp("fuzz")
    (root / "empty").mkdir()
    (root / "garbage.yaml").write_bytes(b"\x01\x02: [unclosed\n{{")  # not UTF-8: one line too
    (root / "list.yaml").write_text("- 1\n- 2\n")
    (root / "keys.yaml").write_text("nonsense_key: 1\nrun: {name: x}\n")
    store = root / "bad_store"
    store.mkdir()
    (store / "part-1.jsonl").write_bytes(b'{"key": "a", "run": "r"}\ngarbage\n')
    missing = [str(root / "nope"), str(root / "nope" / "deeper")]
    paths = [*missing, str(root / "empty"), str(root / "garbage.yaml"), str(root / "list.yaml"),
             str(root / "keys.yaml"), str(store)]
    return root, paths, missing


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for a directory): what a refused command must not change."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def run_cli(argv: list[str], cwd: Path) -> tuple[int, str]:
    from quantdyn.cli import main

    err, out = io.StringIO(), io.StringIO()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                main(argv)
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        os.chdir(old)
    return code, err.getvalue()


def _defects(cmd: Command) -> list[str]:
    """The ways this command's line is made invalid by construction."""
    out = ["unknown option"]
    if cmd.arguments:
        out.append("missing input")  # every command's first positional names something to read: a path, a preset
    if any(required for required, _ in cmd.arguments):
        out.append("no arguments")
    if cmd.arguments and all(n > 0 for _, n in cmd.arguments):
        out.append("extra argument")
    return out


@st.composite
def junk_command_lines(draw, paths, missing):
    """A command line of a random command with junk option values and bad paths (either may happen to be valid)
    and one defect that no value can repair: an unknown option, a missing path as the first argument, no
    arguments where one is required, or one argument too many."""
    cmd = draw(st.sampled_from(COMMANDS))
    defect = draw(st.sampled_from(_defects(cmd)))
    values = st.one_of(st.sampled_from(JUNK), st.sampled_from(paths),
                       st.integers(-10**9, 10**9).map(str),
                       st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=10))
    n_fixed = sum(max(n, 0) for _, n in cmd.arguments)
    if defect == "no arguments":
        args = []
    elif defect == "extra argument":
        args = [draw(st.sampled_from(paths)) for _ in range(n_fixed + 1)]
    else:
        args = [draw(st.sampled_from(paths)) for _ in range(draw(st.integers(0, n_fixed + 1)))]
        if defect == "missing input":
            args = [draw(st.sampled_from(missing)), *args[1:]]
    argv = [*cmd.path, *args]
    for opt, is_flag in draw(st.lists(st.sampled_from(cmd.options), max_size=4)) if cmd.options else []:
        argv.append(opt)
        if not is_flag:
            argv.append(draw(values))
    if defect == "unknown option":  # right after the command's name, where no option can take it as its value
        argv.insert(len(cmd.path), draw(st.sampled_from(UNKNOWN_OPTIONS)))
    return defect, argv


@fuzz(250)
@given(data=st.data())
def test_fuzzed_command_lines_fail_in_one_line(places, data):
    """The house rule for every refused command line: exit 2, one `error:` line on stderr, no traceback,
    nothing created or changed."""
    root, paths, missing = places
    defect, argv = data.draw(junk_command_lines(paths, missing))
    TALLY["fuzzed command lines:trials"] += 1
    before = tree(root)
    code, err = run_cli(argv, root)
    assert "Traceback" not in err, (defect, argv, err)
    assert code == 2, (defect, argv, code, err)
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), (defect, argv, err)
    assert tree(root) == before, (defect, argv)
    TALLY["fuzzed command lines:survived"] += 1


@pytest.mark.parametrize("device", ["x", "0", "cuda:x", ""])
@pytest.mark.parametrize("command", [["quantize"], ["eval", "--tasks", "quantdyn_nextsent"]], ids=lambda c: c[0])
def test_a_device_torch_cannot_parse_is_one_line(places, command, device):
    """Found by the fuzzing above: `--device 0` (any name torch.device refuses) ended in a RuntimeError traceback."""
    root, _, missing = places
    code, err = run_cli([command[0], missing[0], *command[1:], "--device", device], root)
    assert code == 2 and err == f"error: device '{device}' is not a device; use cpu, cuda, cuda:N or auto\n", err


def _valid_command_lines():
    """Lines that are valid by construction: listing the public trajectories and showing each one."""
    from quantdyn.sources.presets import load_presets

    return [["trajectories"], ["trajectories", "--json"],
            *(["trajectories", name, *json] for name in sorted(load_presets()) for json in ([], ["--json"]))]


@pytest.mark.parametrize("argv", _valid_command_lines(), ids=" ".join)
def test_valid_command_lines_succeed_quietly(places, argv):
    root, _, _ = places
    before = tree(root)
    code, err = run_cli(argv, root)
    assert code == 0 and err == "", (argv, err)
    assert tree(root) == before


# --------------------------------------------------------------------------- configs


def _junk_values():
    return st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                     st.lists(st.integers(-3, 3), max_size=3), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))


def _typed_value(tp, depth):
    """Values of the right type (often valid), or junk."""
    origin = typing.get_origin(tp)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if dataclasses.is_dataclass(tp) and depth < 3:
        return st.one_of(config_dicts(tp, depth + 1), _junk_values())
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and args:
        return st.one_of(st.none(), *[_typed_value(a, depth) for a in args])
    if tp is int:
        return st.one_of(st.integers(-5, 300), _junk_values())
    if tp is float:
        return st.one_of(st.floats(-2, 2), st.sampled_from([0.0, 1.0, -1.0, 1e-3, float("nan"), float("inf")]),
                         _junk_values())
    if tp is bool:
        return st.one_of(st.booleans(), st.sampled_from(["yes", "no", "maybe"]), _junk_values())
    if origin in (tuple, list):
        return st.one_of(st.lists(st.sampled_from(JUNK), max_size=3), _junk_values())
    return _junk_values()


def config_dicts(cls, depth=0):
    hints = typing.get_type_hints(cls)
    fields = {f.name: _typed_value(hints[f.name], depth) for f in dataclasses.fields(cls) if f.init}
    extra = {"nonsense_key": _junk_values()} if depth == 0 else {}
    return st.fixed_dictionaries({}, optional={**fields, **extra})


def _same(a, b) -> bool:
    """Equal configs, NaN fields included (a NaN the config accepts reads back as NaN)."""
    if dataclasses.is_dataclass(a) and type(a) is type(b):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    if isinstance(a, (list, tuple)) and type(a) is type(b):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _config_classes():
    from quantdyn.data.prepare import DataConfig
    from quantdyn.quantize.catalogue import QuantConfig
    from quantdyn.sweep.sweep import SweepConfig
    from quantdyn.train.config import RunConfig

    return [RunConfig, SweepConfig, DataConfig, QuantConfig]


@pytest.mark.parametrize("cls", _config_classes(), ids=lambda c: c.__name__)
def test_fuzzed_configs_are_built_or_refused_in_one_line(cls):
    from quantdyn.config import from_dict

    from quantdyn.config import to_dict

    @fuzz(150)
    @given(config_dicts(cls))
    def check(data):
        TALLY["fuzzed configs:trials"] += 1
        try:
            cfg = from_dict(cls, data)
        except QuantdynError as e:
            assert "\n" not in str(e) and str(e), data
        else:
            assert "nonsense_key" not in data, data  # an unknown key is refused, whatever the other values
            assert _same(from_dict(cls, to_dict(cfg)), cfg), data  # what was accepted is saved and read back
        TALLY["fuzzed configs:survived"] += 1

    check()


@fuzz(300)
@given(st.one_of(st.text(max_size=24), st.sampled_from(JUNK), st.dictionaries(
    st.sampled_from(["method", "bits", "group_size", "sym", "damp_percent", "block_size", "preset", "name", "frob"]),
    _junk_values(), max_size=4)))
def test_fuzzed_quantizer_specs(spec):
    from quantdyn.quantize.catalogue import parse_quantizer

    TALLY["fuzzed quantizer specs:trials"] += 1
    try:
        cfg = parse_quantizer(spec)
    except QuantdynError as e:
        assert "\n" not in str(e)
    else:
        assert not (isinstance(spec, dict) and "frob" in spec), spec  # an unknown field is refused
        assert parse_quantizer(cfg.name) == cfg  # whatever was accepted has a label that reads back
    TALLY["fuzzed quantizer specs:survived"] += 1


@fuzz(100)
@given(st.one_of(st.text(max_size=64).map(lambda t: t.encode()), st.binary(max_size=64)))  # UTF-8 or not
def test_fuzzed_yaml_files(tmp_path_factory, raw):
    from quantdyn.config import load_yaml

    TALLY["fuzzed YAML files:trials"] += 1
    p = tmp_path_factory.mktemp("y") / "c.yaml"
    p.write_bytes(raw)
    try:  # what the file holds decides the outcome: a mapping (or nothing) is read, anything else refused
        want = yaml.safe_load(raw.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError):
        want = QuantdynError
    if want is None:
        want = {}
    if isinstance(want, dict):
        assert load_yaml(p) == want
    else:
        with pytest.raises(QuantdynError) as e:
            load_yaml(p)
        assert "\n" not in str(e.value) and str(p) in str(e.value)
    TALLY["fuzzed YAML files:survived"] += 1


def test_yaml_not_utf8(tmp_path):
    from quantdyn.config import load_yaml

    p = tmp_path / "c.yaml"
    p.write_bytes(b"\xff\xfe: 1\n")
    with pytest.raises(QuantdynError, match="UTF-8"):
        load_yaml(p)
