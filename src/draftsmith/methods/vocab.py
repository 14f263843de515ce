"""The draft vocabulary: the target token ids a draft model predicts, chosen by loss-masked token frequency.

docs/architecture.md: the `draft_vocab_size` most frequent target ids among loss-masked tokens, sorted by id;
`d2t[i] = target_id(i) - i` (int64 offsets, what vLLM reads) and `t2d` a bool mask over the target vocabulary.
Ties in frequency go to the lower token id, so the choice is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from draftsmith.core.errors import DraftsmithError


@dataclass
class DraftVocab:
    draft_to_target: torch.Tensor  # int64 [draft_vocab], target ids sorted ascending
    d2t: torch.Tensor  # int64 [draft_vocab], d2t[i] = draft_to_target[i] - i
    t2d: torch.Tensor  # bool [target_vocab], True where a target id is in the draft vocab
    coverage: float  # fraction of loss-masked tokens whose id is in the draft vocab

    @property
    def draft_vocab_size(self) -> int:
        return int(self.draft_to_target.numel())

    @property
    def target_vocab_size(self) -> int:
        return int(self.t2d.numel())


def _ranked_ids(counts: np.ndarray) -> np.ndarray:
    """Token ids by descending count, lower id first among equal counts."""
    return np.lexsort((np.arange(len(counts)), -counts))


def _counts(token_counts: torch.Tensor | np.ndarray) -> np.ndarray:
    counts = np.asarray(token_counts.cpu() if isinstance(token_counts, torch.Tensor) else token_counts)
    if counts.ndim != 1 or counts.size == 0:
        raise DraftsmithError(
            f"token counts must be a non-empty 1-D vector over the target vocabulary, got shape {tuple(counts.shape)}"
        )
    if (counts < 0).any():
        raise DraftsmithError("token counts must not be negative")
    return counts.astype(np.int64)


def build_draft_vocab(token_counts: torch.Tensor | np.ndarray, draft_vocab_size: int) -> DraftVocab:
    """Pick the `draft_vocab_size` most frequent loss-masked target ids (see module docstring)."""
    counts = _counts(token_counts)
    vocab = len(counts)
    if not 1 <= draft_vocab_size <= vocab:
        raise DraftsmithError(
            f"draft vocab size {draft_vocab_size} must be between 1 and the target's vocabulary size {vocab}"
        )
    chosen = np.sort(_ranked_ids(counts)[:draft_vocab_size])
    total = int(counts.sum())
    draft_to_target = torch.from_numpy(chosen.astype(np.int64))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_to_target] = True
    return DraftVocab(
        draft_to_target=draft_to_target,
        d2t=draft_to_target - torch.arange(draft_vocab_size, dtype=torch.long),
        t2d=t2d,
        coverage=float(counts[chosen].sum()) / total if total else 0.0,
    )


def coverage_report(token_counts: torch.Tensor, sizes: tuple[int, ...]) -> list[tuple[int, float]]:
    """(draft vocab size, loss-masked token coverage) for each size, capped at the target vocabulary size."""
    counts = _counts(token_counts)
    cumulative = np.cumsum(counts[_ranked_ids(counts)])
    total = int(cumulative[-1])
    capped = sorted({min(int(s), len(counts)) for s in sizes if s >= 1})
    return [(size, float(cumulative[size - 1]) / total if total else 0.0) for size in capped]
