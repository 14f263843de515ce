"""Online training through Mooncake with real vLLM and a real `mooncake_master` on loopback, run as a user runs it:

- the engine node and the trainer node share nothing but the master's address: `draftsmith feed` in one working
  directory (its own copy of the prepared set), `train --remote-engines --spool mooncake://HOST:PORT/RUN` in another
  (no spool path); samples.jsonl and the final weights equal offline training on the same store;
- torchrun with 2 ranks fetching their micro-batches from one engine (rank 0 starts the master);
- kill -9 of the engine process, of the Mooncake master (the trainer restarts it: the chunks it held are computed
  again) and of the trainer, each resumed to the uninterrupted run's final weights, every sample once;
- the spool's failures, each one line: a segment too small for the bound, a stalled trainer (the engine names it), a
  stalled engine (the trainer names it and its log), --spool-gb beyond its filesystem's free space (before any
  engine starts), a filesystem that fills during the run (no restarts).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from online import (
    STEPS,
    TRAIN,
    alive,
    assert_once_per_epoch,
    assert_same_weights,
    draftsmith,
    error_lines,
    read_jsonl,
    steps_done,
    torchrun_offline_and_online,
    wait_for,
    wait_gone,
)

from draftsmith.core.net import free_port
from draftsmith.extract.spool import FeedStatus, Spool


def _mooncake_loads() -> bool:
    try:
        import mooncake.store  # noqa: F401 - the package and the RDMA libraries it loads
    except ImportError:
        return False
    return True


pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.skipif(
        not _mooncake_loads(),
        reason="Mooncake is not installed (the mooncake extra and "
        "Debian's libibverbs1 librdmacm1; .ci/run installs them)",
    ),
]

BOUND_GB = "0.02"  # four one-step chunks and the held-out split's, a fraction of the whole store


class Master:
    """`mooncake_master` on loopback as an operator starts it (the engine node's)."""

    def __init__(self, log: Path):
        from draftsmith.extract.spool.mooncake import master_binary

        self.binary, self.log, self.port, self.proc = master_binary(), log, free_port(), None

    def start(self) -> Master:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    "--rpc_address=127.0.0.1",
                    f"--rpc_port={self.port}",
                    "--metrics_host=127.0.0.1",
                    f"--metrics_port={free_port()}",
                    "--enable_metric_reporting=false",
                ],
                stdout=log,
                stderr=log,
            )
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return self
            except OSError:
                assert time.monotonic() < deadline and self.proc.poll() is None, self.log.read_text()[-2000:]
                time.sleep(0.1)

    def address(self, run: str) -> str:
        return f"mooncake://127.0.0.1:{self.port}/{run}"

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(autouse=True)
def no_process_left():
    """Whatever a test started (trainers, engine processes, masters) is gone after it, passed or failed."""
    yield
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()


@pytest.fixture
def master(tmp_path):
    m = Master(tmp_path / "mooncake_master.log").start()
    yield m
    m.stop()


def children(proc: subprocess.Popen, needle: str) -> list[int]:
    """The pids of `proc`'s descendants whose command line holds `needle`."""
    try:
        return [c.pid for c in psutil.Process(proc.pid).children(recursive=True) if needle in " ".join(c.cmdline())]
    except psutil.Error:
        return []


def feed(master_address: str, node: Path, prepared: Path, *extra: str, log: Path) -> subprocess.Popen:
    """`draftsmith feed` on the "engine node": its own working directory and copy of the prepared set."""
    node.mkdir(parents=True, exist_ok=True)
    copy = node / "prepared"
    if not copy.exists():
        shutil.copytree(prepared, copy)
    return draftsmith(
        "feed",
        "--spool",
        master_address,
        "--prepared",
        copy,
        "--scratch",
        node / "scratch",
        *extra,
        log=log,
        cores=[0],
        cwd=node,
    )


