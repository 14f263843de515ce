"""Online training from live vLLM engines (`draftsmith train --data PREPARED --engine vllm`): the plan of spool
chunks, the engine process and the feature source that fills each batch's hidden states from the spool.

    plan     `plan_chunks`: the run's optimizer steps from the resume point on, exactly as the samplers give them to
             every rank, packed per epoch into chunks of at most bound / SPOOL_CHUNKS bytes (and the held-out
             split's chunk); pure
    engine   `engine_process.EngineProcess`, started by rank 0 on its own GPUs or cores and restarted when it dies
             (with --remote-engines an operator starts it on another node, `draftsmith feed`); rank 0 watches it,
             the transport (restarting a Mooncake master it started) and the progress both sides report
    read     `EngineSource`: a batch's states come from its chunk, fetched from the spool into a directory the rank
             reads (waiting until it is ready), or from the --keep-epoch0 store; a chunk is removed once every rank
             has moved past it; the held-out split's chunk is copied out by every rank once and removed at once

The spool is a directory or a Mooncake store (`draftsmith.extract.spool`), both behind the same two roles. Neither
side waits forever: the trainer ends the run in one line naming the engine process and its log when it reports no
progress for --stall-timeout-s, and a lost chunk (a restarted Mooncake master) is asked for again in a new plan
generation, never trained on twice or skipped.

The batches are the offline ones: the same samplers over the same prepared set, so the same samples in the same
order.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import torch

from draftsmith.config import ExtractConfig, TrainConfig
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.manifest import read_manifest_json
from draftsmith.core.sizing import GiB, SPOOL_CHUNKS
from draftsmith.core.spool_address import LocalMooncake, parse_spool
from draftsmith.extract import spool as spool_mod
from draftsmith.extract import store as store_mod
from draftsmith.extract.spool import (
    EVAL_CHUNK,
    Chunk,
    ChunkInfo,
    FeedJob,
    FeedStatus,
    Plan,
    TrainerSide,
    TrainerStatus,
    TransportLost,
)
from draftsmith.extract.spool.mooncake import MooncakeMaster
from draftsmith.extract.store.reader import HiddenStateStore
from draftsmith.prepare.dataset import prepared_digest
from draftsmith.train import distributed
from draftsmith.train.batches import Batch, TokenBudgetSampler, pad_rows
from draftsmith.train.engine_process import (
    ENGINE_RESTARTS,
    EngineProcess,
    engine_cpus,
    engine_devices,
    open_trainer_side,
)


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


def plan_chunks(
    cfg: TrainConfig,
    samplers: Sequence[TokenBudgetSampler],
    evaluation: Sequence[int],
    lengths: Any,
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
        for first, last in spool_mod.pack_steps(list(zip(steps, sizes)), limit):
            if last < position:  # read before the resume point
                continue
            begin = max(position, first)  # a resume inside a chunk asks for the whole chunk, under its own name
            last = min(last, begin + total_steps - step - 1)
            ids = [i for p in range(first, last + 1) for i in steps[p]]
            chunks.append(
                chunk(
                    spool_mod.chunk_name(epoch, first, last),
                    epoch,
                    first,
                    last,
                    ids,
                    (kept if epoch == 0 else epoch0) if keep else set(),
                )
            )
            step += last + 1 - begin
            if epoch == 0:
                epoch0.update(ids)
            if step >= total_steps:
                break
        epoch, position = epoch + 1, 0
    if eval_chunk is not None:
        chunks.insert(min(1, len(chunks)), eval_chunk)
    return chunks


class EngineSource:
    """Fills each batch's hidden states from the spool the engine process fills (see the module)."""

    def __init__(
        self,
        cfg: TrainConfig,
        info: distributed.DistInfo,
        dataset: Any,
        samplers: Sequence[TokenBudgetSampler],
        evaluation: Sequence[int],
        lengths: Any,
        aux_layer_ids: list[int],
        num_layers: int,
        hidden: int,
        start: tuple[int, int, int],
        total_steps: int,
        epochs: int | None,
    ):
        self.cfg, self.info, self.dataset = cfg, info, dataset
        self.bound = int(cfg.spool_gb * GiB)
        self.keep = Path(cfg.keep_epoch0) if cfg.keep_epoch0 is not None else None
        self.layer_ids = list(aux_layer_ids) + [num_layers]
        self.chunks = plan_chunks(
            cfg,
            samplers,
            evaluation,
            lengths,
            len(self.layer_ids),
            hidden,
            self.bound,
            start,
            total_steps,
            epochs,
            self._kept_ids(),
        )
        self.eval_ids = set(int(i) for i in evaluation)
        self.by_step = {
            (c.epoch, p): c for c in self.chunks if c.name != EVAL_CHUNK for p in range(c.first, c.last + 1)
        }
        self.from_engine = {c.name: set(c.engine_ids) for c in self.chunks}
        self.eval_chunk = next((c for c in self.chunks if c.name == EVAL_CHUNK), None)
        self.cache = Path(cfg.output) / "spool-cache" / f"rank{info.rank}"  # chunks this rank reads, fetched
        self.open_chunks: dict[str, HiddenStateStore] = {}
        self.consumed: set[str] = set()
        self.current: Chunk | None = None
        self.keep_reader: store_mod.HiddenStateStore | None = None
        self.generation = 0
        self.step = 0
        self.waited = self._waited_at_log = 0.0
        self._log_time = time.perf_counter()
        self._beat = 0.0
        # the engine status's `updated`, and when this process saw it change
        self._seen: tuple[float | None, float] = (None, time.monotonic())
        self._answered = time.monotonic()  # when the transport last answered
        self._lock: contextlib.ExitStack | None = None
        self.engine: EngineProcess | None = None
        self.last_status: FeedStatus | None = None  # the engine's status as the run closed
        self._engine_seen = FeedStatus()  # its last report with a pid
        self.master: MooncakeMaster | None = None
        self.cpus = engine_cpus(cfg) if info.device.type != "cuda" and not cfg.remote_engines else None
        self._trainer_cpus = sorted(os.sched_getaffinity(0))
        if self.cpus:  # the trainer keeps the other cores (until close)
            rest = sorted(set(self._trainer_cpus) - set(self.cpus))
            os.sched_setaffinity(0, rest)
            torch.set_num_threads(len(rest))
        error = None
        self.spool: TrainerSide  # once opened (close() reads it with getattr: an open that failed leaves none)
        own_master = isinstance(parse_spool(cfg.spool or "."), LocalMooncake)  # rank 0 starts it on loopback: one node
        try:
            if own_master and info.world_size > distributed.local_world_size():
                error = (
                    "--spool mooncake under torchrun on several nodes: the ranks need a master they all reach; "
                    "start mooncake_master and give --spool mooncake://HOST:PORT"
                )
            elif info.is_main or not own_master:
                self.spool, self.master = open_trainer_side(cfg, self.bound, Path(cfg.output) / "mooncake_master.log")
        except DraftsmithError as err:
            error = str(err)
        error = next((e for e in distributed.gather_objects(error, info) if e), None)  # any rank's
        if own_master and error is None and info.world_size > 1:  # the other ranks connect to rank 0's master
            where = distributed.gather_objects(self.spool.describe() if info.is_main else None, info)[0]
            try:
                if not info.is_main:
                    self.spool, _ = open_trainer_side(cfg.model_copy(update={"spool": where}), self.bound, Path())
            except DraftsmithError as err:
                error = str(err)
            error = next((e for e in distributed.gather_objects(error, info) if e), None)
        if error is None:
            try:
                self._held_locally()
                if info.is_main:
                    self._start()
            except DraftsmithError as err:
                error = str(err)
        error = distributed.broadcast_error(error, info)  # the others read only once the spool is cleaned
        if error:
            self.close(False)
            raise DraftsmithError(error)

    # -- starting
    def _kept_ids(self) -> set[int]:
        if self.keep is None or not (self.keep / "manifest.json").is_file():
            return set()
        if read_manifest_json(self.keep).get("kind") != "store":
            raise DraftsmithError(
                f"--keep-epoch0 {self.keep}: is not a hidden-state store; give a new directory or "
                "the store an earlier run kept"
            )
        return {int(i) for i in store_mod.open(self.keep, dtype=None).sample_ids}

    def _matches(self, chunk: Chunk, info: ChunkInfo | None) -> bool:
        return (
            info is not None
            and sorted(info.sample_ids) == sorted(chunk.engine_ids)
            and info.dtype == self.cfg.spool_dtype
            and list(info.layer_ids) == self.layer_ids
        )

    def _held_locally(self) -> None:
        """The held-out chunk every rank copied out on an earlier run is read from those copies (when all have it)."""
        chunk = self.eval_chunk
        ok = 0
        if chunk is not None and chunk.from_engine and (self.cache / EVAL_CHUNK / "manifest.json").is_file():
            with contextlib.suppress(DraftsmithError):
                ok = int(self._matches(chunk, spool_mod.store_info(self.cache / EVAL_CHUNK)))
        if chunk is not None and chunk.from_engine:
            total = int(distributed.all_reduce_sum(torch.tensor([ok]), self.info).item())
            if total == self.info.world_size:
                self.consumed.add(EVAL_CHUNK)
                self.open_chunks[EVAL_CHUNK] = store_mod.open(self.cache / EVAL_CHUNK, dtype=None)

    def _start(self) -> None:
        if importlib.util.find_spec("vllm") is None and not self.cfg.remote_engines:
            raise DraftsmithError(
                "--engine vllm: vLLM is not installed in this environment; install it (README: "
                '"Install into your vLLM environment"), or train with --engine hf or from a store'
            )
        self._lock = contextlib.ExitStack()
        self.spool.prepare()
        self._lock.enter_context(self.spool.trainer_lock())
        local_engine = None if self.cfg.remote_engines else Path(self.cfg.output) / "engine-scratch"
        self.spool.check_capacity(self.bound, max((c.estimate for c in self.chunks), default=0), local_engine)
        with self.spool.engine_lock(wait_s=30.0):  # an engine of a killed trainer is gone
            # Ready chunks are kept only within the plan's first bound's worth: the engine writes in plan order, so
            # chunks a crash left further ahead would leave no room for the ones the trainer needs first.
            wanted, room = {}, self.bound
            for c in (c for c in self.chunks if c.from_engine and c.name not in self.consumed):
                room -= c.estimate
                if room < 0:
                    break
                wanted[c.name] = c
            for name in list(wanted):
                if self.spool.is_ready(name) and not self._matches(wanted[name], self.spool.chunk_info(name)):
                    self.spool.remove(name)
            self.spool.clean(set(wanted), [c.name for c in self.chunks])
            previous = None
            with contextlib.suppress(DraftsmithError, KeyError, TypeError, ValueError):  # unreadable: start again
                previous = self.spool.read_plan()
            self.generation = previous.generation if previous is not None else 0
            self._write_job()
            self.spool.write_status(FeedStatus(waiting="start"))
        self._beat = 0.0
        self._heartbeat()
        if self.cfg.remote_engines:
            self._write_plan()
        elif any(
            c.from_engine and not self.spool.is_ready(c.name) and c.name not in self.consumed for c in self.chunks
        ):
            self.engine = EngineProcess(
                self.cfg,
                self.spool.describe(),
                Path(self.cfg.output) / "feed.log",
                Path(self.cfg.output) / "engine-scratch",
                self.cpus,
                engine_devices(self.cfg, self.info),
            )
            self._spawn()

    def _write_job(self) -> None:
        self.spool.write_job(
            FeedJob(
                extract=self._extract_config(),
                bound=self.bound,
                cpus=self.cpus,
                prepared_digest=prepared_digest(self.cfg.data),
                stall_s=self.cfg.stall_timeout_s,
            )
        )

    def _write_plan(self) -> None:
        """A new plan generation: the chunks neither read nor ready. A ready chunk stays out of it: an engine process
        reads the plan seconds on (once vLLM has imported), and by then the trainer may have read and deleted it;
        redone, it would fill the spool with chunks no one reads while the trainer waits for the next."""
        self.generation += 1
        self.spool.write_plan(
            Plan(
                [
                    c
                    for c in self.chunks
                    if c.from_engine and c.name not in self.consumed and not self.spool.is_ready(c.name)
                ],
                self.generation,
            )
        )

    def _extract_config(self) -> ExtractConfig:
        cfg = self.cfg
        return ExtractConfig(
            prepared=Path(cfg.data).resolve(),
            output=Path(cfg.output) / "engine-scratch",
            backend="vllm",
            target=cfg.target,
            aux_layer_ids=self.layer_ids[:-1],
            dtype=cfg.spool_dtype,
            tensor_parallel_size=cfg.engine_tensor_parallel_size,
            data_parallel_size=cfg.engine_data_parallel_size,
            vllm_strategy=cfg.vllm_strategy,
            vllm_compile=cfg.vllm_compile,
            compute_dtype=cfg.engine_dtype,
            trust_remote_code=cfg.trust_remote_code,
        )

    def _spawn(self) -> None:
        self._write_plan()
        self.spool.write_status(FeedStatus(waiting="start", generation=self.generation))
        self._seen = (None, time.monotonic())
        assert self.engine is not None  # spawned on this node
        self.engine.start()

    # -- watching the other side
    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._beat >= 1.0:
            self._beat = now
            self.spool.write_trainer(
                TrainerStatus(step=self.step, chunks_read=len(self.consumed), stall_s=self.cfg.stall_timeout_s)
            )

    def _where_logged(self) -> str:
        if self.engine is not None:
            return str(self.engine.log)
        status = self._engine_seen
        return f"{status.log or 'its log'} on {status.host or 'the engine node'}"

    def _watch(self, chunk: Chunk) -> None:
        """While waiting for `chunk` (rank 0): the master, the job, the engine process and its progress."""
        if self.master is not None and not self.master.alive():
            print(
                f"draftsmith train: mooncake_master stopped (see {self.master.log}); restarting it",
                file=sys.stderr,
                flush=True,
            )
            self.master.restart()
        if not self.spool.has_job():  # the store lost it (a restarted master): and with it, its chunks
            self._write_job()
            self._write_plan()
            return
        status = self.spool.read_status()
        if self.engine is not None and self.engine.exited():
            self._engine_exited(chunk, status)
            return
        if status.updated != self._seen[0]:  # progress, timed by this node's clock (the engine's may differ)
            self._seen = (status.updated, time.monotonic())
        if status.pid:
            self._engine_seen = status  # what a stalled engine process last said (its keys may go with it)
        by_engine = status.pid != 0  # written by an engine process since this trainer (re)started it
        if status.waiting == "plan" and status.generation == self.generation and by_engine:
            if not self.spool.is_ready(chunk.name):  # it finished the plan and the chunk is not there: lost
                self._write_plan()
                return
        if status.error and by_engine and self.engine is None:
            raise DraftsmithError(
                f"--engine vllm: the engine process on {status.host or 'the engine node'} stopped "
                f"before chunk {chunk.name} ({status.error}); see {self._where_logged()}"
            )
        if time.monotonic() - self._seen[1] > self.cfg.stall_timeout_s:
            last = self._engine_seen
            who = f"the engine process (pid {last.pid} on {last.host})" if last.pid else "the engine process"
            doing = (
                f"last computing chunk {last.chunk}"
                if last.chunk
                else f"last waiting for {last.waiting}"
                if last.waiting
                else "with no report yet"
            )
            raise DraftsmithError(
                f"--engine vllm: {who} has made no progress for {self.cfg.stall_timeout_s:g} s "
                f"({doing}) while the trainer waits for chunk {chunk.name}; see "
                f"{self._where_logged()}; run the same command again to resume"
            )

    def _engine_exited(self, chunk: Chunk, status: FeedStatus) -> None:
        engine = self.engine
        assert engine is not None and engine.proc is not None  # the process on this node, which exited
        code = engine.proc.returncode
        if self.spool.is_ready(chunk.name):
            return
        engine.stop()
        why = status.error or f"exit code {code}; {engine.log_tail() or 'no output'}"
        setup_failed = bool(status.error) and not status.engine_started  # the same again on a restart
        if engine.restarts >= ENGINE_RESTARTS or status.done or setup_failed or status.fatal:
            raise DraftsmithError(
                f"--engine vllm: the engine process stopped before chunk {chunk.name} ({why}); "
                f"see {engine.log}; run the same command again to resume"
            )
        engine.restarts += 1
        engine.total_restarts += 1
        print(
            f"draftsmith train: the engine process stopped ({why[:300]}); restarting it "
            f"({engine.restarts} of {ENGINE_RESTARTS})",
            file=sys.stderr,
            flush=True,
        )
        self._spawn()

    # -- reading
    def _wait(self, chunk: Chunk) -> HiddenStateStore | None:
        """The chunk's store, once it is fetched (rank 0 watches the engines and the transport meanwhile)."""
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
                    if self.info.is_main:  # its index outlived its parts: removed, and asked for again
                        self.spool.remove(chunk.name)
                        self._write_plan()
                if self.info.is_main:
                    self._watch(chunk)
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
        if self.engine is not None:
            self.engine.restarts = 0
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
        if waited > 0.1 * interval:
            waits = "trainer"
        elif status.waiting == "space":
            waits = "engines (spool full)"
        elif status.waiting == "start":
            waits = "trainer (engine starting)"
        else:
            waits = "none"
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

    def _feed_status(self) -> FeedStatus:
        """The engine process's last report (the one read at close, once the spool is closed)."""
        return self.last_status if self.last_status is not None else self.spool.read_status()

    def summary(self) -> dict:
        status = self._feed_status()
        return {
            "mode": f"online (vLLM engines, {self.spool.transport})",
            "spool": self.spool.describe(),
            "spool bound (bytes)": self.bound,
            "spool peak (bytes)": max(self.spool.peak, status.peak),
            "extraction tokens/s": round(status.tokens_per_s, 1),
            "trainer waited (s)": round(self.waited, 1),
            "engine restarts": self.engine.total_restarts if self.engine is not None else 0,
            **({"mooncake master restarts": self.master.restarts} if self.master is not None else {}),
            **({"kept epoch 0 in": str(self.keep)} if self.keep else {}),
        }

    def close(self, completed: bool) -> None:
        """The run ended (`completed`: normally): the last chunk is consumed, the engines told and stopped, on a
        completed run the spool's chunks and this rank's copies removed, and the trainer's cores given back."""
        spool = getattr(self, "spool", None)
        if spool is not None and self.last_status is None:
            with contextlib.suppress(Exception):
                self.last_status = spool.read_status()
        if completed and self.current is not None and spool is not None:
            self._finish(self.current)
            self.current = None
        if spool is not None and self.info.is_main:
            last = TrainerStatus(
                step=self.step, chunks_read=len(self.consumed), finished=completed, stall_s=self.cfg.stall_timeout_s
            )
            with contextlib.suppress(Exception):
                segment = self.last_status.segment if completed and self.last_status else ""
                spool.write_trainer(last, segment=segment)  # where the engine process reads it once this one is gone
            if self.engine is not None:
                self.engine.stop()
            if completed:
                spool.finish()
        if completed:
            shutil.rmtree(self.cache, ignore_errors=True)
            for empty in (self.cache.parent, Path(self.cfg.output) / "engine-scratch"):
                with contextlib.suppress(OSError):
                    empty.rmdir()
        if spool is not None:
            spool.close()
        if self.master is not None:
            self.master.stop()
            self.master = None
        if self._lock is not None:
            self._lock.close()
            self._lock = None
        if self.cpus:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, self._trainer_cpus)
