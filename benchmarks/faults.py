"""Chaos run: every fault of issue 15 injected into the pipeline on the default target, each checked to be survived.

    .venv/bin/python benchmarks/faults.py                   # all of them on SmolLM2-135M-Instruct (a few minutes)
    .venv/bin/python benchmarks/faults.py --only flip,nan   # the faults whose name holds one of these words
    .venv/bin/python benchmarks/faults.py --no-vllm         # without the vLLM engine kill (the slowest start)

fault (stage)                       what is done, and what "survived" checks
flip-prepared-shard (prepare)       a byte flipped inside a prepared shard's token data: the first read of it and
                                    `open_prepared(verify=True)` refuse it in one line naming the shard
flip-store-shard (extract)          the same in a store shard: `store[i]` and `verify_store` name it; `--repair` and
                                    extract again recompute exactly its samples (the store then equals the original)
flip-checkpoint-weights (train)     model.safetensors of the newest step: loading, resuming and `verify_checkpoint`
                                    name the file
flip-training-state (train)         training_state.pt of the newest step: resuming and `verify_checkpoint` name it
nan-hidden-states (extract)         one sample's states made NaN as the target computes them: extract stops naming
                                    the sample; the next run completes the store, equal to an undisturbed one
nan-loss (train)                    one step's loss made NaN: train stops naming the step and the last good
                                    checkpoint; the next run ends equal (bit for bit) to an undisturbed run
full-disk-{extract,train,export}    the output on a size-limited tmpfs that another writer fills mid-stage: one line,
                                    no temp file or half-built directory left, the previous state whole; after the
                                    space is freed the same call completes (equal to an undisturbed run)
kill-9-train (train)                kill -9 at 10 random steps of a run (a child process), each time resumed: the same
                                    final checkpoint (bit for bit, optimizer included) and loss curve
kill-9-extract (extract)            kill -9 at 3 random moments of an extraction: the resumed store equals an
                                    undisturbed one
kill-vllm-engine (extract)          the vLLM engine-core process killed mid-extraction: one line from the CLI; the next
                                    run completes the store with no sample lost or duplicated

A fault counts as injected when the injection happened (a kill that found its process finished is not one);
survived when every check held; samples lost counts samples missing from, or duplicated in, the final artefact;
tracebacks counts failures that were not one line (an exception other than DraftsmithError, or a child process
that ended with a Python traceback). The full-disk faults need root (tmpfs mounts; CI runs as root) and are
reported as not injected otherwise. Prints a table on stderr, then as its LAST line a JSON object: faults_injected,
survived, samples_lost, tracebacks (the last two must be 0).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from draftsmith import export
from draftsmith.config import ExportConfig, ExtractConfig, TrainConfig
from draftsmith.core.errors import DraftsmithError
from draftsmith.extract import common, hf, store
from draftsmith.extract import stage as extract
from draftsmith.methods import artefact
from draftsmith.methods.artefact import load_draft
from draftsmith.prepare.dataset import open_prepared
from draftsmith.train import checkpoint
from draftsmith.train import stage as trainer

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Outcome:
    fault: str
    stage: str
    injected: bool = True
    survived: bool = False
    lost: int = 0
    traceback: bool = False
    detail: str = ""


class Bench:
    """The artefacts every fault starts from: a prepared set, its store and an undisturbed training run."""

    def __init__(
        self,
        work: Path,
        prepared: Path,
        *,
        token_budget: int = 256,
        draft_vocab_size: int = 512,
        epochs: int = 2,
        vllm_env: dict[str, str] | None = None,
    ):
        self.work, self.prepared, self.token_budget = Path(work), Path(prepared), token_budget
        self.draft_vocab_size, self.epochs, self.vllm_env = draft_vocab_size, epochs, vllm_env or {}
        self.num_samples = len(open_prepared(prepared))
        self.store = self.work / "store"
        if not (self.store / "manifest.json").is_file():
            extract.run(self.extract_cfg(self.store), show_progress=False)

    @property
    def run(self) -> Path:
        """The undisturbed training run (trained on first use)."""
        run = self.work / "reference-run"
        if artefact.latest_checkpoint(run) is None:
            trainer.run(self.train_cfg(run))
        return run

    def extract_cfg(self, output: Path, **kw) -> ExtractConfig:
        fields = {
            "prepared": self.prepared,
            "output": output,
            "token_budget": self.token_budget,
            "shard_size_mb": 0.25,
            "device": "cpu",
        }
        return ExtractConfig(**{**fields, **kw})

    def train_cfg(self, output: Path) -> TrainConfig:
        return TrainConfig(
            data=self.store,
            output=output,
            draft_vocab_size=self.draft_vocab_size,
            ttt_steps=2,
            token_budget=self.token_budget,
            epochs=self.epochs,
            noise_std=0.05,
            eval_fraction=0.1,
            eval_every=4,
            save_every=2,
            keep_checkpoints=2,
            log_every=1,
            lr=3e-3,
            warmup_steps=2,
            device="cpu",
            seed=0,
        )

    def copy(self, src: Path, name: str) -> Path:
        dst = self.work / name
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
        return dst


# ------------------------------------------------------------------------------------------------- helpers


class NotSurvived(Exception):
    """A check after a fault failed (the fault was injected, the pipeline did not survive it)."""


def check(condition: bool, what: str) -> None:
    if not condition:
        raise NotSurvived(what)


def expect_error(fn: Callable[[], object], *words: str) -> str:
    """Run `fn`; it must raise a one-line DraftsmithError holding every word. Returns the message."""
    try:
        fn()
    except DraftsmithError as err:
        message = str(err)
        check("\n" not in message, f"the error is not one line: {message!r}")
        missing = [w for w in words if w not in message]
        check(not missing, f"the error does not name {missing}: {message}")
        return message
    raise NotSurvived(f"no error (expected one naming {list(words)})")


def flip_data_byte(file: Path) -> None:
    """Flip one byte in the middle of a file's data, past its header, in place (as a disk's bit rot would)."""
    data = bytearray(file.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little") if file.suffix == ".safetensors" else 0
    data[start + (len(data) - start) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def leftovers(root: Path) -> list[str]:
    """Temp files and half-built or half-removed directories of an atomic write under `root`."""
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob(".*")
        if p.name.endswith(".tmp") or ".partial-" in p.name or ".old-" in p.name
    )


def store_lost(path: Path, expected: int) -> int:
    """Samples missing from or duplicated in a store that should hold samples 0..expected-1."""
    ids = store.open(path).sample_ids.tolist()
    return len(set(range(expected)) - set(ids)) + len(ids) - len(set(ids))


def stores_equal(a: Path, b: Path) -> bool:
    sa, sb = store.open(a, dtype=None), store.open(b, dtype=None)
    if sa.sample_ids.tolist() != sb.sample_ids.tolist():
        return False
    return all(
        torch.equal(x["input_ids"], y["input_ids"])
        and torch.equal(x["loss_mask"], y["loss_mask"])
        and torch.equal(x["hidden_states"].view(torch.uint8), y["hidden_states"].view(torch.uint8))
        for x, y in zip(sa, sb, strict=False)
    )


def curve(run: Path) -> list[tuple]:
    lines = [json.loads(x) for x in (run / trainer.METRICS_FILE).read_text().splitlines()]
    return [(m["type"], m["step"], m["loss"], m.get("tokens_seen"), m["acc"]) for m in lines]


def final_state(run: Path) -> dict[str, torch.Tensor]:
    last = artefact.latest_checkpoint(run)
    tensors = load_file(str(last / artefact.WEIGHTS_FILE))
    for i, per_param in checkpoint.load_training_state(last)["optimizer"]["state"].items():
        for key, value in per_param.items():
            tensors[f"optimizer.{i}.{key}"] = value
    return tensors


def runs_equal(a: Path, b: Path) -> bool:
    x, y = final_state(a), final_state(b)
    return curve(a) == curve(b) and x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@contextlib.contextmanager
def patched(module, name: str, replacement):
    real = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield real
    finally:
        setattr(module, name, real)


def mount_problem() -> str | None:
    """Why a tmpfs cannot be mounted here (None: it can)."""
    if os.geteuid() != 0:
        return "not root: no tmpfs mount"
    if shutil.which("mount") is None:
        return "no mount command"
    return None


@contextlib.contextmanager
def small_disk(path: Path, size_mb: int):
    """A tmpfs of `size_mb` MiB at `path` (unmounted afterwards)."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise NotSurvived(f"cannot mount a tmpfs at {path}: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill_disk(disk: Path) -> Path:
    """Another writer fills the disk to its last byte: returns its file (delete it to free the space)."""
    filler = disk / "filler.bin"
    with open(filler, "ab", buffering=0) as f:  # unbuffered: nothing left to fail at close
        for block in (1 << 20, 1 << 12, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * block)
    return filler


