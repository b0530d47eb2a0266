"""Result rows as pandas tables and Parquet (quantdyn/results/tables.py), and the documented DuckDB query."""
from __future__ import annotations

import json

import pytest

from quantdyn.errors import QuantdynError
from quantdyn.results import load, to_parquet
from quantdyn.results.store import ResultStore

pd = pytest.importorskip("pandas")


def _store(tmp_path):
    s = ResultStore(tmp_path / "results")
    s.append([
        {"key": "a", "kind": "ptq", "step": 100, "delta_ce": 0.05,
         "quant_config": {"method": "gptq", "bits": 3, "group_size": 128}, "window_delta": [0.1, 0.2]},
        {"key": "b", "kind": "fp", "step": 100, "val_loss": 3.2},
    ])
    # a second write of key 'a' (e.g. skip_stored=False): readers keep the first
    s.append([{"key": "a", "kind": "ptq", "step": 100, "delta_ce": 99.0}], skip_stored=False)
    s.append([{"key": "c", "kind": "ptq", "step": 200, "delta_ce": 0.07,
               "quant_config": {"method": "rtn", "bits": 4, "group_size": 0}, "note": "x"}])
    return s


def test_load_matches_store_rows_and_flattens(tmp_path):
    s = _store(tmp_path)
    df = load(s)
    assert list(df["key"]) == [r["key"] for r in s.rows()] == ["a", "b", "c"]
    assert df.loc[df.key == "a", "delta_ce"].item() == 0.05  # the first written row of a key
    assert {"quant_config.method", "quant_config.bits", "quant_config.group_size"} <= set(df.columns)
    assert "quant_config" not in df.columns
    assert df.loc[df.key == "c", "quant_config.bits"].item() == 4
    assert pd.isna(df.loc[df.key == "b", "quant_config.bits"].item())  # missing field -> NaN
    assert df.loc[df.key == "a", "window_delta"].item() == [0.1, 0.2]   # lists stay lists
    nested = load(tmp_path / "results", flatten=False)
    assert nested.loc[nested.key == "a", "quant_config"].item() == {"method": "gptq", "bits": 3, "group_size": 128}
    # a notebook pivot works on it
    p = df[df.kind == "ptq"].pivot_table(index="step", columns="quant_config.method", values="delta_ce")
    assert p.loc[200, "rtn"] == 0.07


def test_load_skips_bad_lines_like_the_store(tmp_path):
    s = _store(tmp_path)
    part = s.parts()[0]
    part.write_text(part.read_text() + "{not json\n")
    assert list(load(s)["key"]) == ["a", "b", "c"]


def test_empty_and_missing_store(tmp_path):
    (tmp_path / "empty").mkdir()  # an existing store without rows (opening one creates nothing before a write)
    assert len(load(tmp_path / "empty")) == 0
    with pytest.raises(QuantdynError, match="does not exist"):
        load(tmp_path / "nope")


def test_to_parquet_roundtrip_and_mixed_types(tmp_path):
    pytest.importorskip("pyarrow")
    s = _store(tmp_path)
    s.append([{"key": "d", "kind": "ptq", "step": "final", "delta_ce": 0.1}])  # step: a number elsewhere, text here
    out = to_parquet(s, tmp_path / "t" / "rows.parquet")
    back = pd.read_parquet(out)
    assert list(back["key"]) == ["a", "b", "c", "d"]
    assert back.loc[back.key == "c", "quant_config.bits"].item() == 4
    assert [json.loads(v) for v in back["step"]] == [100, 100, 200, "final"]  # kept as JSON text, no row lost
    assert sorted(p.name for p in out.parent.iterdir()) == ["rows.parquet"]  # no temporary left behind
    with pytest.raises(QuantdynError, match="is a directory"):
        to_parquet(s, tmp_path)


def test_documented_duckdb_query_reads_the_store(tmp_path):
    duckdb = pytest.importorskip("duckdb")
    s = _store(tmp_path)
    glob = str(s.root / "part-*.jsonl")
    rel = duckdb.sql(
        f"SELECT * EXCLUDE (filename) FROM read_json_auto('{glob}', union_by_name=true, "
        "format='newline_delimited', filename=true) "
        "QUALIFY row_number() OVER (PARTITION BY key ORDER BY filename) = 1 ORDER BY key"
    )
    got = dict(zip(rel.columns, zip(*rel.fetchall())))
    assert got["key"] == ("a", "b", "c")
    assert got["delta_ce"][0] == 0.05  # the first written row of 'a', as load() keeps it


def test_results_command_writes_parquet(tmp_path, cli):
    """`quantdyn results --parquet FILE` (issue 20) = `--out FILE.parquet`: every column, the --where rows only."""
    pytest.importorskip("pyarrow")
    _store(tmp_path)
    st = tmp_path / "results"
    res = cli("results", "--store", st, "--parquet", tmp_path / "all.parquet")
    assert res.returncode == 0, res.stderr
    assert list(pd.read_parquet(tmp_path / "all.parquet")["key"]) == ["a", "b", "c"]
    res = cli("results", "--store", st, "--where", "kind = 'ptq'", "--out", tmp_path / "ptq.parquet")
    assert res.returncode == 0, res.stderr
    back = pd.read_parquet(tmp_path / "ptq.parquet")
    assert sorted(back["key"]) == ["a", "c"] and "quant_config.bits" in back.columns
    res = cli("results", "--store", st, "--parquet", tmp_path / "x.parquet", "--out", tmp_path / "y.csv")
    assert res.returncode == 2 and "not both" in res.stderr and not (tmp_path / "x.parquet").exists()
