"""The engine process of online training: one vLLM (tensor- and data-parallel as `extract` runs it) filling a spool's
chunks in plan order. The trainer starts it on its own node (`python -m draftsmith.extract.vllm.feed SPOOL`), or an
operator starts it on the engine node (`draftsmith feed --spool mooncake://HOST:PORT/RUN`).

    connect  the spool (a directory, or a Mooncake store) -> wait for the trainer's job
    setup    the job's ExtractConfig (its paths replaced by this node's --prepared / --target, checked to be the
             same prepared set) -> probe, strategy, store spec (as `extract` does) -> start vLLM, its sink at no store
    passes   for each plan generation the trainer writes: for each chunk not ready: wait until it fits under the
             bound -> point the sink at a local directory -> prefill its samples -> finish the store -> publish it
    end      when the trainer says the run is over (or, started by the trainer, when the trainer is gone)

Neither side waits forever: waiting for room or for a plan while the trainer reports no progress for its stall limit
ends the process with one line naming the trainer. A full disk or /dev/shm is one line naming the path and the space
the chunk needs, marked fatal so the trainer does not restart the process into the same wall. The process's own death
loses at most the chunk it was writing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
import traceback
from pathlib import Path
from typing import Annotated

import typer
from pydantic import JsonValue

from draftsmith.config import ExtractConfig, FeedConfig, StageResult
from draftsmith.core import sizing
from draftsmith.core.errors import DiskFullError, DraftsmithError
from draftsmith.core.spool_address import DirectoryAddress, LocalMooncake, SpoolAddress, parse_spool
from draftsmith.core.targets import read_config
from draftsmith.extract import common
from draftsmith.extract.spool import (
    STALL_S,
    EngineSide,
    FeedJob,
    FeedStatus,
    Plan,
    Spool,
    TrainerStatus,
    TransportLost,
    free_bytes,
    mooncake,
    wait_for_space,
)
from draftsmith.extract.spool.chunks import Chunk, Waiting
from draftsmith.extract.vllm import dtypes
from draftsmith.extract.vllm import probe as probing
from draftsmith.extract.vllm.backend import _backend_info, _engine_spec, _sink_config, choose_strategy, say_dtype
from draftsmith.extract.vllm.driver import Engine, engine_processes, prompts, start_engine
from draftsmith.prepare.dataset import prepared_digest

HEARTBEAT_S = 2.0
LOST_LIMIT = 3  # the same chunk refused this many times in a row is not the transport's passing loss
_say = common.stage_line("draftsmith engine process")  # this process's lines on stderr


class Fatal(DraftsmithError):
    """An error a restart meets again (a full disk, a segment too small, a different prepared set)."""


def _exit_with_engine(status: FeedStatus, spool: EngineSide, why: str, code: int) -> None:
    """Kill vLLM's processes (its engine core and workers would outlive this one) and exit now."""
    for pid in engine_processes():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    status.error = why
    with contextlib.suppress(Exception):
        spool.write_status(status)
    os._exit(code)


def watch_parent(parent: int, status: FeedStatus, spool: EngineSide) -> None:
    """Exit (with vLLM's processes) once the trainer that started this process is gone, or on SIGTERM."""

    def loop() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        _exit_with_engine(status, spool, "the trainer is gone", 3)

    signal.signal(signal.SIGTERM, lambda *_: _exit_with_engine(status, spool, "stopped (SIGTERM)", 143))
    threading.Thread(target=loop, name="draftsmith-watch-trainer", daemon=True).start()


