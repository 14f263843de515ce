"""The Mooncake transport of the spool (`draftsmith.extract.spool.mooncake`) against a real `mooncake_master` on
loopback, no vLLM: the job, the plan and the statuses round trip; a chunk published by one process is fetched by
another byte for byte, consumed by two ranks and removed by the last; a master restart loses every key (the
trainer's signal to plan again); a full segment refuses a put instead of evicting a chunk; the engine's segment is
sized from the bound and a too-small one is refused in one line; addresses parse or fail in one line."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_spool import _assert_holds, _samples, _write

from draftsmith.config import ExtractConfig
from draftsmith.core.errors import DraftsmithError
from draftsmith.extract.spool import Chunk, FeedJob, FeedStatus, Plan, TrainerStatus, TransportLost


def _mooncake_loads() -> bool:
    try:
        import mooncake.store  # noqa: F401 - the package and the RDMA libraries it loads
    except ImportError:
        return False
    return True


pytestmark = pytest.mark.skipif(
    not _mooncake_loads(),
    reason="Mooncake is not installed (the mooncake extra and Debian's libibverbs1 librdmacm1; .ci/run installs them)",
)

MiB = 1 << 20


@pytest.fixture
def master(tmp_path):
    from draftsmith.extract.spool.mooncake import MooncakeMaster

    m = MooncakeMaster(tmp_path / "master.log")
    m.start()
    yield m
    m.stop()


def _spool(master, run: str = "unit", **kw):
    from draftsmith.extract.spool.mooncake import MooncakeAddress, MooncakeSpool

    return MooncakeSpool(MooncakeAddress(master.host, master.port, run), **kw).connect()


PUBLISHER = """
import sys
from pathlib import Path
from draftsmith.extract.spool.mooncake import MooncakeAddress, MooncakeSpool
sys.path.insert(0, sys.argv[3])
from test_spool import _samples, _write
spool = MooncakeSpool(MooncakeAddress.parse(sys.argv[1]), segment=96 << 20, scratch=Path(sys.argv[2])).connect()
spool.bound = 64 << 20
for name, seed in (("e0000-s0000000-0000001", 0), ("e0000-s0000002-0000003", 1)):
    _write(spool.begin(name), _samples(range(seed * 10, seed * 10 + 8), seed))
    spool.room(name, 1 << 20)
    spool.publish(name)
