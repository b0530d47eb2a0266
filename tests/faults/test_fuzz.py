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


def _commands():
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
        options = [(p.opts[0], bool(getattr(p, "is_flag", False))) for p in cmd.params
                   if p.param_type_name == "option"]
        n_args = sum(1 for p in cmd.params if p.param_type_name == "argument")
        out.append((path, options, n_args))

    walk(typer.main.get_command(app), ())
    return out


COMMANDS = _commands()


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """Paths a fuzzed argument can name: missing, empty, garbage, wrong kind of YAML."""
    root = tmp_path_factory.mktemp("fuzz")
    (root / "empty").mkdir()
    (root / "garbage.yaml").write_bytes(b"\x01\x02: [unclosed\n{{")  # not UTF-8: one line too
    (root / "list.yaml").write_text("- 1\n- 2\n")
    (root / "keys.yaml").write_text("nonsense_key: 1\nrun: {name: x}\n")
    store = root / "bad_store"
    store.mkdir()
    (store / "part-1.jsonl").write_bytes(b'{"key": "a", "run": "r"}\ngarbage\n')
    paths = [str(root / "nope"), str(root / "empty"), str(root / "garbage.yaml"), str(root / "list.yaml"),
             str(root / "keys.yaml"), str(store), str(root / "nope" / "deeper")]
    return root, paths


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


@st.composite
def command_lines(draw, paths):
    path, options, n_args = draw(st.sampled_from(COMMANDS))
    values = st.one_of(st.sampled_from(JUNK), st.sampled_from(paths),
                       st.integers(-10**9, 10**9).map(str),
                       st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=10))
    argv = list(path)
    argv += [draw(st.sampled_from(paths)) for _ in range(draw(st.integers(0, n_args + 1)))]
    for opt, is_flag in draw(st.lists(st.sampled_from(options), max_size=4)) if options else []:
        argv.append(opt)
        if not is_flag:
            argv.append(draw(values))
    if draw(st.integers(0, 9)) == 0:
        argv.insert(draw(st.integers(0, len(argv))), draw(st.sampled_from(["--frob", "-x", "--bits"])))
    return argv


@fuzz(250)
@given(data=st.data())
def test_fuzzed_command_lines_fail_in_one_line(places, data):
    root, paths = places
    argv = data.draw(command_lines(paths))
    TALLY["fuzzed command lines:trials"] += 1
    code, err = run_cli(argv, root)
    assert "Traceback" not in err, (argv, err)
    assert code in (0, 2), (argv, code, err)
    if code == 2:
        lines = [x for x in err.splitlines() if x.strip()]
        errors = [x for x in lines if x.startswith("error: ")]
        assert len(errors) == 1 and lines[-1] == errors[0], (argv, err)  # warnings may come first
    TALLY["fuzzed command lines:survived"] += 1


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


def _config_classes():
    from quantdyn.data.prepare import DataConfig
    from quantdyn.quantize.config import QuantConfig
    from quantdyn.sweep.sweep import SweepConfig
    from quantdyn.train.config import RunConfig

    return [RunConfig, SweepConfig, DataConfig, QuantConfig]


@pytest.mark.parametrize("cls", _config_classes(), ids=lambda c: c.__name__)
def test_fuzzed_configs_are_built_or_refused_in_one_line(cls):
    from quantdyn.config import from_dict

    @fuzz(150)
    @given(config_dicts(cls))
    def check(data):
        TALLY["fuzzed configs:trials"] += 1
        try:
            from_dict(cls, data)
        except QuantdynError as e:
            assert "\n" not in str(e) and str(e), data
        TALLY["fuzzed configs:survived"] += 1

    check()


@fuzz(300)
@given(st.one_of(st.text(max_size=24), st.sampled_from(JUNK), st.dictionaries(
    st.sampled_from(["method", "bits", "group_size", "sym", "damp_percent", "block_size", "preset", "name", "frob"]),
    _junk_values(), max_size=4)))
def test_fuzzed_quantizer_specs(spec):
    from quantdyn.quantize.config import parse_quantizer

    TALLY["fuzzed quantizer specs:trials"] += 1
    try:
        cfg = parse_quantizer(spec)
    except QuantdynError as e:
        assert "\n" not in str(e)
    else:
        assert parse_quantizer(cfg.name) == cfg  # whatever was accepted has a label that reads back
    TALLY["fuzzed quantizer specs:survived"] += 1


@fuzz(100)
@given(st.one_of(st.text(max_size=64).map(lambda t: t.encode()), st.binary(max_size=64)))  # UTF-8 or not
def test_fuzzed_yaml_files(tmp_path_factory, raw):
    from quantdyn.config import load_yaml

    TALLY["fuzzed YAML files:trials"] += 1
    p = tmp_path_factory.mktemp("y") / "c.yaml"
    p.write_bytes(raw)
    try:
        assert isinstance(load_yaml(p), dict)
    except QuantdynError as e:
        assert "\n" not in str(e)
    TALLY["fuzzed YAML files:survived"] += 1


def test_yaml_not_utf8(tmp_path):
    from quantdyn.config import load_yaml

    p = tmp_path / "c.yaml"
    p.write_bytes(b"\xff\xfe: 1\n")
    with pytest.raises(QuantdynError, match="UTF-8"):
        load_yaml(p)