class Feeder:
    """One engine process's run over a spool (see the module); `overrides`: this node's paths for the job's."""

    def __init__(
        self,
        spool: EngineSide,
        status: FeedStatus,
        stall_s: float = STALL_S,
        overrides: dict[str, object] | None = None,
    ):
        self.spool, self.status, self.stall_s = spool, status, stall_s
        self.overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
        self.generation: int | None = None
        self.beat = 0.0  # when this process last reported
        self.lock = threading.Lock()
        self.lost: dict[str, int] = {}  # chunks the transport refused or lost, and how often
        # the trainer's last `updated`, when this process saw it change, and its report
        self.trainer: tuple[float | None, float, TrainerStatus | None] = (None, time.monotonic(), None)

    # -- waiting on the trainer
    def _read_trainer(self) -> TrainerStatus | None:
        """The trainer's report, and when this process saw it change (timed by this node's clock)."""
        trainer = self.spool.read_trainer()
        if trainer is not None and trainer.updated != self.trainer[0]:
            self.trainer = (trainer.updated, time.monotonic(), trainer)
        return trainer

    def _trainer_stalled(self, what: str) -> None:
        """One line when the trainer has reported no progress for its stall limit while this process waits (a
        trainer that stopped answering loses its keys too: its Mooncake segment goes with it)."""
        self._read_trainer()
        now = time.monotonic()
        _, seen_at, report = self.trainer
        limit = report.stall_s if report is not None and report.stall_s else self.stall_s
        if now - seen_at > limit:
            last = f"its last report at step {report.step}" if report is not None else "it has not reported yet"
            raise Fatal(
                f"the trainer of {self.spool.describe()} has made no progress for {limit:g} s while the "
                f"engine process waits for {what} ({last}); stopping — see the trainer's log"
            )

    def _report(self, waiting: Waiting | None = None, **fields: object) -> None:
        with self.lock:
            self.beat = time.monotonic()
            if waiting is not None:
                self.status.waiting = waiting
            for k, v in fields.items():
                setattr(self.status, k, v)
            self.spool.write_status(self.status)

    def _waiting(self, what: Waiting) -> None:
        """Report waiting for `what` once it starts, then every second (alive, and why it waits)."""
        if self.status.waiting != what or time.monotonic() - self.beat > 1.0:
            self._report(what)

    def heartbeat(self, every: float = HEARTBEAT_S) -> threading.Event:
        """Report every `every` seconds from a thread while vLLM starts or computes a chunk (the trainer takes a
        process that stops reporting for its stall limit for a stalled one); set the event returned to stop."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(every):
                if time.monotonic() - self.beat >= every:
                    with contextlib.suppress(Exception):
                        self._report()

        threading.Thread(target=loop, name="draftsmith-feed-heartbeat", daemon=True).start()
        return stop

    def wait_for_job(self) -> FeedJob:
        while True:
            with contextlib.suppress(DraftsmithError):
                return self.spool.read_job()
            self._trainer_stalled("its job")
            time.sleep(0.2)

    def next_plan(self) -> Plan | None:
        """The trainer's plan once its generation is new to this process (None: the run is over)."""
        while True:
            plan = self.spool.read_plan()
            if plan is not None and plan.generation != self.generation:
                self.generation = plan.generation
                self._report(generation=plan.generation)
                return plan
            trainer = self._read_trainer()
            if trainer is not None and trainer.finished:
                return None
            self._trainer_stalled("a plan")
            self._waiting("plan")
            time.sleep(0.1)

    # -- setting up
    def extract_config(self, job: FeedJob) -> ExtractConfig:
        cfg = job.extract
        if self.overrides:
            cfg = cfg.model_copy(update=self.overrides)
        want, have = job.prepared_digest, prepared_digest(cfg.prepared)
        if want and have != want:
            raise Fatal(
                f"--prepared {cfg.prepared}: is not the prepared set the trainer trains on (its shards "
                "differ); give this node a copy of the trainer's --data"
            )
        return cfg

    # -- the passes
    def compute(self, engine: Engine, plan_x: common.ExtractionPlan, chunk: Chunk) -> None:
        partial = self.spool.begin(chunk.name)
        try:
            self.spool.room(chunk.name, chunk.estimate)
        except DraftsmithError as err:  # a full disk or /dev/shm: a restart meets it again
            raise Fatal(str(err)) from None
        start = time.perf_counter()
        try:
            engine.open_store(str(partial))
            share = engine.spec.prefix_caching  # a chunk's samples sharing prefixes: stored as extract stores them
            engine.generate(prompts(plan_x.dataset, plan_x.lengths, chunk.engine_ids, share))
            engine.wait_for_sink(len(chunk.engine_ids))
            written = sum(r.samples_written for r in engine.finish_store())
        except DiskFullError:
            raise Fatal(
                f"{partial}: no space left on device writing chunk {chunk.name} (it needs up to "
                f"{sizing.human_bytes(chunk.estimate)}, {sizing.human_bytes(free_bytes(partial))} are "
                "free there); free space there or give the spool a bigger filesystem"
            ) from None
        if written != len(chunk.engine_ids):
            raise DraftsmithError(f"chunk {chunk.name}: the engine stored {written} of {len(chunk.engine_ids)} samples")
        self.spool.publish(chunk.name)
        self.status.peak = max(self.status.peak, self.spool.usage())
        self.lost.pop(chunk.name, None)
        self.status.seconds += time.perf_counter() - start
        self.status.tokens += chunk.tokens
        self.status.chunks_done += 1
        self._report("", chunk="")

    def one_pass(self, engine: Engine, plan_x: common.ExtractionPlan, plan: Plan) -> None:
        """Every chunk of `plan` not ready, in order; returns early when the trainer writes a newer plan."""
        for chunk in plan.chunks:
            if not chunk.from_engine or self.spool.is_ready(chunk.name):
                continue
            self._read_trainer()
            newer = self.spool.read_plan()
            if newer is not None and newer.generation != plan.generation:
                self.generation = None  # start the new plan's pass
                return

            def waiting(used: int) -> None:
                self._waiting("space")
                self._trainer_stalled(
                    f"room in the spool ({sizing.human_bytes(used)} of "
                    f"{sizing.human_bytes(self.spool.bound or 0)} held)"
                )

            wait_for_space(self.spool, chunk.estimate, on_wait=waiting)
            self._report("", chunk=chunk.name)
            try:
                self.compute(engine, plan_x, chunk)
            except TransportLost as err:  # the trainer writes a new plan; until then, wait for it
                self.lost[chunk.name] = self.lost.get(chunk.name, 0) + 1
                if self.lost[chunk.name] >= LOST_LIMIT:
                    raise Fatal(
                        f"{self.spool.describe()}: chunk {chunk.name} could not be published "
                        f"{LOST_LIMIT} times in a row ({err}); see this process's log"
                    ) from None
                _say(f"{self.spool.describe()} lost chunk {chunk.name} ({err}); waiting for the trainer's next plan")
                return

    def run(self) -> None:
        job = self.wait_for_job()
        beating = self.heartbeat()  # from here on, alive while it reads the target, probes vLLM, starts it, computes
        try:
            self._run(job)
        finally:
            beating.set()

    def _run(self, job: FeedJob) -> None:
        if job.cpus:  # the cores the trainer left to the engine (it runs on the others)
            os.sched_setaffinity(0, job.cpus)
        cfg = self.extract_config(job)
        self.stall_s = job.stall_s or self.stall_s  # the trainer's limit rules the run
        self.spool.bound = job.bound
        self.spool.drop_leftovers()  # a killed engine's partial chunk
        first = self.next_plan()
        if first is None:
            self.status.done = True
            return
        plan_x = common.plan_extraction(cfg)
        config = read_config(plan_x.target_dir)
        report = probing.probe(architecture=plan_x.target.architecture, resolve_config=False, config=config)
        choice = dtypes.choose_dtype(cfg.compute_dtype, report, config)
        strategy = choose_strategy(cfg.vllm_strategy, report, plan_x.layer_ids, choice.dtype)
        needed = sorted({i for c in first.chunks for i in c.engine_ids}) or [0]

        def spec_for(dtype: str):
            spec = common.store_spec(plan_x, backend="vllm", compute_dtype=dtype)
            backend_info: dict[str, JsonValue] = {**_backend_info(report, strategy), "online": True}
            sink_config = _sink_config(plan_x, spec, backend_info).model_copy(update={"store": None})
            shares = cfg.data_parallel_size == 1 and bool((plan_x.dataset.prefixes[2] >= common.MIN_SHARED).any())
            return _engine_spec(plan_x, report, strategy, sink_config, needed, dtype, shares)

        self.status.extra = {"strategy": strategy, "vllm": report.facts.version, "platform": report.facts.platform}
        self._report("start")
        say_dtype("draftsmith engine process", choice, cfg.compute_dtype)
        engine, _ = start_engine(choice, spec_for, say=_say)
        with engine:
            self.status.engine_started = True
            self.status.extra["engine start (s)"] = round(engine.start_seconds, 1)
            plan: Plan | None = first
            while plan is not None:
                self.one_pass(engine, plan_x, plan)
                plan = self.next_plan()
        self.status.done, self.status.chunk, self.status.waiting = True, "", ""


