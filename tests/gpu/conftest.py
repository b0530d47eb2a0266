"""GPU correctness tests: everything here is marked ``gpu`` and skipped, with the reason, on a
machine without a CUDA GPU.  Run them with ``pytest -m gpu`` (or ``pytest tests/gpu``) on one.

What they check and the tolerances they use are in each test's docstring; none of these
tolerances has been measured yet (no GPU was available when they were written): the first run on
a GPU reports the measured differences (``-rA`` prints them) and BENCHMARKS.md records them.
"""
from __future__ import annotations

import pytest
import torch

GPU_REASON = "needs a CUDA GPU (torch.cuda.is_available() is False here); run `pytest -m gpu` on a GPU machine"


def pytest_collection_modifyitems(config, items):
    here = str(__file__).rsplit("/", 1)[0]
    skip = pytest.mark.skip(reason=GPU_REASON)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


@pytest.fixture
def no_tf32():
    """fp32 matmuls in fp32 (TF32 would make every CUDA-vs-CPU comparison a 1e-3 one)."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
