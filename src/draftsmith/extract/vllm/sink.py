"""Inside vLLM's worker process: hand each finished request's hidden states to the draftsmith store.

Every strategy ends here. The connector (connector.py) and the runner taps (taps.py) know only vLLM; this
module knows only the store. One `StoreSink` lives per worker process (module global, see `activate`); on
tensor-parallel ranks other than 0 it swallows the states, so exactly one writer per engine writes.

The sink checks each request's token ids against the prepared set before storing (a request routed to the wrong
sample id would otherwise poison the store silently) and writes through a background thread, so disk writes
overlap the next forward pass. `worker.py` exposes its progress and close to the driver via collective_rpc.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from draftsmith.core.errors import DiskFullError
from draftsmith.extract import common
from draftsmith.extract import store as store_module
from draftsmith.prepare.dataset import open_prepared

SAMPLE_ID_KEY = "draftsmith_sample_id"  # in SamplingParams.extra_args (under "kv_transfer_params": connector)
EXTRA_CONFIG_KEY = "draftsmith"  # the sink config in KVTransferConfig.kv_connector_extra_config


class StoreSink:
    """Writes [T, L, H] states of finished requests into the store as writer `worker` (i/n)."""

    def __init__(self, config: dict[str, Any], *, writes: bool = True):
        self.config = config
        self.writes = writes
        self.received = 0
        self.written_tokens = 0
        self.error: str | None = None
        self.disk_full = False  # the error was a DiskFullError: the driver raises that type again
        self._lock = threading.Lock()
        self.layer_ids = list(config["spec"]["layer_ids"])
        self._writer: store_module.StoreWriter | None = None
        self._background: common.BackgroundWriter | None = None  # set with _writer
        if not writes:
            return
        self.dataset = open_prepared(Path(config["prepared"]))
        self.spec = store_module.StoreSpec.model_validate(config["spec"])
        if config.get("store") is not None:
            self._open(Path(config["store"]))

    def _open(self, path: Path) -> None:
        writer = store_module.create_or_resume(
            path,
            self.spec,
            worker=tuple(self.config["worker"]),
            shard_bytes=int(self.config["shard_bytes"]),
            backend_info=self.config.get("backend_info"),
        )
        self._writer, self._background = writer, common.BackgroundWriter(writer, max_pending=8)

    def open_store(self, path: str) -> None:
        """Write from now on into the store at `path` (the online spool's next chunk): the counters start at 0.
        A store still open is finished first."""
        with self._lock:
            if self._writer is not None:
                self._finish()
            self.received, self.written_tokens = 0, 0
            if self.writes and self.error is None:
                try:
                    self._open(Path(path))
                except BaseException as err:  # noqa: BLE001 - reported to the driver
                    self._failed(err)

    def to_host(self, layers: list[torch.Tensor]) -> common.HostStates:
        """A request's captured layers (each [T, H], views of the engine's buffers, which it reuses after the step)
        as they cross to the host, in the store's dtype where that is fp8 (`common.to_host`: on the CPU the copy
        is the encoding; from a GPU half the bytes cross, asynchronously, into pinned memory)."""
        if not self.writes:  # a rank that does not write: only the rows count
            return common.HostStates(torch.empty(layers[0].shape[0], 0))
        return common.to_host(layers, self.spec.dtype)

    def put(self, sample_id: int, token_ids: Any, parts: list[common.HostStates]) -> None:
        """Store one request's states: its `parts` from `to_host` in token order (one per step its prefill ran
        in; joined in the writer's thread). A sink that does not write only counts the request."""
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
                if rows != ids.shape[0] or shape[:1] != (len(self.layer_ids),):
                    raise RuntimeError(
                        f"sample {sample_id}: captured states [{rows}, {', '.join(map(str, shape))}], "
                        f"expected [{ids.shape[0]}, {len(self.layer_ids)}, H]"
                    )
                self._background.submit([(int(sample_id), ids, torch.as_tensor(row["loss_mask"]), list(parts))])
                self.written_tokens += int(ids.shape[0])
            except BaseException as err:  # noqa: BLE001 - reported to the driver, which raises it there
                self._failed(err)

    def progress(self) -> dict[str, Any]:
        return {"received": self.received, "error": self.error, "disk_full": self.disk_full, "writes": self.writes}

    def _failed(self, err: BaseException) -> None:
        self.error = f"{type(err).__name__}: {err}"
        self.disk_full = isinstance(err, DiskFullError)

    def finish_store(self) -> dict[str, Any]:
        """Flush everything to the store and release the writer; returns what was written. The sink stays, for
        the next `open_store` (online training) or for `deactivate`."""
        with self._lock:
            return self._finish()

    def _finish(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "received": self.received,
            "error": self.error,
            "disk_full": self.disk_full,
            "samples_written": 0,
        }
        if self._writer is None:
            return out
        assert self._background is not None  # set with _writer
        try:
            self._background.close()
            if self.error is None:
                self._writer.close()
            else:
                self._writer.abort()
        except BaseException as err:  # noqa: BLE001
            self._failed(err)
            out["error"], out["disk_full"] = self.error, self.disk_full
            self._writer.abort()
        out["samples_written"] = self._writer.samples_written
        out["shards_written"] = self._writer.shards_written
        out["recovered"] = list(self._writer.recovered)
        self._writer = None
        return out


_ACTIVE: StoreSink | None = None


def activate(config: dict[str, Any], *, writes: bool = True) -> StoreSink:
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


def deactivate() -> dict[str, Any]:
    global _ACTIVE
    sink, _ACTIVE = _ACTIVE, None
    return sink.finish_store() if sink is not None else {"received": 0, "error": None, "samples_written": 0}


def for_data_parallel_rank(config: dict[str, Any], dp_rank: int) -> dict[str, Any]:
    """Engine `dp_rank` of `dp_size` within worker i/n writes as worker i*dp_size + dp_rank of n*dp_size."""
    config = dict(config)
    dp_size = int(config.get("dp_size", 1))
    i, n = config["worker"]
    config["worker"] = [i * dp_size + int(dp_rank or 0), n * dp_size]
    return config


def is_writer_rank() -> bool:
    """Tensor-parallel rank 0 writes; the other ranks hold the same states and stay silent."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank() == 0
    except Exception:  # noqa: BLE001 - not initialised: a single process
        return True
