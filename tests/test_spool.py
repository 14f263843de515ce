"""The online spool without starting vLLM: the chunk plan (plan_chunks), the spool directory (Spool), and absorbing a
chunk into the --keep-epoch0 store (absorb_store)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from draftsmith.config import ExtractConfig, TrainConfig
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.manifest import TargetIdentity
from draftsmith.core.sizing import SPOOL_CHUNKS, GiB
from draftsmith.extract import spool as spool_mod
from draftsmith.extract import store
from draftsmith.extract.spool import (
    ENGINE_LOCK,
    EVAL_CHUNK,
    TRAINER_LOCK,
    Chunk,
    FeedJob,
    FeedStatus,
    Plan,
    Spool,
    TrainerStatus,
    chunk_bytes,
    chunk_name,
    disk_bytes,
    wait_for_space,
)
from draftsmith.extract.store.shards import shard_name
from draftsmith.train import engine_supervisor
from draftsmith.train.batches import TokenBudgetSampler
from draftsmith.train.engine_source import plan_chunks

H, LAYERS = 256, 3  # hidden size, stored layers (2 aux + the last)
BUDGET = 128


# ---------------------------------------------------------------------------------------------- plan_chunks


def _lengths(n: int = 60, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(6, 60, size=n).astype(np.int64)


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(data="prepared", output="run", engine="vllm", token_budget=BUDGET, **kw)


def _samplers(ids, lengths, world: int = 1) -> list[TokenBudgetSampler]:
    return [TokenBudgetSampler(ids, lengths, BUDGET, 0, r, world) for r in range(world)]


def _steps(samplers, epoch: int, grad_accum: int) -> list[list[list[int]]]:
    """Each optimizer step of `epoch` as its micro-batches, rank by rank."""
    per_rank = [s.batches(epoch) for s in samplers]
    n = len(per_rank[0]) // grad_accum
    return [[b for batches in per_rank for b in batches[p * grad_accum : (p + 1) * grad_accum]] for p in range(n)]


def _step_bytes(step: list[list[int]], lengths) -> int:
    ids = [i for b in step for i in b]
    return chunk_bytes(int(lengths[ids].sum()), len(ids), H, LAYERS, "bf16")


class Setup:
    """A tiny training split (and held-out split) with samplers, and the plan of an uninterrupted run."""

    def __init__(
        self,
        world: int = 1,
        grad_accum: int = 1,
        epochs: int | None = 2,
        max_steps: int | None = None,
        n_eval: int = 6,
        steps_per_chunk: float = 2.6,
        **cfg,
    ):
        self.lengths = _lengths()
        ids = np.arange(len(self.lengths))
        self.eval_ids = [int(i) for i in ids[:n_eval]]
        self.train_ids = ids[n_eval:]
        self.cfg = _cfg(grad_accum=grad_accum, **cfg)
        self.samplers = _samplers(self.train_ids, self.lengths, world)
        self.grad_accum, self.epochs = grad_accum, epochs
        n_epochs = epochs if epochs is not None else 4
        self.steps = {e: _steps(self.samplers, e, grad_accum) for e in range(n_epochs)}
        self.total = max_steps if max_steps is not None else sum(len(s) for s in self.steps.values())
        biggest = max(_step_bytes(s, self.lengths) for st in self.steps.values() for s in st)
        self.eval_estimate = (
            chunk_bytes(int(self.lengths[self.eval_ids].sum()), n_eval, H, LAYERS, "bf16") if n_eval else 0
        )
        self.bound = int(SPOOL_CHUNKS * biggest * steps_per_chunk) + self.eval_estimate
        self.limit = (self.bound - self.eval_estimate) // SPOOL_CHUNKS

    def plan(self, start=(0, 0, 0), kept: set[int] | None = None, bound: int | None = None):
        return plan_chunks(
            self.cfg,
            self.samplers,
            self.eval_ids,
            self.lengths,
            LAYERS,
            H,
            self.bound if bound is None else bound,
            start,
            self.total,
            self.epochs,
            kept or set(),
        )


def _train_chunks(chunks):
    return [c for c in chunks if c.name != EVAL_CHUNK]


def test_every_step_of_every_epoch_is_in_exactly_one_chunk_in_order_and_chunks_fit_the_bound():
    s = Setup()
    chunks = s.plan()
    train = _train_chunks(chunks)
    seen = [(c.epoch, p) for c in train for p in range(c.first, c.last + 1)]
    assert seen == [(e, p) for e in range(2) for p in range(len(s.steps[e]))]
    assert sum(c.last + 1 - c.first for c in train) == s.total
    for c in train:
        assert c.sample_ids == [i for p in range(c.first, c.last + 1) for b in s.steps[c.epoch][p] for i in b]
        assert c.engine_ids == c.sample_ids and c.from_engine  # no --keep-epoch0: the engines compute everything
        assert c.tokens == int(s.lengths[c.sample_ids].sum())
        assert c.name == chunk_name(c.epoch, c.first, c.last)
        assert c.estimate <= (s.bound - s.eval_estimate) / SPOOL_CHUNKS
    assert len({c.name for c in chunks}) == len(chunks)
    assert any(c.last > c.first for c in train), "the bound holds several steps: chunks must pack them"
    for a, b in itertools.pairwise(train):  # greedy: the next chunk's first step did not fit into this one
        if a.epoch == b.epoch:
            packed = sum(_step_bytes(s.steps[a.epoch][p], s.lengths) for p in range(a.first, b.first + 1))
            assert packed > s.limit
        else:
            assert b.first == 0  # boundaries are counted from each epoch's first step


def test_the_held_out_chunk_is_second_and_its_bytes_leave_room_for_four_chunks():
    s = Setup()
    chunks = s.plan()
    ev = chunks[1]
    assert ev.name == EVAL_CHUNK and ev.epoch == -1 and ev.sample_ids == s.eval_ids == ev.engine_ids
    assert ev.estimate == s.eval_estimate and [c.name for c in chunks].count(EVAL_CHUNK) == 1
    assert chunks[0].epoch == 0 and chunks[0].first == 0
    # a bigger held-out split leaves less for the training chunks: more, smaller chunks under the same bound
    more = Setup(n_eval=14)
    more.bound = s.bound
    fewer_room = _train_chunks(more.plan())
    assert all(c.estimate <= (s.bound - more.plan()[1].estimate) // SPOOL_CHUNKS for c in fewer_room)
    # no held-out split: no eval chunk
    none = Setup(n_eval=0)
    assert EVAL_CHUNK not in [c.name for c in none.plan()]


@pytest.mark.parametrize("epoch", [0, 1])
def test_a_resume_inside_a_chunk_asks_for_the_same_chunks_as_the_uninterrupted_run(epoch):
    s = Setup()
    full = _train_chunks(s.plan())
    before = sum(len(s.steps[e]) for e in range(epoch))
    inside = [k for k, c in enumerate(full) if c.epoch == epoch and c.last > c.first]
    assert inside
    for k in inside:
        c = full[k]
        for position in range(c.first, c.last + 1):  # the chunk's first step too (a resume on a boundary)
            resumed = s.plan(start=(before + position, epoch, position))
            assert resumed[1].name == EVAL_CHUNK
            assert _train_chunks(resumed) == full[k:], (k, position)  # same names, boundaries, samples
            assert resumed[0].sample_ids == c.sample_ids  # asked for whole


def test_max_steps_truncates_the_last_chunk_and_crosses_epochs():
    s0 = Setup()
    first_epoch = len(s0.steps[0])
    e1 = next(c for c in _train_chunks(s0.plan()) if c.epoch == 1 and c.last > c.first)
    total = first_epoch + e1.first + 1  # ends one step into a chunk of epoch 1
    s = Setup(epochs=None, max_steps=total)
    chunks = _train_chunks(s.plan())
    assert sum(c.last + 1 - c.first for c in chunks) == total
    last = chunks[-1]
    assert (last.epoch, last.first, last.last) == (1, e1.first, e1.first)
    assert last.name == chunk_name(1, e1.first, e1.first)
    assert last.sample_ids == [i for b in s.steps[1][e1.first] for i in b]
    assert chunks[:-1] == _train_chunks(s0.plan())[: len(chunks) - 1]  # the chunks before it are the same
    resumed = _train_chunks(s.plan(start=(total - 1, 1, e1.first)))
    assert resumed == [last]


def test_max_steps_past_the_epochs_runs_more_epochs():
    s0 = Setup()
    total = len(s0.steps[0]) + len(s0.steps[1]) + 2
    s = Setup(epochs=None, max_steps=total)
    chunks = _train_chunks(s.plan())
    assert sum(c.last + 1 - c.first for c in chunks) == total
    assert chunks[-1].epoch == 2 and chunks[-1].last == 1


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_with_two_ranks_each_step_holds_both_ranks_micro_batches(grad_accum):
    s = Setup(world=2, grad_accum=grad_accum)
    per_rank = {e: [smp.batches(e) for smp in s.samplers] for e in range(2)}
    for c in _train_chunks(s.plan()):
        expected = []
        for p in range(c.first, c.last + 1):
            step = []
            for r in range(2):
                mine = per_rank[c.epoch][r][p * grad_accum : (p + 1) * grad_accum]
                assert len(mine) == grad_accum
                step += [i for b in mine for i in b]
            expected += step
        assert sorted(c.sample_ids) == sorted(expected) and len(c.sample_ids) == len(set(c.sample_ids))
    used = len(s.steps[0]) * grad_accum  # micro-batches of whole steps (a smaller rest is dropped)
    rank_ids = [{i for b in per_rank[0][r][:used] for i in b} for r in range(2)]
    assert rank_ids[0] and rank_ids[1] and not rank_ids[0] & rank_ids[1]
    planned = {i for c in _train_chunks(s.plan()) if c.epoch == 0 for i in c.sample_ids}
    assert planned == rank_ids[0] | rank_ids[1]


def test_keep_epoch0_later_epochs_compute_only_what_epoch0_did_not_keep(tmp_path):
    s = Setup(epochs=3, grad_accum=2, keep_epoch0=tmp_path / "kept")
    chunks = s.plan()
    train = _train_chunks(chunks)
    epoch0 = {i for c in train if c.epoch == 0 for i in c.sample_ids}
    assert all(c.engine_ids == c.sample_ids for c in train if c.epoch == 0)
    later = [c for c in train if c.epoch >= 1]
    assert later
    for c in later:
        assert c.engine_ids == [i for i in c.sample_ids if i not in epoch0]
        assert c.tokens == int(s.lengths[c.engine_ids].sum()) if c.engine_ids else c.tokens == 0
        assert c.estimate == chunk_bytes(c.tokens, len(c.engine_ids), H, LAYERS, "bf16")
    # grad_accum 2 drops an odd micro-batch each epoch: what epoch 0 never read comes from the engines later
    dropped = set(s.train_ids.tolist()) - epoch0
    assert {i for c in later for i in c.engine_ids} <= dropped
    assert all(not c.from_engine for c in later if not set(c.sample_ids) & dropped)


def test_keep_epoch0_a_resumed_run_does_not_recompute_kept_samples(tmp_path):
    s = Setup(epochs=2, keep_epoch0=tmp_path / "kept")
    full = _train_chunks(s.plan())
    kept = set(full[0].sample_ids) | set(full[1].sample_ids)  # a crash after two chunks
    c = full[1]
    resumed = s.plan(start=(c.last, 0, c.last), kept=kept)
    ev = resumed[1]
    assert ev.name == EVAL_CHUNK and ev.engine_ids == s.eval_ids
    for chunk in _train_chunks(resumed):
        if chunk.epoch == 0:
            assert chunk.engine_ids == [i for i in chunk.sample_ids if i not in kept]
        else:
            epoch0 = kept | {i for x in full if x.epoch == 0 for i in x.sample_ids}
            assert chunk.engine_ids == [i for i in chunk.sample_ids if i not in epoch0]
    assert _train_chunks(resumed)[0].name == c.name and not _train_chunks(resumed)[0].from_engine
    assert [(x.name, x.sample_ids) for x in _train_chunks(resumed)] == [(x.name, x.sample_ids) for x in full[1:]]
    assert all(x.engine_ids == [] and x.tokens == 0 for x in _train_chunks(resumed) if x.epoch == 1)
    # some held-out samples kept: only the others are computed
    part = s.plan(kept=set(s.eval_ids[:3]))
    assert part[1].name == EVAL_CHUNK and part[1].engine_ids == s.eval_ids[3:]
    # without --keep-epoch0, samples handed in as kept are computed anyway
    plain = Setup(epochs=2)
    assert all(x.engine_ids == x.sample_ids for x in plain.plan(kept=kept | set(s.eval_ids)))


def test_keep_epoch0_a_resume_after_the_held_out_chunk_was_kept_keeps_the_chunk_boundaries(tmp_path):
    s = Setup(epochs=2, keep_epoch0=tmp_path / "kept")
    full = _train_chunks(s.plan())
    c = full[1]
    kept = set(full[0].sample_ids) | set(s.eval_ids)  # chunk 0 and the held-out chunk (read second) were kept
    resumed = s.plan(start=(c.last, 0, c.last), kept=kept)
    assert [(x.epoch, x.first, x.last) for x in _train_chunks(resumed)] == [
        (x.epoch, x.first, x.last) for x in full[1:]
    ]


def test_fp8_chunks_are_smaller_so_more_steps_fit():
    s, f = Setup(), Setup(spool_dtype="fp8")
    f.bound = s.bound
    bf16, fp8 = _train_chunks(s.plan()), _train_chunks(f.plan())
    assert len(fp8) < len(bf16)
    assert all(c.estimate == chunk_bytes(c.tokens, len(c.engine_ids), H, LAYERS, "fp8") for c in fp8)


def _biggest_step(s: Setup) -> int:
    return max(_step_bytes(st, s.lengths) for e in range(2) for st in s.steps[e])


def test_a_bound_too_small_for_one_step_names_spool_gb_and_the_gib_needed():
    s = Setup()
    need = SPOOL_CHUNKS * _biggest_step(s) + s.eval_estimate
    assert _train_chunks(s.plan(bound=need))  # exactly enough: one step a chunk
    with pytest.raises(DraftsmithError) as err:
        s.plan(bound=need - 1)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"--spool-gb {s.cfg.spool_gb:g}:")
    suggested = float(re.search(r"raise --spool-gb to ([0-9.]+) or more", msg)[1])
    assert suggested == pytest.approx(need / GiB, rel=0.01)
    assert "held-out split" in msg
    with pytest.raises(DraftsmithError, match="--spool-gb"):
        s.plan(bound=s.eval_estimate // 2)  # smaller than the held-out chunk alone


def test_the_spool_gb_a_too_small_bound_suggests_is_enough():
    """The suggested --spool-gb must hold four chunks of the biggest step besides the held-out chunk."""
    s = Setup()
    need = SPOOL_CHUNKS * _biggest_step(s) + s.eval_estimate
    with pytest.raises(DraftsmithError) as err:
        s.plan(bound=need - 1)
    suggested = float(re.search(r"raise --spool-gb to ([0-9.]+)", str(err.value))[1])
    assert suggested > 0
    assert _train_chunks(s.plan(bound=int(suggested * GiB)))  # fits


# ---------------------------------------------------------------------------------------------- the chunk store


def _target() -> TargetIdentity:
    return TargetIdentity(
        path="/targets/tiny",
        architecture="LlamaForCausalLM",
        config_hash="cfg",
        tokenizer_hash="tok",
        num_layers=4,
        hidden_size=H,
        vocab_size=320,
    )


def _spec(dtype: str = "bf16") -> store.StoreSpec:
    return store.StoreSpec(
        target=_target(),
        layer_ids=[1, 2, 4],
        hidden_size=H,
        dtype=dtype,
        prepared=store.PreparedRef(path="/data/prepared", fingerprint="fp", num_samples=100),
    )


def _samples(ids, seed: int = 0) -> dict[int, dict]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in ids:
        t = int(torch.randint(3, 40, (1,), generator=g))
        out[i] = {
            "input_ids": torch.randint(0, 320, (t,), generator=g),
            "loss_mask": torch.rand(t, generator=g) > 0.5,
            "hidden_states": torch.randn(t, LAYERS, H, generator=g),
        }
    return out


def _write(path: Path, samples: dict[int, dict], dtype: str = "bf16", **kw) -> Path:
    with store.create_or_resume(path, _spec(dtype), **kw) as writer:
        for i, s in samples.items():
            writer.add(i, s["input_ids"], s["loss_mask"], s["hidden_states"])
    return path


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_a_chunk_store_takes_no_more_disk_than_its_estimate(tmp_path, dtype):
    samples = _samples(range(20))
    path = _write(tmp_path / "chunk", samples, dtype)
    tokens = sum(len(s["input_ids"]) for s in samples.values())
    used = disk_bytes(path)
    assert used <= chunk_bytes(tokens, len(samples), H, LAYERS, dtype)
    assert used >= tokens * LAYERS * H * (2 if dtype == "bf16" else 1)  # it did count the states


# ---------------------------------------------------------------------------------------------- the spool


def _chunk(spool: Spool, name: str, ids, seed: int = 0) -> None:
    _write(spool.begin(name), _samples(ids, seed))
    spool.publish(name)


def test_publish_is_atomic_a_partial_chunk_is_invisible(tmp_path):
    spool = Spool(tmp_path / "spool")
    spool.create()
    name = chunk_name(0, 0, 3)
    partial = spool.begin(name)
    _write(partial, _samples(range(4)))
    assert (partial / "manifest.json").is_file()  # a whole store, but still a partial: not ready
    assert not spool.is_ready(name) and not spool.chunk_path(name).exists()
    spool.publish(name)
    assert spool.is_ready(name) and not partial.exists()
    assert [int(i) for i in store.open(spool.chunk_path(name)).sample_ids] == [0, 1, 2, 3]
    # a partial left by a crash is replaced by the next begin
    spool.partial_path("x").mkdir()
    (spool.partial_path("x") / "junk").write_text("left by a crash")
    assert not spool.begin("x").exists() and not spool.is_ready("x")


def test_consume_with_two_ranks_deletes_only_after_both(tmp_path):
    spool = Spool(tmp_path / "spool")
    spool.create()
    a, b = chunk_name(0, 0, 1), chunk_name(0, 2, 3)
    _chunk(spool, a, [0, 1])
    _chunk(spool, b, [2, 3])
    assert spool.consume(a, 1, 2) is False and spool.is_ready(a)
    assert spool.consume(a, 1, 2) is False and spool.is_ready(a)  # the same rank twice is still one rank
    assert spool.consume(a, 0, 2) is True and not spool.chunk_path(a).exists()
    assert not list((spool.path / "consumed").iterdir())  # its markers go with it
    assert spool.is_ready(b)
    assert spool.consume(b, 0, 1) is True and not spool.is_ready(b)  # one rank: at once
    assert sorted(p.name for p in spool.chunks.iterdir()) == []


def test_remove_twice_is_harmless(tmp_path):
    spool = Spool(tmp_path / "spool")
    spool.create()
    _chunk(spool, "c", [0])
    assert spool.remove("c") is True
    assert spool.remove("c") is False
    assert spool.remove("never-there") is False
    assert list(spool.chunks.iterdir()) == []


def test_clean_removes_leftovers_and_stale_chunks_and_keeps_the_named_ones(tmp_path):
    spool = Spool(tmp_path / "spool")
    spool.create()
    keep, stale = chunk_name(1, 0, 2), chunk_name(0, 0, 2)
    for name, ids in ((keep, [0, 1]), (stale, [2, 3]), (EVAL_CHUNK, [4])):
        _chunk(spool, name, ids)
    half = spool.begin(chunk_name(1, 3, 4))
    half.mkdir()
    (half / "part").write_bytes(b"x" * 100)
    deleted = spool.chunks / f".{chunk_name(0, 3, 4)}.deleted.12345"
    deleted.mkdir()
    marks = spool.path / "consumed"
    for m in (f"{keep}.rank1", f"{stale}.rank0", f"{chunk_name(0, 9, 9)}.rank1"):
        (marks / m).touch()
    removed = spool.clean({keep, EVAL_CHUNK})
    assert sorted(removed) == sorted([stale, half.name, deleted.name])
    assert sorted(p.name for p in spool.chunks.iterdir()) == sorted([keep, EVAL_CHUNK])
    assert spool.is_ready(keep) and spool.is_ready(EVAL_CHUNK)
    assert [p.name for p in marks.iterdir()] == [f"{keep}.rank1"]
    assert spool.clean(set()) == sorted([keep, EVAL_CHUNK]) and list(spool.chunks.iterdir()) == []
    assert Spool(tmp_path / "missing").clean(set()) == []


def test_disk_bytes_counts_allocated_blocks(tmp_path):
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    (d / "one").write_bytes(b"x")
    (d / "sub" / "big").write_bytes(os.urandom(10_000))
    with open(d / "sparse", "wb") as f:
        f.truncate(1 << 20)  # no blocks allocated: counted at its size
    blocks = {p: os.stat(d / p).st_blocks * 512 for p in ("one", "sub/big")}
    assert blocks["one"] > 1  # a filesystem allocates whole blocks
    assert disk_bytes(d) == blocks["one"] + max(blocks["sub/big"], 10_000) + (1 << 20)
    assert disk_bytes(tmp_path / "nothing") == 0
    # the spool's usage is its chunks' bytes: files beside chunks/ (the job, plan and status) do not count
    total = disk_bytes(d)
    spool = Spool(tmp_path / "spool")
    spool.create()
    assert spool.usage() == 0 and Spool(tmp_path / "never-created").usage() == 0
    d.rename(spool.chunks / chunk_name(0, 0, 1))
    (spool.path / "status.json").write_bytes(b"x" * 50_000)
    assert spool.usage() == total and spool.peak == total
    (spool.chunks / chunk_name(0, 0, 1) / "sparse").unlink()
    assert spool.usage() == total - (1 << 20) and spool.peak == total  # the peak stays


def test_wait_for_space_blocks_until_another_thread_removes_a_chunk(tmp_path):
    spool = Spool(tmp_path / "spool")
    spool.create()
    name = chunk_name(0, 0, 9)
    _chunk(spool, name, range(30))
    used = spool.usage()
    needed = used // 2
    spool.bound = used + needed - 1  # one byte short
    seen: list[int] = []
    returned: list[float] = []

    def waiter():
        wait_for_space(spool, needed, on_wait=seen.append)
        returned.append(time.monotonic())

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    time.sleep(0.4)
    assert thread.is_alive() and not returned, "returned while the spool was full"
    assert seen and all(u + needed > spool.bound for u in seen)
    removed_at = time.monotonic()
    assert spool.remove(name)
    thread.join(5)
    assert not thread.is_alive() and returned and returned[0] >= removed_at
    assert returned[0] - removed_at < 2.0
    assert spool.peak >= used


def test_wait_for_space_gives_up_when_told_to_stop_and_never_waits_unbounded(tmp_path):
    spool = Spool(tmp_path / "spool", bound=1000)
    spool.create()
    (spool.path / "status.json").write_bytes(b"x" * 5000)  # beside chunks/: not held against the bound
    calls = []
    wait_for_space(spool, 10, stop=lambda: calls.append(1) or True)
    assert calls == []  # there was room: it never waited
    (spool.chunks / "f").write_bytes(b"x" * 5000)
    t0 = time.monotonic()
    wait_for_space(spool, 10, stop=lambda: calls.append(1) or len(calls) >= 3)
    assert len(calls) == 3 and time.monotonic() - t0 < 2
    wait_for_space(Spool(tmp_path / "spool"), 1 << 40)  # no bound: returns at once


def test_the_trainer_lock_refuses_a_second_holder_with_one_line_naming_the_spool(tmp_path):
    path = tmp_path / "spool"
    first, second = Spool(path), Spool(path)
    with first.lock(TRAINER_LOCK):
        with pytest.raises(DraftsmithError) as err, second.lock(TRAINER_LOCK):
            pytest.fail("a second trainer got the lock")
        msg = str(err.value)
        assert "\n" not in msg and f"--spool {path}" in msg and "another trainer" in msg
        with second.lock(ENGINE_LOCK):  # the engine process's lock is another lock
            with pytest.raises(DraftsmithError, match="an engine process"):
                with first.lock(ENGINE_LOCK):
                    pass
    with second.lock(TRAINER_LOCK):  # released: free again
        pass


def test_a_lock_waits_for_its_holder_up_to_wait_s(tmp_path):
    spool = Spool(tmp_path / "spool")
    held, release = threading.Event(), threading.Event()

    def holder():
        with Spool(spool.path).lock(ENGINE_LOCK):
            held.set()
            release.wait(5)

    thread = threading.Thread(target=holder, daemon=True)
    thread.start()
    assert held.wait(5)
    threading.Timer(0.3, release.set).start()
    t0 = time.monotonic()
    with spool.lock(ENGINE_LOCK, wait_s=5.0):
        waited = time.monotonic() - t0
    thread.join(5)
    assert 0.2 < waited < 4


def test_plan_job_and_status_round_trip(tmp_path):
    s = Setup()
    spool = Spool(tmp_path / "spool")
    spool.create()
    chunks = s.plan()
    assert spool.read_plan() is None  # none written yet
    spool.write_plan(Plan(chunks, 3))
    assert spool.read_plan() == Plan(chunks, 3)
    # a plan.json written before plans had generations (a bare list of chunks) reads as generation 0
    (spool.path / "plan.json").write_text(json.dumps([dataclasses.asdict(c) for c in chunks[:2]]))
    assert spool.read_plan() == Plan(chunks[:2], 0)
    # a status with a field this version does not know (a newer engine process's): read, the field ignored
    (spool.path / "status.json").write_text(
        json.dumps({"pid": 7, "tokens": 100, "seconds": 4.0, "waiting": "space", "unknown": 1})
    )
    status = spool.read_status()
    assert (status.pid, status.tokens_per_s, status.waiting) == (7, 25.0, "space")
    spool.write_status(FeedStatus(pid=8, waiting="plan", engine_started=True))
    status = spool.read_status()
    assert (status.pid, status.waiting, status.engine_started) == (8, "plan", True) and status.updated > 0
    # a status that does not parse (`waiting` is one of four words) reads as no report yet
    (spool.path / "status.json").write_text(json.dumps({"pid": 9, "waiting": "lunch"}))
    assert spool.read_status() == FeedStatus()
    with pytest.raises(DraftsmithError, match="no readable job"):
        spool.read_job()
    (spool.path / "job.json").write_text("{not json")
    with pytest.raises(DraftsmithError, match="no readable job"):
        spool.read_job()
    job = FeedJob(
        extract=ExtractConfig(prepared=tmp_path / "prepared", backend="vllm"),
        bound=5_000,
        cpus=[1],
        prepared_digest="abc",
        stall_s=60.0,
    )
    spool.write_job(job)
    assert spool.read_job() == job and spool.read_job().extract.prepared == tmp_path / "prepared"


def test_the_stall_limit_runs_from_an_engine_process_first_report_its_imports_are_no_stall(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_supervisor, "FIRST_REPORT_S", 1.0)
    spool = Spool(tmp_path / "spool")
    spool.create()
    spool.write_job(FeedJob(extract=ExtractConfig(prepared=tmp_path / "prepared", backend="vllm"), bound=5_000))
    cfg = _cfg(remote_engines=True, stall_timeout_s=0.2)
    supervisor = engine_supervisor.EngineSupervisor(cfg, spool, [], set(), [1, 2], 5_000, None, None, None)
    chunk = Setup().plan()[0]
    spool.write_status(FeedStatus(waiting="start"))  # the trainer's, before any engine process reported
    supervisor.poll(chunk)
    time.sleep(0.5)  # past the stall limit, inside the first report's
    assert supervisor.poll(chunk) is engine_supervisor.Event.QUIET
    spool.write_status(FeedStatus(pid=5, host="node", waiting="space"))  # its first report
    assert supervisor.poll(chunk) is engine_supervisor.Event.PROGRESS
    (spool.path / "status.json").unlink()  # a stopped engine's report gone with it (its Mooncake keys): it did report
    supervisor.poll(chunk)
    time.sleep(0.3)  # past the stall limit with no report
    with pytest.raises(
        DraftsmithError, match=r"pid 5 on node\) has made no progress for 0.2 s \(last waiting for space"
    ):
        supervisor.poll(chunk)
    # a process that never reports is named once the first report's limit is over
    spool.write_status(FeedStatus(waiting="start"))
    fresh = engine_supervisor.EngineSupervisor(cfg, spool, [], set(), [1, 2], 5_000, None, None, None)
    fresh.poll(chunk)
    time.sleep(1.1)
    with pytest.raises(DraftsmithError, match=r"the engine process has made no progress for 1 s \(with no report yet"):
        fresh.poll(chunk)


def test_fetch_copies_a_ready_chunk_out_and_the_copy_outlives_the_spools(tmp_path):
    spool = Spool(tmp_path / "spool")
    spool.create()
    name = chunk_name(0, 0, 4)
    _chunk(spool, name, range(5), seed=3)
    want = _raw(spool.chunk_path(name))
    into = tmp_path / "cache" / "rank0" / name
    into.parent.mkdir(parents=True)
    assert spool.fetch(name, into, keep=True) == into
    assert sorted(p.name for p in into.parent.iterdir()) == [name]  # no partial copy left beside it
    assert spool.is_ready(name)  # copied, not moved
    assert spool.remove(name) and not spool.chunk_path(name).exists()
    got = _raw(into)
    assert sorted(got) == sorted(want) == [0, 1, 2, 3, 4]
    for i in want:
        assert torch.equal(got[i]["hidden_states"], want[i]["hidden_states"]), i
    # without keep, a directory spool's reader reads the chunk where it is
    other = chunk_name(0, 5, 6)
    _chunk(spool, other, [5, 6])
    assert spool.fetch(other, tmp_path / "cache" / "rank0" / other) == spool.chunk_path(other)
    assert not (tmp_path / "cache" / "rank0" / other).exists()
    # not ready (never written, removed, or still partial): None, and nothing made in `into`
    spool.begin(chunk_name(1, 0, 0)).mkdir()
    for missing in (chunk_name(1, 0, 0), name, "never-there"):
        assert spool.fetch(missing, tmp_path / "cache" / missing, keep=True) is None
        assert spool.fetch(missing, tmp_path / "cache" / missing) is None
        assert not (tmp_path / "cache" / missing).exists()


def test_room_refuses_a_chunk_larger_than_the_free_space_in_one_line(tmp_path, monkeypatch):
    from draftsmith.extract.spool import chunks

    spool = Spool(tmp_path / "spool")
    spool.create()
    name = chunk_name(0, 3, 7)
    asked = []
    monkeypatch.setattr(chunks, "free_bytes", lambda path: asked.append(Path(path)) or 3 * 1024**2)
    spool.room(name, 3 * 1024**2)  # exactly what is free: it fits
    assert asked == [spool.partial_path(name)] and spool.partial_path(name).parent == spool.chunks  # staged in place
    with pytest.raises(DraftsmithError) as err:
        spool.room(name, 5 * 1024**3)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{spool.partial_path(name)}:")
    assert "3 MiB free" in msg and "needs up to 5 GiB" in msg and f"chunk {name}" in msg
    with pytest.raises(DraftsmithError, match="3 MiB free"):
        spool.room(name, 3 * 1024**2 + 1)  # one byte more than is free


# ---------------------------------------------------------------------------------------------- absorb_store


def _raw(path: Path) -> dict[int, dict]:
    st = store.open(path, dtype=None)
    return {int(st[k]["sample_id"]): st[k] for k in range(len(st))}


def _assert_holds(path: Path, *parts: Path) -> None:
    got = _raw(path)
    want: dict[int, dict] = {}
    for p in parts:
        want.update(_raw(p))
    assert sorted(got) == sorted(want)
    for i, item in want.items():
        for key in ("input_ids", "loss_mask", "hidden_states"):
            assert torch.equal(got[i][key], item[key]), (i, key)
    report = store.verify_store(path)
    assert report.ok and not report.problems and not report.orphans, report
    assert report.num_samples == len(want)
    assert store.open(path).manifest.num_samples == len(want)


def test_absorbing_two_chunks_makes_a_verified_store_holding_both(tmp_path):
    a = _write(tmp_path / "a", _samples(range(10), seed=1), shard_bytes=20_000)
    b = _write(tmp_path / "b", _samples(range(10, 16), seed=2))
    kept = tmp_path / "kept"
    assert store.absorb_store(kept, a, tag=chunk_name(0, 0, 1)) == 10
    assert store.absorb_store(kept, b, tag=chunk_name(0, 2, 3)) == 6
    _assert_holds(kept, a, b)
    assert len(store.open(kept).manifest.shards) == len(store.open(a).manifest.shards) + 1
    manifest = (kept / "manifest.json").read_text()
    assert store.absorb_store(kept, a, tag=chunk_name(0, 0, 1)) == 0  # again: nothing added
    assert store.absorb_store(kept, b, tag="other-tag") == 0
    assert (kept / "manifest.json").read_text() == manifest
    _assert_holds(kept, a, b)
    shutil.rmtree(a)  # the chunk can go: the kept store's shards are its own files (hard links)
    assert store.verify_store(kept).ok and len(store.open(kept)) == 16


def test_absorb_refuses_a_chunk_of_another_kind(tmp_path):
    kept = tmp_path / "kept"
    store.absorb_store(kept, _write(tmp_path / "a", _samples(range(3))), tag="t0")
    fp8 = _write(tmp_path / "fp8", _samples(range(3, 6)), dtype="fp8")
    with pytest.raises(DraftsmithError, match="dtype"):
        store.absorb_store(kept, fp8, tag="t1")
    assert len(store.open(kept)) == 3


@pytest.mark.parametrize("linked", ["all", "first"])
def test_a_crash_between_link_and_manifest_is_adopted_without_duplicates(tmp_path, linked):
    a = _write(tmp_path / "a", _samples(range(5), seed=1))
    c = _write(tmp_path / "c", _samples(range(5, 17), seed=3), shard_bytes=20_000)
    kept = tmp_path / "kept"
    store.absorb_store(kept, a, tag="eval")
    infos = store.open(c).manifest.shards
    assert len(infos) >= 2
    tag = chunk_name(0, 0, 4)
    for k, info in enumerate(infos if linked == "all" else infos[:1]):  # linked, then the process died
        os.link(c / info.file, kept / "shards" / shard_name(tag, k))
    assert len(store.open(kept)) == 5  # not recorded: not in the store yet
    added = store.absorb_store(kept, c, tag=tag)
    assert added == (0 if linked == "all" else sum(i.num_samples for i in infos[1:]))
    _assert_holds(kept, a, c)
    assert len(list((kept / "shards").glob("part-*.safetensors"))) == 1 + len(infos)
    assert store.absorb_store(kept, c, tag=tag) == 0
    _assert_holds(kept, a, c)


def test_engine_cores_on_a_cpu_are_checked_against_the_cores_this_process_may_use():
    from draftsmith.config import TrainConfig
    from draftsmith.train.engine_process import engine_cpus

    allowed = sorted(os.sched_getaffinity(0))
    # default: the engines on the first half of the cores, the trainer on the rest (one core: shared)
    assert engine_cpus(TrainConfig(engine="vllm")) == (allowed[: len(allowed) // 2] or None)
    if len(allowed) > 1:
        assert engine_cpus(TrainConfig(engine="vllm", engine_devices=[allowed[0]])) == [allowed[0]]
    with pytest.raises(DraftsmithError, match="take every one of the cores") as err:
        engine_cpus(TrainConfig(engine="vllm", engine_devices=allowed))
    assert "\n" not in str(err.value)
    with pytest.raises(DraftsmithError, match=r"core\(s\) \[4096\] are not among"):
        engine_cpus(TrainConfig(engine="vllm", engine_devices=[4096]))


def _ready(spool: Spool, name: str) -> None:
    """A chunk as ready as `is_ready` sees it (a manifest, no states): enough for the trainer's bookkeeping."""
    spool.chunk_path(name).mkdir(parents=True)
    (spool.chunk_path(name) / "manifest.json").write_text("{}")


