"""Checkpoints read lazily (models/weights.py): a shard index that contradicts its files, and a memory budget
too small for the checkpoint's largest tensor, are each one line that names what is wrong, raised before any
weight is read or any data prepared."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantdyn.engine.lazy_model import LazyModel
from quantdyn.engine.measure import MeasureConfig, check_budget, measure
from quantdyn.engine.streams import parse_bytes
from quantdyn.errors import QuantdynError
from quantdyn.models.weights import CheckpointWeights

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """A tiny Llama whose embedding (4096 x 32) is its largest tensor, in several safetensors shards."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=64, bos_token_id=0, eos_token_id=0))
    out = tmp_path_factory.mktemp("ck") / "sharded"
    model.save_pretrained(out, max_shard_size="200KB")
    assert len(list(out.glob("model-*.safetensors"))) >= 3
    return out


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_index(ck: Path, edit) -> None:
    idx = json.loads((ck / INDEX).read_text())
    edit(idx["weight_map"])
    (ck / INDEX).write_text(json.dumps(idx))


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_a_consistent_index_opens(sharded):
    w = CheckpointWeights(sharded)
    wmap = json.loads((sharded / INDEX).read_text())["weight_map"]
    assert sorted(w.names()) == sorted(wmap)
    assert all(w.entry(name).file.name == wmap[name] for name in wmap)


def test_index_naming_a_file_twice(sharded, tmp_path):
    ck = _copy(sharded, tmp_path / "twice")
    wmap0 = json.loads((ck / INDEX).read_text())["weight_map"]
    name = next(f for f in sorted(set(wmap0.values())) if list(wmap0.values()).count(f) >= 2)

    def alias(wmap):  # half of the file's tensors under a second spelling of the same file
        mine = [k for k, v in wmap.items() if v == name]
        for k in mine[: len(mine) // 2]:
            wmap[k] = f"./{name}"

    _edit_index(ck, alias)
    with pytest.raises(QuantdynError) as e:
        CheckpointWeights(ck)
    msg = _one_line(e)
    assert "twice" in msg and f"'{name}'" in msg and f"'./{name}'" in msg


def test_a_tensor_in_two_files(sharded, tmp_path):
    ck = _copy(sharded, tmp_path / "two")
    files = sorted(ck.glob("model-*.safetensors"))
    a, b = files[0], files[1]
    stolen = sorted(load_file(a))[0]
    tensors = {**load_file(b), stolen: load_file(a)[stolen]}
    save_file(tensors, str(b), metadata={"format": "pt"})
    with pytest.raises(QuantdynError) as e:
        CheckpointWeights(ck)
    msg = _one_line(e)
    assert f"'{stolen}'" in msg and f"'{a.name}'" in msg and f"'{b.name}'" in msg and "two files" in msg


def test_index_placing_a_tensor_in_the_wrong_file_or_in_none(sharded, tmp_path):
    ck = _copy(sharded, tmp_path / "wrong")
    files = sorted(f.name for f in ck.glob("model-*.safetensors"))
    moved = {}

    def move(wmap):  # one tensor of a file that keeps others (so the file is still read)
        src = next(f for f in files if list(wmap.values()).count(f) >= 2)
        name = next(k for k, v in wmap.items() if v == src)
        wmap[name] = next(f for f in files if f != src)
        moved[name] = (src, wmap[name])

    _edit_index(ck, move)
    (name, (holder, claimed)), = moved.items()
    with pytest.raises(QuantdynError) as e:
        CheckpointWeights(ck)
    msg = _one_line(e)
    assert f"'{name}' is in '{holder}' but the shard index places it in '{claimed}'" in msg
    ghost = _copy(sharded, tmp_path / "ghost")
    _edit_index(ghost, lambda wmap: wmap.update({"model.layers.9.mlp.up_proj.weight": files[0]}))
    with pytest.raises(QuantdynError, match=r"places tensor 'model.layers.9.mlp.up_proj.weight' in '.*', which "
                                            r"does not hold it"):
        CheckpointWeights(ghost)


def test_budget_below_the_largest_tensor_is_refused_with_the_minimum(sharded, monkeypatch):
    source = LazyModel(CheckpointWeights(sharded), torch.float32)
    name, need = source.largest_tensor()
    assert name == "model.embed_tokens.weight" and need == 4096 * 32 * 4
    with pytest.raises(QuantdynError) as e:
        check_budget(source, need - 1)
    msg = _one_line(e)
    assert "largest tensor 'model.embed_tokens.weight'" in msg and "give at least" in msg
    minimum = parse_bytes(msg.rsplit("give at least ", 1)[1].replace(" ", ""))
    # the budget it names is enough (within the printed rounding): no error, streams get what is left
    assert check_budget(source, int(minimum * 1.01)) > 0
    # computed in another dtype than stored (fp32 here), the read buffer and the converted copy exist together
    bf16 = LazyModel(CheckpointWeights(sharded), torch.bfloat16)
    assert bf16.largest_tensor() == (name, 4096 * 32 * (4 + 2))
    # refused before anything is read: no tensor of the checkpoint is touched
    reads = []
    monkeypatch.setattr(CheckpointWeights, "get", lambda self, n: reads.append(n))
    with pytest.raises(QuantdynError, match="largest tensor"):
        measure(sharded, {"rtn4": "rtn4"}, torch.zeros(2, 9, dtype=torch.long), None,
                cfg=MeasureConfig(max_memory=str(need - 1)))
    assert reads == []


def test_cli_budget_below_the_largest_tensor_is_one_line_exit_2(sharded, cli):
    """`quantdyn quantize --max-memory` too small: one line, exit 2, before any data is prepared (the checkpoint
    has no tokenizer, so preparing data would fail with another message)."""
    r = cli("quantize", sharded, "--method", "rtn", "--bits", "4", "--max-memory", "100KB", "--device", "cpu")
    assert r.returncode == 2
    lines = [x for x in r.stderr.strip().splitlines() if x]
    assert len(lines) == 1 and "largest tensor 'model.embed_tokens.weight'" in lines[0] and "give at least" in lines[0]