def child_traceback(stderr: str) -> bool:
    return "Traceback (most recent call last)" in stderr


# ------------------------------------------------------------------------------------------------- faults


def flip_prepared_shard(b: Bench) -> Outcome:
    path = b.copy(b.prepared, "flip-prepared")
    shard = sorted(path.glob("shard-*.safetensors"))[0]
    flip_data_byte(shard)
    expect_error(lambda: open_prepared(path)[0], str(shard), "sha256")
    expect_error(lambda: open_prepared(path, verify=True), str(shard), "sha256")
    return Outcome("flip-prepared-shard", "prepare", survived=True, detail=f"{shard.name} named on read and verify")


def flip_store_shard(b: Bench) -> Outcome:
    path = b.copy(b.store, "flip-store")
    shard = sorted((path / "shards").glob("part-*.safetensors"))[0]
    flip_data_byte(shard)
    opened = store.open(path)
    expect_error(lambda: [opened[i] for i in range(len(opened))], shard.name, "sha256")
    report = store.verify_store(path)
    check(report.bad_shards == [f"shards/{shard.name}"], f"verify found {report.bad_shards}")
    store.verify_store(path, repair=True)
    extract.run(b.extract_cfg(path), show_progress=False)
    check(stores_equal(path, b.store), "the repaired store differs from the original")
    return Outcome(
        "flip-store-shard",
        "extract",
        survived=True,
        lost=store_lost(path, b.num_samples),
        detail=f"{shard.name} named on read and verify; repaired and re-extracted",
    )


