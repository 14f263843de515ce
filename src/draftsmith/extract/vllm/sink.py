"""Inside vLLM's worker process: hand each finished request's hidden states to the draftsmith store.

Every strategy ends here. The connector (connector.py) and the runner taps (taps.py) know only vLLM; this
module knows only the store. One `StoreSink` lives per worker process (module global, see `activate`); on
tensor-parallel ranks other than 0 it swallows the states, so exactly one writer per engine writes.

The sink checks each request's token ids against the prepared set before storing (a request routed to the wrong
sample id would otherwise poison the store silently) and writes through a background thread, so disk writes
overlap the next forward pass. `worker.py` exposes its progress and close to the driver via collective_rpc.
Its config and its reports cross to and from vLLM's processes as plain dicts (`model_dump(mode="json")`, what
vLLM's own serialisation carries), typed on both ends.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, JsonValue

from draftsmith.core.errors import DiskFullError, DraftsmithError
from draftsmith.extract import common
from draftsmith.extract import store as store_module
from draftsmith.prepare.dataset import open_prepared

SAMPLE_ID_KEY = "draftsmith_sample_id"  # in SamplingParams.extra_args (under "kv_transfer_params": connector)
PARENT_KEY, SHARED_KEY = "draftsmith_parent", "draftsmith_shared"  # beside it: the prefix it shares (driver.Prompt)
EXTRA_CONFIG_KEY = "draftsmith"  # the sink config in KVTransferConfig.kv_connector_extra_config


def read_tag(params: dict | None) -> tuple[int, int, int] | None:
    """(sample id, parent, shared) of a request the driver tagged (driver.tag_request); None for any other."""
    params = params or {}
    if params.get(SAMPLE_ID_KEY) is None:
        return None
    return int(params[SAMPLE_ID_KEY]), int(params.get(PARENT_KEY, -1)), int(params.get(SHARED_KEY, 0))


class SinkConfig(BaseModel):
    """What a worker's sink writes, and where."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    store: str | None  # None: the online spool's chunks, each opened by `open_store`
    prepared: str
    spec: store_module.StoreSpec
    worker: tuple[int, int]  # this writer is i of n
    dp_size: int = 1  # data-parallel engines per writer (`for_data_parallel_rank`)
    shard_bytes: int
    backend_info: dict[str, JsonValue] | None = None

    def for_data_parallel_rank(self, dp_rank: int | None) -> SinkConfig:
        """Engine `dp_rank` of `dp_size` within worker i/n writes as worker i*dp_size + dp_rank of n*dp_size."""
        i, n = self.worker
        return self.model_copy(update={"worker": (i * self.dp_size + int(dp_rank or 0), n * self.dp_size)})


class SinkReport(BaseModel):
    """What a worker's sink reports to the driver: requests received, its error (a full disk flagged: the driver
    raises DiskFullError again) and, once its store is finished, what the store holds."""

    received: int = 0
    error: str | None = None
    disk_full: bool = False
    writes: bool = False  # this rank writes
    samples_written: int = 0
    shards_written: int = 0
    recovered: list[str] = []

    def raise_error(self, what: str) -> None:
        """The error this sink met, raised here as the type it was (DiskFullError for a full disk), prefixed with
        `what`; nothing when it met none."""
        if self.error:
            raise (DiskFullError if self.disk_full else DraftsmithError)(f"{what}: {self.error}")


