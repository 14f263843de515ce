"""The Mooncake transport of the online spool: the engines on one node publish each chunk into a Mooncake store, the
trainer ranks on other nodes fetch the chunks of their micro-batches, and no node needs a path another one sees; the
only module that talks to Mooncake (PyPI `mooncake-transfer-engine-non-cuda`, the `draftsmith[mooncake]` extra).

    RUN/job                          the trainer's job (the ExtractConfig, the bound), as JSON
    RUN/plan -> RUN/plan.G/P         the plan's generation G and its parts (a plan can outgrow one object)
    RUN/status, RUN/trainer          the engine process's and the trainer's progress
    RUN/chunk/NAME/index             a ready chunk: its files, samples, dtype, layers and bytes (written last)
    RUN/chunk/NAME/F.P               part P of the chunk's file number F (a hidden-state store's files)
    RUN/consumed/NAME.rankR          rank R has read the chunk; the last rank removes the chunk's keys

Each process puts what it writes into its own segment, hard-pinned (never evicted): the engine process mounts the one
the chunks live in (the bound, and a margin), each trainer rank a small one for the job, the plan, its status and its
consumed markers; a put that does not fit fails instead of evicting a chunk no one has read. A chunk is computed into a
local directory by the vLLM sink as for the directory spool, then uploaded, then its index is put: a reader that
finds the index finds every part, or the chunk was lost (its engine died with its segment, the master restarted) and
the trainer asks for it again in a new plan generation. Every key starts with RUN, so runs can share a master.

`MooncakeMaster` starts `mooncake_master` on loopback for a one-node run; nothing listens beyond the addresses given.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from draftsmith.core import processes, sizing
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.net import accepts, free_port
from draftsmith.core.spool_address import DEFAULT_RUN, MooncakeAddress
from draftsmith.extract.spool.chunks import (
    Chunk,
    ChunkInfo,
    EngineSide,
    Plan,
    TrainerSide,
    TrainerStatus,
    TransportLost,
    encode,
    fill_directory,
    free_bytes,
)
from draftsmith.extract.spool.directory import store_info

if TYPE_CHECKING:
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

PART = 16 << 20  # bytes per object: a put or get stages through the client's local buffer
LOCAL_BUFFER = 64 << 20
MIN_SEGMENT = 16 << 20  # Mooncake refuses to mount less
CONTROL_SEGMENT = 64 << 20  # a trainer rank's segment: the job, the plan, its status and its consumed markers
WATERMARK = 0.8  # the bound's share of the engine's segment: Mooncake evicts objects above 0.9 of a segment
INSTALL = (
    "pip install 'draftsmith[mooncake]' (mooncake-transfer-engine-non-cuda) and, on Debian or Ubuntu, "
    "apt-get install libibverbs1 librdmacm1 (loaded even for TCP)"
)


def _store_class() -> type[MooncakeDistributedStore]:
    os.environ.setdefault("GLOG_minloglevel", "1")  # Mooncake's client logs each connection at INFO: warnings up
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as err:  # the package, or the RDMA libraries it loads even for TCP
        raise DraftsmithError(f"--spool mooncake: Mooncake cannot be imported ({err}); {INSTALL}") from None
    return MooncakeDistributedStore


def _pinned(segment: str) -> ReplicateConfig:
    """A ReplicateConfig putting into `segment`, hard-pinned (never evicted)."""
    from mooncake.store import ReplicateConfig

    config = ReplicateConfig()
    config.preferred_segment = segment
    config.with_hard_pin = True
    return config


def master_binary() -> str:
    """`mooncake_master` beside this Python (the wheel installs it into the environment's bin), else on PATH."""
    here = Path(sys.executable).parent / "mooncake_master"
    found = str(here) if here.is_file() else shutil.which("mooncake_master")
    if not found:
        raise DraftsmithError(f"--spool mooncake: no mooncake_master in {here.parent} or on PATH; {INSTALL}")
    return found


class MooncakeMaster:
    """`mooncake_master` on loopback (or `host`), started by the trainer for a one-node run, restarted when it dies
    (what it held is lost: the chunks are computed again), stopped at the end."""

    def __init__(self, log: Path, host: str = "127.0.0.1", port: int | None = None, run: str = DEFAULT_RUN):
        self.log, self.host, self.port, self.run = Path(log), host, port, run
        self.proc: processes.ChildProcess | None = None
        self.restarts = 0

    @property
    def address(self) -> MooncakeAddress:
        return MooncakeAddress(self.host, int(self.port or 0), self.run)

    def start(self, timeout: float = 30.0) -> MooncakeAddress:
        binary = master_binary()
        port = self.port = self.port or free_port(self.host)
        metrics = free_port(self.host)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        argv = [binary, f"--rpc_address={self.host}", f"--rpc_port={port}", f"--metrics_host={self.host}"]
        argv += [f"--metrics_port={metrics}", "--enable_metric_reporting=false", "--default_kv_lease_ttl=100"]
        self.proc = processes.ChildProcess(
            argv, log=self.log, append=True, graces_s=(10.0,), preexec_fn=processes.die_with_parent
        )
        if not self.proc.wait_until(lambda: accepts(self.host, port), timeout, 0.05):
            self.stop()
            raise DraftsmithError(f"mooncake_master on {self.host}:{port} did not start; see {self.log}")
        return self.address

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def restart(self) -> None:
        self.stop()
        self.restarts += 1
        self.start()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
        self.proc = None


class MooncakeSpool(EngineSide, TrainerSide):
    """A run's spool in a Mooncake store (both roles: `chunks.EngineSide` with a `segment` and a local `scratch`
    directory, `chunks.TrainerSide` without); `bound` in bytes. `connect()` before use."""

    transport = "Mooncake"
    room_advice = ("the engine's scratch directory", "give --scratch another directory")

    def __init__(
        self,
        address: MooncakeAddress,
        bound: int | None = None,
        *,
        segment: int = CONTROL_SEGMENT,
        scratch: Path | None = None,
        local_host: str | None = None,
    ):
        self.address, self.bound, self.segment = address, bound, segment
        self.staging = Path(scratch) if scratch is not None else None  # the engine side's scratch directory
        self.local_host = local_host or (
            "127.0.0.1" if address.host in ("127.0.0.1", "localhost") else socket.gethostbyname(socket.gethostname())
        )
        self.peak = 0
        self.store: Any = None
        self.config: Any = None  # puts go into this process's own segment, hard-pinned
        self.sizes: dict[str, int] = {}  # bytes of the chunks seen ready
        self.names: list[str] = []  # the current plan's chunks (what usage() counts)

    def describe(self) -> str:
        return str(self.address)

    # -- connecting
    def connect(self, timeout: float = 30.0) -> MooncakeSpool:
        cls = _store_class()
        deadline, rc = time.monotonic() + timeout, None
        while True:
            if not accepts(self.address.host, self.address.port):  # not (yet) there: setup would block a while
                if time.monotonic() > deadline:
                    raise self._unreachable("nothing answers there")
                time.sleep(0.5)
                continue
            store = cls()
            rc = store.setup(
                self.local_host, "P2PHANDSHAKE", int(self.segment), LOCAL_BUFFER, "tcp", "", self.address.master
            )
            if rc == 0:
                self.store, self.config = store, _pinned(store.get_hostname())
                return self
            with contextlib.suppress(Exception):
                store.close()
            if accepts(self.address.host, self.address.port):  # the master is there: the segment is refused
                raise DraftsmithError(
                    f"--spool {self.address}: Mooncake refused to mount a segment of "
                    f"{sizing.human_bytes(self.segment)} on this node (setup returned {rc}); "
                    "give a smaller --segment-gb or --spool-gb, or free memory here"
                )
            if time.monotonic() > deadline:
                raise self._unreachable(f"setup returned {rc}")
            time.sleep(0.5)

    def _unreachable(self, why: str) -> DraftsmithError:
        return DraftsmithError(
            f"--spool {self.address}: cannot reach Mooncake's master at {self.address.master} ({why}); start it "
            f"(mooncake_master --rpc_port {self.address.port}) or give its address"
        )

    def close(self) -> None:
        store, self.store = self.store, None
        if store is not None:
            with contextlib.suppress(Exception):
                store.close()

    # -- keys and values
    def _key(self, *parts: str) -> str:
        return "/".join((self.address.run, *parts))

    def _put(self, key: str, data: bytes) -> None:
        rc = self.store.upsert(key, data, self.config)
        if rc != 0:
            raise TransportLost(f"put {key}: Mooncake returned {rc}")

    def _get(self, key: str) -> bytes | None:
        data = self.store.get(key)
        return bytes(data) if data else None

    def _exists(self, key: str) -> bool:
        return self.store.is_exist(key) == 1

    def _put_json(self, key: str, value: object) -> None:
        self._put(key, json.dumps(value).encode())

    def _get_json(self, key: str) -> object:
        data = self._get(key)
        if data is None:
            return None
        try:
            return json.loads(data)
        except ValueError:
            return None

    def _put_blob(self, key: str, data: bytes | memoryview) -> int:
        """`data` as parts KEY.0, KEY.1 ... of at most PART bytes; returns their number (none for no bytes: Mooncake
        refuses an empty value)."""
        view = memoryview(data)
        parts = -(-len(view) // PART)
        for p in range(parts):
            self._put(f"{key}.{p}", bytes(view[p * PART : (p + 1) * PART]))
        return parts

    def _get_blob(self, key: str, parts: int, size: int, out: BinaryIO) -> bool:
        """Write the parts of `key` to the file `out`; False when one is missing or the sizes disagree."""
        total = 0
        for p in range(parts):
            data = self._get(f"{key}.{p}")
            if data is None:
                return False
            out.write(data)
            total += len(data)
        return total == size

    def _remove_prefix(self, prefix: str) -> int:
        removed = self.store.remove_by_regex("^" + re.escape(prefix), True)
        return max(0, int(removed))

    # -- the job, the plan and the statuses
    def _put_message(self, name: str, data: bytes) -> None:
        self._put(self._key(name), data)

    def _get_message(self, name: str) -> bytes | None:
        return self._get(self._key(name))

    def has_job(self) -> bool:
        return self._exists(self._key("job"))

    def write_plan(self, plan: Plan) -> None:
        data = json.dumps([asdict(c) for c in plan.chunks]).encode()
        parts = self._put_blob(self._key(f"plan.{plan.generation}"), data)
        self._put_json(self._key("plan"), {"generation": plan.generation, "parts": parts, "bytes": len(data)})
        self.names = [c.name for c in plan.chunks]
        for old in range(max(0, plan.generation - 3), plan.generation):  # a reader of the last one may still read
            self._remove_prefix(self._key(f"plan.{old}."))

    def read_plan(self) -> Plan | None:
        head = self._get_json(self._key("plan"))
        if not isinstance(head, dict):
            return None
        buf = io.BytesIO()
        if not self._get_blob(self._key(f"plan.{head['generation']}"), head["parts"], head["bytes"], buf):
            return None
        plan = Plan([Chunk(**c) for c in json.loads(buf.getvalue())], int(head["generation"]))
        self.names = [c.name for c in plan.chunks]
        return plan

    def write_trainer(self, status: TrainerStatus, segment: str = "") -> None:
        """The trainer's progress, in its own segment; or, its last word (the run is over), in the engine process's
        `segment`, which outlives the trainer's (a segment's objects go with the process that mounted it)."""
        key, data = self._key("trainer"), encode(status)
        with contextlib.suppress(TransportLost):
            if not segment:
                self._put(key, data)
                return
            self._remove_prefix(key)
            if self.store.put(key, data, _pinned(segment)) != 0:
                self._put(key, data)

    @property
    def segment_name(self) -> str:
        """This process's segment, as others name it in a ReplicateConfig."""
        return str(self.store.get_hostname())

    # -- chunks, the engine's side
    @contextlib.contextmanager
    def engine_lock(self, wait_s: float = 0.0) -> Iterator[None]:
        """Nothing to lock across nodes: one engine process per run is the operator's to keep (an engine process
        exits when the trainer finishes; a second one would compute the same chunks)."""
        yield

    def publish(self, name: str) -> None:
        """Upload the chunk's files, then its index (a reader sees the index only once every part is there); the
        local copy is removed. TransportLost when Mooncake refuses a part (what was put is removed)."""
        partial = self.partial_path(name)
        info = store_info(partial)
        files = sorted(p for p in partial.rglob("*") if p.is_file())
        entries = []
        try:
            for f, path in enumerate(files):
                data = path.read_bytes()
                parts = self._put_blob(self._key("chunk", name, str(f)), data)
                entries.append({"path": str(path.relative_to(partial)), "bytes": len(data), "parts": parts})
            self._put_json(self._key("chunk", name, "index"), {**asdict(info), "files": entries})
        except TransportLost:
            with contextlib.suppress(Exception):
                self._remove_prefix(self._key("chunk", name) + "/")
            raise
        self.sizes[name] = info.bytes
        shutil.rmtree(partial, ignore_errors=True)

    # -- chunks, both sides
    def _index(self, name: str) -> dict[str, Any] | None:
        index = self._get_json(self._key("chunk", name, "index"))
        return index if isinstance(index, dict) else None

    def is_ready(self, name: str) -> bool:
        return self._exists(self._key("chunk", name, "index"))

    def chunk_info(self, name: str) -> ChunkInfo | None:
        index = self._index(name)
        if index is None:
            return None
        return ChunkInfo(index["sample_ids"], index["dtype"], index["layer_ids"], index["bytes"])

    def usage(self) -> int:
        """Bytes of the current plan's chunks that are ready in the store now."""
        names = list(self.names)
        if not names:
            return 0
        exists = self.store.batch_is_exist([self._key("chunk", n, "index") for n in names])
        used = 0
        for name, ok in zip(names, exists, strict=False):
            if ok == 1:
                if name not in self.sizes:
                    info = self.chunk_info(name)
                    self.sizes[name] = info.bytes if info else 0
                used += self.sizes[name]
        self.peak = max(self.peak, used)
        return used

    # -- chunks, the trainer's side
    @contextlib.contextmanager
    def trainer_lock(self) -> Iterator[None]:
        yield

    def fetch(self, name: str, into: Path, keep: bool = False) -> Path | None:
        """Download ready chunk `name` into the local directory `into` (None: it is not whole in the store)."""
        index = self._index(name)
        if index is None:
            return None

        def download(partial: Path) -> bool:
            for f, entry in enumerate(index["files"]):
                path = partial / entry["path"]
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(path, "wb") as out:
                    if not self._get_blob(self._key("chunk", name, str(f)), entry["parts"], entry["bytes"], out):
                        return False
            return True

        return fill_directory(into, download)

    def consume(self, name: str, rank: int, world: int) -> bool:
        if world > 1:
            with contextlib.suppress(TransportLost):
                self._put(self._key("consumed", f"{name}.rank{rank}"), b"1")
            marks = self.store.batch_is_exist([self._key("consumed", f"{name}.rank{r}") for r in range(world)])
            if any(m != 1 for m in marks):
                return False
        return self.remove(name)

    def remove(self, name: str) -> bool:
        ready = self.is_ready(name)
        with contextlib.suppress(Exception):
            self._remove_prefix(self._key("chunk", name) + "/")
            self._remove_prefix(self._key("consumed", name) + ".rank")
        self.sizes.pop(name, None)
        return ready

    def clean(self, keep: set[str], names: Sequence[str] = ()) -> list[str]:
        """Remove every ready chunk among `names` (the run's chunks) not in `keep` (those an earlier trainer's plan
        left ahead of what this one needs first)."""
        return [name for name in names if name not in keep and self.remove(name)]

    def check_capacity(self, bound: int, largest: int, engine_scratch: Path | None) -> None:
        """The bound lives in the engines' segments; a local engine stages each chunk in `engine_scratch` first."""
        if engine_scratch is not None and largest > (free := free_bytes(engine_scratch)):
            raise DraftsmithError(
                f"{engine_scratch}: the engine writes each chunk here before publishing it, and its "
                f"filesystem has {sizing.human_bytes(free)} free for chunks of up to "
                f"{sizing.human_bytes(largest)}; free space there or lower --spool-gb"
            )

    def finish(self, everything: bool = False) -> None:
        """The run is over: every key of the run is removed but the trainer's status (the engines read it; removed
        too with `everything`, by the engine process once it has)."""
        with contextlib.suppress(Exception):
            for prefix in ("chunk/", "consumed/", "plan", "job", "status") + (("trainer",) if everything else ()):
                self._remove_prefix(self._key(prefix))


def segment_bytes(bound: int) -> int:
    """The segment an engine process mounts to hold `bound` bytes of chunks below Mooncake's eviction watermark."""
    return _whole_mib(bound / WATERMARK + LOCAL_BUFFER)


def _whole_mib(size: float) -> int:
    """Mooncake mounts segments of whole MiB, 16 MiB at least."""
    return max(MIN_SEGMENT, math.ceil(size / (1 << 20)) << 20)


def engine_segment(bound: int, segment_gb: float | None) -> int:
    """The bytes of the segment an engine process mounts for chunks of `bound` bytes: `segment_gb` (refused in one
    line when it cannot hold the bound: four one-step chunks or more), else what the bound needs."""
    if segment_gb is None:
        return segment_bytes(bound)
    segment = _whole_mib(segment_gb * sizing.GiB)
    if bound > segment * WATERMARK:
        need = math.ceil(segment_bytes(bound) / sizing.GiB * 1000) / 1000
        raise DraftsmithError(
            f"--segment-gb {segment_gb:g}: Mooncake's segment on this node cannot hold the "
            f"trainer's --spool-gb of {sizing.human_bytes(bound)} (the spool holds four one-step "
            f"chunks or more) below its {WATERMARK:.0%} watermark; give --segment-gb {need:g} or "
            "more, or the trainer a smaller --spool-gb"
        )
    return segment


__all__ = [
    "MooncakeAddress",
    "MooncakeMaster",
    "MooncakeSpool",
    "TransportLost",
    "engine_segment",
    "master_binary",
    "segment_bytes",
]