def flip_checkpoint_weights(b: Bench) -> Outcome:
    run = b.copy(b.run, "flip-weights")
    weights = artefact.latest_checkpoint(run) / artefact.WEIGHTS_FILE
    flip_data_byte(weights)
    expect_error(lambda: artefact.load_checkpoint(weights.parent), str(weights), "sha256")
    expect_error(lambda: artefact.verify_checkpoint(run), str(weights), "sha256")
    expect_error(lambda: trainer.run(b.train_cfg(run)), str(weights), "sha256")
    return Outcome("flip-checkpoint-weights", "train", survived=True, detail="named on load, resume and verify")


def flip_training_state(b: Bench) -> Outcome:
    run = b.copy(b.run, "flip-state")
    state = artefact.latest_checkpoint(run) / artefact.STATE_FILE
    flip_data_byte(state)
    expect_error(lambda: trainer.run(b.train_cfg(run)), str(state), "sha256")
    expect_error(lambda: artefact.verify_checkpoint(run), str(state), "sha256")
    return Outcome("flip-training-state", "train", survived=True, detail="named on resume and verify")


def nan_hidden_states(b: Bench) -> Outcome:
    out = b.work / "nan-store"
    shutil.rmtree(out, ignore_errors=True)
    plan = common.plan_extraction(b.extract_cfg(out))
    batches = common.plan_batches(plan.sample_ids, plan.lengths, b.token_budget)
    poisoned_call = min(3, len(batches))
    victim = batches[poisoned_call - 1][0]
    calls = [0]

    def poisoned(*args, **kwargs):
        states = real(*args, **kwargs)
        calls[0] += 1
        if calls[0] == poisoned_call:
            states[0, 0, -1, 0] = float("nan")  # the first sample of the batch, its first token, layer N
        return states

    with patched(hf, "capture_hidden_states", poisoned) as real:
        message = expect_error(
            lambda: extract.run(b.extract_cfg(out), show_progress=False), f"sample {victim} ", "NaN/Inf"
        )
    check(not leftovers(out), f"left behind: {leftovers(out)}")
    check(victim not in store.open(out).sample_ids.tolist(), "the NaN sample was stored")
    extract.run(b.extract_cfg(out), show_progress=False)
    check(stores_equal(out, b.store), "the resumed store differs from an undisturbed one")
    return Outcome(
        "nan-hidden-states",
        "extract",
        survived=True,
        lost=store_lost(out, b.num_samples),
        detail=message[message.index(f"sample {victim} ") :].split(";")[0],
    )


