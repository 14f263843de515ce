"""What the online-training tests share (tests/test_train_engine.py, tests/test_train_mooncake.py): the CLI in a
process of its own, the run's settings, and the checks of a run against another."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from draftsmith.extract.spool import disk_bytes

NUM_SAMPLES = 160
MAX_LENGTH = 128
STEPS = 24
# Small steps (about two samples each) so that four chunks of one step and the held-out chunk fit in under a tenth
# of the whole store.
TRAIN = [
    "--token-budget",
    "256",
    "--draft-vocab-size",
    "2000",
    "--warmup-steps",
    "2",
    "--log-every",
    "1",
    "--eval-every",
    "8",
    "--save-every",
    "4",
    "--device",
    "cpu",
    "--no-vllm-compile",
    "--engine-dtype",
    "float32",
]
# float32 in vLLM on both sides: `auto` is bfloat16 on CPUs with bf16 instructions, float32 on others
EXTRACT = ["--backend", "vllm", "--no-vllm-compile", "--compute-dtype", "float32"]
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1"}


# On a CPU the online trainer runs on the cores the engine leaves it (the second half); torch's CPU kernels may round
# differently with another number of threads, so the offline runs it is compared with train on the same cores.
ALLOWED = sorted(os.sched_getaffinity(0))
TRAINER_CORES = ALLOWED[len(ALLOWED) // 2 :] if len(ALLOWED) > 1 else ALLOWED


def draftsmith(
    *args: str | Path,
    check: bool = True,
    log: Path | None = None,
    trainer_cores: bool = False,
    cores: list[int] | None = None,
    cwd: Path | None = None,
):
    """The CLI in a process of its own (in `cwd`): run to the end (and checked), or, with `log`, started (its stdout
    and stderr into `log`) and returned; `trainer_cores`: on the cores an online trainer keeps (or on `cores`)."""
    cmd = [sys.executable, "-m", "draftsmith", *map(str, args)]
    if trainer_cores or cores:
        cmd = ["taskset", "-c", ",".join(map(str, cores or TRAINER_CORES)), *cmd]
    env = {**os.environ, **ENV}
    if log is not None:
        with open(log, "a") as err:
            proc = subprocess.Popen(cmd, env=env, stdout=err, stderr=err, cwd=cwd)
        proc.log = log  # what wait_for shows when the process ends early
        return proc
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=cwd)
    if check:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def error_lines(text: str) -> list[str]:
    """The lines of a CLI's output that report an error (draftsmith's one-line errors start with "error")."""
    return [line for line in text.splitlines() if line.startswith("error:")]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    last = sorted((run / "checkpoints").glob("step-*"))[-1]
    return load_file(str(last / "model.safetensors"))


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def assert_once_per_epoch(run: Path) -> None:
    seen: dict[int, list[int]] = {}
    for line in read_jsonl(run / "samples.jsonl"):
        seen.setdefault(line["epoch"], []).extend(line["samples"])
    for epoch, ids in seen.items():
        assert len(ids) == len(set(ids)), f"epoch {epoch}: a sample was trained on twice"


class SpoolWatch:
    """The bytes on disk under a spool directory, sampled every 5 ms from a thread for as long as it runs."""

    def __init__(self, path: Path):
        self.path, self.peak, self.samples, self._stop = path, 0, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.path.is_dir():
                self.peak = max(self.peak, disk_bytes(self.path))
                self.samples += 1
            time.sleep(0.005)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            log = getattr(proc, "log", None)
            tail = log.read_text()[-3000:] if log is not None and log.is_file() else ""
            raise AssertionError(f"the trainer ended before {what} (exit code {proc.returncode}):\n{tail}")
        if time.monotonic() > deadline:
            proc.kill()  # its engine process follows it
            proc.wait()
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def steps_done(run: Path) -> int:
    path = run / "samples.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def wait_gone(*pids: int, timeout: float = 30.0) -> None:
    """Until none of `pids` is alive, or `timeout` s (SIGKILL is delivered, not waited for); the caller asserts."""
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def reference(work: Path, sharegpt_file: Path) -> dict:
    """The default target's prepared set of NUM_SAMPLES samples, its store (`extract --backend vllm`) and the offline
    run of STEPS steps on it (on the cores an online trainer keeps)."""
    prepared, store_dir, run = work / "prepared", work / "store", work / "offline"
    draftsmith(
        "prepare",
        "--data",
        sharegpt_file,
        "--max-samples",
        NUM_SAMPLES,
        "--max-length",
        MAX_LENGTH,
        "--output",
        prepared,
    )
    draftsmith("extract", "--prepared", prepared, "--output", store_dir, *EXTRACT)
    draftsmith("train", "--data", store_dir, "--output", run, "--max-steps", STEPS, *TRAIN, trainer_cores=True)
    return {"prepared": prepared, "store": store_dir, "run": run, "store_bytes": disk_bytes(store_dir)}


def torchrun_offline_and_online(
    work: Path, store: Path, online: list[str], options: list[str]
) -> tuple[list, list, str]:
    """`torchrun --standalone --nproc-per-node 2 -m draftsmith train` (gloo, one thread a rank) in `work`: from
    `store` into work/offline (on the cores an online trainer keeps), then with `online` (its --data and --engine
    options) into work/online, each checked; returns both runs' (type, step, tokens_seen, loss) per metrics line and
    the online run's stdout."""
    torchrun = [
        str(Path(sys.executable).with_name("torchrun")),
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "draftsmith",
    ]
    env = {**os.environ, **ENV, "OMP_NUM_THREADS": "1"}
    cores = ["taskset", "-c", ",".join(map(str, TRAINER_CORES))]
    for name, data in (("offline", ["--data", str(store)]), ("online", online)):
        cmd = (cores if name == "offline" else []) + torchrun + ["train", *data, "--output", str(work / name), *options]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=work)
        assert done.returncode == 0, done.stderr[-3000:]
    on, off = (
        [(m["type"], m["step"], m.get("tokens_seen"), m["loss"]) for m in read_jsonl(work / run / "metrics.jsonl")]
        for run in ("online", "offline")
    )
    return on, off, done.stdout
