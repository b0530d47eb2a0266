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


# ------------------------------------------------------------- sources: hf specs, folders, held-out split
def test_hf_spec_syntax():
    from quantdyn.data.sources import HFSpec, parse_hf_spec

    assert parse_hf_spec("hf:wikitext") == HFSpec("wikitext")
    assert parse_hf_spec("hf:wikitext:wikitext-2-raw-v1:test@main") == HFSpec("wikitext", "wikitext-2-raw-v1", "test", "main")
    assert parse_hf_spec("hf:org/ds::validation") == HFSpec("org/ds", None, "validation")
    assert parse_hf_spec("hf:org/ds@v1.0") == HFSpec("org/ds", None, "train", "v1.0")
    assert parse_hf_spec("hf:org/ds::validation@abc").spec() == "hf:org/ds::validation@abc"
    for bad, msg in [("hf:a:b:c:d", "too many"), ("hf:", "no dataset name"), ("hf:x@", "empty revision")]:
        with pytest.raises(QuantdynError, match=msg):
            parse_hf_spec(bad)
    # the default split keeps the identity it had before splits could be chosen (old caches stay valid)
    a, b = resolve_source("hf:org/ds")[0], resolve_source("hf:org/ds::train")[0]
    c, d = resolve_source("hf:org/ds::test")[0], resolve_source("hf:org/ds@v2")[0]
    assert a.identity == b.identity and len({a.identity, c.identity, d.identity}) == 3