def _supervisor(spool: Spool, chunks, cfg: TrainConfig | None = None):
    """Rank 0's supervisor of the engine on `spool` for `chunks` (no master, no engine process until it starts one):
    made with no I/O, as the trainer makes it."""
    from draftsmith.train.engine_supervisor import EngineSupervisor

    cfg = cfg if cfg is not None else TrainConfig(engine="vllm")
    return EngineSupervisor(cfg, spool, chunks, set(), [], spool.bound, None, None, None)


def test_a_resume_keeps_only_the_ready_chunks_that_leave_room_for_those_needed_first(tmp_path, monkeypatch):
    """A trainer killed after the engine ran ahead, resumed from an earlier checkpoint: the chunks the spool still
    holds far ahead must go, or the engine (writing in plan order) would wait for room the trainer never frees."""
    from draftsmith.train import engine_supervisor

    spool = Spool(tmp_path / "spool", bound=10_000)
    spool.create()
    chunks = [Chunk(f"c{k}", 0, k, k, [k], [k], 10, 3_000) for k in range(6)]
    for c in chunks[1:]:  # c0 was consumed before the kill; c1..c5 are ready
        _ready(spool, c.name)
    spool.write_plan(Plan(chunks, 5))  # the killed trainer's last plan generation
    source = _supervisor(spool, chunks, TrainConfig(engine="vllm", output=tmp_path / "run"))
    monkeypatch.setattr(engine_supervisor, "chunk_matches", lambda chunk, info, dtype, layer_ids: True)
    source._extract_config = lambda: ExtractConfig(backend="vllm")
    spawned = []
    source._spawn = lambda: spawned.append(True)
    monkeypatch.setattr(engine_supervisor, "prepared_digest", lambda data: "digest")
    monkeypatch.setattr(engine_supervisor.importlib.util, "find_spec", lambda name: True)  # as if vLLM were installed
    try:
        source.start(TrainerStatus(stall_s=source.cfg.stall_timeout_s))
    finally:
        source.close()
    assert source._lock is None  # released by close
    # c0 (missing), c1, c2 fit in 10,000 bytes (3 x 3,000); c3.. are removed
    assert [c.name for c in chunks if spool.is_ready(c.name)] == ["c1", "c2"]
    assert spawned and source.generation == 5  # the next plan it writes is newer than any an engine has seen
    # the engine's log is the trainer's, beside its run: not in the spool, where it would count against the bound
    assert isinstance(source.engine, engine_supervisor.EngineProcess)
    assert source.engine.log == tmp_path / "run" / "feed.log"
    assert spool.read_job().bound == 10_000


