"""Training: the TTT forward and loss (ttt.py), data sources (data.py), the loop (trainer.py), checkpoints
(checkpoint.py) and torchrun support (distributed.py). The stage entry point is `run(cfg: TrainConfig)`."""

from draftsmith.train.stage import run

__all__ = ["run"]
