"""The ``files:EXT[,EXT...]:DIRECTORY`` source: a tree of source code and docs (a Python installation on a GPU
machine with no network) read as a corpus, one document per file."""
from __future__ import annotations

import os

import numpy as np
import pytest

from quantdyn.data.prepare import DataConfig, prepare_data
from quantdyn.data.sources import files_with_extensions, parse_files_spec, resolve_source
from quantdyn.errors import QuantdynError


def _tree(root):
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "pkg" / "__pycache__").mkdir()
    files = {
        "pkg/__init__.py": "import os\n\n\ndef f():\n    return 1\n",
        "pkg/sub/mod.py": "class A:\n    pass\n\n\nclass B(A):\n    x = 2\n",
        "README.MD": "# Title\n\nSome words about the package.\n",
        "docs.rst": "Heading\n=======\n\nText.\n",
        "notes.txt": "left out: .txt is not in the list\n",
        ".hidden.py": "secret = 1\n",
        ".git/config.py": "secret = 2\n",
        "pkg/__pycache__/mod.cpython-312.pyc": "\x00\x01binary",
        "pkg/empty.py": "   \n\n",
    }
    for rel, text in files.items():
        (root / rel).write_text(text)
    return files


def test_files_source_reads_each_matching_file_whole_in_sorted_order(tmp_path):
    files = _tree(tmp_path / "site")
    os.symlink(tmp_path / "site" / "pkg", tmp_path / "site" / "pkg" / "sub" / "loop")  # not followed
    info, docs = resolve_source(f"files:py,md,.RST:{tmp_path / 'site'}")
    got = list(docs())
    want = [files[k] for k in ("README.MD", "docs.rst", "pkg/__init__.py", "pkg/sub/mod.py")]  # sorted paths
    assert got == want  # whole files (blank lines inside code kept), empty ones and hidden/.pyc/.txt left out
    assert info.kind == "files" and info.details["files"] == 5  # pkg/empty.py is listed, yields nothing
    assert info.details["extensions"] == [".md", ".py", ".rst"]
    assert info.details["bytes"] == sum(len(files[k]) for k in ("README.MD", "docs.rst", "pkg/__init__.py",
                                                                "pkg/sub/mod.py", "pkg/empty.py"))
    # the identity follows the extension list and the files' contents
    same = resolve_source(f"files:rst,md,py:{tmp_path / 'site'}")[0]
    fewer = resolve_source(f"files:py:{tmp_path / 'site'}")[0]
    assert same.identity == info.identity and fewer.identity != info.identity
    (tmp_path / "site" / "docs.rst").write_text("Heading\n=======\n\nLonger text now.\n")
    assert resolve_source(f"files:py,md,rst:{tmp_path / 'site'}")[0].identity != info.identity


def test_files_source_spec_errors_are_one_line(tmp_path):
    _tree(tmp_path / "site")
    cases = {
        "files:py": "has no folder",
        "files:py:": "has no folder",
        f"files::{tmp_path}": "names no file extensions",
        f"files:, .:{tmp_path}": "names no file extensions",
        f"files:*.py:{tmp_path}": "plain name endings",
        f"files:py:{tmp_path / 'nope'}": "is not a folder",
        f"files:ipynb,toml:{tmp_path / 'site'}": "holds no .ipynb or .toml files",
    }
    for spec, msg in cases.items():
        with pytest.raises(QuantdynError, match=msg) as e:
            resolve_source(spec)
        assert "\n" not in str(e.value), spec


def test_parse_files_spec_keeps_colons_in_the_folder():
    assert parse_files_spec("files:py,.MD,py:/a/b:c") == ((".md", ".py"), __import__("pathlib").Path("/a/b:c"))


def test_files_source_prepares_token_shards(tmp_path):
    """End to end through prepare_data with the gpt2 tokenizer (what the GPU study uses): documents are split
    by hash, every one lands in a split, and the shards decode to the files' text."""
    root = tmp_path / "code"
    root.mkdir()
    for i in range(60):
        (root / f"m{i:02d}.py").write_text(f"def f{i}(x):\n    return x * {i}\n\n\nVALUE_{i} = {i * 7}\n")
    cfg = DataConfig(source=f"files:py:{root}", tokenizer="gpt2", val_fraction=0.1, calib_fraction=0.1,
                     cache_dir=str(tmp_path / "cache"))
    data = prepare_data(cfg, progress=False)
    m = data.manifest
    assert m["source_kind"] == "files" and m["source_details"]["files"] == 60
    assert sum(m["held_out"]["documents"].values()) == 60
    text = data.tokenizer.decode(np.asarray(data.train).tolist())
    assert "return x * " in text and "\n\n\nVALUE_" in text
    assert files_with_extensions(root, (".py",))[0].name == "m00.py"
    assert prepare_data(cfg, progress=False).directory == data.directory  # cached: the same shards
