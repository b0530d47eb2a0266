"""One name for one thing (issue 50 item 4): the spelling users reach for is accepted where it can mean one thing
(`sweep --out` is its --store) and otherwise answered with the option that means it: the did-you-mean of an unknown
option ranks by meaning (cli/app.OPTION_SYNONYMS) before spelling."""
from __future__ import annotations

import pytest

from quantdyn.cli.app import OPTION_SYNONYMS
from quantdyn.errors import did_you_mean


@pytest.mark.parametrize("args, meant", [
    (["sweep", "--output", "x"], "--store"),  # sweep writes rows to its store (spelling alone said --account)
    (["sweep", "--dest", "x"], "--store"),
    (["analyze", "c", "--out", "x"], "--store"),  # no --out here: the one place it writes
    (["eval", "m", "--tasks", "t", "--output", "x"], "--store"),
    (["quantize", "m", "--output", "x"], "--out"),  # where --out exists it is the answer
    (["results", "--dest", "x.csv"], "--out"),
    (["grid", "c.yaml", "--out", "x"], "--dir"),
    (["quantize", "m", "-q", "rtn4"], "--quantizers"),
    (["quantize", "m", "--quant", "rtn4"], "--quantizers"),
    (["allocate", "m", "--quant", "q4_0"], "--types"),  # allocate's quantizer types
    (["quantize", "m", "--bit", "3"], "--bits"),  # spelling still answers what meaning does not know
    (["quantize", "m", "--gpu", "0"], "--device"),
    (["quantize", "m", "--format", "gguf"], "--export"),  # a format is quantize's --export, a sweep's quantizer
    (["sweep", "--format", "q4_k_m"], "--quantizers"),
])
def test_unknown_options_are_answered_by_meaning(cli, args, meant):
    r = cli(*args)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"(did you mean '{meant}'?)" in r.stderr, r.stderr


def test_did_you_mean_ranks_meaning_before_spelling():
    opts = ["--account", "--store", "--quiet", "--quantizers"]
    assert did_you_mean("--out", opts) == " (did you mean '--account'?)"  # spelling alone: the answer
    assert did_you_mean("--out", opts, OPTION_SYNONYMS) == " (did you mean '--store'?)"
    assert did_you_mean("-q", opts, OPTION_SYNONYMS) == " (did you mean '--quantizers'?)"
    assert did_you_mean("--quiett", opts, OPTION_SYNONYMS) == " (did you mean '--quiet'?)"
    assert did_you_mean("--out", ["--window"], OPTION_SYNONYMS) == ""  # no option that means it, none spelt like it


def test_sweep_out_is_its_store(cli, monkeypatch, tmp_path):
    import quantdyn.sweep.sweep as sw

    seen = []
    monkeypatch.setattr(sw, "run_sweep", lambda cfg, **k: seen.append(cfg.store) or
                        {"written": 0, "skipped": 0, "failed": []})
    ck = tmp_path / "ck"
    ck.mkdir()
    r = cli("sweep", "--checkpoint", ck, "--out", tmp_path / "st", "--quiet")
    assert r.returncode == 0 and seen == [str(tmp_path / "st")], r.stderr
    assert f"store {tmp_path / 'st'}" in r.stdout and r.stderr == ""  # an accepted spelling: no note
    r = cli("sweep", "--checkpoint", ck, "--out", tmp_path / "a", "--store", tmp_path / "b")
    assert r.returncode == 2 and "give the store once" in r.stderr and len(seen) == 1
    r = cli("sweep", "--checkpoint", ck, "--out", tmp_path / "a", "--store", tmp_path / "a", "--quiet")
    assert r.returncode == 0 and seen[-1] == str(tmp_path / "a")


def test_out_means_one_thing_on_every_command():
    """No command has two options answering to --out (the hidden sweep alias stands in for a missing --out)."""
    import typer

    from quantdyn.cli import app

    def walk(cmd, path=()):
        for name, sub in getattr(cmd, "commands", {}).items():
            yield from walk(sub, (*path, name))
        if not hasattr(cmd, "commands"):
            yield " ".join(path), cmd

    for name, cmd in walk(typer.main.get_command(app)):
        outs = [p for p in cmd.params if "--out" in p.opts]
        assert len(outs) <= 1, name
        if name == "sweep":
            assert outs[0].hidden and not any("--out" in p.opts and not p.hidden for p in cmd.params)