def test_an_engine_started_on_a_resume_never_redoes_the_ready_chunks_the_trainer_reads_meanwhile(tmp_path):
    """The race CI met: a resumed trainer reads the chunks a killed engine left ready and deletes them while its new
    engine process is still importing vLLM; that process reads the plan then, finds them missing, and must not redo
    them (the spool would fill with chunks no one reads, the engine waiting for room, the trainer for the next)."""
    from draftsmith.core import processes
    from draftsmith.train import engine_process

    spool = Spool(tmp_path / "spool", bound=10_000)
    spool.create()
    chunks = [Chunk(f"c{k}", 0, k, k, [k], [k], 10, 3_000) for k in range(5)]
    for c in chunks[:2]:  # left ready by the killed engine
        _ready(spool, c.name)
    source = _supervisor(spool, chunks)
    source.engine = engine_process.EngineProcess(
        source.cfg, str(spool.path), tmp_path / "run" / "feed.log", tmp_path / "run" / "engine-scratch", None, None
    )
    spool.write_job(_job())
    started = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(processes.subprocess, "Popen", lambda *a, **k: started.append(a[0]) or _Exited(0))
        source._spawn()
    assert len(started) == 1 and str(spool.path) in started[0] and engine_process.ENGINE_MODULE in started[0]
    import typer

    from draftsmith.extract.vllm import feed

    argv = started[0][started[0].index(engine_process.ENGINE_MODULE) + 1 :]  # what the child's typer options read
    app = typer.Typer()
    app.command()(feed.main)  # as typer.run(main) makes it
    params = typer.main.get_command(app).make_context("feed", list(argv)).params
    assert params["where"] == str(spool.path) and params["log"] == str(tmp_path / "run" / "feed.log")
    assert params["scratch"] == tmp_path / "run" / "engine-scratch" and params["stall_s"] == source.cfg.stall_timeout_s
    for c in chunks[:2]:  # the trainer reads them before the engine process reads its plan
        spool.consume(c.name, 0, 1)
    assert not any(spool.is_ready(c.name) for c in chunks)
    plan = spool.read_plan()
    assert [c.name for c in plan.chunks] == ["c2", "c3", "c4"] and plan.generation == 1


