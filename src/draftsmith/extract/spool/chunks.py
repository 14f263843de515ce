"""What both sides of the online spool agree on, whatever carries it: the chunks of a plan, their names and sizes,
the engine process's status, and the two roles (`EngineSide`, `TrainerSide`) a transport plays.

A chunk holds the samples of consecutive optimizer steps of one epoch, every rank's micro-batches, packed so its
bytes stay under bound / SPOOL_CHUNKS (plus the held-out split's chunk "eval", which every rank copies out of the
spool once and keeps). Chunk names carry their epoch and steps, and chunk boundaries are counted from each epoch's
first step, so a resumed run asks for the same chunks and a chunk a crash left whole is used as it is.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Protocol, Sequence

from draftsmith.core import sizing

EVAL_CHUNK = "eval"
FILE_SLACK = 3 * 4096 + 64 * 1024  # a chunk's manifest, lock and headers, and the last block of each file
STALL_S = 1800.0  # the default most seconds either side waits for the other with no sign of progress


class TransportLost(Exception):
    """The transport does not answer, or lost what it held (a restarted Mooncake master, an engine gone with its
    segment): the engine process waits for the trainer's next plan; the trainer writes one."""


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


@dataclass
class Plan:
    """The chunks the engines compute, in order; `generation` grows each time the trainer writes a new plan (a
    restart, or chunks lost with the transport), so an engine process knows to start its pass again."""

    chunks: list[Chunk]
    generation: int = 0


@dataclass
class ChunkInfo:
    """What a ready chunk holds, read without reading its states (a resume keeps a chunk only when it matches)."""

    sample_ids: list[int]
    dtype: str
    layer_ids: list[int]
    bytes: int


def chunk_name(epoch: int, first: int, last: int) -> str:
    return f"e{epoch:04d}-s{first:07d}-{last:07d}"


def chunk_bytes(tokens: int, samples: int, hidden_size: int, num_layer_ids: int, dtype: sizing.StorageDtype) -> int:
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


@dataclass
class FeedStatus:
    """What the engine process reports (status.json, or its key in a store); `updated` is when it last wrote."""

    pid: int = 0
    host: str = ""
    chunk: str = ""
    chunks_done: int = 0
    tokens: int = 0
    seconds: float = 0.0  # computing, not waiting
    waiting: str = ""  # "space": the spool is full; "start": the engine is starting; "plan": for the trainer's plan
    error: str = ""
    fatal: bool = False  # the error comes back on a restart (a full disk, a bad setup): do not restart
    peak: int = 0
    done: bool = False
    generation: int = 0  # of the plan it works on
    log: str = ""  # where its output goes, on its host
    segment: str = ""  # the Mooncake segment its chunks live in (the trainer's last word goes there)
    updated: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class TrainerStatus:
    """What the trainer reports to the engines: its progress (the engines stop waiting for room when it has made
    none for the stall limit) and whether the run is over."""

    step: int = 0
    chunks_read: int = 0
    finished: bool = False
    stall_s: float = STALL_S
    updated: float = 0.0


def read_feed_status(spool: "TrainerSide") -> FeedStatus:
    known = set(FeedStatus.__dataclass_fields__)
    return FeedStatus(**{k: v for k, v in spool.read_status().items() if k in known})


