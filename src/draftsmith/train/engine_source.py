"""Online training from live vLLM engines (`draftsmith train --data PREPARED --engine vllm`): the plan of spool
chunks, the engine process, and the feature source that fills each batch's hidden states from the spool.

    plan     the run's optimizer steps from the resume point on, exactly as the samplers give them to every rank,
             packed per epoch into chunks of at most bound / SPOOL_CHUNKS bytes (and the held-out split's chunk)
    engine   `python -m draftsmith.extract.vllm.feed SPOOL` started by rank 0, on its own GPUs (on a CPU: on half the
             cores, or those --engine-devices names, the trainer on the rest); restarted when it dies, up to
             ENGINE_RESTARTS times without a new chunk
    read     a batch's states come from its chunk (waiting until it is ready) or from the --keep-epoch0 store; a
             chunk is deleted once every rank has moved past it (epoch 0's and the held-out split's are first
             linked into the --keep-epoch0 store)

The batches are the offline ones: the same samplers over the same prepared set, so the same samples in the same
order. The spool itself is `draftsmith.extract.spool`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import signal
import subprocess
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
from draftsmith.extract import spool as spool_mod
from draftsmith.extract import store as store_mod
from draftsmith.extract.spool import EVAL_CHUNK, LOG_FILE, TRAINER_LOCK, Chunk, Spool
from draftsmith.extract.vllm.driver import cpu_thread_binding
from draftsmith.train import distributed
from draftsmith.train.batches import Batch, TokenBudgetSampler, pad_rows

ENGINE_MODULE = "draftsmith.extract.vllm.feed"
ENGINE_RESTARTS = 3


def engine_cpus(cfg: TrainConfig) -> list[int] | None:
    """On a CPU, the cores the engines run on: those --engine-devices names, by default the first half of the cores
    this process may use (None on one core: they share it); this process (the trainer) keeps the others. Sharing
    every core oversubscribes them: on 2 cores the split trains 1.26x faster (docs/benchmarks.md)."""
    allowed = sorted(os.sched_getaffinity(0))
    if not cfg.engine_devices:
        return allowed[:len(allowed) // 2] or None
    engines = sorted(set(cfg.engine_devices))
    outside = [c for c in engines if c not in allowed]
    rest = [c for c in allowed if c not in engines]
    if outside or not rest:
        raise DraftsmithError(f"--engine-devices {','.join(map(str, engines))}: on a CPU these are cores, and "
                              f"{f'core(s) {outside} are not among' if outside else 'they take every one of'} the "
                              f"cores this process may use ({','.join(map(str, allowed))}); leave the trainer at "
                              "least one")
    return engines


def engine_devices(cfg: TrainConfig, info: distributed.DistInfo) -> list[int] | None:
    """The GPUs the engines run on (None on a CPU), disjoint from the trainer's."""
    if info.device.type != "cuda":
        return None
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = [int(x) for x in env.split(",") if x.strip()] if env else list(range(torch.cuda.device_count()))
    trainer = visible[:distributed.local_world_size()]
    engines = list(cfg.engine_devices) if cfg.engine_devices else [d for d in visible if d not in trainer]
    need = cfg.engine_tensor_parallel_size * cfg.engine_data_parallel_size
    if set(engines) & set(trainer):
        raise DraftsmithError(f"--engine-devices {','.join(map(str, engines))}: GPU(s) "
                              f"{sorted(set(engines) & set(trainer))} also train; give the engines other GPUs")
    if len(engines) < need:
        raise DraftsmithError(f"--engine vllm: the engines need {need} GPU(s) (tensor x data parallel size), "
                              f"{len(engines)} left besides the trainer's {trainer}; pass --engine-devices or train "
                              "on fewer GPUs")
    return engines[:need]


def _steps_of_epoch(samplers: Sequence[TokenBudgetSampler], epoch: int, grad_accum: int) -> list[list[int]]:
    """Every rank's samples of each optimizer step of `epoch`, in the order the ranks read them."""
    per_rank = [s.batches(epoch) for s in samplers]
    n = len(per_rank[0]) // grad_accum
    return [[i for batches in per_rank for b in batches[p * grad_accum:(p + 1) * grad_accum] for i in b]
            for p in range(n)]


