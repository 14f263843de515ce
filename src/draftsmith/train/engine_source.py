"""Online training from live vLLM engines (`draftsmith train --data PREPARED --engine vllm`): the feature source
that fills each batch's hidden states from the spool the engine process fills, in named phases.

    plan     `plan_chunks`: the run's optimizer steps from the resume point on, exactly as the samplers give them to
             every rank, packed per epoch into chunks of at most bound / SPOOL_CHUNKS bytes (and the held-out
             split's chunk); pure
    cores    on a CPU, `engine_process.TrainerCores`: the engine gets its cores, the trainer keeps the others until
             the run closes
    spool    the transport on every rank (`_open_transport`): a directory or a Mooncake store
             (`draftsmith.extract.spool`), both behind the same trainer role, opened once, errors gathered once
    engine   `engine_supervisor.EngineSupervisor` on rank 0: the job, each plan generation, the engine process
             (`engine_process.EngineProcess`, with --remote-engines started by an operator on another node: `draftsmith
             feed`), a Mooncake master it started, and the stall watch, polled while the trainer waits
    read     `EngineSource`: a batch's states come from its chunk, fetched from the spool into a directory the rank
             reads (waiting until it is ready), or from the --keep-epoch0 store; a chunk is removed once every rank
             has moved past it; the held-out split's chunk is copied out by every rank once and removed at once

Neither side waits forever: the trainer ends the run in one line naming the engine process and its log when it
reports no progress for --stall-timeout-s, and a lost chunk (a restarted Mooncake master) is asked for again in a new
plan generation, never trained on twice or skipped.

The batches are the offline ones: the same samplers over the same prepared set, so the same samples in the same
order.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from draftsmith.config import TrainConfig
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.manifest import read_manifest_json
from draftsmith.core.sizing import SPOOL_CHUNKS, GiB
from draftsmith.core.spool_address import LocalMooncake, parse_spool
from draftsmith.extract import spool as spool_mod
from draftsmith.extract import store as store_mod
from draftsmith.extract.spool import EVAL_CHUNK, Chunk, FeedStatus, TrainerSide, TrainerStatus, TransportLost
from draftsmith.extract.spool.mooncake import MooncakeMaster
from draftsmith.extract.store.reader import HiddenStateStore
from draftsmith.train import distributed
from draftsmith.train.batches import Batch, FeatureSource, TokenBudgetSampler, pad_rows
from draftsmith.train.engine_process import TrainerCores, engine_cpus, engine_devices, open_trainer_side
from draftsmith.train.engine_supervisor import EngineSupervisor, chunk_matches


def _steps_of_epoch(samplers: Sequence[TokenBudgetSampler], epoch: int, grad_accum: int) -> list[list[int]]:
    """Every rank's samples of each optimizer step of `epoch`, in the order the ranks read them."""
    per_rank = [s.batches(epoch) for s in samplers]
    n = len(per_rank[0]) // grad_accum
    return [
        [i for batches in per_rank for b in batches[p * grad_accum : (p + 1) * grad_accum] for i in b] for p in range(n)
    ]


def _round_up(x: float) -> float:
    """`x` rounded up to three significant digits (a bound suggested must be enough)."""
    scale = 10.0 ** (2 - math.floor(math.log10(x)))
    return math.ceil(x * scale) / scale


