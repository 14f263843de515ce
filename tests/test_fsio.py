import errno
import os
from pathlib import Path

import pytest

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import (
    atomic_dir,
    atomic_path,
    atomic_write_json,
    file_lock,
    sha256_bytes,
    sha256_file,
)


def test_atomic_write_replaces_whole_file_and_leaves_no_temp(tmp_path):
    target = tmp_path / "a.json"
    atomic_write_json(target, {"x": 1})
    atomic_write_json(target, {"x": 2})
    assert target.read_text().strip().endswith("}")
    assert '"x": 2' in target.read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_atomic_path_failure_keeps_old_content(tmp_path):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("killed")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_atomic_dir_appears_only_when_complete(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError), atomic_dir(out) as tmp:
        (tmp / "shard").write_text("partial")
        raise RuntimeError("crash")
    assert not out.exists() and list(tmp_path.iterdir()) == []
    with atomic_dir(out) as tmp:
        (tmp / "shard").write_text("whole")
        assert not out.exists()
    assert (out / "shard").read_text() == "whole"


def test_disk_full_is_a_one_line_user_error(tmp_path, monkeypatch):
    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(DraftsmithError, match="no space left on device"), atomic_path(tmp_path / "x") as tmp:
        monkeypatch.setattr(os, "replace", full)
        tmp.write_bytes(b"data")


def test_read_only_directory_is_a_user_error(tmp_path):
    # root ignores permission bits, but not sysfs: use it when we are root (as CI is)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.geteuid() == 0:
        ro = Path("/sys/kernel")
    with pytest.raises(DraftsmithError, match="cannot write here"):
        atomic_write_json(ro / "x.json", {})


def test_sha256_file_matches_bytes(tmp_path):
    p = tmp_path / "d"
    p.write_bytes(b"draftsmith" * 1000)
    assert sha256_file(p, chunk=7) == sha256_bytes(b"draftsmith" * 1000)


def test_file_lock_is_reentrant_across_calls(tmp_path):
    with file_lock(tmp_path / "l.lock"):
        pass
    with file_lock(tmp_path / "l.lock"):
        assert (tmp_path / "l.lock").exists()