def test_write_plan_starts_a_new_generation_without_the_chunks_read_or_ready(tmp_path):
    spool = Spool(tmp_path / "spool", bound=10_000)
    spool.create()
    chunks = [Chunk(f"c{k}", 0, k, k, [k], [k], 10, 3_000) for k in range(5)]
    chunks.append(Chunk("c5", 0, 5, 5, [5], [], 0, 0))  # all from the --keep-epoch0 store: not the engines'
    source = _supervisor(spool, chunks)
    source.generation = 4
    source.consumed = {"c0"}
    _ready(spool, "c1")  # published, not read yet
    source.write_plan()
    plan = spool.read_plan()
    assert plan.generation == 5 and [c.name for c in plan.chunks] == ["c2", "c3", "c4"]
    assert plan.chunks == chunks[2:5]  # whole: the engine computes them from these
    # the trainer reads c1 and c2 meanwhile, and c3 is lost with its transport: the next generation asks for it again
    source.consumed |= {"c1", "c2"}
    spool.consume("c1", 0, 1)
    source.write_plan()
    plan = spool.read_plan()
    assert plan.generation == 6 and [c.name for c in plan.chunks] == ["c3", "c4"]


class _Exited:
    def __init__(self, code: int):
        self.returncode, self.pid = code, -1

    def poll(self):
        return self.returncode


