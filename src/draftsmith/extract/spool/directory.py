"""The directory transport of the online spool: a bounded directory, on local disk or /dev/shm (or a filesystem
every node mounts), through which live vLLM engines hand hidden states to the trainer; the only module that reads or
writes it.

    SPOOL/job.json             what the engine process runs: the ExtractConfig, the bound, the GPUs it may use
    SPOOL/plan.json            the chunks in the order the trainer needs them, and the plan's generation (the trainer's)
    SPOOL/status.json          the engine process's progress: chunk, tokens, rate, what it waits for, its error
    SPOOL/trainer.json         the trainer's progress (the engine process stops waiting on a trainer that makes none)
    SPOOL/chunks/NAME/         a ready chunk: a hidden-state store (draftsmith.extract.store) of its samples
    SPOOL/chunks/.NAME.partial/  a chunk being written (removed by the next start when left by a crash)
    SPOOL/consumed/NAME.rankR  rank R has read the chunk (under torchrun; the last rank deletes it)

Only chunks/ counts against the bound (the engine's log is the trainer's OUTPUT/feed.log). A chunk is published by one
rename, so a reader sees it whole or not at all; the engine process starts a chunk only when the spool's bytes plus
the chunk's are under the bound and its filesystem has the room; the trainer deletes what it has read. The plan and
the chunks are `chunks.py`'s; the Mooncake transport (`mooncake.py`) plays the same two roles.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path

from draftsmith.core import sizing
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import atomic_write_bytes, atomic_write_text
from draftsmith.extract import store as store_mod
from draftsmith.extract.spool.chunks import Chunk, ChunkInfo, EngineSide, Plan, TrainerSide, fill_directory, free_bytes
from draftsmith.extract.store.writer import TryLock

CHUNKS_DIR = "chunks"
CONSUMED_DIR = "consumed"
JOB_FILE, PLAN_FILE, STATUS_FILE, TRAINER_FILE = "job.json", "plan.json", "status.json", "trainer.json"
ENGINE_LOCK, TRAINER_LOCK = ".engine.lock", ".trainer.lock"


def disk_bytes(path: Path) -> int:
    """Bytes the files under `path` take on disk (allocated blocks; at least their sizes)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.stat(os.path.join(root, name))
                total += max(st.st_blocks * 512, st.st_size)
    return total


def store_info(path: Path) -> ChunkInfo:
    """What the chunk store at `path` holds (DraftsmithError when it is no readable store)."""
    reader = store_mod.open(path, dtype=None)
    return ChunkInfo(
        [int(i) for i in reader.sample_ids], reader.manifest.dtype, list(reader.layer_ids), disk_bytes(path)
    )