def nan_loss(b: Bench) -> Outcome:
    run = b.work / "nan-run"
    shutil.rmtree(run, ignore_errors=True)
    calls = [0]

    def poisoned(model, head, batch, cfg, dtype, normaliser, *args, **kwargs):
        result = real(model, head, batch, cfg, dtype, normaliser, *args, **kwargs)
        calls[0] += normaliser is not None  # a training micro-batch (evaluation passes none)
        if normaliser is not None and calls[0] == 5:
            result.loss = result.loss * float("nan")
        return result

    with patched(trainer, "forward", poisoned) as real:
        message = expect_error(lambda: trainer.run(b.train_cfg(run)), "step 5: loss is NaN/Inf", "last good checkpoint")
    check(not leftovers(run), f"left behind: {leftovers(run)}")
    artefact.verify_checkpoint(run)
    trainer.run(b.train_cfg(run))
    check(runs_equal(run, b.run), "the resumed run differs from an undisturbed one")
    return Outcome("nan-loss", "train", survived=True, detail=message.split(";")[0])


def _megabytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file()) >> 20


def _full_disk(b: Bench, name: str, stage: str, body: Callable[[Path], str], needs: Path) -> Outcome:
    """`body(disk)` on a tmpfs twice the size of `needs` (an undisturbed artefact of the stage), plus 32 MiB."""
    problem = mount_problem()
    if problem:
        return Outcome(name, stage, injected=False, detail=problem)
    with small_disk(b.work / name, 2 * _megabytes(needs) + 32) as disk:
        detail = body(disk)
    return Outcome(name, stage, survived=True, detail=detail)


def full_disk_extract(b: Bench) -> Outcome:
    lost = [0]

    def body(disk: Path) -> str:
        out = disk / "store"
        calls, filler = [0], []

        def filling(path, data):
            calls[0] += 1
            if calls[0] == 2:
                filler.append(fill_disk(disk))
            return real(path, data)

        with patched(store.shards, "_write_file", filling) as real:
            expect_error(
                lambda: extract.run(b.extract_cfg(out), show_progress=False), str(out), "no space left on device"
            )
        check(not leftovers(out), f"left behind: {leftovers(out)}")
        check(store.verify_store(out).ok, "the store is not whole after the full disk")
        partial = len(store.open(out))
        filler[0].unlink()
        extract.run(b.extract_cfg(out), show_progress=False)
        check(stores_equal(out, b.store), "the resumed store differs from an undisturbed one")
        lost[0] = store_lost(out, b.num_samples)
        return f"stopped with {partial} samples stored; resumed"

    outcome = _full_disk(b, "full-disk-extract", "extract", body, b.store)
    outcome.lost = lost[0]
    return outcome