class StoreSink:
    """Writes [T, L, H] states of finished requests into the store as writer `worker` (i/n)."""

    def __init__(self, config: SinkConfig, *, writes: bool = True):
        self.config = config
        self.writes = writes
        self.received = 0
        self.error: str | None = None
        self.disk_full = False  # the error was a DiskFullError: the driver raises that type again
        self._lock = threading.Lock()
        self.spec = config.spec
        self.layer_ids = list(config.spec.layer_ids)
        self._writer: store_module.StoreWriter | None = None
        self._background: common.BackgroundWriter | None = None  # set with _writer
        if not writes:
            return
        self.dataset = open_prepared(Path(config.prepared))
        if config.store is not None:
            self._open(Path(config.store))

    def _open(self, path: Path) -> None:
        writer = store_module.create_or_resume(
            path,
            self.spec,
            worker=self.config.worker,
            shard_bytes=self.config.shard_bytes,
            backend_info=self.config.backend_info,
        )
        self._writer, self._background = writer, common.BackgroundWriter(writer, max_pending=8)

    def open_store(self, path: str) -> None:
        """Write from now on into the store at `path` (the online spool's next chunk): the counters start at 0.
        A store still open is finished first."""
        with self._lock:
            if self._writer is not None:
                self._finish()
            self.received = 0
            if self.writes and self.error is None:
                try:
                    self._open(Path(path))
                except BaseException as err:  # noqa: BLE001 - reported to the driver
                    self._failed(err)

    def to_host(self, layers: list[torch.Tensor]) -> common.HostStates:
        """A request's captured layers (each [T, H], views of the engine's buffers, which it reuses after the step)
        as they cross to the host (`common.to_host`), in the store's dtype where that is fp8."""
        if not self.writes:  # a rank that does not write: only the rows count
            return common.HostStates(torch.empty(layers[0].shape[0], 0))
        return common.to_host(layers, self.spec.dtype)

    def put(
        self,
        sample_id: int,
        token_ids: Sequence[int] | torch.Tensor,
        parts: list[common.HostStates],
        parent: int = -1,
        shared: int = 0,
    ) -> None:
        """Store one request's states from token `shared` on (the first ones are sample `parent`'s): its `parts`
        from `to_host` in token order (one per step its prefill ran in; joined in the writer's thread). A sink that
        does not write only counts the request."""
        with self._lock:
            self.received += 1
            if not self.writes or self.error is not None:
                return
            if self._writer is None:
                self.error = f"request for sample {sample_id} arrived with no store open"
                return
            assert self._background is not None  # set with _writer
            try:
                row = self.dataset[int(sample_id)]
                ids = torch.as_tensor(row["input_ids"]).to(torch.int64)
                got = torch.as_tensor(list(token_ids) if not torch.is_tensor(token_ids) else token_ids).to(torch.int64)
                if got.shape != ids.shape or not torch.equal(got.cpu(), ids):
                    raise RuntimeError(f"request for sample {sample_id} carried other token ids than the prepared set")
                rows, shape = sum(p.data.shape[0] for p in parts), tuple(parts[0].data.shape[1:]) if parts else ()
                if rows != ids.shape[0] - shared or shape[:1] != (len(self.layer_ids),):
                    raise RuntimeError(
                        f"sample {sample_id}: captured states [{rows}, {', '.join(map(str, shape))}], "
                        f"expected [{ids.shape[0] - shared}, {len(self.layer_ids)}, H]"
                    )
                item = (int(sample_id), ids, torch.as_tensor(row["loss_mask"]), list(parts), None, parent, shared)
                self._background.submit([item])
            except BaseException as err:  # noqa: BLE001 - reported to the driver, which raises it there
                self._failed(err)

    def progress(self) -> SinkReport:
        return SinkReport(received=self.received, error=self.error, disk_full=self.disk_full, writes=self.writes)

    def _failed(self, err: BaseException) -> None:
        self.error = f"{type(err).__name__}: {err}"
        self.disk_full = isinstance(err, DiskFullError)

    def finish_store(self) -> SinkReport:
        """Flush everything to the store and release the writer; returns what was written. The sink stays, for
        the next `open_store` (online training) or for `deactivate`."""
        with self._lock:
            return self._finish()

    def _finish(self) -> SinkReport:
        writer = self._writer
        if writer is None:
            return self.progress()
        assert self._background is not None  # set with _writer
        try:
            self._background.close()
            if self.error is None:
                writer.close()
            else:
                writer.abort()
        except BaseException as err:  # noqa: BLE001
            self._failed(err)
            writer.abort()
        self._writer = None
        written = {"samples_written": writer.samples_written, "shards_written": writer.shards_written}
        return self.progress().model_copy(update={**written, "recovered": list(writer.recovered)})


_ACTIVE: StoreSink | None = None


def activate(config: SinkConfig, *, writes: bool = True) -> StoreSink:
    """The worker's sink for `config`: the one already open for it, else a new one (a sink left open for another
    store by an engine that died in this process is closed first, keeping what it had stored)."""
    global _ACTIVE
    if _ACTIVE is not None and (_ACTIVE.config != config or _ACTIVE.writes != writes):
        deactivate()
    if _ACTIVE is None:
        _ACTIVE = StoreSink(config, writes=writes)
    return _ACTIVE


def active() -> StoreSink | None:
    return _ACTIVE


def deactivate() -> SinkReport:
    global _ACTIVE
    sink, _ACTIVE = _ACTIVE, None
    return sink.finish_store() if sink is not None else SinkReport()


def is_writer_rank() -> bool:
    """Tensor-parallel rank 0 writes; the other ranks hold the same states and stay silent."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank() == 0
    except Exception:  # noqa: BLE001 - not initialised: a single process
        return True
