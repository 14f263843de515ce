"""`draftsmith train --engine vllm` with real vLLM on this CPU, run as a user runs it (the CLI, in a process of its
own, vLLM's engine in the engine process):

- online-from-engine equals offline-from-store (`extract --backend vllm`, then `train --data STORE`) on the default
  target: the same samples in the same order (samples.jsonl), the same loss and held-out curves, equal final weights;
  while the spool, bound to less than a tenth of the store, is measured every few milliseconds and stays under it;
- kill -9 of the whole job, the engine mid-chunk, resumed by the same command: every sample once per epoch, final
  weights equal the uninterrupted run's (the engine alone and the trainer alone: tests/test_train_mooncake.py);
- --keep-epoch0 across an epoch boundary: epoch 1 comes from the kept store, not the engines; the kept store trains
  offline to the same samples and weights;
- a DeepSeek-V3 target (MLA, MoE) through the same path equals its offline run: EAGLE-3 on two ranks (torchrun, one
  engine process read by both), DFlash in one process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
from pathlib import Path

import pytest
from online import (
    EXTRACT,
    MAX_LENGTH,
    STEPS,
    TRAIN,
    SpoolWatch,
    alive,
    assert_once_per_epoch,
    assert_same_weights,
    draftsmith,
    read_jsonl,
    steps_done,
    torchrun_offline_and_online,
    wait_for,
    wait_gone,
)

from draftsmith.extract import store
from draftsmith.extract.spool import Spool

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engine")


@pytest.fixture(scope="module")
def prepared(online_reference) -> Path:
    return online_reference["prepared"]


@pytest.fixture(scope="module")
def offline(online_reference) -> dict:
    """extract --backend vllm, then train --data STORE (conftest's online_reference, shared with the Mooncake
    tests)."""
    return online_reference


@pytest.fixture(scope="module")
def online(work, prepared, offline) -> dict:
    """train --engine vllm with a spool bound of a twelfth of the store, the spool measured while it runs."""
    bound_gb = offline["store_bytes"] / 12 / (1 << 30)
    run = work / "online"
    watch = SpoolWatch(run / "spool")
    done = draftsmith(
        "train",
        "--data",
        prepared,
        "--engine",
        "vllm",
        "--spool-gb",
        f"{bound_gb:.6f}",
        "--output",
        run,
        "--max-steps",
        STEPS,
        *TRAIN,
    )
    return {
        "run": run,
        "peak": watch.stop(),
        "samples": watch.samples,
        "bound": int(bound_gb * (1 << 30)),
        "stdout": done.stdout,
        "bound_gb": bound_gb,
    }


def test_online_from_engine_equals_offline_from_store_under_a_tenth_of_its_disk(offline, online):
    on, off = online["run"], offline["run"]
    # the same samples in the same order
    assert read_jsonl(on / "samples.jsonl") == read_jsonl(off / "samples.jsonl")
    assert len(read_jsonl(on / "samples.jsonl")) == STEPS
    # the same curves: train loss at every step, every held-out evaluation
    curve = {k: [] for k in ("on", "off")}
    for key, run in (("on", on), ("off", off)):
        for line in read_jsonl(run / "metrics.jsonl"):
            curve[key].append(
                (line["type"], line["step"], line["loss"], line.get("acceptance_length"), tuple(line.get("acc", ())))
            )
    assert [c[:2] for c in curve["on"]] == [c[:2] for c in curve["off"]]
    assert sum(c[0] == "eval" for c in curve["on"]) >= 3
    for a, b in zip(curve["on"], curve["off"], strict=False):
        assert a[2] == pytest.approx(b[2], rel=1e-5, abs=1e-6), (a, b)
        assert a[4] == pytest.approx(b[4], abs=1e-6), (a, b)
    assert_same_weights(on, off)
    # the disk: the bound is under a tenth of the store, and the measured peak stays under the bound
    assert online["bound"] < offline["store_bytes"] / 10
    assert online["samples"] > 100, "the spool was hardly sampled"
    assert 0 < online["peak"] <= online["bound"], (online["peak"], online["bound"])
    # the run reports it, and leaves no chunk behind
    metrics = [m for m in read_jsonl(on / "metrics.jsonl") if m["type"] == "train"]
    assert all(m["spool_bytes"] <= online["bound"] for m in metrics)
    assert metrics[-1]["extract_tokens_per_s"] > 0 and {m["waiting"] for m in metrics} <= {
        "trainer",
        "engines (spool full)",
        "trainer (engine starting)",
        "none",
    }
    assert "online (vLLM engines, spool)" in online["stdout"]
    assert not any((on / "spool" / "chunks").iterdir())


def test_kill_9_of_the_whole_job_mid_chunk_resumes_to_the_same_weights(work, prepared, online):
    """The trainer and its engine process killed at once, the engine mid-chunk, past a checkpoint: the same command
    resumes from the directory spool it left (kill -9 of the engine alone, which the trainer restarts, and of the
    trainer alone, whose engine process exits by itself, are tests/test_train_mooncake.py's: the same restart and
    watch code over the other spool)."""
    run = work / "faults"
    args = (
        "train",
        "--data",
        prepared,
        "--engine",
        "vllm",
        "--spool-gb",
        f"{online['bound_gb']:.6f}",
        "--output",
        run,
        "--max-steps",
        STEPS,
        *TRAIN,
    )
    spool, log = Spool(run / "spool"), work / "faults.log"
    trainer = draftsmith(*args, log=log)
    wait_for(lambda: steps_done(run) >= 10 and spool.read_status().chunks_done >= 2, trainer, "step 10")
    engine = spool.read_status().pid
    trainer.kill()
    os.kill(engine, signal.SIGKILL)
    trainer.wait()
    wait_gone(engine)
    assert not alive(engine)
    done = draftsmith(*args)  # the same command finishes the run
    assert "resumed from" in done.stdout, done.stdout[-2000:]
    assert_once_per_epoch(run)
    assert read_jsonl(run / "samples.jsonl") == read_jsonl(online["run"] / "samples.jsonl")
    assert_same_weights(run, online["run"])


def test_keep_epoch0_feeds_later_epochs_and_trains_offline(work, sharegpt_file):
    """Two epochs online with --keep-epoch0: the engines compute epoch 0 (and the held-out split) only, epoch 1 comes
    from the kept store; and the kept store is an ordinary store: two epochs offline on it give the same samples and
    weights (its states are the engines', which test_online_from_engine_equals_offline_from_store holds to
    `extract --backend vllm`)."""
    prepared, kept = work / "prepared-small", work / "kept"
    draftsmith(
        "prepare", "--data", sharegpt_file, "--max-samples", 24, "--max-length", MAX_LENGTH, "--output", prepared
    )
    options = ["--epochs", "2", *TRAIN]
    done = draftsmith(
        "train",
        "--data",
        prepared,
        "--engine",
        "vllm",
        "--spool-gb",
        "0.05",
        "--keep-epoch0",
        kept,
        "--output",
        work / "online-2ep",
        *options,
    )
    assert "kept epoch 0 in" in done.stdout
    samples = read_jsonl(work / "online-2ep" / "samples.jsonl")
    assert {line["epoch"] for line in samples} == {0, 1}
    # epoch 1 and the held-out split came from the kept store: the engines computed epoch 0 (and the held-out
    # split) only
    status = json.loads((work / "online-2ep" / "spool" / "status.json").read_text())
    epoch0 = {i for line in samples if line["epoch"] == 0 for i in line["samples"]}
    kept_store = store.open(kept)
    assert epoch0 <= set(kept_store.sample_ids.tolist())
    lengths = {int(i): int(n) for i, n in zip(kept_store.sample_ids, kept_store.lengths, strict=False)}
    assert status["tokens"] == sum(lengths.values()), "the engines computed samples outside epoch 0 / held-out"
    assert store.verify_store(kept).ok
    draftsmith("train", "--data", kept, "--output", work / "from-kept", *options, trainer_cores=True)
    assert read_jsonl(work / "from-kept" / "samples.jsonl") == samples
    assert_same_weights(work / "online-2ep", work / "from-kept")


def family_data(name: str, conversations: int, tmp_path: Path) -> Path:
    """A prepared set of the tiny `name` target from tests/families.py, and its store (`extract --backend vllm`) at
    tmp_path / "store"; returns the prepared set."""
    sys.path.insert(0, str(Path(__file__).parent))
    import families
    from test_families import write_chats

    chats = write_chats(tmp_path / "chats.jsonl", conversations)
    prepared = tmp_path / "prepared"
    draftsmith(
        "prepare", "--data", chats, "--target", families.target_dir(name), "--max-length", 192, "--output", prepared
    )
    draftsmith("extract", "--prepared", prepared, "--output", tmp_path / "store", *EXTRACT)
    return prepared


def test_deepseek_v3_target_trains_online_as_offline_on_two_ranks(tmp_path):
    """A DeepSeek-V3 target (MLA, MoE): EAGLE-3 with torchrun --nproc-per-node 2 (gloo), rank 0 starting the one
    engine process and both ranks reading their own micro-batches of the same chunks (the last to read one deletes
    it), equals two ranks on its store; a DFlash draft in one process equals its offline run."""
    prepared = family_data("deepseek_v3", 32, tmp_path)
    options = [
        "--max-steps",
        "8",
        "--token-budget",
        "512",
        "--draft-vocab-size",
        "256",
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
    on, off, _ = torchrun_offline_and_online(
        tmp_path, tmp_path / "store", ["--data", str(prepared), "--engine", "vllm", "--spool-gb", "0.05"], options
    )
    assert len(on) >= 8 and [x[:3] for x in on] == [x[:3] for x in off]  # the same steps over both ranks' tokens
    assert [x[3] for x in on] == pytest.approx([x[3] for x in off], rel=1e-5)
    assert read_jsonl(tmp_path / "online" / "samples.jsonl") == read_jsonl(tmp_path / "offline" / "samples.jsonl")
    assert_same_weights(tmp_path / "online", tmp_path / "offline")
    assert not any((tmp_path / "online" / "spool" / "chunks").iterdir())  # every chunk read by both, then deleted
    assert not any((tmp_path / "online" / "spool" / "consumed").iterdir())
    # a DFlash draft of the seed's backbone, from the same store and from the engines' spool: the same curve
    from draftsmith.extract import store

    layers = ",".join(map(str, store.open(tmp_path / "store").aux_layer_ids))
    dflash = [
        *options,
        "--method",
        "dflash",
        "--block-size",
        "4",
        "--num-layers",
        "1",
        "--anchors-per-sample",
        "16",
        "--aux-layer-ids",
        layers,
    ]
    draftsmith(
        "train", "--data", tmp_path / "store", "--output", tmp_path / "dflash-offline", *dflash, trainer_cores=True
    )
    draftsmith(
        "train",
        "--data",
        prepared,
        "--engine",
        "vllm",
        "--spool-gb",
        "0.05",
        "--output",
        tmp_path / "dflash-online",
        *dflash,
    )
    on, off = (
        [m["loss"] for m in read_jsonl(tmp_path / f"dflash-{run}" / "metrics.jsonl")] for run in ("online", "offline")
    )
    assert len(on) >= 8 and on == pytest.approx(off, rel=1e-5)
    assert_same_weights(tmp_path / "dflash-online", tmp_path / "dflash-offline")
