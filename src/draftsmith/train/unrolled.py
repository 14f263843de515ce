"""The unrolled objective (EAGLE-3, Eagle 3.1, P-EAGLE): training-time test (TTT), the draft unrolled over a batch one
step (or parallel depth) at a time, each step scored against the target (objective.py).

Alignment (docs/architecture.md; reference implementations had an off-by-one here). Tokens x_0..x_{T-1}; the target's
state at position j (layer N) gives p_j, its distribution of token x_{j+1}. At TTT step k the draft at position t
  - reads the embedding of x_{t+k+1} and the fused target features f_t (k = 0) or its own step k-1 output at t,
  - sits at RoPE position t+k and attends causally to step-0 keys s <= t plus its own keys of steps 1..k at t,
  - predicts token x_{t+k+2}: it is trained towards p_{t+k+1}, with weight loss_mask[t+k+2] (the predicted token's).
So step k has T-k-2 candidate positions, of which the loss-masked ones are scored.

P-EAGLE (a spec with a mask token, parallel drafting in vLLM): step 0 is EAGLE-3's; at depth k >= 1 the slot at
position t+k reads the mask token's embedding and fc(mask_hidden) instead of x_{t+k+1} and step k-1's output, and
still attends to step-0 keys s <= t plus its own anchor's slots of depths 1..k (the same attention as TTT, so the
same memory-linear kernels), and predicts x_{t+k+2}: what vLLM's k-th parallel proposal from prefix 0..t+1 is.
COD sampling (`step_index(..., cod=...)`) scores only a subset of the anchors at each depth >= 1: about
n * ratio**k of depth k's n candidates, at least floor * n; the MLP and lm_head then run on those rows alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from draftsmith.methods.attention import KVCache, Tree
from draftsmith.methods.eagle3.modeling import Eagle3Draft
from draftsmith.methods.objective import COD
from draftsmith.train.block_loss import TargetStates
from draftsmith.train.objective import MapsTensors, Pass, TargetDistribution, TTTResult, score_steps


@dataclass
class StepIndex(MapsTensors):
    """Rows of a padded batch [B, T], flattened to b * T + t, that a TTT step reads (built on the host)."""

    needed: torch.Tensor  # [N] int64: rows j whose target distribution p_j some step is scored against
    scored: list[torch.Tensor]  # per step k, [N_k] int64: rows t scored at step k (loss_mask[t+k+2])
    target: list[torch.Tensor]  # per step k, [N_k] int64: where row t+k+1 sits in `needed`
    counts: torch.Tensor  # [K] float64: N_k, the scored positions per step
    live: list[torch.Tensor]  # per step k, int64: rows whose step-k output is read (scored at a step >= k)
    tree: Tree | None = None  # a tree-packed batch's (B = 1) positions and mask (train/packing.py)
    keeps_states: ClassVar[bool] = False  # the target's side: its distribution (over the draft vocabulary)

    def score(
        self,
        draft: Eagle3Draft,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        target: TargetDistribution | TargetStates,
        run: Pass,
    ) -> TTTResult:
        """The unrolled objective: `run.ttt_steps` draft steps over the batch, each scored against the target."""
        index = self if run.live_rows else replace(self, live=[])
        steps = ttt_hidden_states(
            draft, input_ids, aux_hidden, run.ttt_steps, run.mode, run.checkpointed, run.kernel, index
        )
        return score_steps(draft, steps, target, self, run)


def step_index(
    loss_mask: np.ndarray | torch.Tensor,
    ttt_steps: int,
    cod: COD | None = None,
    sample_ids: Sequence[int] = (),
    epoch: int = 0,
) -> StepIndex:
    """The rows each TTT step reads, from a [B, T] 0/1 loss mask (numpy, on the host: no device work): sample b's
    position t is row b * T + t (`sample_steps`)."""
    mask = np.asarray(loss_mask, dtype=bool)
    b, t = mask.shape
    rows = np.arange(b * t, dtype=np.int64).reshape(b, t)
    return sample_steps(list(mask), list(rows), b * t, ttt_steps, cod, sample_ids, epoch)


def sample_steps(  # noqa: PLR0913 - the samples, where they sit, and what the step draws
    masks: Sequence[np.ndarray],
    rows: Sequence[np.ndarray],
    num_rows: int,
    ttt_steps: int,
    cod: COD | None = None,
    sample_ids: Sequence[int] = (),
    epoch: int = 0,
    tree: Tree | None = None,
) -> StepIndex:
    """The rows each TTT step reads, per sample: masks[i] its 0/1 loss mask [T_i], rows[i] the batch row ([0,
    num_rows)) holding each of its positions (a padded batch: b * T + t; a tree-packed one: an ancestor's row for the
    prefix it shares, train/packing.py).

    Step k scores position t (t < T_i-k-2) when mask[t+k+2] and trains it towards p_{t+k+1}; p_j is needed when
    mask[j+1] (so every target row a step reads is in `needed`, and padding is never read). With `cod`
    (P-EAGLE), depth k >= 1 scores only COD.keep of each sample's candidates (`sample_ids` seed the choice). Two
    samples scoring the same row (a shared prefix both supervise) list it twice: it counts twice, as in their own rows.
    """
    needed = np.zeros(num_rows, dtype=bool)
    for mask, where in zip(masks, rows, strict=True):
        needed[where[:-1][mask[1:]]] = True
    rank = np.cumsum(needed) - 1  # position of each needed row in `needed`
    priority = []  # COD: one random priority per position of each sample
    if cod is not None:
        draws = [np.random.default_rng([cod.seed, epoch, int(i)]) for i in sample_ids]
        priority = [draw.random(len(mask)) for draw, mask in zip(draws, masks, strict=True)]
    scored, target, counts = [], [], []
    for k in range(ttt_steps):
        step_rows, step_target = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        for i, (mask, where) in enumerate(zip(masks, rows, strict=True)):
            candidates = np.flatnonzero(mask[k + 2 :])  # t with mask[t+k+2]
            if cod is not None and k:
                keep = cod.keep(len(candidates), k)
                if keep < len(candidates):
                    candidates = np.sort(candidates[np.argsort(priority[i][candidates], kind="stable")[:keep]])
            step_rows.append(where[candidates])
            step_target.append(rank[where[candidates + k + 1]])  # t + k + 1 < T_i: the same sample
        scored.append(torch.from_numpy(np.concatenate(step_rows).astype(np.int64)))
        target.append(torch.from_numpy(np.concatenate(step_target).astype(np.int64)))
        counts.append(len(scored[-1]))
    live: list[torch.Tensor] = []
    later = np.zeros(num_rows, dtype=bool)
    for step in reversed(scored):  # a position's step-k output feeds its own step k+1 (hidden state, diagonal key)
        later[step.numpy()] = True
        live.insert(0, torch.from_numpy(np.flatnonzero(later).astype(np.int64)))
    return StepIndex(
        torch.from_numpy(np.flatnonzero(needed).astype(np.int64)),
        scored,
        target,
        torch.tensor(counts, dtype=torch.float64),
        live,
        tree,
    )


def step_counts(loss_mask: torch.Tensor, ttt_steps: int) -> torch.Tensor:
    """Scored (loss-masked) positions per TTT step [K] (StepIndex.counts without the rows)."""
    t = loss_mask.shape[1]
    return torch.tensor(
        [float(loss_mask[:, k + 2 :].sum()) if k + 2 < t else 0.0 for k in range(ttt_steps)], dtype=torch.float64
    )


def ttt_hidden_states(
    draft: Eagle3Draft,
    input_ids: torch.Tensor,
    aux_hidden: torch.Tensor,
    ttt_steps: int,
    mode: str = "ttt",
    checkpointed: bool = False,
    kernel: str = "auto",
    index: StepIndex | None = None,
) -> Iterator[torch.Tensor]:
    """The draft's pre-norm hidden state [B, T, H] of each TTT step k = 0..K-1 (see the module docstring).

    With the batch's `index` (and its `live` rows), a layer's MLP runs only on the positions read later
    (`StepIndex.live`): the rows scored at this step or a later one (about a third fewer on chat data). Not at step 0
    below the last layer, whose outputs are the next layer's step-0 keys, read by every later position. The hidden
    states of the other rows then differ, and nothing reads them. An index's `tree`: a tree-packed batch (B = 1), its
    rows at their samples' positions, each seeing the rows of its own sample only.
    """
    b, t = input_ids.shape
    tree = None if index is None else index.tree
    cache = KVCache(len(draft.layers), kernel, tree)
    hidden = draft.fuse(aux_hidden)  # [B, T, H]
    positions = torch.arange(t, device=input_ids.device).expand(b, t) if tree is None else tree.positions[None]
    last = len(draft.layers) - 1
    parallel = draft.spec.mask_token_id is not None  # P-EAGLE's slots read the mask token
    if parallel:  # P-EAGLE: every slot of depth >= 1 reads the mask token and fc(mask_hidden), not step k-1
        assert draft.spec.mask_token_id is not None  # a P-EAGLE spec's
        mask_ids = torch.full_like(input_ids, draft.spec.mask_token_id)
        mask_hidden = draft.mask_features().to(hidden.dtype).expand(b, t, -1)
    for k in range(ttt_steps):
        if parallel and k:
            ids, hidden = mask_ids, mask_hidden
        else:
            ids = F.pad(input_ids[:, k + 1 :], (0, k + 1))  # step k at t reads x_{t+k+1}
        rows = (
            None
            if index is None or not index.live
            else [index.live[k] if k or i == last else None for i in range(last + 1)]
        )
        out = draft.forward_hidden(ids, hidden, positions + k, cache, mode=mode, checkpointed=checkpointed, rows=rows)
        yield out
        hidden = draft.feedback(out)  # EAGLE-3: feeds step k+1 (Eagle 3.1: normed)
