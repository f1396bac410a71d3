"""funcamp._core.atomic: the one atomic-write helper (funcamp.save, the multi-rank commit, the step
cache), and which temporary files of crashed writes it removes -- only those whose writer is gone.
(test_save.py kills a real writer mid-save; here each rule is checked on planted files.)"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time

import pytest
import torch

import funcamp
from funcamp._core import atomic as _atomic
from funcamp.checkpoints import save as _save
from funcamp.stepcache import cache as _step_cache


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _plant(directory, name, host, pid, *, age=0.0):
    path = directory / f".{name}.{host}.{pid}.0123456789abcdef.tmp"
    path.write_bytes(b"half a checkpoint")
    if age:
        then = time.time() - age
        os.utime(path, (then, then))
    return path


def _write(path, data=b"new"):
    _atomic.atomic_write(path, lambda f: f.write(data))


def test_temp_names_name_the_writer_and_match_the_pattern():
    name = _atomic.temp_name("ckpt.pt")
    match = _atomic._pattern("ckpt.pt").fullmatch(name)
    assert match is not None and (match[1], int(match[2])) == (_atomic._HOST, os.getpid())
    assert _atomic._pattern("ckpt.pt").fullmatch(_atomic.temp_name("ckpt.ptx")) is None
    assert _atomic.temp_name("ckpt.pt") != name


@pytest.mark.parametrize("length", [150, 200, 255])
def test_a_long_names_temp_name_is_never_longer_than_name_max(tmp_path, length):
    long = "c" * (length - 3) + ".pt"
    tmp = _atomic.temp_name(long)
    assert len(tmp) <= _atomic.NAME_MAX and _atomic._pattern(long).fullmatch(tmp)
    assert _atomic._pattern("d" + long[1:]).fullmatch(tmp) is None  # another name's hash
    _write(tmp_path / long, b"new")
    assert (tmp_path / long).read_bytes() == b"new"
    dead = _dead_pid()
    debris = tmp_path / tmp.replace(f".{os.getpid()}.", f".{dead}.")
    debris.write_bytes(b"left behind")
    assert _atomic.remove_debris(tmp_path / long) == [debris.name]


def test_a_dead_writer_on_this_host_is_cleaned_at_once(tmp_path):
    debris = _plant(tmp_path, "c.pt", _atomic._HOST, _dead_pid())
    _write(tmp_path / "c.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]
    assert not debris.exists() and (tmp_path / "c.pt").read_bytes() == b"new"


def test_a_live_writer_is_never_cleaned(tmp_path):
    # a live process on this host (pid running), even once the file is old
    alive = _plant(tmp_path, "c.pt", _atomic._HOST, os.getppid())
    # a writer holding its lock (on another host, or in another pid namespace): even when old
    locked = _plant(tmp_path, "c.pt", "elsewhere", 12345, age=3600)
    fd = os.open(locked, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _write(tmp_path / "c.pt")
        assert alive.exists() and locked.exists()
    finally:
        os.close(fd)


def test_another_hosts_debris_goes_once_stale(tmp_path):
    fresh = _plant(tmp_path, "c.pt", "elsewhere", 12345)
    stale = _plant(tmp_path, "c.pt", "elsewhere", 12346, age=_atomic.STALE_S + 5)
    # a pid now used by another process, its lock free and its file stale: left behind
    reused = _plant(tmp_path, "c.pt", _atomic._HOST, os.getppid(), age=_atomic.STALE_S + 5)
    assert sorted(_atomic.remove_debris(tmp_path / "c.pt")) == sorted([stale.name, reused.name])
    assert fresh.exists() and not stale.exists() and not reused.exists()


def test_without_locks_only_dead_pids_on_this_host_are_cleaned(tmp_path, monkeypatch):
    monkeypatch.setattr(_atomic, "_lock", lambda fd: None)  # a file system that cannot lock
    dead = _plant(tmp_path, "c.pt", _atomic._HOST, _dead_pid())
    stale = _plant(tmp_path, "c.pt", "elsewhere", 12345, age=3600)
    assert _atomic.remove_debris(tmp_path / "c.pt") == [dead.name]
    assert stale.exists()


def test_nothing_but_this_paths_debris_is_touched(tmp_path):
    dead = _dead_pid()
    keep = [
        f".other.pt.{_atomic._HOST}.{dead}.0123456789abcdef.tmp",  # another path's
        ".c.pt.0123456789abcdef.tmp",  # an older funcamp's: no writer in the name
        f".c.pt.{_atomic._HOST}.{dead}.0123.tmp",  # not the pattern
        f"c.pt.{_atomic._HOST}.{dead}.0123456789abcdef.tmp",  # no leading dot
        "c.pt.bak",
    ]
    for name in keep:
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / f".c.pt.{_atomic._HOST}.{dead}.fedcba9876543210.tmp").mkdir()  # not a file
    _write(tmp_path / "c.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*keep, "c.pt", f".c.pt.{_atomic._HOST}.{dead}.fedcba9876543210.tmp"]
    )


def test_the_writer_holds_its_lock_while_it_writes(tmp_path):
    seen = []

    def write(f):
        (tmp,) = (p for p in tmp_path.iterdir() if p.name.endswith(".tmp"))
        fd = os.open(tmp, os.O_RDONLY)
        try:
            seen.append(_atomic._lock(fd))
        finally:
            os.close(fd)
        f.write(b"data")

    _atomic.atomic_write(tmp_path / "c.pt", write)
    assert seen == [False]  # a cleaner would find it locked
    assert (tmp_path / "c.pt").read_bytes() == b"data"


def test_the_checkpoints_and_the_step_cache_share_the_helper():
    assert _save.atomic_write is _atomic.atomic_write
    assert _step_cache.atomic_write is _atomic.atomic_write
    assert not hasattr(_save, "_atomic_write") and not hasattr(_step_cache, "_atomic_write")


def test_a_multi_rank_save_removes_crashed_saves_data(single_rank_group, tmp_path):
    """A crash before the commit leaves a ``data-<token>/`` directory (and maybe the header's
    temporary file); the next committed save removes both."""
    state = funcamp.TrainState.create({"w": torch.ones(2)}, funcamp.sgd(0.1), "float32")
    path = tmp_path / "ckpt"
    funcamp.save(path, state, policy="float32", group=single_rank_group)
    (path / "data-0123456789abcdef").mkdir()
    (path / "data-0123456789abcdef" / "__0_0.distcp").write_bytes(b"half")
    header_tmp = _plant(path, "funcamp.pt", _atomic._HOST, _dead_pid())
    funcamp.save(path, state, policy="float32", group=single_rank_group)
    names = sorted(p.name for p in path.iterdir())
    assert len(names) == 2 and names[0].startswith("data-") and names[1] == "funcamp.pt"
    assert names[0] != "data-0123456789abcdef" and not header_tmp.exists()
    loaded = funcamp.load(path, state, policy="float32")
    assert torch.equal(loaded.params["w"], state.params["w"])


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() == 0, reason="root reads anything")
def test_an_unreadable_file_is_left_alone(tmp_path):
    debris = _plant(tmp_path, "c.pt", _atomic._HOST, _dead_pid())
    debris.chmod(0)
    _write(tmp_path / "c.pt")
    assert debris.exists()