def serve(
    where: SpoolAddress,
    *,
    scratch: Path | None,
    segment_gb: float | None,
    stall_s: float,
    overrides: dict[str, object] | None,
    parent: int | None,
    log: str | None = None,
) -> FeedStatus:
    """Run one engine process over the spool at `where`; its status at the end (`error` set on failure). Over
    Mooncake it first reads the job with a small segment (the bound sizes the segment the chunks live in), then
    mounts that one. `log`: where this process's output goes, as the trainer names it to the user."""
    status = FeedStatus(pid=os.getpid(), host=socket.gethostname())
    spool: EngineSide | None = None
    try:
        if isinstance(where, LocalMooncake):
            raise Fatal("--spool mooncake: the engine side needs the trainer's master, mooncake://HOST:PORT[/RUN]")
        if isinstance(where, DirectoryAddress):
            spool = Spool(where.path)
        else:
            spool = mooncake.MooncakeSpool(where, scratch=scratch).connect()
            bound = Feeder(spool, status, stall_s).wait_for_job().bound
            try:
                segment = mooncake.engine_segment(bound, segment_gb)
            except DraftsmithError as err:
                raise Fatal(str(err)) from None
            spool.close()
            spool = None
            mounted = mooncake.MooncakeSpool(where, segment=segment, scratch=scratch).connect()
            status.segment, spool = mounted.segment_name, mounted
        if parent is not None:
            watch_parent(parent, status, spool)
        status.log = log or "the output of `draftsmith feed`"
        with spool.engine_lock(wait_s=60.0):
            Feeder(spool, status, stall_s, overrides).run()
    except Fatal as err:
        status.error, status.fatal = str(err), True
    except DraftsmithError as err:
        status.error = str(err)
    except Exception as err:  # noqa: BLE001 - reported to the trainer in one line; the traceback is in the log
        traceback.print_exc()
        status.error = f"{type(err).__name__}: {err}".replace("\n", " ")
    if spool is not None:
        with contextlib.suppress(Exception):
            spool.write_status(status)
            if status.done:  # the trainer's last word read: nothing is left
                spool.finish(everything=True)
    return status