class EngineSide(Protocol):
    """The engine process's view of a spool (`draftsmith.extract.vllm.feed`): it reads the job and the plan, computes
    each chunk into a local directory and publishes it, never holding more than the bound."""

    bound: int | None

    def describe(self) -> str:
        """Where the spool is, for messages (a path, or mooncake://HOST:PORT/RUN)."""

    def engine_lock(self) -> ContextManager[None]:
        """Held for the engine process's life: one engine process per spool."""

    def read_job(self) -> dict[str, Any]:
        """The trainer's job: the ExtractConfig, the bound, the devices; a one-line error when there is none."""

    def read_plan(self) -> Plan | None:
        """The trainer's current plan (None: none now, e.g. the transport lost it and the trainer rewrites it)."""

    def read_trainer(self) -> TrainerStatus | None:
        """The trainer's last progress report."""

    def write_status(self, status: FeedStatus) -> None:
        """Replace the engine status the trainer reads."""

    def drop_leftovers(self) -> list[str]:
        """Remove what a killed engine process left half-written; returns the names removed."""

    def is_ready(self, name: str) -> bool:
        """Chunk `name` is published whole."""

    def usage(self) -> int:
        """Bytes the published chunks hold now (what the bound limits)."""

    def begin(self, name: str) -> Path:
        """A fresh local directory the sink writes chunk `name`'s store into."""

    def room(self, name: str, needed: int) -> None:
        """One line (DraftsmithError) when the filesystem chunk `name` is written on has less than `needed` free."""

    def publish(self, name: str) -> None:
        """The chunk begun under `name` becomes ready, whole or not at all."""


class TrainerSide(Protocol):
    """The trainer's view of a spool (`draftsmith.train.engine_source`): it writes the job and the plan, fetches
    each chunk it needs into a directory it reads, and removes a chunk once every rank has read it."""

    bound: int | None
    peak: int
    remote: bool  # chunks are copied to the trainer's side to be read

    def describe(self) -> str: ...

    def trainer_lock(self) -> ContextManager[None]:
        """Held for the trainer's life: one trainer per spool."""

    def engine_lock(self, wait_s: float) -> ContextManager[None]:
        """Held while the trainer cleans the spool: no engine process is writing (a killed trainer's engine process
        exits by itself, within `wait_s`)."""

    def write_job(self, job: dict[str, Any]) -> None: ...

    def read_plan(self) -> Plan | None: ...

    def has_job(self) -> bool:
        """The job is still there (False once the transport lost it: a restarted Mooncake master)."""

    def write_plan(self, plan: Plan) -> None: ...

    def write_trainer(self, status: TrainerStatus) -> None: ...

    def read_status(self) -> dict[str, Any]: ...

    def chunk_info(self, name: str) -> ChunkInfo | None:
        """What ready chunk `name` holds (None: not ready or unreadable)."""

    def is_ready(self, name: str) -> bool: ...

    def fetch(self, name: str, into: Path, keep: bool = False) -> Path | None:
        """A local store directory holding ready chunk `name` (copied into `into` when the chunk lives elsewhere or
        `keep`: the trainer keeps its copy after the spool's is removed); None when it is not whole any more."""

    def consume(self, name: str, rank: int, world: int) -> bool:
        """Rank `rank` has read chunk `name`; the last of `world` ranks removes it. True when it was removed."""

    def remove(self, name: str) -> bool: ...

    def clean(self, keep: set[str], names: Sequence[str] = ()) -> list[str]:
        """Remove leftovers and every ready chunk of the run (`names`) not in `keep`."""

    def usage(self) -> int: ...


def fill_directory(into: Path, write: Callable[[Path], bool]) -> Path | None:
    """`write(partial)` fills a fresh directory beside `into`, renamed to `into` when it returns True (a reader of
    `into` sees a whole chunk or none); None when it returned False, leaving nothing behind."""
    partial = into.parent / f".{into.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(into, ignore_errors=True)
    if not write(partial):
        shutil.rmtree(partial, ignore_errors=True)
        return None
    os.replace(partial, into)
    return into


def wait_for_space(spool: EngineSide, needed: int, stop: Any = None, on_wait: Any = None) -> None:
    """Block until `needed` more bytes fit under the spool's bound (`on_wait(used)` while waiting; `stop()` true:
    give up)."""
    while spool.bound is not None and (used := spool.usage()) + needed > spool.bound:
        if on_wait is not None:
            on_wait(used)
        if stop is not None and stop():
            return
        time.sleep(0.05)
