"""What both sides of the online spool agree on, whatever carries it: the chunks of a plan, their names and sizes,
the engine process's status, and the two roles (`EngineSide`, `TrainerSide`) a transport plays.

A chunk holds the samples of consecutive optimizer steps of one epoch, every rank's micro-batches, packed so its
bytes stay under bound / SPOOL_CHUNKS (plus the held-out split's chunk "eval", which every rank copies out of the
spool once and keeps). Chunk names carry their epoch and steps, and chunk boundaries are counted from each epoch's
first step, so a resumed run asks for the same chunks and a chunk a crash left whole is used as it is.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError

from draftsmith.config import ExtractConfig
from draftsmith.core import sizing
from draftsmith.core.errors import DraftsmithError

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


Waiting = Literal["", "space", "start", "plan"]  # what an engine process waits for: nothing, room, vLLM, a plan


class FeedJob(BaseModel):
    """What the trainer asks of every engine process: written once per (re)start, read by `draftsmith feed`."""

    model_config = ConfigDict(extra="forbid")

    extract: ExtractConfig  # what to compute, as `draftsmith extract --backend vllm` would
    bound: int  # bytes the spool may hold
    cpus: list[int] | None = None  # the cores the trainer left to its local engine process (it runs on the others)
    prepared_digest: str | None = None  # of the trainer's prepared set: an engine on another node must read the same
    stall_s: float | None = None  # the trainer's stall limit, which rules the run


class FeedStatus(BaseModel):
    """What the engine process reports (status.json, or its key in a store); `updated` is when it last wrote. Fields
    a newer engine process adds are ignored, not an error."""

    model_config = ConfigDict(extra="ignore")

    pid: int = 0  # 0: written by the trainer (before an engine process reported)
    host: str = ""
    chunk: str = ""
    chunks_done: int = 0
    tokens: int = 0
    seconds: float = 0.0  # computing, not waiting
    waiting: Waiting = ""
    engine_started: bool = False  # vLLM started in this process: an error after it is not one of the set-up
    error: str = ""
    fatal: bool = False  # the error comes back on a restart (a full disk, a bad setup): do not restart
    peak: int = 0
    done: bool = False
    generation: int = 0  # of the plan it works on
    log: str = ""  # where its output goes, on its host
    segment: str = ""  # the Mooncake segment its chunks live in (the trainer's last word goes there)
    updated: float = 0.0
    extra: dict[str, JsonValue] = Field(default_factory=dict)  # shown in the trainer's summary, never read as data

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class TrainerStatus(BaseModel):
    """What the trainer reports to the engines: its progress (the engines stop waiting for room when it has made
    none for the stall limit) and whether the run is over."""

    model_config = ConfigDict(extra="ignore")

    step: int = 0
    chunks_read: int = 0
    finished: bool = False
    stall_s: float = STALL_S
    updated: float = 0.0


Message = TypeVar("Message", FeedJob, FeedStatus, TrainerStatus)


def encode(message: FeedJob | FeedStatus | TrainerStatus) -> bytes:
    """A message as the transports carry it: JSON, stamped with the time it was written (a job has no stamp)."""
    if isinstance(message, FeedJob):
        return message.model_dump_json().encode()
    return message.model_copy(update={"updated": time.time()}).model_dump_json().encode()


def decode(kind: type[Message], data: bytes | str | None) -> Message | None:
    """A message read back; None when there is none or it does not parse (a torn or foreign write: the writer
    replaces it within a second)."""
    if data is None:
        return None
    try:
        return kind.model_validate_json(data)
    except ValidationError:
        return None


class _Transport(ABC):
    """What a transport stores for both roles: a few named messages, as bytes (encoded by `encode`, one home)."""

    bound: int | None

    @abstractmethod
    def describe(self) -> str:
        """Where the spool is, for messages (a path, or mooncake://HOST:PORT/RUN)."""

    @abstractmethod
    def _put_message(self, name: str, data: bytes) -> None:
        """Replace message `name` ("job", "status", "trainer")."""

    @abstractmethod
    def _get_message(self, name: str) -> bytes | None:
        """Message `name` as last written (None: none)."""

    @abstractmethod
    def engine_lock(self, wait_s: float = 0.0) -> AbstractContextManager[None]:
        """The engine process's lock: held for its life (one engine process per spool), and by the trainer while it
        cleans the spool (a killed trainer's engine process exits by itself within `wait_s`)."""

    @abstractmethod
    def read_plan(self) -> Plan | None:
        """The trainer's current plan (None: none now, e.g. the transport lost it and the trainer rewrites it)."""

    @abstractmethod
    def is_ready(self, name: str) -> bool:
        """Chunk `name` is published whole."""

    @abstractmethod
    def usage(self) -> int:
        """Bytes the published chunks hold now (what the bound limits)."""

    def write_status(self, status: FeedStatus) -> None:
        """Replace the engine status: the engine process's reports, or the trainer's reset before it starts one (one a
        transport lost: the reader reads the next)."""
        with contextlib.suppress(TransportLost):
            self._put_message("status", encode(status))

    # -- lifecycle hooks: nothing unless a transport needs it
    def finish(self, everything: bool = False) -> None:  # noqa: B027 - a no-op lifecycle hook a transport may override
        """The run is over: remove what it left in the spool (`everything`: the engine process's last call, once it
        has read the trainer's last word)."""

    def close(self) -> None:  # noqa: B027 - a no-op lifecycle hook a transport may override
        """Let go of the transport (a connection)."""


class EngineSide(_Transport):
    """The engine process's view of a spool (`draftsmith.extract.vllm.feed`): it reads the job and the plan, computes
    each chunk into a local staging directory and publishes it, never holding more than the bound."""

    staging: Path | None  # where chunks are written before they are published (None: this side cannot write)
    room_advice: tuple[str, str]  # what the staging directory is, and how to get more room there: for an error

    def read_job(self) -> FeedJob:
        """The trainer's job; a one-line error when there is none (or it does not parse)."""
        job = decode(FeedJob, self._get_message("job"))
        if job is None:
            raise DraftsmithError(
                f"--spool {self.describe()}: no readable job; the trainer writes it before the engines start"
            )
        return job

    def read_trainer(self) -> TrainerStatus | None:
        """The trainer's last progress report."""
        return decode(TrainerStatus, self._get_message("trainer"))

    def partial_path(self, name: str) -> Path:
        if self.staging is None:
            raise DraftsmithError(f"--spool {self.describe()}: the engine side needs a local scratch directory")
        return self.staging / f".{name}.partial"

    def begin(self, name: str) -> Path:
        """A fresh staging directory the sink writes chunk `name`'s store into (one a crash left is removed)."""
        partial = self.partial_path(name)
        shutil.rmtree(partial, ignore_errors=True)
        partial.parent.mkdir(parents=True, exist_ok=True)
        return partial

    def room(self, name: str, needed: int) -> None:
        """One line (DraftsmithError) when the filesystem chunk `name` is staged on has less than `needed` free (a
        full disk or /dev/shm: the same again on a restart)."""
        free = free_bytes(self.partial_path(name))
        if free < needed:
            raise DraftsmithError(
                f"{self.partial_path(name)}: the filesystem holding {self.room_advice[0]} has "
                f"{sizing.human_bytes(free)} free and chunk {name} needs up to "
                f"{sizing.human_bytes(needed)}; free space there or {self.room_advice[1]}"
            )

    def drop_leftovers(self) -> list[str]:
        """Remove what a killed engine process left half-written in staging; returns the names removed. Only the
        engine process holding the engine lock calls it, so nothing live is removed."""
        removed = []
        if self.staging is not None and self.staging.is_dir():
            for entry in sorted(self.staging.iterdir()):
                if entry.name.startswith("."):
                    shutil.rmtree(entry, ignore_errors=True)
                    removed.append(entry.name)
        return removed

    @abstractmethod
    def publish(self, name: str) -> None:
        """The chunk begun under `name` becomes ready, whole or not at all."""


class TrainerSide(_Transport):
    """The trainer's view of a spool (`draftsmith.train.engine_source`): it writes the job and the plan, fetches
    each chunk it needs into a directory it reads, and removes a chunk once every rank has read it. It never asks
    which transport it has: what differs is behind the hooks."""

    peak: int
    transport: str  # its name in the run's summary

    def write_job(self, job: FeedJob) -> None:
        self._put_message("job", encode(job))

    def write_trainer(self, status: TrainerStatus, segment: str = "") -> None:
        """The trainer's progress; with `segment` (the run is over), where the engine process reads it once this
        process is gone (a transport whose messages outlive their writer ignores it)."""
        with contextlib.suppress(TransportLost):  # the engines read the next one
            self._put_message("trainer", encode(status))

    def read_status(self) -> FeedStatus:
        """The engine process's last report (an empty one when there is none yet)."""
        return decode(FeedStatus, self._get_message("status")) or FeedStatus()

    def prepare(self) -> None:
        """Make the spool usable before the trainer locks it (a directory is created)."""

    def check_capacity(self, bound: int, largest: int, engine_scratch: Path | None) -> None:
        """One line when the spool cannot hold `bound` bytes, or the local engine's `engine_scratch` (None: the
        engines run elsewhere) cannot stage a chunk of `largest` bytes."""

    @abstractmethod
    def trainer_lock(self) -> AbstractContextManager[None]:
        """Held for the trainer's life: one trainer per spool."""

    @abstractmethod
    def has_job(self) -> bool:
        """The job is still there (False once the transport lost it: a restarted Mooncake master)."""

    @abstractmethod
    def write_plan(self, plan: Plan) -> None: ...

    @abstractmethod
    def chunk_info(self, name: str) -> ChunkInfo | None:
        """What ready chunk `name` holds (None: not ready or unreadable)."""

    @abstractmethod
    def fetch(self, name: str, into: Path, keep: bool = False) -> Path | None:
        """A local store directory holding ready chunk `name` (copied into `into` when the chunk lives elsewhere or
        `keep`: the trainer keeps its copy after the spool's is removed); None when it is not whole any more."""

    @abstractmethod
    def consume(self, name: str, rank: int, world: int) -> bool:
        """Rank `rank` has read chunk `name`; the last of `world` ranks removes it. True when it was removed."""

    @abstractmethod
    def remove(self, name: str) -> bool: ...

    @abstractmethod
    def clean(self, keep: set[str], names: Sequence[str] = ()) -> list[str]:
        """Remove leftovers and every ready chunk of the run (`names`) not in `keep`."""


def free_bytes(path: Path) -> int:
    """Bytes free on the filesystem holding `path` (or its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


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


def wait_for_space(
    spool: EngineSide, needed: int, stop: Callable[[], bool] | None = None, on_wait: Callable[[int], None] | None = None
) -> None:
    """Block until `needed` more bytes fit under the spool's bound (`on_wait(used)` while waiting; `stop()` true:
    give up)."""
    while spool.bound is not None and (used := spool.usage()) + needed > spool.bound:
        if on_wait is not None:
            on_wait(used)
        if stop is not None and stop():
            return
        time.sleep(0.05)