def run(cfg: FeedConfig) -> StageResult:
    """`draftsmith feed`: the engine side of `train --engine vllm --remote-engines`, on the engine node."""
    scratch = cfg.scratch or Path(os.environ.get("TMPDIR", "/tmp")) / f"draftsmith-feed-{os.getpid()}"
    status = serve(
        parse_spool(cfg.spool),
        scratch=scratch,
        segment_gb=cfg.segment_gb,
        stall_s=cfg.stall_timeout_s,
        overrides={"prepared": cfg.prepared, "target": cfg.target},
        parent=None,
    )
    if status.error:
        raise DraftsmithError(status.error)
    return StageResult(
        stage="feed",
        output=scratch,
        summary={
            "spool": cfg.spool,
            "chunks computed": status.chunks_done,
            "tokens": status.tokens,
            "extraction tokens/s": round(status.tokens_per_s, 1),
            **status.extra,
        },
    )


def main(
    where: Annotated[str, typer.Argument(help="The spool: a directory or mooncake://HOST:PORT/NAME.")],
    scratch: Annotated[Path | None, typer.Option(help="Local staging directory.")] = None,
    stall_s: Annotated[float, typer.Option(help="Seconds without the trainer before stopping.")] = STALL_S,
    log: Annotated[
        str | None,
        typer.Option(help="Where this process's output goes (the trainer's OUTPUT/feed.log), named in its errors."),
    ] = None,
) -> None:
    """The trainer's child (`train --engine vllm`, started by train/engine_process.py): one engine process over the
    spool, until the trainer is done or gone."""
    status = serve(
        parse_spool(where),
        scratch=scratch,
        segment_gb=None,
        stall_s=stall_s,
        overrides=None,
        parent=os.getppid(),
        log=log,
    )
    if status.error:  # into OUTPUT/feed.log; the trainer reports it in its own line
        _say(status.error)
        raise typer.Exit(1)


if __name__ == "__main__":
    typer.run(main)
