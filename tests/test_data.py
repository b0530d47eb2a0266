import json

import numpy as np
import pytest

from quantdyn.data.prepare import DataConfig, prepare_data, split_of
from quantdyn.data.sources import resolve_source
from quantdyn.errors import QuantdynError


def _docs(n=300):
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "quant", "rate", "decay", "model", "token", "weight"]
    return [f"doc {i}: " + " ".join(rng.choice(words, size=40)) for i in range(n)]


def test_split_is_deterministic_and_order_free(kjv_small):
    cfg, data = kjv_small
    docs = list(resolve_source("builtin:kjv")[1]())
    assert len(docs) == 1189  # one document per chapter
    a = [split_of(d, 7, 0.05, 0.02) for d in docs]
    b = [split_of(d, 7, 0.05, 0.02) for d in reversed(docs)][::-1]
    assert a == b
    assert 0.02 < a.count("val") / len(a) < 0.09 and a.count("calib") > 5
    assert [split_of(d, 8, 0.05, 0.02) for d in docs] != a  # the seed matters
    # the shards never mix splits: no val window occurs verbatim in train
    val = np.asarray(data.val[:64])
    train = np.asarray(data.train)
    hits = np.flatnonzero(train[: len(train) - 64] == val[0])
    assert not any((train[h : h + 64] == val).all() for h in hits)


def test_manifest_and_cache_reuse(kjv_small):
    cfg, data = kjv_small
    m = data.manifest
    assert m["splits"]["train"]["tokens"] == 200_000 and m["vocab_size"] == 512
    assert m["tokenizer_hash"] and m["source"] == "builtin:kjv"
    again = prepare_data(cfg, progress=False)
    assert again.directory == data.directory
    assert data.eval_windows(32, 5).shape == (5, 32)
    w1, w2 = data.calib_windows(4, 32, seed=1), data.calib_windows(4, 32, seed=1)
    assert (w1 == w2).all()


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet", "hf"])
def test_local_sources(tmp_path, kind):
    docs = _docs()
    if kind == "txt":
        p = tmp_path / "c.txt"
        p.write_text("\n\n".join(docs))
        spec = str(p)
    elif kind == "jsonl":
        p = tmp_path / "c.jsonl"
        p.write_text("\n".join(json.dumps({"body": d}) for d in docs))
        spec = str(p)
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        p = tmp_path / "c.parquet"
        pq.write_table(pa.table({"body": docs}), p)
        spec = str(p)
    else:  # a Hugging Face dataset directory written to disk, read by datasets (streaming)
        d = tmp_path / "hfds" / "data"
        d.mkdir(parents=True)
        (d / "train-00000.jsonl").write_text("\n".join(json.dumps({"body": x}) for x in docs))
        spec = f"hf:{tmp_path / 'hfds'}"
    field = "text" if kind == "txt" else "body"
    cfg = DataConfig(source=spec, text_field=field, tokenizer="bpe:300", val_fraction=0.1, calib_fraction=0.1,
                     cache_dir=str(tmp_path / "cache"))
    data = prepare_data(cfg, progress=False)
    n = sum(data.manifest["splits"][s]["tokens"] for s in ("train", "val", "calib"))
    assert n > 300 * 40 and data.manifest["splits"]["val"]["tokens"] > 0
    text = data.tokenizer.decode(np.asarray(data.train[:30]).tolist())
    assert "doc" in text


def test_gpt2_tokenizer_and_budget(tmp_path):
    cfg = DataConfig(tokenizer="gpt2", max_tokens=5000, cache_dir=str(tmp_path))
    data = prepare_data(cfg, progress=False)
    assert data.vocab_size == 50257 and data.manifest["splits"]["train"]["tokens"] == 5000
    assert data.tokenizer.decode(data.tokenizer("In the beginning")["input_ids"]) == "In the beginning"


def test_bad_data(tmp_path):
    with pytest.raises(QuantdynError, match="does not exist"):
        prepare_data(DataConfig(source=str(tmp_path / "nope.txt"), cache_dir=str(tmp_path)))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(QuantdynError, match="no training text"):
        prepare_data(DataConfig(source=str(empty), tokenizer="gpt2", cache_dir=str(tmp_path)), progress=False)
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"x": "hello"}\n')
    with pytest.raises(QuantdynError, match="no field 'text'"):
        prepare_data(DataConfig(source=str(bad), tokenizer="gpt2", cache_dir=str(tmp_path)), progress=False)
    with pytest.raises(QuantdynError, match="unsupported type"):
        (tmp_path / "x.csv").write_text("a")
        prepare_data(DataConfig(source=str(tmp_path / "x.csv"), cache_dir=str(tmp_path)))
    with pytest.raises(QuantdynError, match="did you mean 'kjv'"):
        prepare_data(DataConfig(source="builtin:kvj", cache_dir=str(tmp_path)))
    assert not list(tmp_path.glob("*/manifest.json"))  # nothing half-written under a final name
