"""kill -9 at random moments of a training run, each time resumed: the run ends with the same final checkpoint
(bit-identical tensors) and the same loss curve as an uninterrupted one.

The trainer runs in forked child processes of this one (torch and the tiny target already imported: a child starts
in milliseconds), online on a tiny random target, with every feature that has state to resume: gradient
accumulation, feature noise, evaluation (best/), several checkpoints kept, an epoch boundary.

The kill moments are defined by the run's own progress, not by the clock, so that every kill lands mid-run on a
machine of any speed: the child reports each logged step through a pipe; kill k waits for the k-th of ten random
steps of the run (sorted) and then for a random fraction of a step; and a child that reaches its final checkpoint
before the kill waits there to be killed, so no kill ever finds the run finished.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import time

import pytest
import torch
from conftest import write_random_prepared
from safetensors.torch import load_file

from draftsmith.config import TrainConfig
from draftsmith.methods import artefact
from draftsmith.train import checkpoint
from draftsmith.train import stage as trainer
from draftsmith.train.metrics import MetricsSink

KILLS = 10


def _train_child(cfg: TrainConfig, conn, hold: bool) -> None:
    torch.set_num_threads(1)  # deterministic and fast on a tiny model
    write, save = MetricsSink.write, trainer.save

    def reporting_write(self, record: dict) -> None:
        write(self, record)
        if record["type"] == "train":
            conn.send(record["step"])  # after the line is on disk

    def holding_save(r, last_saved, best=False):
        if hold and not best and r.state.step >= r.total_steps:  # the final checkpoint: wait here for the kill
            conn.send("final")
            time.sleep(600)
        return save(r, last_saved, best)

    MetricsSink.write, trainer.save = reporting_write, holding_save  # this child's copies only (forked)
    trainer.run(cfg)


def _start(cfg: TrainConfig, hold: bool = False):
    receive, send = multiprocessing.Pipe(duplex=False)
    proc = multiprocessing.get_context("fork").Process(target=_train_child, args=(cfg, send, hold), daemon=True)
    proc.start()
    send.close()
    return proc, receive


def _steps(receive, until: int | None = None) -> int:
    """Read the child's reports until it reports step `until` (or its final checkpoint); the last step seen."""
    last = 0
    while True:
        assert receive.poll(120), "the training child stopped reporting"
        try:
            got = receive.recv()
        except EOFError:
            return last
        if got == "final" or (until is not None and got >= until):
            return last if got == "final" else got
        last = got


def _curve(run) -> list[tuple]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [(m["type"], m["step"], m["loss"], m.get("tokens_seen"), m["acc"]) for m in lines]


def _final(run) -> dict[str, torch.Tensor]:
    last = artefact.latest_checkpoint(run)
    tensors = load_file(str(last / artefact.WEIGHTS_FILE))
    state = checkpoint.load_training_state(last)
    for i, per_param in state["optimizer"]["state"].items():
        for key, value in per_param.items():
            tensors[f"optimizer.{i}.{key}"] = value
    return tensors


@pytest.fixture(scope="module")
def prepared(tiny_target_dir, tmp_path_factory):
    return write_random_prepared(tmp_path_factory.mktemp("kill") / "prepared", tiny_target_dir, 40, 14, 40)


@pytest.mark.parametrize("method", ["eagle3", "peagle", "dflash"])
def test_kill_9_at_random_moments_then_resume_ends_bit_identical(prepared, tmp_path, method):
    def cfg(out):  # peagle: 3 depths, COD sampling drawn per (epoch, sample): a resume must draw the same anchors;
        #            dflash: blocks of 4 at anchors drawn per (epoch, sample), the same on a resume
        shape = {
            "eagle3": dict(ttt_steps=2, draft_vocab_size=300),
            "peagle": dict(ttt_steps=3, cod_ratio=0.6, cod_floor=0.2, draft_vocab_size=300),
            "dflash": dict(block_size=4, anchors_per_sample=6, num_layers=2),
        }[method]
        return TrainConfig(
            data=prepared,
            output=out,
            token_budget=96,
            grad_accum=2,
            epochs=2,
            noise_std=0.05,
            eval_fraction=0.1,
            eval_every=3,
            save_every=2,
            keep_checkpoints=2,
            log_every=1,
            lr=3e-3,
            warmup_steps=2,
            device="cpu",
            method=method,
            **shape,
        )

    reference = tmp_path / "reference"
    proc, receive = _start(cfg(reference))
    total = _steps(receive)
    proc.join(120)
    assert proc.exitcode == 0 and total > KILLS

    killed = tmp_path / "killed"
    rng = random.Random(1234)
    moments = sorted(rng.sample(range(1, total), KILLS))  # the steps after which the kills come
    reached = []
    for step in moments:
        proc, receive = _start(cfg(killed), hold=True)
        reached.append(_steps(receive, until=step))
        time.sleep(rng.uniform(0.0, 0.02))  # and a random fraction of a step (forward, backward, a save...)
        assert proc.is_alive()  # mid-run: a child at its final checkpoint waits for the kill
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        assert proc.exitcode == -signal.SIGKILL
    proc, receive = _start(cfg(killed))  # and once more, to the end
    _steps(receive)
    proc.join(120)
    assert proc.exitcode == 0
    assert all(got >= step for got, step in zip(reached, moments, strict=False)), (
        moments,
        reached,
    )  # kills spread over the run
    print(f"kills after steps {reached} of {total}")

    assert _curve(killed) == _curve(reference)
    ref, got = _final(reference), _final(killed)
    assert ref.keys() == got.keys() and "fc.weight" in ref and any(k.startswith("optimizer.") for k in ref)
    assert ("mask_hidden" in ref) == (method == "peagle") and ("hidden_norm.weight" in ref) == (method == "dflash")
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
    for path in artefact.list_checkpoints(killed) + [killed / artefact.BEST_DIR]:
        artefact.load_checkpoint(path)  # every checkpoint on disk is whole