class Spool(EngineSide, TrainerSide):
    """A spool directory (both roles: `chunks.EngineSide` and `chunks.TrainerSide`); `bound` in bytes. Chunks are
    staged and published inside it, by one rename."""

    transport = "spool"
    room_advice = ("the spool", "give --spool a directory on a bigger filesystem")

    def __init__(self, path: Path, bound: int | None = None):
        self.path = Path(path)
        self.staging: Path | None = self.path / CHUNKS_DIR  # chunks are written beside the published ones
        self.bound = bound
        self.peak = 0

    def describe(self) -> str:
        return str(self.path)

    # -- layout
    @property
    def chunks(self) -> Path:
        return self.path / CHUNKS_DIR

    def chunk_path(self, name: str) -> Path:
        return self.chunks / name

    def is_ready(self, name: str) -> bool:
        return (self.chunk_path(name) / "manifest.json").is_file()

    def usage(self) -> int:
        """Bytes the chunks take on disk now (and the highest seen by this process so far in `peak`)."""
        used = disk_bytes(self.chunks) if self.chunks.is_dir() else 0
        self.peak = max(self.peak, used)
        return used

    def prepare(self) -> None:
        self.create()

    def check_capacity(self, bound: int, largest: int, engine_scratch: Path | None) -> None:
        """The bound against the free space of the spool's filesystem (the engine stages chunks inside it)."""
        free = free_bytes(self.path) + self.usage()
        if bound > free:
            raise DraftsmithError(
                f"--spool-gb {bound / sizing.GiB:g}: the filesystem holding --spool {self.path} has "
                f"{sizing.human_bytes(free)} free (/dev/shm is often small in containers); lower "
                "--spool-gb or give --spool a directory on a bigger filesystem"
            )

    def finish(self, everything: bool = False) -> None:
        if not everything:  # the trainer's call; the files it leaves are its own to remove, not the engine's
            self.clean(set(), [])

    def create(self) -> None:
        for d in (self.path, self.chunks, self.path / CONSUMED_DIR):
            try:
                d.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise DraftsmithError(f"--spool {self.path}: cannot create it ({err.strerror})") from None

    # -- the job, the plan and the status (small JSON files, replaced atomically)
    _FILES = {"job": JOB_FILE, "status": STATUS_FILE, "trainer": TRAINER_FILE}

    def _put_message(self, name: str, data: bytes) -> None:
        atomic_write_bytes(self.path / self._FILES[name], data)

    def _get_message(self, name: str) -> bytes | None:
        with contextlib.suppress(FileNotFoundError):
            return (self.path / self._FILES[name]).read_bytes()
        return None

    def has_job(self) -> bool:
        return (self.path / JOB_FILE).is_file()

    def write_plan(self, plan: Plan) -> None:
        data = {"generation": plan.generation, "chunks": [asdict(c) for c in plan.chunks]}
        atomic_write_text(self.path / PLAN_FILE, json.dumps(data))

    def read_plan(self) -> Plan | None:
        path = self.path / PLAN_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except ValueError as err:
            raise DraftsmithError(
                f"{path}: not valid JSON ({err}); delete the spool directory and start again"
            ) from None
        if isinstance(data, list):  # written before plans had generations
            return Plan([Chunk(**c) for c in data], 0)
        return None if data is None else Plan([Chunk(**c) for c in data["chunks"]], int(data["generation"]))

    # -- chunks
    def publish(self, name: str) -> None:
        """The partial chunk becomes ready, by one rename."""
        os.replace(self.partial_path(name), self.chunk_path(name))

    def chunk_info(self, name: str) -> ChunkInfo | None:
        try:
            return store_info(self.chunk_path(name))
        except DraftsmithError:
            return None

    def fetch(self, name: str, into: Path, keep: bool = False) -> Path | None:
        """The chunk's directory in the spool, or with `keep` a copy of it in `into` (the spool's is removed once
        every rank has copied it)."""
        if not self.is_ready(name):
            return None
        if not keep:
            return self.chunk_path(name)

        def copy(partial: Path) -> bool:
            try:
                shutil.copytree(self.chunk_path(name), partial)
            except (FileNotFoundError, shutil.Error):  # removed meanwhile
                return False
            return True

        return fill_directory(into, copy)

    def consume(self, name: str, rank: int, world: int) -> bool:
        if world > 1:
            marks = self.path / CONSUMED_DIR
            (marks / f"{name}.rank{rank}").touch()
            if any(not (marks / f"{name}.rank{r}").exists() for r in range(world)):
                return False
        return self.remove(name)

    def remove(self, name: str) -> bool:
        """Delete a chunk: renamed out of the way first, so only one remover wins and no half-deleted chunk is seen."""
        gone = self.chunks / f".{name}.deleted.{os.getpid()}"
        try:
            os.replace(self.chunk_path(name), gone)
        except FileNotFoundError:
            return False
        shutil.rmtree(gone, ignore_errors=True)
        for r in (self.path / CONSUMED_DIR).glob(f"{name}.rank*"):
            r.unlink(missing_ok=True)
        return True

    def clean(self, keep: set[str], names: Sequence[str] = ()) -> list[str]:
        """Remove partial and deleted leftovers and every ready chunk not in `keep` (`names`, the run's chunks: all
        of a directory's are this run's); returns what was removed."""
        removed: list[str] = []
        if not self.chunks.is_dir():
            return removed
        for entry in sorted(self.chunks.iterdir()):
            if entry.name.startswith(".") or entry.name not in keep:
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
        for mark in (self.path / CONSUMED_DIR).glob("*"):
            if mark.name.split(".rank")[0] not in keep:
                mark.unlink(missing_ok=True)
        return removed

    def trainer_lock(self) -> contextlib.AbstractContextManager[None]:
        return self.lock(TRAINER_LOCK)

    def engine_lock(self, wait_s: float = 0.0) -> contextlib.AbstractContextManager[None]:
        return self.lock(ENGINE_LOCK, wait_s)

    @contextlib.contextmanager
    def lock(self, name: str, wait_s: float = 0.0) -> Iterator[None]:
        """An exclusive flock on SPOOL/`name` (the engine process's, or the trainer's), waiting up to `wait_s`."""
        self.create()
        lock, deadline = TryLock(self.path / name), time.monotonic() + wait_s
        while not lock.try_acquire():
            if time.monotonic() >= deadline:
                who = "an engine process" if name == ENGINE_LOCK else "another trainer"
                raise DraftsmithError(f"--spool {self.path}: {who} still uses it; stop it or use another --spool")
            time.sleep(0.1)
        try:
            yield
        finally:
            lock.release()


__all__ = ["ENGINE_LOCK", "Spool", "TRAINER_LOCK", "disk_bytes"]