class _FakeEngine:
    """What the trainer's supervision reads of an `EngineProcess`, without a process."""

    def __init__(self, log: Path, code: int | None):
        self.log, self.proc = log, _Exited(code) if code is not None else None
        self.restarts = self.total_restarts = self.stops = 0

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def log_tail(self, lines: int = 3) -> str:
        return "the last line of its log"

    def stop(self) -> None:
        self.stops += 1


def _job() -> FeedJob:
    return FeedJob(extract=ExtractConfig(backend="vllm"), bound=10_000)


def _exited_source(tmp_path, status: FeedStatus, code: int):
    spool = Spool(tmp_path / "spool", bound=10_000)
    spool.create()
    spool.write_status(status)
    source = _supervisor(spool, [])
    source.engine = _FakeEngine(tmp_path / "run" / "feed.log", code)
    spawned = []
    source._spawn = lambda: spawned.append(True)
    return source, Chunk("c0", 0, 0, 0, [1], [1], 10, 100), spawned


def test_an_engine_killed_mid_run_is_restarted_and_a_setup_error_is_one_line_at_once(tmp_path, capsys):
    from draftsmith.train.engine_supervisor import Event

    def exited(source, chunk):
        return source._engine_exited(chunk, source.spool.read_status())

    # killed (signal, the status of a started engine): restarted, and the user told so
    source, chunk, spawned = _exited_source(tmp_path / "a", FeedStatus(pid=7, engine_started=True), -9)
    assert exited(source, chunk) == Event.ENGINE_RESTARTED
    assert spawned and source.engine.restarts == 1 and source.engine.total_restarts == 1
    assert source.engine.stops == 1  # what is left of it (vLLM's processes) goes before the new one starts
    err = capsys.readouterr().err
    assert "restarting it (1 of 3)" in err and "exit code -9" in err and "the last line of its log" in err
    # it exited after publishing the chunk the trainer waits for: nothing to do for that chunk
    source, chunk, spawned = _exited_source(tmp_path / "ready", FeedStatus(pid=7, engine_started=True), 0)
    _ready(source.spool, chunk.name)
    assert exited(source, chunk) == Event.ENGINE_EXITED
    assert not spawned and source.engine.restarts == 0
    # an error before vLLM started (a strategy the installed vLLM lacks, say) would be the same again: no restart
    source, chunk, spawned = _exited_source(
        tmp_path / "b", FeedStatus(pid=7, error="--vllm-strategy connector: not possible with this vLLM"), 1
    )
    with pytest.raises(DraftsmithError, match="stopped before chunk c0 .--vllm-strategy connector: not possible") as e:
        exited(source, chunk)
    assert not spawned and "\n" not in str(e.value)
    # a fatal error of a started engine (a full disk): the same wall again on a restart, so one line at once
    full = "/dev/shm/spool/chunks/.c0.partial: the filesystem holding the spool has 1 MiB free"
    source, chunk, spawned = _exited_source(
        tmp_path / "f", FeedStatus(pid=7, error=full, fatal=True, engine_started=True), 1
    )
    with pytest.raises(DraftsmithError) as e:
        exited(source, chunk)
    assert not spawned and source.engine.restarts == 0 and "\n" not in str(e.value)
    assert full in str(e.value) and str(source.engine.log) in str(e.value)
    # restarts run out: one line naming the chunk and the log
    source, chunk, spawned = _exited_source(tmp_path / "c", FeedStatus(pid=7, engine_started=True), -9)
    source.engine.restarts = 3
    with pytest.raises(DraftsmithError, match="before chunk c0 .*/run/feed.log; run the same command again"):
        exited(source, chunk)
    assert not spawned


