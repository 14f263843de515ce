"""Training: the stage (`run(cfg: TrainConfig)`, stage.py: the loop), its set-up (setup.py), the TTT forward and loss
(ttt.py), batches (batches.py), metrics (metrics.py), checkpoints (checkpoint.py), torchrun support
(distributed.py) and the draft model (model.py, attention.py, drafts.py).

On import, before torch is loaded (the CLI's `train` path), OpenMP is told to let idle threads sleep rather than
spin (OMP_WAIT_POLICY=PASSIVE) unless the environment already says otherwise: on a CPU shared with other work,
spinning threads wait for each other's time slices at every parallel region, and a training step ran about 3x
slower on this project's busy 2-core machines (docs/benchmarks.md). The variable is removed again once torch has
read it, so processes started later (vLLM) keep their own defaults. It changes no result, only waiting.
"""

import os
import sys

_PASSIVE = "OMP_WAIT_POLICY" not in os.environ and "torch" not in sys.modules
if _PASSIVE:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
import torch  # noqa: E402 - OpenMP reads its settings once, when torch loads it

if _PASSIVE:
    del os.environ["OMP_WAIT_POLICY"]

from draftsmith.train.stage import run  # noqa: E402

__all__ = ["run"]
