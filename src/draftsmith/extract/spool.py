"""The online spool: the bounded directory through which live vLLM engines hand hidden states to the trainer
(`draftsmith train --engine vllm`); the only module that reads or writes it.

    SPOOL/job.json             what the engine process runs: the ExtractConfig, the bound, the GPUs it may use
    SPOOL/plan.json            the chunks in the order the trainer needs them (written by the trainer)
    SPOOL/status.json          the engine process's progress: chunk, tokens, rate, what it waits for, its error
    SPOOL/feed.log             the engine process's output (vLLM's log)
    SPOOL/chunks/NAME/         a ready chunk: a hidden-state store (draftsmith.extract.store) of its samples
    SPOOL/chunks/.NAME.partial/  a chunk being written (removed by the next start when left by a crash)
    SPOOL/consumed/NAME.rankR  rank R has read the chunk (under torchrun; the last rank deletes it)

A chunk holds the samples of consecutive optimizer steps of one epoch, every rank's micro-batches, packed so its
bytes stay under bound / SPOOL_CHUNKS (plus the held-out split's chunk "eval", which stays for the whole run). A
chunk is published by one rename, so a reader sees it whole or not at all; the engine process starts a chunk only
when the spool's bytes plus the chunk's are under the bound; the trainer deletes what it has read. Chunk names carry
their epoch and steps, and chunk boundaries are counted from each epoch's first step, so a resumed run asks for the
same chunks and a chunk a crash left whole is used as it is.

Another transport (the engines on other nodes) replaces only where chunks come from: anything that publishes a
store directory under chunks/NAME by a rename, in plan order, and keeps under the bound, feeds the same trainer.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from draftsmith.core import sizing
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import atomic_write_text

CHUNKS_DIR = "chunks"
CONSUMED_DIR = "consumed"
JOB_FILE, PLAN_FILE, STATUS_FILE, LOG_FILE = "job.json", "plan.json", "status.json", "feed.log"
EVAL_CHUNK = "eval"
FILE_SLACK = 3 * 4096 + 64 * 1024  # a chunk's manifest, lock and headers, and the last block of each file
ENGINE_LOCK, TRAINER_LOCK = ".engine.lock", ".trainer.lock"


@dataclass
class Chunk:
    """Consecutive optimizer steps [first, last] of `epoch` (or the held-out split: name "eval")."""

    name: str
    epoch: int
    first: int
    last: int
    sample_ids: list[int]  # every sample the trainer reads from it, in plan order
    engine_ids: list[int]  # those the engines compute (the rest come from the --keep-epoch0 store)
    tokens: int  # of engine_ids
    estimate: int  # bytes on disk, at most

    @property
    def from_engine(self) -> bool:
        return bool(self.engine_ids)


def chunk_name(epoch: int, first: int, last: int) -> str:
    return f"e{epoch:04d}-s{first:07d}-{last:07d}"


def chunk_bytes(tokens: int, samples: int, hidden_size: int, num_layer_ids: int, dtype: str) -> int:
    """The most a chunk of `samples` samples and `tokens` tokens takes on disk."""
    return sizing.store_bytes(tokens, hidden_size, num_layer_ids, dtype, samples=samples) + FILE_SLACK


def pack_steps(steps: Sequence[tuple[list[int], int]], limit: int) -> list[tuple[int, int]]:
    """Consecutive steps (each: its sample ids, its bytes) grouped greedily into [first, last] runs of at most `limit`
    bytes; a single step over the limit is refused by the caller before this."""
    runs, first, total = [], 0, 0
    for p, (_, size) in enumerate(steps):
        if p > first and total + size > limit:
            runs.append((first, p - 1))
            first, total = p, 0
        total += size
    if steps:
        runs.append((first, len(steps) - 1))
    return runs


def disk_bytes(path: Path) -> int:
    """Bytes the files under `path` take on disk (allocated blocks; at least their sizes)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.stat(os.path.join(root, name))
                total += max(st.st_blocks * 512, st.st_size)
    return total


