"""QUANTDYN_NO_SKIP=1 (tests/conftest.py), which CI's cross-check runs set: every skip there is a failure -- in a
test, in a fixture, at collection -- and an expected failure (xfail) stays one."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PROBE = '''
import pytest

def test_skips():
    pytest.skip("probe")

def test_needs_a_missing_package():
    pytest.importorskip("quantdyn_no_such_module")

@pytest.fixture
def missing():
    pytest.skip("fixture probe")

def test_fixture_skips(missing):
    pass

@pytest.mark.xfail(strict=True, reason="expected")
def test_expected_failure():
    assert False

def test_passes():
    pass
'''


def test_no_skip_turns_every_skip_into_a_failure(tmp_path):
    (tmp_path / "test_probe.py").write_text(PROBE)
    (tmp_path / "test_skipped_module.py").write_text('import pytest\npytest.importorskip("quantdyn_no_such_module")\n')
    env = dict(os.environ, QUANTDYN_NO_SKIP="1", PYTHONPATH=str(Path(__file__).parent))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", "-c",
                        os.devnull, "--rootdir", str(tmp_path), "--continue-on-collection-errors", str(tmp_path)],
                       capture_output=True, text=True, env=env)
    summary = r.stdout.strip().splitlines()[-1]
    assert r.returncode == 1, r.stdout[-3000:]
    # the two skipping tests fail; the fixture's skip and the module's are errors (setup, collection)
    assert summary.startswith("2 failed, 1 passed, 1 xfailed, 2 errors"), r.stdout[-3000:]
    assert "skipped under QUANTDYN_NO_SKIP=1" in r.stdout and "quantdyn_no_such_module" in r.stdout
