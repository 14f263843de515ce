"""Training: the stage (`run(cfg: TrainConfig)`, stage.py: the loop), its set-up (setup.py), the two objectives
(objective.py; unrolled.py: TTT steps; blocks.py: a block method's blocks), batches (batches.py), metrics
(metrics.py), the checkpoints it writes (checkpoint.py) and torchrun support (distributed.py); the drafts it trains are
draftsmith.methods'. OpenMP's wait policy is chosen by the CLI before this package loads torch
(core/threads.py); importing it changes nothing.
This package imports nothing itself: importing one of its modules loads neither the stage nor its torch.
"""