class Spool:
    """A spool directory; `bound` in bytes."""

    def __init__(self, path: Path, bound: int | None = None):
        self.path = Path(path)
        self.bound = bound
        self.peak = 0

    # -- layout
    @property
    def chunks(self) -> Path:
        return self.path / CHUNKS_DIR

    def chunk_path(self, name: str) -> Path:
        return self.chunks / name

    def partial_path(self, name: str) -> Path:
        return self.chunks / f".{name}.partial"

    def is_ready(self, name: str) -> bool:
        return (self.chunk_path(name) / "manifest.json").is_file()

    def usage(self) -> int:
        """Bytes on disk now (and the highest seen by this process so far in `peak`)."""
        used = disk_bytes(self.path) if self.path.is_dir() else 0
        self.peak = max(self.peak, used)
        return used

    def create(self) -> None:
        for d in (self.path, self.chunks, self.path / CONSUMED_DIR):
            try:
                d.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise DraftsmithError(f"--spool {self.path}: cannot create it ({err.strerror})") from None

    # -- the job, the plan and the status (small JSON files, replaced atomically)
    def _write(self, name: str, data: Any) -> None:
        atomic_write_text(self.path / name, json.dumps(data))

    def _read(self, name: str) -> Any:
        path = self.path / name
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except ValueError as err:
            raise DraftsmithError(f"{path}: not valid JSON ({err}); delete the spool directory and start again")

    def write_job(self, job: dict[str, Any]) -> None:
        self._write(JOB_FILE, job)

    def read_job(self) -> dict[str, Any]:
        job = self._read(JOB_FILE)
        if not isinstance(job, dict):
            raise DraftsmithError(f"{self.path}: no {JOB_FILE}; the trainer writes it before starting the engines")
        return job

    def write_plan(self, chunks: Sequence[Chunk]) -> None:
        self._write(PLAN_FILE, [asdict(c) for c in chunks])

    def read_plan(self) -> list[Chunk]:
        return [Chunk(**c) for c in self._read(PLAN_FILE) or []]

    def write_status(self, status: dict[str, Any]) -> None:
        self._write(STATUS_FILE, {**status, "updated": time.time()})

    def read_status(self) -> dict[str, Any]:
        with contextlib.suppress(DraftsmithError):
            status = self._read(STATUS_FILE)
            if isinstance(status, dict):
                return status
        return {}

    def log_tail(self, lines: int = 3) -> str:
        with contextlib.suppress(OSError):
            text = (self.path / LOG_FILE).read_text(encoding="utf-8", errors="replace").strip().splitlines()
            return " | ".join(line.strip() for line in text[-lines:])
        return ""

    # -- chunks
    def begin(self, name: str) -> Path:
        """A fresh partial directory for chunk `name` (one a crash left behind is removed)."""
        partial = self.partial_path(name)
        shutil.rmtree(partial, ignore_errors=True)
        return partial

    def publish(self, name: str) -> None:
        """The partial chunk becomes ready, by one rename."""
        os.replace(self.partial_path(name), self.chunk_path(name))

    def consume(self, name: str, rank: int, world: int) -> bool:
        """Rank `rank` has read chunk `name`; the last of `world` ranks deletes it. True when it was deleted."""
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

    def clean(self, keep: set[str]) -> list[str]:
        """Remove partial and deleted leftovers and every ready chunk not in `keep`; returns what was removed."""
        removed = []
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

    def drop_leftovers(self) -> list[str]:
        """Remove what a killed engine or trainer left half-done (partial and half-deleted chunks); only the engine
        process holding the engine lock calls this, so nothing live is removed."""
        removed = []
        if self.chunks.is_dir():
            for entry in sorted(self.chunks.iterdir()):
                if entry.name.startswith("."):
                    shutil.rmtree(entry, ignore_errors=True)
                    removed.append(entry.name)
        return removed

    def wait_for_space(self, needed: int, stop: Any = None, on_wait: Any = None) -> None:
        """Block until `needed` more bytes fit under the bound (`on_wait(used)` while waiting, `stop()` true: give
        up)."""
        while self.bound is not None and self.usage() + needed > self.bound:
            if on_wait is not None:
                on_wait(self.usage())
            if stop is not None and stop():
                return
            time.sleep(0.05)

    @contextlib.contextmanager
    def lock(self, name: str, wait_s: float = 0.0) -> Iterator[None]:
        """An exclusive flock on SPOOL/`name` (the engine process's, or the trainer's), waiting up to `wait_s`."""
        self.create()
        fd = os.open(self.path / name, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + wait_s
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        who = "an engine process" if name == ENGINE_LOCK else "another trainer"
                        raise DraftsmithError(f"--spool {self.path}: {who} still uses it; stop it or use another "
                                              "--spool") from None
                    time.sleep(0.1)
            yield
        finally:
            os.close(fd)


@dataclass
class FeedStatus:
    """What the engine process reports in status.json."""

    pid: int = 0
    chunk: str = ""
    chunks_done: int = 0
    tokens: int = 0
    seconds: float = 0.0  # computing, not waiting
    waiting: str = ""  # "space": the spool is full; "start": the engine is starting; "" computing
    error: str = ""
    peak: int = 0
    done: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def read_feed_status(spool: Spool) -> FeedStatus:
    known = set(FeedStatus.__dataclass_fields__)
    return FeedStatus(**{k: v for k, v in spool.read_status().items() if k in known})


__all__ = ["Chunk", "EVAL_CHUNK", "FeedStatus", "Spool", "chunk_bytes", "chunk_name", "disk_bytes", "pack_steps",
           "read_feed_status"]