def test_engine_node_and_trainer_node_share_only_the_master_and_train_as_offline(online_reference, master, tmp_path):
    engine_node, trainer_node = tmp_path / "engine-node", tmp_path / "trainer-node"
    trainer_node.mkdir()
    where = master.address("equal")
    engine = feed(where, engine_node, online_reference["prepared"], log=tmp_path / "feed.out")
    done = draftsmith(
        "train",
        "--data",
        online_reference["prepared"],
        "--engine",
        "vllm",
        "--remote-engines",
        "--spool",
        where,
        "--spool-gb",
        BOUND_GB,
        "--output",
        "run",
        "--max-steps",
        STEPS,
        *TRAIN,
        trainer_cores=True,
        cwd=trainer_node,
    )
    assert engine.wait(120) == 0, (tmp_path / "feed.out").read_text()[-3000:]
    run = trainer_node / "run"
    assert read_jsonl(run / "samples.jsonl") == read_jsonl(online_reference["run"] / "samples.jsonl")
    assert len(read_jsonl(run / "samples.jsonl")) == STEPS
    assert_same_weights(run, online_reference["run"])
    # the trainer had no spool of its own, and kept nothing of the engine's once done
    assert "online (vLLM engines, Mooncake)" in done.stdout and where in done.stdout
    assert not (run / "spool").exists() and not (run / "spool-cache").exists()
    # the engine node computed every chunk, and the run's keys are gone from the master
    out = (tmp_path / "feed.out").read_text()
    assert "chunks computed" in out, out[-2000:]
    from draftsmith.extract.spool.mooncake import MooncakeAddress, MooncakeSpool

    probe = MooncakeSpool(MooncakeAddress.parse(where)).connect()
    try:
        assert not probe.has_job() and probe.read_plan() is None
        assert probe.read_trainer() is None and probe.read_status() == FeedStatus()
    finally:
        probe.close()


def test_torchrun_two_ranks_fetch_from_one_engine_through_mooncake(online_reference, tmp_path):
    """rank 0 starts the master on loopback and the engine process; both ranks fetch their own micro-batches of the
    same chunks; the curve equals two ranks reading the store."""
    options = [
        "--max-steps",
        "6",
        "--token-budget",
        "256",
        "--draft-vocab-size",
        "2000",
        "--log-every",
        "1",
        "--warmup-steps",
        "0",
        "--device",
        "cpu",
        "--no-vllm-compile",
        "--engine-dtype",
        "float32",
    ]
    on, off, stdout = torchrun_offline_and_online(
        tmp_path,
        online_reference["store"],
        [
            "--data",
            str(online_reference["prepared"]),
            "--engine",
            "vllm",
            "--spool",
            "mooncake",
            "--spool-gb",
            BOUND_GB,
        ],
        options,
    )
    assert len(on) >= 6 and [x[:3] for x in on] == [x[:3] for x in off]
    assert [x[3] for x in on] == pytest.approx([x[3] for x in off], rel=1e-5)
    assert read_jsonl(tmp_path / "online" / "samples.jsonl") == read_jsonl(tmp_path / "offline" / "samples.jsonl")
    assert "Mooncake" in stdout


