"""Atomic, checksummed file I/O: every artefact write in draftsmith goes through here.

A stage can be killed at any moment, so nothing is ever written in place: data goes to a temp file in the
same directory, is fsynced, then renamed over the target (rename is atomic on POSIX).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from pydantic import BaseModel

from draftsmith.core.errors import DiskFullError, DraftsmithError


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _explain_os_error(path: Path, err: OSError) -> DraftsmithError:
    if err.errno == errno.ENOSPC:
        return DiskFullError(
            f"{path}: no space left on device; free disk space and run the same command again to resume"
        )
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return DraftsmithError(f"{path}: cannot write here ({os.strerror(err.errno)}); choose a writable --output")
    return DraftsmithError(f"{path}: {os.strerror(err.errno) if err.errno else err}")


def _os_error_in(err: BaseException) -> OSError | None:
    """The OSError behind a failed write that a library reported as its own error: safetensors' "I/O error: No
    space left on device (os error 28)", or an OSError in the exception's cause or context. None: not a disk error."""
    seen: BaseException | None = err
    while seen is not None and not isinstance(seen, DraftsmithError):
        if isinstance(seen, OSError) and seen.errno:
            return seen
        if found := re.search(r"\(os error (\d+)\)", str(seen)):
            return OSError(int(found.group(1)), os.strerror(int(found.group(1))))
        seen = seen.__cause__ or seen.__context__
    return None


def _raise_write_failure(path: Path, err: BaseException) -> NoReturn:
    """What a failed atomic write raises: a one-line DraftsmithError for a disk problem, else the error itself."""
    if isinstance(err, OSError):
        raise _explain_os_error(path, err) from None
    if isinstance(err, Exception) and not isinstance(err, DraftsmithError) and (os_err := _os_error_in(err)):
        raise _explain_os_error(path, os_err) from None
    raise err


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temp path beside `path`; on success it is fsynced and renamed onto `path`."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
    except OSError as err:
        raise _explain_os_error(path, err) from None
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
        _fsync_dir(path.parent)
    except BaseException as err:  # a full disk may come as an OSError or as a library's own error type
        tmp_path.unlink(missing_ok=True)
        _raise_write_failure(path, err)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj: object) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


@contextlib.contextmanager
def atomic_dir(path: Path) -> Iterator[Path]:
    """Build a whole directory beside `path` and rename it into place only when complete.

    A later stage can therefore never see a half-written output: either the directory exists whole, or
    not at all (a leftover `.name.partial-*` is removed by the next run).
    """
    path = Path(path)
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        for stale in parent.glob(f".{path.name}.partial-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=parent))
    except OSError as err:
        raise _explain_os_error(path, err) from None
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
        _fsync_dir(parent)
    except BaseException as err:  # a full disk may come as an OSError or as a library's own error type
        shutil.rmtree(tmp, ignore_errors=True)
        _raise_write_failure(path, err)


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock (flock) so two processes never fill the same cache entry or store."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


# ------------------------------------------------------------------------------- resumable directory writes

RESUME_NAME = "resume.json"


def resume_dir(output: Path) -> Path:
    """Where an artefact for `output` is built shard by shard before it is renamed into place."""
    output = Path(output)
    return output.parent / f".{output.name}.resume"


def fresh_dir(path: Path) -> None:
    """An empty directory at `path` (what was there is removed); one line naming it when it cannot be made."""
    shutil.rmtree(path, ignore_errors=True)
    try:
        Path(path).mkdir(parents=True)
    except OSError as err:
        raise DraftsmithError(f"{path}: cannot create ({err.strerror}); choose a writable --output") from None


def load_resume(work: Path, fingerprint: str, shard_model: Any) -> dict | None:
    """The progress record (`resume.json`: fingerprint, shards, the caller's state) of an interrupted write of the
    same job in `work`, if its shards validate as `shard_model` (a pydantic model with `file` and `num_bytes`) and
    every one is there whole; else None."""
    try:
        data = json.loads((Path(work) / RESUME_NAME).read_text(encoding="utf-8"))
        if data.get("fingerprint") != fingerprint:
            return None
        shards = [shard_model.model_validate(s) for s in data["shards"]]
    except (OSError, ValueError, KeyError, TypeError):  # pydantic's ValidationError is a ValueError
        return None
    for shard in shards:
        file = Path(work) / shard.file
        if not file.is_file() or file.stat().st_size != shard.num_bytes:
            return None
    return data


def save_resume(work: Path, fingerprint: str, shards: Sequence[BaseModel], **state: object) -> None:
    """The progress record `load_resume` reads: the job's fingerprint, its complete shards, the caller's `state`."""
    record = {"fingerprint": fingerprint, "shards": [s.model_dump() for s in shards], **state}
    atomic_write_json(Path(work) / RESUME_NAME, record)


def publish_resumed(work: Path, output: Path) -> None:
    """The artefact completed in `work` (its `resume_dir`) renamed to `output`, replacing what was there."""
    (work / RESUME_NAME).unlink(missing_ok=True)
    if output.exists():
        shutil.rmtree(output)
    os.replace(work, output)