def plan_chunks(  # noqa: PLR0913 - one feed's settings, as TrainConfig names them
    cfg: TrainConfig,
    samplers: Sequence[TokenBudgetSampler],
    evaluation: Sequence[int],
    lengths: np.ndarray,
    layers: int,
    hidden: int,
    bound: int,
    start: tuple[int, int, int],
    total_steps: int,
    epochs: int | None,
    kept: set[int],
) -> list[Chunk]:
    """The chunks the run still needs, in the order it needs them. `start`: (step, epoch, position) of the resume;
    `kept`: samples already in the --keep-epoch0 store."""

    def size(ids: Sequence[int]) -> int:
        return spool_mod.chunk_bytes(int(sum(int(lengths[i]) for i in ids)), len(ids), hidden, layers, cfg.spool_dtype)

    def chunk(name: str, epoch: int, first: int, last: int, ids: list[int], have: set[int]) -> Chunk:
        engine = [i for i in ids if i not in have]
        return Chunk(name, epoch, first, last, ids, engine, int(sum(int(lengths[i]) for i in engine)), size(engine))

    keep = cfg.keep_epoch0 is not None
    eval_chunk = chunk(EVAL_CHUNK, -1, 0, 0, list(evaluation), kept if keep else set()) if len(evaluation) else None
    # the held-out chunk's whole size, kept or not, so the chunk boundaries do not move once it is kept
    held_out = size(list(evaluation)) if len(evaluation) else 0
    limit = (bound - held_out) // SPOOL_CHUNKS
    step, epoch, position = start
    chunks: list[Chunk] = []
    epoch0 = set(kept)
    while step < total_steps and (epochs is None or epoch < epochs):
        steps = _steps_of_epoch(samplers, epoch, cfg.grad_accum)
        if not steps:
            break
        sizes = [size(ids) for ids in steps]
        if max(sizes) > limit:
            need = _round_up((max(sizes) * SPOOL_CHUNKS + held_out) / GiB)
            raise DraftsmithError(
                f"--spool-gb {cfg.spool_gb:g}: one optimizer step takes up to {max(sizes) / GiB:.3g} "
                f"GiB of hidden states and the spool holds {SPOOL_CHUNKS} chunks of at least one "
                f"step{' besides the held-out split' if eval_chunk else ''}; raise --spool-gb to "
                f"{need:g} or more, or lower --token-budget / --grad-accum"
            )
        for first, last in spool_mod.pack_steps(list(zip(steps, sizes, strict=False)), limit):
            if last < position:  # read before the resume point
                continue
            begin = max(position, first)  # a resume inside a chunk asks for the whole chunk, under its own name
            last = min(last, begin + total_steps - step - 1)
            ids = [i for p in range(first, last + 1) for i in steps[p]]
            have = (kept if epoch == 0 else epoch0) if keep else set()  # what --keep-epoch0 holds by then
            chunks.append(chunk(spool_mod.chunk_name(epoch, first, last), epoch, first, last, ids, have))
            step += last + 1 - begin
            if epoch == 0:
                epoch0.update(ids)
            if step >= total_steps:
                break
        epoch, position = epoch + 1, 0
    if eval_chunk is not None:
        chunks.insert(min(1, len(chunks)), eval_chunk)
    return chunks


def _open_transport(
    cfg: TrainConfig, info: distributed.DistInfo, bound: int
) -> tuple[TrainerSide, MooncakeMaster | None]:
    """The spool on every rank (and the Mooncake master rank 0 starts for `--spool mooncake`: the other ranks then
    connect to it), or one error for all ranks, with what this rank opened closed again."""
    spool: TrainerSide | None = None
    master: MooncakeMaster | None = None
    error = None
    own_master = isinstance(parse_spool(cfg.spool or "."), LocalMooncake)  # rank 0 starts it on loopback: one node
    try:
        if own_master and info.world_size > distributed.local_world_size():
            error = (
                "--spool mooncake under torchrun on several nodes: the ranks need a master they all reach; "
                "start mooncake_master and give --spool mooncake://HOST:PORT"
            )
        elif info.is_main or not own_master:
            spool, master = open_trainer_side(cfg, bound, Path(cfg.output) / "mooncake_master.log")
    except DraftsmithError as err:
        error = str(err)
    error = next((e for e in distributed.gather_objects(error, info) if e), None)  # any rank's
    if own_master and error is None and info.world_size > 1:  # the other ranks connect to rank 0's master
        where = distributed.gather_objects(spool.describe() if spool is not None else None, info)[0]
        try:
            if not info.is_main:
                spool, _ = open_trainer_side(cfg.model_copy(update={"spool": where}), bound, Path())
        except DraftsmithError as err:
            error = str(err)
        error = next((e for e in distributed.gather_objects(error, info) if e), None)
    if error is not None:
        if spool is not None:
            spool.close()
        if master is not None:
            master.stop()
        raise DraftsmithError(error)
    assert spool is not None  # opened on every rank, or an error above
    return spool, master


