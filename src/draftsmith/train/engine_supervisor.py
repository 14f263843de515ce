"""Rank 0's side of online training's engine (`draftsmith train --engine vllm`): it writes the engine's job and each
plan generation, starts the engine process on this node (with --remote-engines an operator starts it elsewhere:
`draftsmith feed`), and, while the trainer waits for a chunk, `poll`s everything on the other side of the spool:

    master    the Mooncake master draftsmith started, restarted when it stops
    job       lost with a restarted master (and its chunks with it): the job and a new plan generation written again
    process   restarted when it dies without the chunk, up to ENGINE_RESTARTS times; an error it reports before vLLM
              started, or a fatal one (a full disk), ends the run at once: the same would happen again
    plan      a plan the engine finished without the chunk the trainer waits for (lost): asked for again
    progress  no report for --stall-timeout-s ends the run in one line naming the process and its log (before a
              process's first report, at least FIRST_REPORT_S: importing vLLM is no stall)

Each poll says what it saw (`Event`); what ends the run is raised as one DraftsmithError. Constructing a supervisor
does no I/O: `start` takes the trainer's lock, cleans the spool, writes the job and starts the engine; `stop_engine`
and `close` undo it in that order.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.util
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from draftsmith.config import ExtractConfig, TrainConfig
from draftsmith.core.errors import DraftsmithError
from draftsmith.extract.spool import Chunk, ChunkInfo, FeedJob, FeedStatus, Plan, TrainerSide, TrainerStatus
from draftsmith.extract.spool.mooncake import MooncakeMaster
from draftsmith.prepare.dataset import prepared_digest
from draftsmith.train.engine_process import ENGINE_RESTARTS, EngineProcess

FIRST_REPORT_S = 300.0  # the least time a (re)started engine process has for its first report (its imports)


class Event(enum.Enum):
    """What one `EngineSupervisor.poll` saw (what ends the run is raised instead)."""

    QUIET = "quiet"  # no new report from the engine
    PROGRESS = "progress"  # the engine reported since the last poll
    MASTER_RESTARTED = "master restarted"  # the Mooncake master had stopped
    JOB_REWRITTEN = "job rewritten"  # the transport had lost the job: it and a new plan generation were written
    REPLANNED = "replanned"  # the engine finished its plan without the chunk: a new generation asks for it again
    ENGINE_RESTARTED = "engine restarted"  # the process died without the chunk and was started again
    ENGINE_EXITED = "engine exited"  # the process exited after publishing the chunk: nothing to do for it


def chunk_matches(chunk: Chunk, info: ChunkInfo | None, dtype: str, layer_ids: Sequence[int]) -> bool:
    """Whether a chunk the spool (or a rank's copy) holds is the one planned: its samples, dtype and layers."""
    return (
        info is not None
        and sorted(info.sample_ids) == sorted(chunk.engine_ids)
        and info.dtype == dtype
        and list(info.layer_ids) == list(layer_ids)
    )


class EngineSupervisor:
    """Rank 0's engine: its job, plan generations, process, master and progress (see the module).

    `consumed` is the reader's set of chunks read, the same set object: a plan asks only for the others."""

    def __init__(  # noqa: PLR0913 - one supervisor's settings, as TrainConfig names them
        self,
        cfg: TrainConfig,
        spool: TrainerSide,
        chunks: Sequence[Chunk],
        consumed: set[str],
        layer_ids: Sequence[int],
        bound: int,
        cpus: list[int] | None,
        devices: list[int] | None,
        master: MooncakeMaster | None,
    ):
        self.cfg, self.spool, self.chunks, self.consumed = cfg, spool, list(chunks), consumed
        self.layer_ids, self.bound, self.cpus, self.devices, self.master = list(layer_ids), bound, cpus, devices, master
        self.generation = 0  # of the last plan written
        self.engine: EngineProcess | None = None  # the process on this node, once started
        self._lock: contextlib.ExitStack | None = None
        # the engine status's `updated`, and when this node's clock saw it change (the engine's clock may differ)
        self._seen: tuple[float | None, float] = (None, time.monotonic())
        self._engine_seen = FeedStatus()  # its last report with a pid

    # -- starting
    def start(self, first: TrainerStatus) -> None:
        """The trainer's lock, the spool checked and cleaned for this plan, the job, the trainer's `first` report (before
        an engine reads it), and the engine process where one is needed (every chunk left ready: none)."""
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
                if self.spool.is_ready(name) and not chunk_matches(
                    wanted[name], self.spool.chunk_info(name), self.cfg.spool_dtype, self.layer_ids
                ):
                    self.spool.remove(name)
            self.spool.clean(set(wanted), [c.name for c in self.chunks])
            previous = None
            with contextlib.suppress(DraftsmithError, KeyError, TypeError, ValueError):  # unreadable: start again
                previous = self.spool.read_plan()
            self.generation = previous.generation if previous is not None else 0
            self.write_job()
            self.spool.write_status(FeedStatus(waiting="start"))
        self.spool.write_trainer(first)
        if self.cfg.remote_engines:
            self.write_plan()
        elif next(self._pending(), None) is not None:
            self.engine = EngineProcess(
                self.cfg,
                self.spool.describe(),
                Path(self.cfg.output) / "feed.log",
                Path(self.cfg.output) / "engine-scratch",
                self.cpus,
                self.devices,
            )
            self._spawn()

    def write_job(self) -> None:
        self.spool.write_job(
            FeedJob(
                extract=self._extract_config(),
                bound=self.bound,
                cpus=self.cpus,
                prepared_digest=prepared_digest(self.cfg.data),
                stall_s=self.cfg.stall_timeout_s,
            )
        )

    def write_plan(self) -> None:
        """A new plan generation: the chunks neither read nor ready. A ready chunk stays out of it: an engine process
        reads the plan seconds on (once vLLM has imported), and by then the trainer may have read and deleted it;
        redone, it would fill the spool with chunks no one reads while the trainer waits for the next."""
        self.generation += 1
        self.spool.write_plan(Plan(list(self._pending()), self.generation))

    def _pending(self) -> Iterator[Chunk]:
        """The engine's chunks neither read nor ready."""
        unread = (c for c in self.chunks if c.from_engine and c.name not in self.consumed)
        return (c for c in unread if not self.spool.is_ready(c.name))

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
        self.write_plan()
        self.spool.write_status(FeedStatus(waiting="start", generation=self.generation))
        self._seen, self._engine_seen = (None, time.monotonic()), FeedStatus()
        assert self.engine is not None  # spawned on this node
        self.engine.start()

    # -- watching the other side
    def where_logged(self) -> str:
        if self.engine is not None:
            return str(self.engine.log)
        status = self._engine_seen
        return f"{status.log or 'its log'} on {status.host or 'the engine node'}"

    def poll(self, chunk: Chunk) -> Event:
        """One look at the other side while the trainer waits for `chunk`: what it saw, or a DraftsmithError where
        the run cannot go on."""
        restarted = False
        if self.master is not None and not self.master.alive():
            print(
                f"draftsmith train: mooncake_master stopped (see {self.master.log}); restarting it",
                file=sys.stderr,
                flush=True,
            )
            self.master.restart()
            restarted = True
        if not self.spool.has_job():  # the store lost it (a restarted master): and with it, its chunks
            self.write_job()
            self.write_plan()
            return Event.JOB_REWRITTEN
        status = self.spool.read_status()
        if self.engine is not None and self.engine.exited():
            return self._engine_exited(chunk, status)
        progress = status.updated != self._seen[0]
        if progress:
            self._seen = (status.updated, time.monotonic())
        if status.pid:
            self._engine_seen = status  # what a stalled engine process last said (its keys may go with it)
        by_engine = status.pid != 0  # written by an engine process since this trainer (re)started it
        planned = status.waiting == "plan" and status.generation == self.generation and by_engine
        if planned and not self.spool.is_ready(chunk.name):  # it finished the plan and the chunk is not there: lost
            self.write_plan()
            return Event.REPLANNED
        if status.error and by_engine and self.engine is None:
            raise DraftsmithError(
                f"--engine vllm: the engine process on {status.host or 'the engine node'} stopped "
                f"before chunk {chunk.name} ({status.error}); see {self.where_logged()}"
            )
        reported = self._engine_seen.pid != 0  # by this process (a stopped one's keys may go with it: still reported)
        limit = self.cfg.stall_timeout_s if reported else max(self.cfg.stall_timeout_s, FIRST_REPORT_S)
        if time.monotonic() - self._seen[1] > limit:
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
                f"--engine vllm: {who} has made no progress for {limit:g} s "
                f"({doing}) while the trainer waits for chunk {chunk.name}; see "
                f"{self.where_logged()}; run the same command again to resume"
            )
        if restarted:
            return Event.MASTER_RESTARTED
        return Event.PROGRESS if progress else Event.QUIET

    def _engine_exited(self, chunk: Chunk, status: FeedStatus) -> Event:
        engine = self.engine
        assert engine is not None and engine.proc is not None  # the process on this node, which exited
        code = engine.proc.poll()
        if self.spool.is_ready(chunk.name):
            return Event.ENGINE_EXITED
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
        return Event.ENGINE_RESTARTED

    def chunk_arrived(self) -> None:
        """The chunk waited for is here: the engine's restarts count from zero again."""
        if self.engine is not None:
            self.engine.restarts = 0

    # -- reporting and ending
    def summary(self) -> dict:
        return {
            "engine restarts": self.engine.total_restarts if self.engine is not None else 0,
            **({"mooncake master restarts": self.master.restarts} if self.master is not None else {}),
        }

    def stop_engine(self, last: TrainerStatus, segment: str = "") -> None:
        """The run ended: the trainer's last report written (where the engine process reads it once this one is
        gone: `segment`), the process stopped, and on a completed run the transport told so. Before the spool
        closes."""
        with contextlib.suppress(Exception):
            self.spool.write_trainer(last, segment=segment)
        if self.engine is not None:
            self.engine.stop()
        if last.finished:
            self.spool.finish()

    def close(self) -> None:
        """After the spool closed: the master draftsmith started stopped, the trainer's lock released."""
        if self.master is not None:
            self.master.stop()
            self.master = None
        if self._lock is not None:
            self._lock.close()
            self._lock = None
