"""The block objective (DFlash, DSpark): one draft forward per batch over blocks at sampled anchors, scored against the
target (objective.py) by the fused block loss (block_loss.py).

Blocks [x_a, mask x (S-1)] at sampled anchors a (`Anchors`, `block_index`), block position j trained towards p_{a+j-1}
with weight step_weight**(j-1) (exp(-(j-1)/loss_decay)); the metrics call block position j "step" j-1 (DSpark, whose
anchor row proposes too: j), so every number reads as the unrolled objective's. Its head and vocabulary are the
target's (or, with --draft-vocab-size, its own over a reduced vocabulary), so its loss and metrics run a slice of rows
at a time from [N, H] states, never [N, V] (block_loss.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import numpy as np
import torch

from draftsmith.methods.attention import (
    Tree,
    anchor_chunks,
    block_attention,
    chunked_block_attention,
    naive_block_attention,
)
from draftsmith.methods.dflash.modeling import DFlashDraft
from draftsmith.methods.objective import Anchors
from draftsmith.train.block_loss import TargetStates, score_blocks
from draftsmith.train.objective import (
    ACCEPT,
    CORRECT,
    KL,
    MapsTensors,
    Pass,
    TargetDistribution,
    TTTResult,
    new_sums,
    score_steps,
    slice_rows,
    step_loss_term,
)

# Rows of the head's matmuls a CPU runs at a time in the fused loss (block_loss.BlockKL; its reductions still take
# objective.REDUCE_ROWS): a [64, H] x [H, V] matmul streams the whole [V, H] head for half the work of a [128, H]
# one (64, 128, 256 and 512 tried on a 2-core EPYC: 128 and 256 the fastest within noise, 128 the smaller).
HEAD_ROWS = 128


@dataclass
class BlockIndex(MapsTensors):
    """What a block method's batch reads, built on the host: the blocks (anchors) and, per proposal d of a block (the
    "steps" of the metrics: d = 0 proposes x_{a+1}), the block rows scored and the target rows they are scored
    against. Proposal d is block row j = d + 1 (DFlash: the anchor row proposes nothing) or j = d (DSpark)."""

    needed: torch.Tensor  # [N] int64: rows b * T + i whose target distribution p_i some block row is scored on
    scored: list[torch.Tensor]  # per proposal d, [N_d] int64: rows (b * A + a) * S + j of the block hidden states
    target: list[torch.Tensor]  # per proposal d, [N_d] int64: where row b * T + anchor + d sits in `needed`
    counts: torch.Tensor  # [D] float64: N_d (D = S - 1, DSpark S)
    anchors: torch.Tensor  # [B, A] int64: block starts, ascending per sample (padding: 1, never scored)
    chunk_limits: list[int]  # per chunk of attention.anchor_chunks(A, S): its largest anchor over the batch
    tree: Tree | None = None  # a tree-packed batch's (B = 1) positions and mask (train/packing.py)
    keeps_states: ClassVar[bool] = True  # the target's side: the normed states (TargetStates, never [N, V])

    def score(
        self,
        draft: DFlashDraft,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        target: TargetDistribution | TargetStates,
        run: Pass,
    ) -> TTTResult:
        """The block objective: one draft forward over the batch's blocks; block row j is "step" j-1 (DSpark: j)."""
        attention = "naive" if run.mode == "naive" else run.kernel
        steps = dflash_hidden_states(draft, input_ids, aux_hidden, self, run.checkpointed, attention)
        # TargetHead's for the whole vocabulary, and the head BlockKL computes (DFlashDraft.logits, not a subclass's
        # own): never [N, V] (block_loss.py)
        if isinstance(target, TargetStates) and type(draft).logits is DFlashDraft.logits:
            return _block_loss(draft, next(steps), input_ids, target, self, run)
        return score_steps(draft, steps, target, self, run)


def block_index(
    loss_mask: np.ndarray | torch.Tensor, anchors: Anchors, sample_ids: Sequence[int] = (), epoch: int = 0
) -> BlockIndex:
    """The blocks of a [B, T] 0/1 loss mask (numpy, on the host) and the rows each block proposal reads: sample b's
    position t is row b * T + t (`sample_blocks`)."""
    mask = np.asarray(loss_mask, dtype=bool)
    b, t = mask.shape
    rows = np.arange(b * t, dtype=np.int64).reshape(b, t)
    return sample_blocks(list(mask), list(rows), (b, t), anchors, list(sample_ids) or list(range(b)), epoch)