def test_kill_9_of_engine_master_and_trainer_each_resume_to_the_same_weights(online_reference, tmp_path):
    run, log = tmp_path / "run", tmp_path / "train.log"
    args = (
        "train",
        "--data",
        online_reference["prepared"],
        "--engine",
        "vllm",
        "--spool",
        "mooncake",
        "--spool-gb",
        BOUND_GB,
        "--output",
        run,
        "--max-steps",
        STEPS,
        *TRAIN,
    )
    trainer = draftsmith(*args, log=log)

    def one(needle: str) -> int:
        found: list[int] = []

        def there() -> bool:
            found[:] = children(trainer, needle)
            return bool(found)

        wait_for(there, trainer, needle)
        return found[0]

    # 1. the engine process, once the run has begun: the trainer restarts it
    wait_for(lambda: steps_done(run) >= 3, trainer, "step 3")
    os.kill(one("draftsmith.extract.vllm.feed"), signal.SIGKILL)
    # 2. the master, with chunks in it: the trainer restarts it, and the chunks it held are computed again
    wait_for(lambda: steps_done(run) >= 9, trainer, "step 9")
    master = one("mooncake_master")
    os.kill(master, signal.SIGKILL)
    wait_for(lambda: steps_done(run) >= 15, trainer, "step 15")
    # 3. the trainer: its master and its engine process die with it
    engine, master = one("draftsmith.extract.vllm.feed"), one("mooncake_master")
    trainer.kill()
    trainer.wait()
    wait_gone(engine, master)
    assert not alive(engine) and not alive(master), "the engine process or the master outlived the trainer"
    text = log.read_text()
    assert "restarting it (1 of 3)" in text and "mooncake_master stopped" in text, text[-3000:]
    # 4. the same command finishes the run
    done = draftsmith(*args)
    assert_once_per_epoch(run)
    assert read_jsonl(run / "samples.jsonl") == read_jsonl(online_reference["run"] / "samples.jsonl")
    assert_same_weights(run, online_reference["run"])
    assert "online (vLLM engines, Mooncake)" in done.stdout


def test_a_segment_too_small_for_the_bound_is_one_line_on_both_sides(online_reference, master, tmp_path):
    where = master.address("small")
    trainer = draftsmith(
        "train",
        "--data",
        online_reference["prepared"],
        "--engine",
        "vllm",
        "--remote-engines",
        "--spool",
        where,
        "--spool-gb",
        BOUND_GB,
        "--output",
        tmp_path / "run",
        "--max-steps",
        STEPS,
        *TRAIN,
        log=tmp_path / "train.log",
    )
    engine = feed(
        where,
        tmp_path / "engine-node",
        online_reference["prepared"],
        "--segment-gb",
        "0.016",
        log=tmp_path / "feed.log",
    )
    assert engine.wait(120) == 1
    assert trainer.wait(120) == 1
    feed_errors = error_lines((tmp_path / "feed.log").read_text())
    assert len(feed_errors) == 1 and "--segment-gb 0.016" in feed_errors[0] and "cannot hold" in feed_errors[0], (
        feed_errors
    )
    train_errors = error_lines((tmp_path / "train.log").read_text())
    assert len(train_errors) == 1 and "--segment-gb 0.016" in train_errors[0], train_errors


def test_a_stalled_trainer_is_named_by_the_engine_and_the_engine_then_by_the_trainer(
    online_reference, master, tmp_path
):
    where = master.address("stall")
    trainer = draftsmith(
        "train",
        "--data",
        online_reference["prepared"],
        "--engine",
        "vllm",
        "--remote-engines",
        "--spool",
        where,
        "--spool-gb",
        BOUND_GB,
        "--output",
        tmp_path / "run",
        "--max-steps",
        STEPS,
        "--stall-timeout-s",
        "15",
        *TRAIN,
        log=tmp_path / "train.log",
    )
    engine = feed(where, tmp_path / "engine-node", online_reference["prepared"], log=tmp_path / "feed.log")
    wait_for(lambda: steps_done(tmp_path / "run") >= 1, trainer, "step 1")
    trainer.send_signal(signal.SIGSTOP)  # the engine fills the spool, then waits for room that never comes
    try:
        assert engine.wait(180) == 1
    finally:
        trainer.send_signal(signal.SIGCONT)
    feed_errors = error_lines((tmp_path / "feed.log").read_text())
    assert len(feed_errors) == 1 and "the trainer of " + where in feed_errors[0], feed_errors
    assert "no progress for 15 s" in feed_errors[0] and "room in the spool" in feed_errors[0]
    # the trainer, resumed, finds the engine process gone: one line naming it, not a wait
    assert trainer.wait(120) == 1
    train_errors = error_lines((tmp_path / "train.log").read_text())
    assert len(train_errors) == 1 and "the engine process" in train_errors[0], train_errors
    assert "stopped" in train_errors[0] or "no progress for 15 s" in train_errors[0], train_errors


