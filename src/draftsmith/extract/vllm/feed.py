"""The engine process of online training: one vLLM (tensor- and data-parallel as `extract` runs it) filling the
spool's chunks in plan order (`python -m draftsmith.extract.vllm.feed SPOOL`, started by the trainer).

    read job.json (an ExtractConfig) and plan.json -> probe, strategy, store spec (as `extract` does)
    start vLLM with its sink pointed at no store
    for each chunk not ready: wait until it fits under the bound -> point the sink at chunks/.NAME.partial
        -> prefill its samples -> wait for the sink -> finish the store -> rename it to chunks/NAME

The process exits when its trainer does (a watcher thread sees the parent gone, kills vLLM's processes and exits),
so a trainer killed with -9 leaves no engine behind. Its own death loses at most the chunk it was writing, a
partial directory the next start removes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from draftsmith.config import ExtractConfig
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.targets import read_config
from draftsmith.extract import common
from draftsmith.extract.spool import ENGINE_LOCK, FeedStatus, Spool
from draftsmith.extract.vllm import _engine_spec, _sink_config, choose_strategy
from draftsmith.extract.vllm import probe as probing
from draftsmith.extract.vllm.driver import Engine, engine_processes, resolve_dtype


def _exit_with_engine(status: FeedStatus, spool: Spool, why: str, code: int) -> None:
    """Kill vLLM's processes (its engine core and workers would outlive this one) and exit now."""
    for pid in engine_processes():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    status.error = why
    with contextlib.suppress(Exception):
        spool.write_status(vars(status))
    os._exit(code)


def watch_parent(parent: int, status: FeedStatus, spool: Spool) -> None:
    """Exit (with vLLM's processes) once the trainer that started this process is gone, or on SIGTERM."""

    def loop() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        _exit_with_engine(status, spool, "the trainer is gone", 3)

    signal.signal(signal.SIGTERM, lambda *_: _exit_with_engine(status, spool, "stopped (SIGTERM)", 143))
    threading.Thread(target=loop, name="draftsmith-watch-trainer", daemon=True).start()


def feed(spool: Spool, status: FeedStatus) -> None:
    job = spool.read_job()
    if job.get("cpus"):  # the cores the trainer left to the engine (it runs on the others)
        os.sched_setaffinity(0, job["cpus"])
    cfg = ExtractConfig.model_validate(job["extract"])
    spool.bound = int(job["bound"])
    spool.drop_leftovers()  # a killed engine's partial chunk would count against the bound
    chunks = [c for c in spool.read_plan() if c.from_engine and not spool.is_ready(c.name)]
    if not chunks:
        status.done = True
        return
    plan = common.plan_extraction(cfg)
    report = probing.probe(architecture=plan.target.architecture, resolve_config=False,
                           config=read_config(plan.target_dir))
    dtype = resolve_dtype(cfg.compute_dtype, report.facts.platform)
    strategy = choose_strategy(cfg.vllm_strategy, report, plan.layer_ids, dtype)
    spec = common.store_spec(plan, backend="vllm", compute_dtype=dtype)
    backend_info = {"engine": "vllm", "vllm": report.facts.version, "strategy": strategy,
                    "platform": report.facts.platform, "online": True}
    sink_config = {**_sink_config(cfg, plan, spec, backend_info), "store": None}
    needed = sorted({i for c in chunks for i in c.engine_ids})
    status.extra = {"strategy": strategy, "vllm": report.facts.version, "platform": report.facts.platform}
    status.waiting = "start"
    spool.write_status(vars(status))
    with Engine(_engine_spec(cfg, plan, report, strategy, sink_config, needed)) as engine:
        status.extra["engine start (s)"] = round(engine.start_seconds, 1)
        for chunk in chunks:
            if spool.is_ready(chunk.name):
                continue

            def waiting(used: int) -> None:
                if status.waiting != "space":
                    status.waiting = "space"
                    spool.write_status(vars(status))

            spool.wait_for_space(chunk.estimate, on_wait=waiting)
            status.waiting, status.chunk = "", chunk.name
            spool.write_status(vars(status))
            start = time.perf_counter()
            engine.open_store(str(spool.begin(chunk.name)))
            engine.generate([(i, plan.dataset[i]["input_ids"].tolist()) for i in chunk.engine_ids])
            engine.wait_for_sink(len(chunk.engine_ids))
            written = sum(r.get("samples_written", 0) for r in engine.finish_store())
            if written != len(chunk.engine_ids):
                raise DraftsmithError(f"chunk {chunk.name}: the engine stored {written} of {len(chunk.engine_ids)} "
                                      "samples")
            status.peak = max(status.peak, spool.usage())  # the chunk is whole and nothing was read yet
            spool.publish(chunk.name)
            status.seconds += time.perf_counter() - start
            status.tokens += chunk.tokens
            status.chunks_done += 1
            spool.write_status(vars(status))
    status.done, status.chunk = True, ""


def main(argv: list[str]) -> int:
    spool = Spool(Path(argv[0]))
    status = FeedStatus(pid=os.getpid())
    watch_parent(os.getppid(), status, spool)
    try:
        with spool.lock(ENGINE_LOCK, wait_s=60.0):
            feed(spool, status)
    except DraftsmithError as err:
        status.error = str(err)
    except Exception as err:  # noqa: BLE001 - reported to the trainer in one line; the traceback is in feed.log
        traceback.print_exc()
        status.error = f"{type(err).__name__}: {err}".replace("\n", " ")
    spool.write_status(vars(status))
    if status.error:
        print(f"draftsmith engine process: {status.error}", file=sys.stderr, flush=True)
    return 1 if status.error else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