def sample_blocks(  # noqa: PLR0913 - the samples, where they sit, and what the batch draws
    masks: Sequence[np.ndarray],
    rows: Sequence[np.ndarray],
    shape: tuple[int, int],
    anchors: Anchors,
    sample_ids: Sequence[int],
    epoch: int = 0,
    tree: Tree | None = None,
) -> BlockIndex:
    """The blocks of each sample (masks[i] its 0/1 loss mask [T_i], rows[i] the row of the [B, T] batch `shape`,
    flattened, holding each of its positions: b * T + t padded, an ancestor's row for a shared prefix tree-packed)
    and the rows each block proposal reads.

    Proposal d of the block at anchor a proposes x_{a+d+1}: it is scored when a + d + 1 < T_i and mask[a+d+1], and
    trained towards p_{a+d} (the target's distribution of that token), the same alignment as every method. It is
    block row d + 1 (DFlash: block position j proposes x_{a+j}) or, `anchors.from_anchor`, block row d (DSpark). A
    block's anchor is the row holding x_a; its context the rows before it that its sample holds (`tree`)."""
    b, t = shape
    size = anchors.block_size
    drawn = [anchors.draw(mask, epoch, i) for mask, i in zip(masks, sample_ids, strict=True)]
    batch_row = [int(where[0]) // t for where in rows]
    slots, used = [], np.zeros(b, dtype=np.int64)
    for r, d in zip(batch_row, drawn, strict=True):
        slots.append(used[r] + np.arange(len(d)))
        used[r] += len(d)
    num = max(1, int(used.max(initial=0)))
    starts = np.ones((b, num), dtype=np.int64)  # padding: 1, never scored
    first = 0 if anchors.from_anchor else 1  # the block row of proposal 0
    j = np.arange(first, size)
    needed = np.zeros(b * t, dtype=bool)
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))
    picked: list[list[tuple[np.ndarray, np.ndarray]]] = [[empty] for _ in j]  # per proposal: (block rows, targets)
    for mask, where, d, slot, r in zip(masks, rows, drawn, slots, batch_row, strict=True):
        starts[r, slot] = where[d] - r * t  # the anchor's column in its batch row
        pos = d[:, None] + (j - first + 1)[None, :]  # [A_i, D] the proposed token's position
        inside = np.minimum(pos, len(mask) - 1)
        scored = (pos < len(mask)) & mask[inside]
        target = where[inside - 1]  # the row of p_{a+d}
        needed[target[scored]] = True
        block_rows = (r * num + slot)[:, None] * size + j[None, :]
        for k in range(len(j)):
            picked[k].append((block_rows[:, k][scored[:, k]], target[:, k][scored[:, k]]))
    rank = np.cumsum(needed) - 1
    out_scored, out_target, counts = [], [], []
    for parts in picked:
        proposal_rows, proposal_target = (np.concatenate(x) for x in zip(*parts, strict=True))
        out_scored.append(torch.from_numpy(proposal_rows.astype(np.int64)))
        out_target.append(torch.from_numpy(rank[proposal_target].astype(np.int64)))
        counts.append(len(proposal_rows))
    limits = [int(starts[:, a0:a1].max()) for a0, a1 in anchor_chunks(num, size)]
    return BlockIndex(
        torch.from_numpy(np.flatnonzero(needed).astype(np.int64)),
        out_scored,
        out_target,
        torch.tensor(counts, dtype=torch.float64),
        torch.from_numpy(starts),
        limits,
        tree,
    )


def dflash_hidden_states(
    draft: DFlashDraft,
    input_ids: torch.Tensor,
    aux_hidden: torch.Tensor,
    index: BlockIndex,
    checkpointed: bool = False,
    attention: str = "auto",
) -> Iterator[torch.Tensor]:
    """DFlash: the blocks' pre-norm hidden states [B, A*S, H] from one draft forward, once per block position j
    (the rows of position j are `index.scored[j-1]`). Block a sits at positions anchor .. anchor + S - 1, reads
    [x_anchor, mask, ...] and sees the context s < anchor: what vLLM's round from prefix 0..anchor computes.
    attention: `block_attention`'s kernel ("auto", "flex", "chunked"), or "naive": one explicit mask over every
    block (tests)."""
    b, t = input_ids.shape
    anchors, tree = index.anchors, index.tree
    size = draft.spec.block_size
    assert size is not None  # a DFlash spec's
    block_ids = draft.block_ids(input_ids.gather(1, anchors)).flatten(1)  # [B, A*S]
    at = anchors if tree is None else tree.positions[anchors]  # a tree-packed row's position in its sample
    block_positions = (at[:, :, None] + torch.arange(size, device=anchors.device)).flatten(1)
    positions = torch.arange(t, device=input_ids.device).expand(b, t) if tree is None else tree.positions[None]
    if attention == "naive":
        attend = partial(naive_block_attention, limits=anchors, tree=tree)
    elif tree is not None:  # the tree's mask runs in the chunked kernel, on every device
        attend = partial(chunked_block_attention, limits=anchors, chunk_limits=index.chunk_limits, tree=tree)
    else:
        attend = partial(block_attention, limits=anchors, chunk_limits=index.chunk_limits, kernel=attention)
    hidden = draft.forward_hidden(
        block_ids, block_positions, draft.context(aux_hidden), positions, attend, checkpointed=checkpointed
    )
    for _ in range(size - 1):
        yield hidden


def _block_loss(
    draft: DFlashDraft,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    target: TargetStates,
    index: BlockIndex,
    run: Pass,
) -> TTTResult:
    """The scoring of a block method's proposals over TargetStates (block_loss.score_blocks: the head's
    matmul, the target's p, KL, metrics and the rows' gradient a slice at a time; DSpark's Markov bias and confidence
    loss), its sums then filled per proposal as objective.score_steps fills them."""
    sums, loss = new_sums(index, run)
    sub = slice_rows(hidden.device, target.weight.shape[0])
    rows = max(sub, HEAD_ROWS) if hidden.device.type == "cpu" else sub
    extra_loss, per_step = score_blocks(
        draft, hidden, input_ids, target, index, run.step_weight, run.normaliser, run.metrics, rows, sub
    )
    for k, (step_kl, step_correct, step_accept) in enumerate(per_step):
        step_loss = step_kl.sum()
        loss = loss + step_loss_term(run, k, step_loss)
        sums[KL, k] = step_loss.detach()
        if run.metrics:
            sums[CORRECT, k] = step_correct.sum()
            sums[ACCEPT, k] = step_accept.sum()
    return TTTResult(loss=loss + extra_loss, sums=sums)
