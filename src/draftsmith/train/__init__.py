"""Training: the stage (`run(cfg: TrainConfig)`, stage.py: the loop), its set-up (setup.py), the TTT forward and loss
(ttt.py), batches (batches.py), metrics (metrics.py), checkpoints (checkpoint.py), torchrun support
(distributed.py) and the draft model (model.py, attention.py, drafts.py).

On import, before torch is loaded (the CLI's `train` path), OpenMP's wait policy is chosen from how busy the CPU is
right then, unless the environment already sets OMP_WAIT_POLICY: with other processes running (sampled from
/proc/stat's procs_running), idle threads sleep (PASSIVE): on a CPU shared with other work, spinning threads wait
for each other's time slices at every parallel region, and a training step ran about 3x slower on this project's
busy 2-core machines. On an otherwise idle CPU OpenMP keeps its default (a thread spins a while before it sleeps):
there PASSIVE costs every one of the step's few thousand parallel regions a wake-up, about 30 % of a step on a
2-core Xeon (docs/benchmarks.md). The variable is removed again once torch has read it, so processes started later
(vLLM) keep their own defaults. It changes no result, only waiting. train/threads.py decides; `WAIT_POLICY` says
what and why (train prints it).
"""

import os

from draftsmith.train.threads import WAIT_POLICY, WAIT_POLICY_SET

if WAIT_POLICY_SET:
    os.environ["OMP_WAIT_POLICY"] = WAIT_POLICY_SET
import torch  # noqa: E402, F401 - loaded here, after the wait policy: OpenMP reads its settings once

if WAIT_POLICY_SET:
    del os.environ["OMP_WAIT_POLICY"]

from draftsmith.train.stage import run  # noqa: E402

__all__ = ["run", "WAIT_POLICY"]