def _round_up(x: float) -> float:
    """`x` rounded up to three significant digits (a bound suggested must be enough)."""
    scale = 10.0 ** (2 - math.floor(math.log10(x)))
    return math.ceil(x * scale) / scale


def plan_chunks(cfg: TrainConfig, samplers: Sequence[TokenBudgetSampler], evaluation: Sequence[int],
                lengths: Any, layers: int, hidden: int, bound: int, start: tuple[int, int, int], total_steps: int,
                epochs: int | None, kept: set[int]) -> list[Chunk]:
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
            raise DraftsmithError(f"--spool-gb {cfg.spool_gb:g}: one optimizer step takes up to {max(sizes) / GiB:.3g} "
                                  f"GiB of hidden states and the spool holds {SPOOL_CHUNKS} chunks of at least one "
                                  f"step{' besides the held-out split' if eval_chunk else ''}; raise --spool-gb to "
                                  f"{need:g} or more, or lower --token-budget / --grad-accum")
        for first, last in spool_mod.pack_steps(list(zip(steps, sizes)), limit):
            if last < position:  # read before the resume point
                continue
            begin = max(position, first)  # a resume inside a chunk asks for the whole chunk, under its own name
            last = min(last, begin + total_steps - step - 1)
            ids = [i for p in range(first, last + 1) for i in steps[p]]
            chunks.append(chunk(spool_mod.chunk_name(epoch, first, last), epoch, first, last, ids,
                                (kept if epoch == 0 else epoch0) if keep else set()))
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
    """Fills each batch's hidden states from the spool that rank 0's engine process fills (see the module)."""

    def __init__(self, cfg: TrainConfig, info: distributed.DistInfo, dataset: Any,
                 samplers: Sequence[TokenBudgetSampler],
                 evaluation: Sequence[int], lengths: Any, aux_layer_ids: list[int], num_layers: int, hidden: int,
                 start: tuple[int, int, int], total_steps: int, epochs: int | None):
        self.cfg, self.info, self.dataset = cfg, info, dataset
        self.bound = int(cfg.spool_gb * GiB)
        self.spool = Spool(Path(cfg.spool) if cfg.spool is not None else Path(cfg.output) / "spool", self.bound)
        self.keep = Path(cfg.keep_epoch0) if cfg.keep_epoch0 is not None else None
        self.layer_ids = list(aux_layer_ids) + [num_layers]
        self.chunks = plan_chunks(cfg, samplers, evaluation, lengths, len(self.layer_ids), hidden, self.bound, start,
                                  total_steps, epochs, self._kept_ids())
        self.eval_ids = set(int(i) for i in evaluation)
        self.by_step = {(c.epoch, p): c for c in self.chunks if c.name != EVAL_CHUNK
                        for p in range(c.first, c.last + 1)}
        self.from_engine = {c.name: set(c.engine_ids) for c in self.chunks}
        self.eval_chunk = next((c for c in self.chunks if c.name == EVAL_CHUNK), None)
        self.open_chunks: dict[str, Any] = {}
        self.consumed: set[str] = set()
        self.current: Chunk | None = None
        self.keep_reader = None
        self.proc: subprocess.Popen | None = None
        self.restarts = self.total_restarts = 0
        self.waited = self._waited_at_log = 0.0
        self._log_time = time.perf_counter()
        self._lock = None
        self.cpus = engine_cpus(cfg) if info.device.type != "cuda" else None
        if self.cpus:  # the trainer keeps the other cores
            rest = sorted(set(os.sched_getaffinity(0)) - set(self.cpus))
            os.sched_setaffinity(0, rest)
            torch.set_num_threads(len(rest))
        error = None
        if info.is_main:
            try:
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
            raise DraftsmithError(f"--keep-epoch0 {self.keep}: is not a hidden-state store; give a new directory or "
                                  "the store an earlier run kept")
        return {int(i) for i in store_mod.open(self.keep, dtype=None).sample_ids}

    def _start(self) -> None:
        if importlib.util.find_spec("vllm") is None:
            raise DraftsmithError("--engine vllm: vLLM is not installed in this environment; install it (README: "
                                  "\"Install into your vLLM environment\"), or train with --engine hf or from a store")
        self._lock = contextlib.ExitStack()
        self._lock.enter_context(self.spool.lock(TRAINER_LOCK))
        with self.spool.lock(spool_mod.ENGINE_LOCK, wait_s=30.0):  # an engine of a killed trainer is gone
            # Ready chunks are kept only within the plan's first bound's worth: the engine writes in plan order, so
            # chunks a crash left further ahead would leave no room for the ones the trainer needs first.
            wanted, room = {}, self.bound
            for c in (c for c in self.chunks if c.from_engine):
                room -= c.estimate
                if room < 0:
                    break
                wanted[c.name] = c
            for name in list(wanted):
                if self.spool.is_ready(name) and not self._chunk_matches(wanted[name]):
                    self.spool.remove(name)
            self.spool.clean(set(wanted))
            self.spool.write_job({"extract": self._extract_config().model_dump(mode="json"), "bound": self.bound,
                                  "devices": engine_devices(self.cfg, self.info), "cpus": self.cpus})
            self.spool.write_status({"pid": 0, "waiting": "start"})
        if any(c.from_engine and not self.spool.is_ready(c.name) for c in self.chunks):
            self._spawn()

    def _chunk_matches(self, chunk: Chunk) -> bool:
        try:
            reader = store_mod.open(self.spool.chunk_path(chunk.name), dtype=None)
        except DraftsmithError:
            return False
        return (sorted(int(i) for i in reader.sample_ids) == sorted(chunk.engine_ids)
                and reader.manifest.dtype == self.cfg.spool_dtype and list(reader.layer_ids) == self.layer_ids)

    def _extract_config(self) -> ExtractConfig:
        cfg = self.cfg
        return ExtractConfig(prepared=cfg.data, output=self.spool.chunks, backend="vllm", target=cfg.target,
                             aux_layer_ids=self.layer_ids[:-1], dtype=cfg.spool_dtype,
                             tensor_parallel_size=cfg.engine_tensor_parallel_size,
                             data_parallel_size=cfg.engine_data_parallel_size, vllm_strategy=cfg.vllm_strategy,
                             vllm_compile=cfg.vllm_compile, compute_dtype=cfg.engine_dtype,
                             trust_remote_code=cfg.trust_remote_code)

    def _spawn(self) -> None:
        """Start the engine process on the chunks neither read nor ready. A ready chunk stays out of its plan: the
        process reads the plan only once vLLM has imported, seconds on, and by then the trainer may have read and
        deleted it; redone, it would fill the spool with chunks no one reads while the trainer waits for the next."""
        self.spool.write_plan([c for c in self.chunks
                               if c.name not in self.consumed and not self.spool.is_ready(c.name)])
        env = dict(os.environ)
        job = self.spool.read_job()
        if job.get("devices") is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, job["devices"]))
        if job.get("cpus") and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:  # vLLM binds its threads there
            world = self.cfg.engine_tensor_parallel_size * self.cfg.engine_data_parallel_size
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(world, job["cpus"])
        with open(self.spool.path / LOG_FILE, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", ENGINE_MODULE, str(self.spool.path)], env=env,
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    def _stop_engine(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(OSError):  # vLLM's processes of a dead engine process, if any are left
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)

    # -- reading
    def _wait(self, chunk: Chunk) -> Any:
        """The chunk's store, once it is ready (rank 0 restarts a dead engine process meanwhile)."""
        if chunk.name in self.open_chunks:
            return self.open_chunks[chunk.name]
        if not chunk.from_engine:
            return None
        start = time.perf_counter()
        while not self.spool.is_ready(chunk.name):
            self.spool.usage()
            if self.proc is not None and self.proc.poll() is not None:
                self._engine_exited(chunk)
            elif self.proc is None and self.info.is_main:
                self._spawn()
            time.sleep(0.02)
        self.waited += time.perf_counter() - start
        self.restarts = 0
        reader = store_mod.open(self.spool.chunk_path(chunk.name), dtype=None)
        self.open_chunks[chunk.name] = reader
        if chunk.name == EVAL_CHUNK or chunk.epoch == 0:
            self._absorb(chunk)
        return reader

    def _engine_exited(self, chunk: Chunk) -> None:
        code = self.proc.returncode
        status = spool_mod.read_feed_status(self.spool)
        if self.spool.is_ready(chunk.name):
            return
        self._stop_engine()
        why = status.error or f"exit code {code}; {self.spool.log_tail() or 'no output'}"
        setup_failed = bool(status.error) and "engine start (s)" not in status.extra  # the same again on a restart
        if self.restarts >= ENGINE_RESTARTS or status.done or setup_failed:
            raise DraftsmithError(f"--engine vllm: the engine process stopped before chunk {chunk.name} ({why}); "
                                  f"see {self.spool.path / LOG_FILE}; run the same command again to resume")
        self.restarts += 1
        self.total_restarts += 1
        print(f"draftsmith train: the engine process stopped ({why[:300]}); restarting it "
              f"({self.restarts} of {ENGINE_RESTARTS})", file=sys.stderr, flush=True)
        self._spawn()

    def _absorb(self, chunk: Chunk) -> None:
        if self.keep is not None and self.info.is_main and chunk.from_engine:
            store_mod.absorb_store(self.keep, self.spool.chunk_path(chunk.name), tag=chunk.name)

    def _kept(self, sample_id: int) -> dict:
        for attempt in range(2):
            if self.keep_reader is None or attempt:
                if self.keep is None or not (self.keep / "manifest.json").is_file():
                    break
                self.keep_reader = store_mod.open(self.keep, dtype=None)
            with contextlib.suppress(KeyError, IndexError, DraftsmithError):
                return self.keep_reader[self.keep_reader.index_of(sample_id)]
        raise DraftsmithError(f"sample {sample_id}: in neither its spool chunk nor --keep-epoch0 {self.keep}; "
                              "delete the spool directory and run the same command again")

    def __call__(self, batch: Batch) -> Batch:
        if batch.sample_ids[0] in self.eval_ids:
            chunk = self.eval_chunk
        else:
            chunk = self.by_step.get((batch.epoch, batch.position))
            if chunk is None:
                raise DraftsmithError(f"epoch {batch.epoch}, step {batch.position}: not in the spool's plan")
            if self.current is not None and self.current.name != chunk.name:
                self._finish(self.current)
            self.current = chunk
        reader = self._wait(chunk)
        items = []
        for sid in batch.sample_ids:
            if reader is not None and sid in self.from_engine[chunk.name]:
                items.append(reader[reader.index_of(sid)])
            else:
                items.append(self._kept(sid))
        t = batch.input_ids.shape[1]
        hs, sc = (pad_rows(items, key, t) for key in ("hidden_states", "hidden_scales"))
        device = batch.input_ids.device
        return replace(batch, hidden_states=hs.to(device), hidden_scales=None if sc is None else sc.to(device))

    def _finish(self, chunk: Chunk) -> None:
        """Every micro-batch of `chunk` was read: delete it (once every rank has)."""
        self.open_chunks.pop(chunk.name, None)
        self.consumed.add(chunk.name)
        if chunk.from_engine:
            self.spool.consume(chunk.name, self.info.rank, self.info.world_size)

    # -- reporting
    def metrics(self) -> dict:
        status = spool_mod.read_feed_status(self.spool)
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
        return {"extract_tokens_per_s": round(status.tokens_per_s, 1), "spool_bytes": self.spool.usage(),
                "spool_bound": self.bound, "trainer_wait_s": round(self.waited, 2), "waiting": waits}

    def describe(self, metrics: dict) -> str:
        return (f"  extract {metrics['extract_tokens_per_s']:,.0f} tok/s  spool {metrics['spool_bytes'] / GiB:.2f}/"
                f"{self.bound / GiB:.2f} GiB  waits: {metrics['waiting']}")

    def summary(self) -> dict:
        status = spool_mod.read_feed_status(self.spool)
        return {"mode": "online (vLLM engines, spool)", "spool": str(self.spool.path),
                "spool bound (bytes)": self.bound,
                "spool peak (bytes)": max(self.spool.peak, status.peak), "extraction tokens/s":
                round(status.tokens_per_s, 1), "trainer waited (s)": round(self.waited, 1),
                "engine restarts": self.total_restarts, **({"kept epoch 0 in": str(self.keep)} if self.keep else {})}

    def close(self, completed: bool) -> None:
        """The run ended (`completed`: normally): the last chunk is consumed, the engine stopped, and on a completed
        run the spool's chunks removed."""
        if completed and self.current is not None:
            self._finish(self.current)
            self.current = None
        if self.info.is_main:
            self._stop_engine()
            if completed:
                self.spool.clean(set())
        if self._lock is not None:
            self._lock.close()
            self._lock = None