def full_disk_train(b: Bench) -> Outcome:
    def body(disk: Path) -> str:
        run = disk / "run"
        calls, filler = [0], []

        def filling(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 3:
                filler.append(fill_disk(disk))
            return real(*args, **kwargs)

        with patched(checkpoint, "save_checkpoint", filling) as real:
            message = expect_error(
                lambda: trainer.run(b.train_cfg(run)), "no space left on device", "last good checkpoint"
            )
        check(not leftovers(run), f"left behind: {leftovers(run)}")
        checked = artefact.verify_checkpoint(run)
        filler[0].unlink()
        trainer.run(b.train_cfg(run))
        check(runs_equal(run, b.run), "the resumed run differs from an undisturbed one")
        return f"stopped at {message.split('training stopped at ')[-1].split(';')[0]}; {len(checked)} whole; resumed"

    return _full_disk(b, "full-disk-train", "train", body, b.run)


def full_disk_export(b: Bench) -> Outcome:
    def body(disk: Path) -> str:
        first, second = disk / "export", disk / "export-2"
        export.run(ExportConfig(checkpoint=b.run, output=first))
        before = (first / artefact.WEIGHTS_FILE).read_bytes()
        filler = fill_disk(disk)
        expect_error(
            lambda: export.run(ExportConfig(checkpoint=b.run, output=first, dtype="fp32")),
            str(first),
            "no space left on device",
        )
        expect_error(
            lambda: export.run(ExportConfig(checkpoint=b.run, output=second)), str(second), "no space left on device"
        )
        check(not leftovers(disk), f"left behind: {leftovers(disk)}")
        check(not second.exists(), "a half-written export directory was left")
        check((first / artefact.WEIGHTS_FILE).read_bytes() == before, "the previous export changed")
        load_draft(first)  # whole: its checksums hold
        filler.unlink()
        export.run(ExportConfig(checkpoint=b.run, output=second))
        load_draft(second)
        return "previous export whole, no partial directory; exported after freeing space"

    return _full_disk(b, "full-disk-export", "export", body, b.run / artefact.BEST_DIR)


_TRAIN_CHILD = (
    "import json, sys\nfrom draftsmith.config import TrainConfig\nfrom draftsmith.train import stage\n"
    "stage.run(TrainConfig(**json.loads(sys.argv[1])))\n"
)


def _logged_step(run: Path) -> int:
    try:
        lines = (run / trainer.METRICS_FILE).read_text().splitlines()
    except OSError:
        return -1
    steps = [json.loads(x)["step"] for x in lines if x.endswith("}") and '"type": "train"' in x]
    return steps[-1] if steps else -1


def kill_9_train(b: Bench, kills: int = 10, seed: int = 1234) -> Outcome:
    run = b.work / "killed-run"
    shutil.rmtree(run, ignore_errors=True)
    cfg = json.dumps(b.train_cfg(run).model_dump(mode="json"))
    total = artefact.load_checkpoint(b.run)[1].step
    rng = random.Random(seed)
    landed, tracebacks = 0, False
    for step in sorted(rng.sample(range(1, total - 1), min(kills, total - 2))):
        proc = subprocess.Popen(
            [sys.executable, "-c", _TRAIN_CHILD, cfg], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        deadline = time.monotonic() + 600
        while proc.poll() is None and _logged_step(run) < step and time.monotonic() < deadline:
            time.sleep(0.005)  # until the run has logged the kill's step ...
        time.sleep(rng.uniform(0.0, 0.05))  # ... and a random fraction of the next one
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            landed += 1
        _, err = proc.communicate(timeout=120)
        tracebacks |= proc.returncode not in (0, -signal.SIGKILL) or child_traceback(err)
    final = subprocess.run([sys.executable, "-c", _TRAIN_CHILD, cfg], capture_output=True, text=True)
    tracebacks |= final.returncode != 0 or child_traceback(final.stderr)
    check(final.returncode == 0, f"the last resume failed: {final.stderr[-500:]}")
    check(runs_equal(run, b.run), "the killed-and-resumed run differs from an undisturbed one")
    artefact.verify_checkpoint(run)
    return Outcome(
        "kill-9-train",
        "train",
        injected=landed > 0,
        survived=True,
        traceback=tracebacks,
        detail=f"{landed} kills landed mid-run of {total} steps; final checkpoint and curve identical",
    )


def _extract_command(prepared: Path, output: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "draftsmith", "extract", "--prepared", str(prepared), "--output", str(output), *extra]


def _stored(path: Path) -> int:
    try:
        return store.read_manifest(path, store.StoreManifest).num_samples
    except DraftsmithError:
        return -1


def kill_9_extract(b: Bench, kills: int = 3, seed: int = 1234) -> Outcome:
    out = b.work / "killed-store"
    shutil.rmtree(out, ignore_errors=True)
    command = _extract_command(
        b.prepared, out, "--token-budget", str(b.token_budget), "--shard-size-mb", "0.25", "--device", "cpu"
    )
    rng, landed, tracebacks = random.Random(seed), 0, False
    for _ in range(kills):
        before = _stored(out)
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 600
        while proc.poll() is None and _stored(out) <= max(before, 0) and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.3))
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            landed += 1
        _, err = proc.communicate(timeout=120)
        tracebacks |= child_traceback(err)
    final = subprocess.run(command, capture_output=True, text=True)
    tracebacks |= final.returncode != 0 or child_traceback(final.stderr)
    check(final.returncode == 0, f"the last resume failed: {final.stderr[-500:]}")
    check(stores_equal(out, b.store), "the killed-and-resumed store differs from an undisturbed one")
    return Outcome(
        "kill-9-extract",
        "extract",
        injected=landed > 0,
        survived=True,
        traceback=tracebacks,
        lost=store_lost(out, b.num_samples),
        detail=f"{landed} kills landed mid-run; store identical",
    )


