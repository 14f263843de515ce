"""Where training batches come from: a token-budget sampler, padding collation, and the two feature sources.

Offline: the hidden-state store already holds the aux layers and layer N for every sample.
Online: the target runs inside the trainer (transformers) and the same layers are captured with the hf extraction
backend's forward hooks (`draftsmith.extract.hf.capture_hidden_states`); nothing touches the disk. Both produce
the same `Batch`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import nn

from draftsmith.core.capture import capture_hidden_states
from draftsmith.core.errors import DraftsmithError


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] int64, right-padded with 0
    loss_mask: torch.Tensor  # [B, T] bool, False on padding
    hidden_states: torch.Tensor | None  # [B, T, L, H]: aux layers then layer N (None until the online target ran)
    sample_ids: list[int]
    lengths: list[int]

    @property
    def num_tokens(self) -> int:
        return int(sum(self.lengths))

    def to(self, device: torch.device) -> "Batch":
        hs = self.hidden_states.to(device, non_blocking=True) if self.hidden_states is not None else None
        return Batch(self.input_ids.to(device), self.loss_mask.to(device), hs, self.sample_ids, self.lengths)


def collate(items: Sequence[dict]) -> Batch:
    """Right-pad samples to the longest: causal attention never lets a real position see the padding."""
    lengths = [int(it["input_ids"].shape[0]) for it in items]
    b, t = len(items), max(lengths)
    input_ids = torch.zeros(b, t, dtype=torch.int64)
    loss_mask = torch.zeros(b, t, dtype=torch.bool)
    hidden = None
    if "hidden_states" in items[0]:
        _, layers, h = items[0]["hidden_states"].shape
        hidden = torch.zeros(b, t, layers, h, dtype=items[0]["hidden_states"].dtype)
    for i, (it, n) in enumerate(zip(items, lengths)):
        input_ids[i, :n] = it["input_ids"]
        loss_mask[i, :n] = it["loss_mask"].bool()
        if hidden is not None:
            hidden[i, :n] = it["hidden_states"]
    return Batch(input_ids, loss_mask, hidden, [int(it["sample_id"]) for it in items], lengths)


class TokenBudgetSampler:
    """Deterministic per-epoch batches of dataset indices, each at most `token_budget` tokens once padded.

    Each epoch: shuffle (seed, epoch), sort by length inside windows (little padding, still random), pack greedily,
    shuffle the batch order, keep a multiple of world_size and give rank r every world_size-th batch. The state is
    (epoch, position) only, so a resumed run sees exactly the batches an uninterrupted one would.
    """

    WINDOW = 512  # samples sorted together

    def __init__(self, indices: Sequence[int], lengths: np.ndarray, token_budget: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1, shuffle: bool = True):
        self.indices = np.asarray(indices, dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.token_budget, self.seed, self.rank, self.world_size, self.shuffle = (token_budget, seed, rank,
                                                                                 world_size, shuffle)
        if len(self.indices) == 0:
            raise DraftsmithError("the training data set is empty (no samples after the held-out split); "
                                  "add data or lower --eval-fraction")
        too_long = self.indices[self.lengths[self.indices] > token_budget]
        if len(too_long):
            i = int(too_long[0])
            raise DraftsmithError(
                f"sample {i} has {int(self.lengths[i])} tokens, more than --token-budget {token_budget} "
                f"({len(too_long)} such samples); raise --token-budget to at least {int(self.lengths.max())} "
                "or prepare the data with a smaller --max-length")
        self.epoch, self.position = 0, 0

    def batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of epoch `epoch`."""
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(self.indices) if self.shuffle else self.indices.copy()
        batches: list[list[int]] = []
        for w in range(0, len(order), self.WINDOW):
            window = order[w:w + self.WINDOW]
            window = window[np.argsort(-self.lengths[window], kind="stable")]
            current: list[int] = []
            longest = 0
            for i in window.tolist():
                n = int(self.lengths[i])
                if current and (len(current) + 1) * max(longest, n) > self.token_budget:
                    batches.append(current)
                    current, longest = [], 0
                current.append(i)
                longest = max(longest, n)
            if current:
                batches.append(current)
        if self.shuffle:
            batches = [batches[j] for j in rng.permutation(len(batches))]
        usable = len(batches) // self.world_size * self.world_size
        return batches[self.rank:usable:self.world_size]

    def __len__(self) -> int:
        return len(self.batches(self.epoch))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


# ---------------------------------------------------------------------------------------------- online capture

class OnlineSource:
    """Fills a batch's hidden states by running the target (the online mode of the trainer)."""

    def __init__(self, target: nn.Module, layer_ids: Sequence[int]):
        self.target, self.layer_ids = target, list(layer_ids)

    def __call__(self, batch: Batch) -> Batch:
        # right-padded: causal attention keeps padding out of every real position, so no attention mask is needed
        hs = capture_hidden_states(self.target, batch.input_ids, None, self.layer_ids, dtype=torch.float32)
        return Batch(batch.input_ids, batch.loss_mask, hs, batch.sample_ids, batch.lengths)


def fetch(dataset, ids: list[int]) -> Batch:
    return collate([dataset[i] for i in ids])


def token_counts_from(dataset, vocab_size: int) -> torch.Tensor:
    """Loss-masked token counts [vocab] computed from the samples themselves (when no prepared set is at hand)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for i in range(len(dataset)):
        item = dataset[i]
        ids = item["input_ids"][item["loss_mask"].bool()]
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts
