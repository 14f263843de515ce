"""What a method's training draws for a batch, as plain descriptors (`DraftMethod.sampling`): every TTT step or
P-EAGLE's COD at the parallel depths (`Steps`, the unrolled objective, train/unrolled.py), or a block method's
anchors (`Anchors`, the block objective, train/blocks.py). No torch: train/ turns a descriptor into its objective's
index once (`train.batches.Sampling`), so methods/ never imports the trainer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class COD:
    """P-EAGLE's COD sampling of the anchors each depth k >= 1 scores: of depth k's n candidates (loss-masked),
    keep ceil(n * ratio**k), at least ceil(n * floor) (and at most n). Which ones: per sample, the candidates with
    the smallest of one random priority per position, drawn from (seed, epoch, sample id) -- so the kept sets
    shrink nested-wise with depth, and a resumed run draws the same ones."""

    ratio: float
    floor: float
    seed: int = 0

    def keep(self, n: int, k: int) -> int:
        if k == 0 or n == 0:
            return n
        return min(n, max(math.ceil(n * self.ratio**k - 1e-9), math.ceil(n * self.floor - 1e-9)))


@dataclass(frozen=True)
class Steps:
    """The unrolled objective's draw: every scored position at every step, or P-EAGLE's COD at depths >= 1."""

    cod: COD | None = None


ALL_STEPS = Steps()  # EAGLE-3's and Eagle 3.1's


@dataclass(frozen=True)
class Anchors:
    """The block methods' anchor sampling: per sample, up to `per_sample` block starts drawn without replacement from
    the positions a that can anchor a block (a >= 1, so the block has a context; loss_mask[a] and loss_mask[a+1]: the
    anchor is a token the target wrote, as vLLM's bonus token is, and the first proposal is scored), from one
    generator per (seed, epoch, sample id): the same blocks on a resume. `from_anchor`: the block's first proposal is
    its anchor row's (DSpark) instead of its first mask row's (DFlash)."""

    block_size: int
    per_sample: int
    seed: int = 0
    from_anchor: bool = False  # DSpark: the anchor row proposes too (x_{a+1}), so every row of the block is scored

    def draw(self, mask: np.ndarray, epoch: int, sample_id: int) -> np.ndarray:
        valid = np.zeros(len(mask), dtype=bool)
        valid[1:-1] = mask[1:-1] & mask[2:]
        candidates = np.flatnonzero(valid)
        if len(candidates) > self.per_sample:
            rng = np.random.default_rng([self.seed, epoch, int(sample_id)])
            candidates = np.sort(rng.choice(candidates, self.per_sample, replace=False))
        return candidates


Draw = Steps | Anchors  # what a method's training draws: its objective follows from the descriptor's type