print("published", flush=True)
sys.stdin.readline()
"""


def test_a_chunk_published_by_one_process_is_fetched_by_another_and_removed_by_its_last_reader(master, tmp_path):
    trainer = _spool(master)
    publisher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            PUBLISHER,
            f"mooncake://{master.host}:{master.port}/unit",
            str(tmp_path / "scratch"),
            str(Path(__file__).parent),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = publisher.stdout.readline()
        assert line.startswith("published"), line
        names = ["e0000-s0000000-0000001", "e0000-s0000002-0000003"]
        trainer.write_plan(Plan([Chunk(n, 0, 0, 1, [], [], 0, 0) for n in names], 1))
        held = trainer.usage()  # the published chunks' bytes, seen from the other side
        assert held == sum(trainer.chunk_info(n).bytes for n in names) > 8 * 3 * 64 * 2
        info = trainer.chunk_info(names[0])
        assert sorted(info.sample_ids) == list(range(8)) and info.dtype == "bf16" and info.layer_ids == [1, 2, 4]
        # byte for byte: the fetched store holds the very samples written on the other side
        local = trainer.fetch(names[0], tmp_path / "cache" / names[0])
        _assert_holds(local, _write(tmp_path / "expected", _samples(range(8), 0)))
        assert not (tmp_path / "scratch" / f".{names[0]}.partial").exists()  # the publisher's copy is gone
        # two ranks: only the second reader removes it
        assert trainer.consume(names[0], 0, 2) is False and trainer.is_ready(names[0])
        assert trainer.consume(names[0], 1, 2) is True and not trainer.is_ready(names[0])
        assert trainer.fetch(names[0], tmp_path / "again") is None and not (tmp_path / "again").exists()
        assert 0 < trainer.usage() < held
        trainer.finish()
        assert not trainer.is_ready(names[1]) and trainer.read_plan() is None
    finally:
        publisher.stdin.write("\n")
        publisher.stdin.flush()
        publisher.wait(30)
        trainer.close()


def test_job_plan_and_statuses_round_trip_and_a_restarted_master_has_none(master):
    spool = _spool(master)
    try:
        assert not spool.has_job() and spool.read_plan() is None and spool.read_trainer() is None
        with pytest.raises(DraftsmithError, match="no readable job"):
            spool.read_job()
        job = FeedJob(extract=ExtractConfig(backend="vllm", tensor_parallel_size=2), bound=123, cpus=[0, 1])
        spool.write_job(job)
        chunks = [
            Chunk(f"e0000-s{p:07d}-{p:07d}", 0, p, p, list(range(p * 400, p * 400 + 400)), [p], 5, 6)
            for p in range(120)
        ]  # a plan of more than one part
        spool.write_plan(Plan(chunks, 7))
        spool.write_status(FeedStatus(pid=42, chunk="c", waiting="space", segment="s"))
        spool.write_trainer(TrainerStatus(step=9, stall_s=60))
        assert spool.read_job() == job and spool.has_job()
        plan = spool.read_plan()
        assert plan.generation == 7 and plan.chunks == chunks
        status = spool.read_status()
        assert (status.pid, status.chunk, status.waiting, status.segment) == (42, "c", "space", "s")
        assert status.updated > 0
        trainer = spool.read_trainer()
        assert (trainer.step, trainer.stall_s, trainer.finished) == (9, 60, False)
        # the master dies and comes back on the same port: every key is gone, and the client writes again
        master.restart()
        assert not spool.has_job() and spool.read_plan() is None
        deadline = time.monotonic() + 60
        while True:  # the client mounts its segment on the new master within seconds
            try:
                spool.write_job(job.model_copy(update={"bound": 5}))
                break
            except TransportLost:
                assert time.monotonic() < deadline, "the client never came back to the restarted master"
                time.sleep(0.5)
        assert spool.read_job().bound == 5
    finally:
        spool.close()


def test_a_full_segment_refuses_a_put_instead_of_evicting_what_it_holds(master):
    spool = _spool(master, segment=16 * MiB)
    try:
        spool._put_blob(spool._key("first"), b"\1" * (6 * MiB))
        with pytest.raises(TransportLost):
            for k in range(4):
                spool._put_blob(spool._key(f"more{k}"), b"\2" * (6 * MiB))
        assert spool._exists(spool._key("first.0"))  # nothing was evicted to make room
    finally:
        spool.close()


def test_the_engine_segment_holds_the_bound_and_a_smaller_one_is_refused_in_one_line():
    from draftsmith.extract.spool.mooncake import engine_segment, segment_bytes

    bound = 100 * MiB
    assert segment_bytes(bound) >= bound / 0.8 and segment_bytes(bound) % MiB == 0
    assert engine_segment(bound, None) == segment_bytes(bound)
    assert engine_segment(bound, 0.5) == 512 * MiB
    assert engine_segment(1 * MiB, 0.001) == 16 * MiB  # Mooncake mounts 16 MiB at least
    with pytest.raises(DraftsmithError) as err:
        engine_segment(bound, 0.1)
    message = str(err.value)
    assert "\n" not in message and "--segment-gb 0.1" in message and "cannot hold" in message
    suggested = float(message.split("give --segment-gb ")[1].split()[0])
    assert engine_segment(bound, suggested) >= bound / 0.8  # the suggestion is enough


def test_an_unreachable_master_is_one_line_naming_it():
    from draftsmith.extract.spool.mooncake import MooncakeAddress, MooncakeSpool

    with pytest.raises(DraftsmithError) as err:
        MooncakeSpool(MooncakeAddress("127.0.0.1", 1, "x")).connect(timeout=1.0)
    assert "cannot reach Mooncake's master at 127.0.0.1:1" in str(err.value)