def test_a_stalled_engine_ends_the_run_naming_it_and_its_log(online_reference, tmp_path):
    run, log = tmp_path / "run", tmp_path / "train.log"
    trainer = draftsmith(
        "train",
        "--data",
        online_reference["prepared"],
        "--engine",
        "vllm",
        "--spool-gb",
        BOUND_GB,
        "--output",
        run,
        "--max-steps",
        STEPS,
        "--stall-timeout-s",
        "10",
        *TRAIN,
        log=log,
    )
    wait_for(lambda: steps_done(run) >= 1, trainer, "step 1")
    engine = children(trainer, "draftsmith.extract.vllm.feed")[0]
    os.kill(engine, signal.SIGSTOP)
    try:
        assert trainer.wait(120) == 1
    finally:
        with_kill = alive(engine)
        if with_kill:
            os.kill(engine, signal.SIGKILL)
    errors = error_lines(log.read_text())
    assert len(errors) == 1, errors
    assert f"the engine process (pid {engine}" in errors[0] and "no progress for 10 s" in errors[0]
    assert str(run / "feed.log") in errors[0]
    assert "restarting" not in log.read_text()


def _tmpfs(path: Path, size: str) -> Path:
    path.mkdir(parents=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); CI runs as root")
    return path


@pytest.fixture
def small_fs(tmp_path):
    """A 64 MiB tmpfs, as /dev/shm often is in a container."""
    fs = _tmpfs(tmp_path / "shm", "64m")
    yield fs
    subprocess.run(["umount", "-l", str(fs)], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI runs as root)")
def test_spool_gb_beyond_the_free_space_is_refused_before_any_engine_starts(online_reference, small_fs, tmp_path):
    done = draftsmith(
        "train",
        "--data",
        online_reference["prepared"],
        "--engine",
        "vllm",
        "--spool",
        small_fs / "spool",
        "--spool-gb",
        "0.1",
        "--output",
        tmp_path / "run",
        "--max-steps",
        STEPS,
        *TRAIN,
        check=False,
    )
    assert done.returncode == 1
    errors = error_lines(done.stderr)
    assert len(errors) == 1 and "--spool-gb 0.1" in errors[0] and str(small_fs / "spool") in errors[0], done.stderr
    assert "64 MiB free" in errors[0] or "MiB free" in errors[0]
    assert not (tmp_path / "run" / "feed.log").exists(), "an engine started"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI runs as root)")
def test_a_filesystem_that_fills_during_the_run_is_one_line_without_restarts(online_reference, small_fs, tmp_path):
    run, log, spool = tmp_path / "run", tmp_path / "train.log", small_fs / "spool"
    trainer = draftsmith(
        "train",
        "--data",
        online_reference["prepared"],
        "--engine",
        "vllm",
        "--spool",
        spool,
        "--spool-gb",
        BOUND_GB,
        "--output",
        run,
        "--max-steps",
        STEPS,
        *TRAIN,
        log=log,
    )
    # another process fills the filesystem while the engine starts: its first chunk no longer fits
    wait_for(lambda: (run / "feed.log").is_file(), trainer, "the engine process")
    free = shutil.disk_usage(small_fs).free
    with open(small_fs / "filler", "wb") as f:
        f.write(b"\0" * (free - (256 << 10)))
    assert trainer.wait(300) == 1
    errors = error_lines(log.read_text())
    assert len(errors) == 1, errors
    assert str(spool) in errors[0] and "free" in errors[0] and "needs up to" in errors[0], errors[0]
    assert "restarting" not in log.read_text()
    assert Spool(spool).read_status().fatal