def _kept_ids(keep: Path | None) -> set[int]:
    """The samples an earlier run kept in the --keep-epoch0 store."""
    if keep is None or not (keep / "manifest.json").is_file():
        return set()
    if read_manifest_json(keep).get("kind") != "store":
        raise DraftsmithError(
            f"--keep-epoch0 {keep}: is not a hidden-state store; give a new directory or the store an earlier run kept"
        )
    return {int(i) for i in store_mod.open(keep, dtype=None).sample_ids}


class EngineSource(FeatureSource):
    """Fills each batch's hidden states from the spool the engine process fills (see the module). `open` makes one
    (the plan, the cores, the transport, rank 0's supervisor started); constructing one does no I/O."""

    def __init__(  # noqa: PLR0913 - one feed's settings, as TrainConfig names them
        self,
        cfg: TrainConfig,
        info: distributed.DistInfo,
        chunks: Sequence[Chunk],
        evaluation: Sequence[int],
        layer_ids: Sequence[int],
        spool: TrainerSide,
        supervisor: EngineSupervisor | None,
        cores: TrainerCores | None,
        consumed: set[str],
    ):
        self.cfg, self.info, self.chunks, self.layer_ids = cfg, info, list(chunks), list(layer_ids)
        self.spool, self.supervisor, self.cores = spool, supervisor, cores
        self.bound = int(cfg.spool_gb * GiB)
        self.keep = cfg.keep_epoch0
        self.eval_ids = set(int(i) for i in evaluation)
        self.by_step = {
            (c.epoch, p): c for c in self.chunks if c.name != EVAL_CHUNK for p in range(c.first, c.last + 1)
        }
        self.from_engine = {c.name: set(c.engine_ids) for c in self.chunks}
        self.eval_chunk = next((c for c in self.chunks if c.name == EVAL_CHUNK), None)
        self.cache = Path(cfg.output) / "spool-cache" / f"rank{info.rank}"  # chunks this rank reads, fetched
        self.open_chunks: dict[str, HiddenStateStore] = {}
        self.consumed = consumed  # the chunks read (rank 0's supervisor plans the others)
        self.current: Chunk | None = None
        self.keep_reader: store_mod.HiddenStateStore | None = None
        self.step = 0
        self.waited = self._waited_at_log = 0.0
        self._log_time = time.perf_counter()
        self._beat = 0.0
        self._answered = time.monotonic()  # when the transport last answered
        self.last_status: FeedStatus | None = None  # the engine's status as the run closed

    @classmethod
    def open(  # noqa: PLR0913 - one feed's settings, as TrainConfig names them
        cls,
        cfg: TrainConfig,
        info: distributed.DistInfo,
        samplers: Sequence[TokenBudgetSampler],
        evaluation: Sequence[int],
        lengths: np.ndarray,
        aux_layer_ids: list[int],
        num_layers: int,
        hidden: int,
        start: tuple[int, int, int],
        total_steps: int,
        epochs: int | None,
    ) -> EngineSource:
        """The phases, in order: the plan (pure), the trainer's cores (on a CPU, the engine takes the others), the
        transport on every rank, the held-out chunk's copies, rank 0's supervisor started; any rank's error ends all
        of them in one line with everything opened closed again."""
        bound = int(cfg.spool_gb * GiB)
        layer_ids = list(aux_layer_ids) + [num_layers]
        kept = _kept_ids(cfg.keep_epoch0)
        chunks = plan_chunks(
            cfg, samplers, evaluation, lengths, len(layer_ids), hidden, bound, start, total_steps, epochs, kept
        )
        engine = engine_cpus(cfg) if info.device.type != "cuda" and not cfg.remote_engines else None
        cores = TrainerCores(engine) if engine else None
        if cores is not None:  # the trainer keeps the other cores (until close)
            cores.take()
        try:
            spool, master = _open_transport(cfg, info, bound)
        except DraftsmithError:
            if cores is not None:
                cores.restore()
            raise
        consumed: set[str] = set()
        supervisor = None
        if info.is_main:
            supervisor = EngineSupervisor(
                cfg, spool, chunks, consumed, layer_ids, bound, engine, engine_devices(cfg, info), master
            )
        source = cls(cfg, info, chunks, evaluation, layer_ids, spool, supervisor, cores, consumed)
        error = None
        try:
            source._held_locally()
            if supervisor is not None:
                supervisor.start(source._report())
        except DraftsmithError as err:
            error = str(err)
        error = distributed.broadcast_error(error, info)  # the others read only once the spool is cleaned
        if error:
            source.close(False)
            raise DraftsmithError(error)
        return source

    def _held_locally(self) -> None:
        """The held-out chunk every rank copied out on an earlier run is read from those copies (when all have it)."""
        chunk = self.eval_chunk
        ok = 0
        if chunk is not None and chunk.from_engine and (self.cache / EVAL_CHUNK / "manifest.json").is_file():
            with contextlib.suppress(DraftsmithError):
                info = spool_mod.store_info(self.cache / EVAL_CHUNK)
                ok = int(chunk_matches(chunk, info, self.cfg.spool_dtype, self.layer_ids))
        if chunk is not None and chunk.from_engine:
            total = int(distributed.all_reduce_sum(torch.tensor([ok]), self.info).item())
            if total == self.info.world_size:
                self.consumed.add(EVAL_CHUNK)
                self.open_chunks[EVAL_CHUNK] = store_mod.open(self.cache / EVAL_CHUNK, dtype=None)

    def _report(self, finished: bool = False) -> TrainerStatus:
        """What the trainer tells the engine process: its step, the chunks read, its stall limit, whether it ended."""
        return TrainerStatus(
            step=self.step, chunks_read=len(self.consumed), finished=finished, stall_s=self.cfg.stall_timeout_s
        )

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._beat >= 1.0:
            self._beat = now
            self.spool.write_trainer(self._report())

    # -- reading
    def _wait(self, chunk: Chunk) -> HiddenStateStore | None:  # noqa: C901 - one branch per way a feed's engine can stop
        """The chunk's store, once it is fetched (rank 0's supervisor watches the other side meanwhile)."""
        if chunk.name in self.open_chunks:
            return self.open_chunks[chunk.name]
        if not chunk.from_engine:
            return None
        start = time.perf_counter()
        keep = chunk.name == EVAL_CHUNK
        while True:
            self._heartbeat()
            try:
                if self.spool.is_ready(chunk.name):
                    local = self.spool.fetch(chunk.name, self.cache / chunk.name, keep=keep)
                    if local is not None:
                        break
                    if self.supervisor is not None:  # its index outlived its parts: removed, and asked for again
                        self.spool.remove(chunk.name)
                        self.supervisor.write_plan()
                if self.supervisor is not None:
                    self.supervisor.poll(chunk)
                self._answered = time.monotonic()
            except TransportLost as err:  # the master is back in a moment, or the stall limit ends the wait
                if time.monotonic() - self._answered > self.cfg.stall_timeout_s:
                    raise DraftsmithError(
                        f"--spool {self.spool.describe()}: the transport has not answered for "
                        f"{self.cfg.stall_timeout_s:g} s ({err}); is its master running?"
                    ) from None
                time.sleep(0.5)
            time.sleep(0.02)
        self.waited += time.perf_counter() - start
        if self.supervisor is not None:
            self.supervisor.chunk_arrived()
        reader = store_mod.open(local, dtype=None)
        self.open_chunks[chunk.name] = reader
        if chunk.name == EVAL_CHUNK or chunk.epoch == 0:
            self._absorb(chunk, local)
        if keep:  # every rank has its own copy: the spool's goes as soon as the last rank has one
            self.consumed.add(chunk.name)
            self.spool.consume(chunk.name, self.info.rank, self.info.world_size)
        return reader

    def _absorb(self, chunk: Chunk, local: Path) -> None:
        if self.keep is not None and self.info.is_main and chunk.from_engine:
            store_mod.absorb_store(self.keep, local, tag=chunk.name)

    def _kept(self, sample_id: int) -> dict:
        for attempt in range(2):
            if self.keep_reader is None or attempt:
                if self.keep is None or not (self.keep / "manifest.json").is_file():
                    break
                self.keep_reader = store_mod.open(self.keep, dtype=None)
            with contextlib.suppress(KeyError, IndexError, DraftsmithError):
                return self.keep_reader[self.keep_reader.index_of(sample_id)]
        raise DraftsmithError(
            f"sample {sample_id}: in neither its spool chunk nor --keep-epoch0 {self.keep}; "
            "delete the spool directory and run the same command again"
        )

    def __call__(self, batch: Batch) -> Batch:
        if batch.sample_ids[0] in self.eval_ids:
            chunk = self.eval_chunk
            assert chunk is not None  # planned with the eval ids
        else:
            chunk = self.by_step.get((batch.epoch, batch.position))
            if chunk is None:
                raise DraftsmithError(f"epoch {batch.epoch}, step {batch.position}: not in the spool's plan")
            if self.current is not None and self.current.name != chunk.name:
                self._finish(self.current)
            self.current = chunk
            self.step = batch.position
        reader = self._wait(chunk)
        self._heartbeat()
        items = []
        for sid in batch.sample_ids:
            if reader is not None and sid in self.from_engine[chunk.name]:
                items.append(reader[reader.index_of(sid)])
            else:
                items.append(self._kept(sid))
        t = batch.input_ids.shape[1]
        hs, sc = (pad_rows(items, key, t) for key in ("hidden_states", "hidden_scales"))
        assert hs is not None  # every stored sample has its states
        device = batch.input_ids.device
        return replace(batch, hidden_states=hs.to(device), hidden_scales=None if sc is None else sc.to(device))

    def _finish(self, chunk: Chunk) -> None:
        """Every micro-batch of `chunk` was read: delete it (once every rank has), and this rank's copy."""
        self.open_chunks.pop(chunk.name, None)
        self.consumed.add(chunk.name)
        if chunk.from_engine:
            self.spool.consume(chunk.name, self.info.rank, self.info.world_size)
            shutil.rmtree(self.cache / chunk.name, ignore_errors=True)

    # -- reporting
    def metrics(self) -> dict:
        status = self.spool.read_status()
        now = time.perf_counter()
        interval, waited = max(now - self._log_time, 1e-9), self.waited - self._waited_at_log
        self._log_time, self._waited_at_log = now, self.waited
        engine_waits = {"space": "engines (spool full)", "start": "trainer (engine starting)"}  # by status.waiting
        waits = "trainer" if waited > 0.1 * interval else engine_waits.get(status.waiting, "none")
        return {
            "extract_tokens_per_s": round(status.tokens_per_s, 1),
            "spool_bytes": self.spool.usage(),
            "spool_bound": self.bound,
            "trainer_wait_s": round(self.waited, 2),
            "waiting": waits,
        }

    def describe(self, metrics: dict) -> str:
        return (
            f"  extract {metrics['extract_tokens_per_s']:,.0f} tok/s  spool {metrics['spool_bytes'] / GiB:.2f}/"
            f"{self.bound / GiB:.2f} GiB  waits: {metrics['waiting']}"
        )

    def summary(self) -> dict:
        # the engine process's last report: the one read at close, once the spool is closed
        status = self.last_status if self.last_status is not None else self.spool.read_status()
        return {
            "mode": f"online (vLLM engines, {self.spool.transport})",
            "spool": self.spool.describe(),
            "spool bound (bytes)": self.bound,
            "spool peak (bytes)": max(self.spool.peak, status.peak),
            "extraction tokens/s": round(status.tokens_per_s, 1),
            "trainer waited (s)": round(self.waited, 1),
            **(self.supervisor.summary() if self.supervisor is not None else {"engine restarts": 0}),
            **({"kept epoch 0 in": str(self.keep)} if self.keep else {}),
        }

    def close(self, completed: bool) -> None:
        """The run ended (`completed`: normally): the last chunk is consumed, the engines told and stopped, on a
        completed run the spool's chunks and this rank's copies removed, the transport closed (and the master rank 0
        started stopped), and the trainer's cores given back."""
        if self.last_status is None:
            with contextlib.suppress(Exception):
                self.last_status = self.spool.read_status()
        if completed and self.current is not None:
            self._finish(self.current)
            self.current = None
        if self.supervisor is not None:
            self.supervisor.stop_engine(
                self._report(finished=completed), self.last_status.segment if completed and self.last_status else ""
            )
        if completed:
            shutil.rmtree(self.cache, ignore_errors=True)
            for empty in (self.cache.parent, Path(self.cfg.output) / "engine-scratch"):
                with contextlib.suppress(OSError):
                    empty.rmdir()
        self.spool.close()
        if self.supervisor is not None:
            self.supervisor.close()
        if self.cores is not None:
            self.cores.restore()
