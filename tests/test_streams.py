"""Activation stream storage (engine/streams.py): where spilled streams go and what is left behind."""
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from quantdyn.engine.streams import ORPHAN_AGE_S, StreamStore, _spill_prefix, remove_orphaned_spills


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_spilled_streams_round_trip_and_are_removed(tmp_path):
    with StreamStore(torch.device("cpu"), 1 << 20, spill_dir=str(tmp_path), force="disk") as store:
        s = store.new("fp-eval")
        x = torch.randn(3, 5)
        s.append(x)
        s[0] = x * 2
        assert torch.equal(s[0], x * 2)
        (spill,) = tmp_path.iterdir()
        assert spill.name.startswith(_spill_prefix(__import__("os").getpid()) + "-")
    assert list(tmp_path.iterdir()) == []


def test_orphaned_spill_directories_of_dead_processes_are_removed(tmp_path):
    """A walk killed with SIGKILL (the OOM killer) cannot remove its spill directory; the next walk that
    spills there removes it — but never one of a live process, of another host, one changed within the last
    hour (a live walk in another PID namespace) or one of an unknown layout."""
    dead = tmp_path / f"{_spill_prefix(_dead_pid())}-abc"
    live = tmp_path / f"{_spill_prefix(1)}-def"  # pid 1 always runs
    other_host = tmp_path / f"quantdyn-streams-some.other-node-{_dead_pid()}-ghi"
    old_layout = tmp_path / "quantdyn-streams-k2j3h4"
    mine = tmp_path / "my-files"
    recent = tmp_path / f"{_spill_prefix(_dead_pid())}-jkl"  # dead pid, but written to a minute ago
    old = time.time() - 2 * ORPHAN_AGE_S
    for d in (dead, live, other_host, old_layout, mine, recent):
        d.mkdir()
        f = d / "fp-eval-0-000000.pt"
        f.write_bytes(b"x" * 100)
        if d is not recent:
            os.utime(f, (old, old))
            os.utime(d, (old, old))
    os.utime(recent, (old, old))
    os.utime(recent / "fp-eval-0-000000.pt", (time.time() - 60,) * 2)
    with StreamStore(torch.device("cpu"), 1 << 20, spill_dir=str(tmp_path), force="disk") as store:
        store.new("fp-eval").append(torch.ones(2))
        assert not dead.exists()
        assert all(d.exists() for d in (live, other_host, old_layout, mine, recent))
    assert remove_orphaned_spills(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(d.name for d in (live, other_host, old_layout, mine, recent))


def test_auto_placement_on_cpu(tmp_path, monkeypatch):
    """auto on CPU: small streams stay in memory; large ones (over AUTO_SPILL_BYTES) spill to a real disk but
    not to tmpfs (where spilling saves nothing); an explicit budget or too little free RAM decides alone."""
    import quantdyn.engine.streams as st

    cpu = torch.device("cpu")
    big, small = st.AUTO_SPILL_BYTES + 1, st.AUTO_SPILL_BYTES
    monkeypatch.setattr(st, "available_host_bytes", lambda: 64 * 2**30)
    monkeypatch.setattr(st, "_mount_type", lambda path: "ext4")
    assert StreamStore(cpu, small, spill_dir=str(tmp_path)).where == "device"
    assert StreamStore(cpu, big, spill_dir=str(tmp_path)).where == "disk"
    assert StreamStore(cpu, big, budget=2 * big, spill_dir=str(tmp_path)).where == "device"
    assert StreamStore(cpu, small, budget=small - 1, spill_dir=str(tmp_path)).where == "disk"
    assert StreamStore(cpu, big, spill_dir=str(tmp_path), force="device").where == "device"
    monkeypatch.setattr(st, "_mount_type", lambda path: "tmpfs")
    assert StreamStore(cpu, big, spill_dir=str(tmp_path)).where == "device"
    monkeypatch.setattr(st, "available_host_bytes", lambda: small)
    assert StreamStore(cpu, small, spill_dir=str(tmp_path)).where == "disk"  # over half the free RAM


def test_mount_type_reads_the_longest_matching_mount(tmp_path, monkeypatch):
    import builtins

    import quantdyn.engine.streams as st

    mounts = ("rootfs / ext4 rw 0 0\n"
              "tmpfs /dev/shm tmpfs rw 0 0\n"
              "fast /scratch xfs rw 0 0\n"
              "ram /scratch/ram\\040disk tmpfs rw 0 0\n")
    real_open = builtins.open

    def fake_open(path, *a, **k):
        if path == "/proc/mounts":
            import io
            return io.StringIO(mounts)
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(st.os.path, "realpath", lambda p: str(p))
    assert st._mount_type("/scratch/x") == "xfs"
    assert st._mount_type("/scratch/ram disk/x") == "tmpfs"
    assert st._mount_type("/scratchy") == "ext4"  # a name prefix is not a parent directory
    assert st._mount_type("/dev/shm") == "tmpfs"
    assert st.ram_backed(Path("/dev/shm/q")) and not st.ram_backed(Path("/home/q"))
