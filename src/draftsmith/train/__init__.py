"""Training: the stage (`run(cfg: TrainConfig)`, stage.py: the loop), its set-up (setup.py), the two objectives
(objective.py; unrolled.py: TTT steps; blocks.py: a block method's blocks), batches (batches.py), metrics
(metrics.py), checkpoints (checkpoint.py), torchrun support (distributed.py) and the draft model (model.py,
attention.py, drafts.py). OpenMP's wait policy is chosen by the CLI before this package loads torch
(core/threads.py); importing it changes nothing.
`run` is loaded from stage.py on first use (PEP 562): importing a module of this package does not load the
stage and its torch.
"""

from __future__ import annotations

import importlib

__all__ = ["run"]


def __getattr__(name: str):
    """`run`, from stage.py on first use; a submodule is imported as usual."""
    if name == "run":
        return importlib.import_module("draftsmith.train.stage").run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