def test_the_trainer_names_an_engine_process_that_makes_no_progress_and_its_log(tmp_path):
    spool = Spool(tmp_path / "spool", bound=10_000)
    spool.create()
    spool.write_job(_job())
    from draftsmith.train.engine_supervisor import Event

    source = _supervisor(spool, [], TrainConfig(engine="vllm", stall_timeout_s=30))
    source.engine = _FakeEngine(tmp_path / "run" / "feed.log", None)  # running
    chunk = Chunk("c0", 0, 0, 0, [1], [1], 10, 100)
    spool.write_status(FeedStatus(pid=4242, host="engine-node", chunk="c0"))
    updated = spool.read_status().updated
    source._seen = (updated, time.monotonic() - 29)  # unchanged, but within the limit
    assert source.poll(chunk) == Event.QUIET
    source._seen = (updated, time.monotonic() - 31)  # unchanged past the limit
    with pytest.raises(DraftsmithError) as err:
        source.poll(chunk)
    msg = str(err.value)
    assert "\n" not in msg and "no progress for 30 s" in msg and "chunk c0" in msg
    assert "pid 4242 on engine-node" in msg and str(tmp_path / "run" / "feed.log") in msg
    # the engine reports again: progress, whatever its clock says (an hour behind the trainer's, here)
    spool.write_status(FeedStatus(pid=4242, host="engine-node", chunk="c0"))
    (spool.path / "status.json").write_text(
        spool.read_status().model_copy(update={"updated": time.time() - 3600}).model_dump_json()
    )
    assert source.poll(chunk) == Event.PROGRESS
    assert source._seen[0] == pytest.approx(time.time() - 3600, abs=60)
    assert time.monotonic() - source._seen[1] < 5


