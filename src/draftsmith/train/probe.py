"""`train --probe-every N`: the acceptance a real engine gives, while training.

Every N optimizer steps, and at the run's end, rank 0 writes the current draft (weights only, as best/ is) to
RUN/probe/draft and decodes a few prompts with it in a real engine: `draftsmith evaluate` in a child process
(`--probe-engine auto`: the installed vLLM where it can decode the draft here, else the reference decoder), greedy,
`--probe-num-prompts` of `--probe-prompts` (default: the training data's held-out split, the split the trainer
holds out). Its τ and acceptance per position go into metrics.jsonl as a `"type": "probe"` line beside the held-out
evaluation (and into TensorBoard as probe/acceptance_length, probe/acc_i); each probe's report stays in
RUN/probe/step-N/. The child process keeps the engine's memory and failures out of the trainer: a probe that fails
is one line in the log and training goes on. Training waits for it: its cost is one engine start and the prompts'
decoding (`seconds` in its line); `--probe-device` gives it a device of its own on a GPU machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from draftsmith.config import TrainConfig
from draftsmith.core import processes
from draftsmith.core.errors import DraftsmithError
from draftsmith.methods import artefact
from draftsmith.train import checkpoint
from draftsmith.train.metrics import MetricsSink

TIMEOUT_S = 3600  # an engine that has not answered by then is not coming back


def due(cfg: TrainConfig, step: int, last: bool) -> bool:
    """A probe at this step: every --probe-every steps, and at the run's end."""
    return cfg.probe_every is not None and (last or step % cfg.probe_every == 0)


def command(cfg: TrainConfig, draft: Path, report: Path) -> list[str]:
    """`draftsmith evaluate` as the probe runs it."""
    argv = [sys.executable, "-m", "draftsmith", "evaluate", "--draft", str(draft), "--output", str(report)]
    argv += ["--prompts", cfg.probe_prompts, "--num-prompts", str(cfg.probe_num_prompts), "--engine", cfg.probe_engine]
    argv += ["--max-new-tokens", str(cfg.probe_max_new_tokens), "--no-baseline"]
    return argv + (["--device", cfg.probe_device] if cfg.probe_device else [])


def _environment(cfg: TrainConfig) -> dict[str, str]:
    """The child's environment: on a device of its own where asked (a vLLM engine sees that GPU alone)."""
    env = dict(os.environ)
    if cfg.probe_device and cfg.probe_device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = cfg.probe_device.removeprefix("cuda:")
    return env


def run(
    cfg: TrainConfig, manifest: artefact.CheckpointManifest, weights: dict[str, torch.Tensor], sink: MetricsSink
) -> dict | None:
    """One probe at `manifest.step` (rank 0): the draft written, decoded, its line logged; the line, or None where
    the probe failed (said in one line)."""
    t0, step, root = time.perf_counter(), manifest.step, Path(cfg.output) / "probe"
    report = root / f"step-{step}"
    log = root / f"step-{step}.log"
    try:
        draft = checkpoint.save_checkpoint(root, manifest, weights, None, best=True)
        with processes.ChildProcess(command(cfg, draft, report), log=log, env=_environment(cfg)) as child:
            code = child.wait(TIMEOUT_S)
        if code != 0:
            raise RuntimeError(f"exit {code}: {processes.failure_line(log)}")
        measured = json.loads((report / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError, RuntimeError, DraftsmithError, subprocess.TimeoutExpired) as err:
        print(f"train: the probe at step {step} failed ({err}; log: {log}); training goes on", file=sys.stderr)
        return None
    run = measured["runs"][0]
    line = {
        "type": "probe",
        "step": step,
        "engine": measured["engine"] + (f" {measured['vllm_version']}" if measured.get("vllm_version") else ""),
        "prompts": f"{measured['prompts']} ({measured['num_prompts']})",
        "k": run["k"],
        "acceptance_length": run["tau"],
        "acc": run["acceptance_per_pos"],
        "tau_95": run.get("tau_95"),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    sink.write(line)
    return line