def engine_processes(pid: int) -> list[int]:
    """The vLLM processes a driver started (its descendants, without multiprocessing's resource tracker)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        with contextlib.suppress(OSError):
            if b"resource_tracker" not in (Path("/proc") / str(child) / "cmdline").read_bytes():
                found.append(child)
        todo += children.get(child, [])
    return sorted(found)


def kill_vllm_engine(b: Bench, min_stored: int = 2) -> Outcome:
    if importlib.util.find_spec("vllm") is None:
        return Outcome("kill-vllm-engine", "extract", injected=False, detail="vLLM is not installed")
    out = b.work / "vllm-store"
    shutil.rmtree(out, ignore_errors=True)
    command = _extract_command(
        b.prepared,
        out,
        "--backend",
        "vllm",
        "--no-vllm-compile",
        "--compute-dtype",
        "float32",
        "--shard-size-mb",
        "0.05",
        "--token-budget",
        str(b.token_budget),
    )
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", **b.vllm_env}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the engine in its own process, as in production
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 900
    while proc.poll() is None and _stored(out) < min_stored and time.monotonic() < deadline:
        time.sleep(0.02)  # until the engine's worker has committed a few shards ...
    victims = engine_processes(proc.pid) if proc.poll() is None else []
    for victim in victims:  # ... then the engine dies under the driver
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    try:
        _, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise NotSurvived("the driver hung after its engine died") from None
    if not victims:
        return Outcome("kill-vllm-engine", "extract", injected=False, detail=f"no engine to kill: {err[-300:]}")
    (b.work / "kill-vllm-engine.stderr").write_text(err)
    errors = [line.strip() for line in err.splitlines() if line.startswith("error:")]
    check(
        proc.returncode == 1 and len(errors) == 1 and not child_traceback(err) and "died" in errors[0],
        f"not one error line (exit {proc.returncode}): {errors or err[-300:]}",
    )
    partial = _stored(out)
    final = subprocess.run(command, capture_output=True, text=True, env=env)
    check(final.returncode == 0, f"the resumed run failed: {final.stderr[-800:]}")
    resumed = store.open(out)
    check(resumed.sample_ids.tolist() == list(range(b.num_samples)), "the resumed store's sample ids differ")
    check(store.verify_store(out).ok, "the resumed store does not verify")
    reference = store.open(b.store)
    for k in range(len(resumed)):
        check(torch.equal(resumed[k]["input_ids"], reference[k]["input_ids"]), f"sample {k}: other tokens")
    return Outcome(
        "kill-vllm-engine",
        "extract",
        survived=True,
        lost=store_lost(out, b.num_samples),
        traceback=child_traceback(final.stderr),
        detail=f"{errors[0].split(': ', 2)[-1][:70]}... ({partial} stored); resumed",
    )


FAULTS: dict[str, tuple[str, Callable[[Bench], Outcome]]] = {
    "flip-prepared-shard": ("prepare", flip_prepared_shard),
    "flip-store-shard": ("extract", flip_store_shard),
    "flip-checkpoint-weights": ("train", flip_checkpoint_weights),
    "flip-training-state": ("train", flip_training_state),
    "nan-hidden-states": ("extract", nan_hidden_states),
    "nan-loss": ("train", nan_loss),
    "full-disk-extract": ("extract", full_disk_extract),
    "full-disk-train": ("train", full_disk_train),
    "full-disk-export": ("export", full_disk_export),
    "kill-9-train": ("train", kill_9_train),
    "kill-9-extract": ("extract", kill_9_extract),
    "kill-vllm-engine": ("extract", kill_vllm_engine),
}


def run_fault(b: Bench, name: str) -> Outcome:
    """One fault; a failed check is 'not survived', an escaped exception other than DraftsmithError a traceback."""
    stage, fn = FAULTS[name]
    try:
        return fn(b)
    except NotSurvived as err:
        return Outcome(name, stage, detail=str(err)[:300])
    except DraftsmithError as err:  # a one-line error where the fault should have been survived
        return Outcome(name, stage, detail=f"DraftsmithError: {err}"[:300])
    except Exception as err:  # noqa: BLE001 - counted and shown: this is what the run is looking for
        traceback.print_exc()
        return Outcome(name, stage, traceback=True, detail=f"{type(err).__name__}: {err}"[:300])


def summary(outcomes: list[Outcome]) -> dict[str, int]:
    injected = [o for o in outcomes if o.injected]
    return {
        "faults_injected": len(injected),
        "survived": sum(o.survived for o in injected),
        "samples_lost": sum(o.lost for o in outcomes),
        "tracebacks": sum(o.traceback for o in outcomes),
    }


def print_table(outcomes: list[Outcome]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="draftsmith faults")
    for column in ("fault", "stage", "injected", "survived", "samples lost", "traceback", "detail"):
        table.add_column(column)
    for o in outcomes:
        table.add_row(
            o.fault,
            o.stage,
            "yes" if o.injected else "no",
            "yes" if o.survived else "[red]NO[/]",
            str(o.lost),
            "[red]yes[/]" if o.traceback else "no",
            o.detail,
        )
    Console(stderr=True, width=200).print(table)


def prepare_default(work: Path, n: int, max_length: int) -> Path:
    from draftsmith.config import PrepareConfig
    from draftsmith.core import assets
    from draftsmith.prepare import stage as prepare

    path = work / "prepared"
    if not (path / "manifest.json").is_file():
        prepare.run(
            PrepareConfig(
                data=[str(assets.sharegpt_path())], max_samples=n, max_length=max_length, output=path, num_workers=1
            )
        )
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="", help="comma-separated words: run the faults whose name holds one")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM engine kill")
    parser.add_argument("--samples", type=int, default=40, help="ShareGPT conversations (default 40)")
    parser.add_argument("--max-length", type=int, default=128, help="tokens per conversation (default 128)")
    parser.add_argument("--work", type=Path, default=None, help="keep the artefacts here (default: a temp dir)")
    args = parser.parse_args()
    words = [w for w in args.only.split(",") if w]
    names = [
        n
        for n in FAULTS
        if (not words or any(w in n for w in words)) and not (args.no_vllm and n == "kill-vllm-engine")
    ]
    with tempfile.TemporaryDirectory(prefix="draftsmith-faults-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        bench = Bench(work, prepare_default(work, args.samples, args.max_length))
        print(f"set-up {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        outcomes = []
        for name in names:
            t = time.perf_counter()
            outcomes.append(run_fault(bench, name))
            print(f"{name}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
        print_table(outcomes)
        print(f"total {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    print(json.dumps(summary(outcomes)))


if __name__ == "__main__":
    main()