def _hf_dir(tmp_path, n=200):
    """A local Hugging Face dataset directory with a train and a test split (datasets infers them)."""
    d = tmp_path / "hfds" / "data"
    d.mkdir(parents=True)
    docs = _docs(n)
    (d / "train-00000.jsonl").write_text("\n".join(json.dumps({"text": x}) for x in docs))
    (d / "test-00000.jsonl").write_text("\n".join(json.dumps({"text": "held " + x}) for x in docs[: n // 2]))
    return tmp_path / "hfds"


def test_hf_split_choice_and_held_out_manifest(tmp_path):
    root = _hf_dir(tmp_path)
    common = dict(tokenizer="gpt2", val_fraction=0.1, calib_fraction=0.1, cache_dir=str(tmp_path / "cache"))
    train = prepare_data(DataConfig(source=f"hf:{root}", **common), progress=False)
    test = prepare_data(DataConfig(source=f"hf:{root}::test", **common), progress=False)
    assert train.directory != test.directory
    assert test.manifest["source_details"]["split"] == "test" and train.manifest["source_details"]["split"] == "train"
    held = test.manifest["held_out"]
    assert held["source_split"] == "test" and sum(held["documents"].values()) == 100
    assert held["split_seed"] == 1234 and (held["val_fraction"], held["calib_fraction"]) == (0.1, 0.1)
    assert test.tokenizer.decode(np.asarray(test.val[:3]).tolist()).startswith("held doc")
    assert not train.tokenizer.decode(np.asarray(train.val[:20]).tolist()).startswith("held")
    # the digest identifies the held-out documents: stable, and another split seed gives another set
    again = prepare_data(DataConfig(source=f"hf:{root}::test", **{**common, "cache_dir": str(tmp_path / "c2")}),
                         progress=False)
    assert again.manifest["held_out"]["val_digest"] == held["val_digest"]
    other = prepare_data(DataConfig(source=f"hf:{root}::test", split_seed=7, **common), progress=False)
    assert other.manifest["held_out"]["val_digest"] != held["val_digest"]
    with pytest.raises(QuantdynError, match="split 'validation'"):
        prepare_data(DataConfig(source=f"hf:{root}::validation", **common), progress=False)


def test_hf_source_is_streamed_once_and_revision_is_passed(tmp_path, monkeypatch):
    import datasets


    calls = []
    docs = _docs(150)

    def fake_load(name, config=None, split=None, revision=None, streaming=False):
        calls.append((name, config, split, revision, streaming))
        return iter([{"text": x} for x in docs])

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    for tok in ("bpe:300", "gpt2"):  # bpe learns its merges first: the one download is spooled to disk
        calls.clear()
        cfg = DataConfig(source="hf:org/corpus:en:validation@v1.2", tokenizer=tok, val_fraction=0.1,
                         calib_fraction=0.1, cache_dir=str(tmp_path / tok.replace(":", "")))
        data = prepare_data(cfg, progress=False)
        assert calls == [("org/corpus", "en", "validation", "v1.2", True)], calls
        assert sum(data.manifest["held_out"]["documents"].values()) == 150
        assert data.manifest["source_details"] == {"name": "org/corpus", "config": "en", "split": "validation",
                                                   "revision": "v1.2"}
        assert not list(data.directory.glob("*.spool"))


def test_folder_source_reads_every_text_file(tmp_path):
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = _docs(240)
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("\n\n".join(docs[:60]))
    (root / "sub" / "b.jsonl").write_text("\n".join(json.dumps({"text": x}) for x in docs[60:120]))
    pq.write_table(pa.table({"text": docs[120:180]}), root / "sub" / "c.parquet")
    with gzip.open(root / "d.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps({"text": x}) for x in docs[180:]))
    (root / ".hidden.txt").write_text("secret words " * 50)
    (root / "README.md").write_text("not a corpus file")
    cfg = DataConfig(source=str(root), tokenizer="gpt2", val_fraction=0.1, calib_fraction=0.1,
                     cache_dir=str(tmp_path / "cache"))
    data = prepare_data(cfg, progress=False)
    m = data.manifest
    assert m["source_kind"] == "folder" and m["source_details"]["files"] == 4
    assert m["source_details"]["types"] == ["jsonl", "parquet", "txt"]
    assert sum(m["held_out"]["documents"].values()) == 240  # every document, none from the hidden file
    assert "secret" not in data.tokenizer.decode(np.asarray(data.train).tolist())
    (root / "sub" / "b.jsonl").write_text("\n".join(json.dumps({"text": x}) for x in docs[60:100]))
    assert prepare_data(cfg, progress=False).directory != data.directory  # an edited file is new data
    empty = tmp_path / "empty"
    (empty / "x").mkdir(parents=True)
    (empty / "x" / "notes.md").write_text("hi")
    with pytest.raises(QuantdynError, match="holds no .txt, .jsonl"):
        prepare_data(DataConfig(source=str(empty), cache_dir=str(tmp_path / "cache")))


def test_concurrent_preparers_tokenize_once(tmp_path, monkeypatch):
    """Two preparers of one cache at the same time (two sweeps, two array tasks): one tokenizes, the
    other waits on the cache lock and opens the result."""
    import threading
    import time

    import quantdyn.data.prepare as prepare

    real, runs = prepare._prepare, []

    def slow(*a, **k):
        runs.append(threading.get_ident())
        time.sleep(0.5)  # long enough for the other thread to arrive while this one holds the lock
        return real(*a, **k)

    monkeypatch.setattr(prepare, "_prepare", slow)
    p = tmp_path / "c.jsonl"
    p.write_text("\n".join(json.dumps({"text": d}) for d in _docs(120)))
    cfg = DataConfig(source=str(p), tokenizer="gpt2", val_fraction=0.1, calib_fraction=0.1, cache_dir=str(tmp_path / "cc"))
    out = []
    threads = [threading.Thread(target=lambda: out.append(prepare_data(cfg, progress=False))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(runs) == 1 and len(out) == 2 and out[0].directory == out[1].directory


def test_cache_key_follows_the_source_and_old_caches_stay_valid(tmp_path):
    """Editing a source file gives new shards (the key holds the source identity); a cache named the
    old way (by the config alone) is still used while its source is unchanged."""
    import shutil

    p = tmp_path / "c.jsonl"
    p.write_text("\n".join(json.dumps({"text": d}) for d in _docs(120)))
    cfg = DataConfig(source=str(p), tokenizer="gpt2", val_fraction=0.1, calib_fraction=0.1, cache_dir=str(tmp_path / "cc"))
    data = prepare_data(cfg, progress=False)
    m = dict(data.manifest)
    first_key = data.data_hash
    legacy = tmp_path / "cc" / m["legacy_key"]
    shutil.move(data.directory, legacy)  # what an older quantdyn left: named and keyed by the legacy key
    m["key"] = m.pop("legacy_key")
    (legacy / "manifest.json").write_text(json.dumps(m))
    old = prepare_data(cfg, progress=False)
    assert old.directory == legacy and old.data_hash == m["key"] and old.same_data(m["key"])
    p.write_text("\n".join(json.dumps({"text": d}) for d in _docs(100)))
    new = prepare_data(cfg, progress=False)
    assert new.directory != legacy and sum(new.manifest["held_out"]["documents"].values()) == 100
    assert not new.same_data(first_key)  # a run that recorded the earlier shards cannot resume on these
    assert new.same_data(m["key"])  # a legacy key never named the source's contents: accepted as before