def test_a_lost_job_is_written_again_and_a_plan_finished_without_the_chunk_asks_for_it_again(tmp_path, monkeypatch):
    """What a poll does besides watching for stalls: a transport that lost the job (a restarted Mooncake master loses
    its keys) gets the job and a new plan generation; an engine that finished the current plan while the chunk the
    trainer waits for is not there (lost with its transport) gets a new generation that asks for it again."""
    from draftsmith.train import engine_supervisor
    from draftsmith.train.engine_supervisor import Event

    monkeypatch.setattr(engine_supervisor, "prepared_digest", lambda data: "digest")
    spool = Spool(tmp_path / "spool", bound=10_000)
    spool.create()
    chunks = [Chunk(f"c{k}", 0, k, k, [k], [k], 10, 3_000) for k in range(3)]
    source = _supervisor(spool, chunks, TrainConfig(engine="vllm", data=tmp_path / "prepared"))
    source.generation = 2
    assert not spool.has_job()
    assert source.poll(chunks[0]) == Event.JOB_REWRITTEN
    assert spool.read_job().bound == 10_000 and spool.read_job().prepared_digest == "digest"
    assert spool.read_plan().generation == 3 and [c.name for c in spool.read_plan().chunks] == ["c0", "c1", "c2"]
    # an engine of this generation says it has done its plan; c0 was read, c1 never arrived
    source.consumed.add("c0")
    spool.write_status(FeedStatus(pid=7, waiting="plan", generation=3))
    assert source.poll(chunks[1]) == Event.REPLANNED
    assert spool.read_plan().generation == 4 and [c.name for c in spool.read_plan().chunks] == ["c1", "c2"]
    # the same report of an older generation's plan, or with the chunk there, asks for nothing
    spool.write_status(FeedStatus(pid=7, waiting="plan", generation=3))
    assert source.poll(chunks[1]) == Event.PROGRESS and spool.read_plan().generation == 4
    spool.write_status(FeedStatus(pid=7, waiting="plan", generation=4))
    _ready(spool, "c1")
    assert source.poll(chunks[1]) == Event.PROGRESS and spool.read_plan().generation == 4


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to split")
def test_the_trainer_keeps_the_cores_the_engine_does_not_take_and_gets_all_back():
    from draftsmith.train.engine_process import TrainerCores

    had, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    cores = TrainerCores(had[: len(had) // 2])
    try:
        cores.take()
        assert sorted(os.sched_getaffinity(0)) == had[len(had) // 2 :]
        assert torch.get_num_threads() == len(had) - len(had) // 2
    finally:
        cores.restore()
    assert sorted(os.sched_getaffinity(0)) == had and torch.get_num_threads() == threads
    cores.restore()  # twice: harmless
    assert sorted(os.sched_getaffinity(0)) == had


def test_spool_gb_beyond_the_free_space_of_the_spools_filesystem_is_refused_in_one_line(tmp_path, monkeypatch):
    from draftsmith.extract.spool import directory

    spool = Spool(tmp_path / "shm" / "spool", bound=int(2 * GiB))
    spool.create()
    _chunk(spool, chunk_name(0, 0, 1), range(4))  # left by a killed run: its bytes are room for this one
    held = spool.usage()
    free = [int(2 * GiB) - held]
    seen = []
    monkeypatch.setattr(directory, "free_bytes", lambda path: seen.append(Path(path)) or free[0])
    spool.check_capacity(int(2 * GiB), 0, tmp_path / "engine-scratch")  # free + held is exactly the bound
    assert seen == [spool.path]  # the spool's own filesystem (the engine stages chunks inside it, not in scratch)
    free[0] -= 1
    with pytest.raises(DraftsmithError, match="^--spool-gb 2: "):  # one byte short
        spool.check_capacity(int(2 * GiB), 0, None)
    free[0] = int(GiB) - held
    with pytest.raises(DraftsmithError) as err:
        spool.check_capacity(int(2 * GiB), 0, None)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("--spool-gb 2:") and f"--spool {spool.path} " in msg
    assert "has 1 GiB free" in msg  # what there is, not what was asked for


def test_the_engine_process_names_a_trainer_that_makes_no_progress(tmp_path):
    from draftsmith.extract.vllm import feed

    spool = Spool(tmp_path / "spool")
    spool.create()
    feeder = feed.Feeder(spool, spool_mod.FeedStatus(), stall_s=1800.0)
    feeder._trainer_stalled("a plan")  # no report yet, and just started: within the limit
    spool.write_trainer(TrainerStatus(step=41, stall_s=20.0))  # the trainer's limit is the one that counts
    report = spool.read_trainer()
    feeder._trainer_stalled("a plan")
    assert feeder.trainer[0] == report.updated  # seen now
    feeder.trainer = (report.updated, time.monotonic() - 19, report)
    feeder._trainer_stalled("a plan")  # unchanged, within its 20 s
    feeder.trainer = (report.updated, time.monotonic() - 21, report)
    with pytest.raises(feed.Fatal) as err:
        feeder._trainer_stalled("room in the spool")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"the trainer of {spool.path} has made no progress for 20 s")
    assert "waits for room in the spool" in msg and "step 41" in msg
    # the trainer reports again: progress (its own clock an hour behind this node's does not matter)
    time.sleep(0.01)
    spool.write_trainer(TrainerStatus(step=42, stall_s=20.0))
    data = json.loads((spool.path / "trainer.json").read_text())
    (spool.path / "trainer.json").write_text(json.dumps({**data, "updated": time.time() - 3600}))
    feeder._trainer_stalled("room in the spool")
    assert feeder.trainer[2].step == 42
    # never reported, past this process's own limit
    quiet = feed.Feeder(Spool(tmp_path / "other"), spool_mod.FeedStatus(), stall_s=5.0)
    quiet.trainer = (None, time.monotonic() - 6, None)
    with pytest.raises(feed.Fatal, match=r"no progress for 5 s .*\(it has not reported yet\)"):
        quiet._trainer_stalled("its job")


def test_over_mooncake_a_local_engine_s_scratch_must_stage_the_largest_chunk(tmp_path, monkeypatch):
    from draftsmith.core.spool_address import MooncakeAddress
    from draftsmith.extract.spool import mooncake

    spool = mooncake.MooncakeSpool(MooncakeAddress("127.0.0.1", 1, "run"), bound=int(10 * GiB))  # never connected
    seen = []
    monkeypatch.setattr(mooncake, "free_bytes", lambda path: seen.append(Path(path)) or 100 * 2**20)
    spool.check_capacity(int(10 * GiB), 0, None)  # the engines run elsewhere; the bound lives in their segments
    assert seen == []
    spool.check_capacity(int(10 * GiB), 100 * 2**20, tmp_path / "scratch")  # exactly what is free
    assert seen == [tmp_path / "scratch"]
    with pytest.raises(DraftsmithError) as err:
        spool.check_capacity(int(10 * GiB), 100 * 2**20 + 1, tmp_path / "scratch")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{tmp_path / 'scratch'}:") and "100 MiB free" in msg
    # the engine side without a scratch directory cannot stage a chunk: one line naming the spool
    with pytest.raises(DraftsmithError, match="mooncake://127.0.0.1:1/run: the engine side needs a local scratch"):
        spool.begin("c0")
