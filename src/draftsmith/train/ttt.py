"""Training-time test (TTT): the unrolled draft forward, the target's distribution, the loss and the metrics.

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

DFlash (`DFlashDraft`, draftsmith.train.methods.dflash) runs one forward per batch instead of the unrolled steps: blocks
[x_a, mask x (S-1)] at sampled anchors a (`Anchors`, `block_index`), block position j trained towards p_{a+j-1} with
weight step_weight**(j-1) (exp(-(j-1)/loss_decay)); the metrics call block position j "step" j-1, so every number
below (KL, accuracy, acceptance per step) reads the same for all three methods. Its head and vocabulary are the
target's (or, with --draft-vocab-size, its own over a reduced vocabulary), so its loss and metrics run a slice of rows
at a time from [N, H] states, never [N, V] (block_loss.py).

No host synchronisation inside a step: which rows are scored at each step, and which rows of the target's
distribution they read, are index tensors built on the host with the batch (`step_index`, called by the collate
function), so every gather below has a size known before the step runs. Metrics are summed on the device; the
metrics that need the target's full vocabulary (its top-1 and the mass inside the draft vocabulary) are computed
only when asked for (logged steps, evaluation): the loss needs the draft vocabulary alone.
"""

from __future__ import annotations

from dataclasses import dataclass
import math
from typing import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.train.attention import anchor_chunks, block_attention, naive_block_attention
from draftsmith.train.block_loss import TargetStates, score_blocks, target_states
from draftsmith.train.dflash_model import DFlashDraft
from draftsmith.train.model import Eagle3Draft, KVCache

# Target logits are materialised for at most this many elements at a time (a 150k vocabulary stays bounded).
LOGIT_CHUNK_ELEMENTS = 1 << 24
# Rows of logits a CPU reduces at a time (top-1, logsumexp, the KL and its gradient, the acceptance): each
# operation of a reduction finds the slice the previous one left in the caches ([64, 8192] fp32 is 2 MiB) instead
# of streaming the whole [N, V] through memory once per operation; 64 measured best on a 2-core Xeon (32-256
# tried). A GPU takes LOGIT_CHUNK_ELEMENTS at a time (few kernel launches, bounded memory).
REDUCE_ROWS = 64
# Rows of the head's matmuls a CPU runs at a time in DFlash's fused loss (block_loss.BlockKL; its reductions still take
# REDUCE_ROWS): a [64, H] x [H, V] matmul streams the whole [V, H] head for half the work of a [128, H] one (64, 128,
# 256 and 512 tried on a 2-core EPYC: 128 and 256 the fastest within noise, 128 the smaller).
HEAD_ROWS = 128
# Rows of TTTResult.sums.
KL, CORRECT, ACCEPT, COUNT = range(4)


# ---------------------------------------------------------------------------------------------- host-side index


@dataclass
class StepIndex:
    """Rows of a padded batch [B, T], flattened to b * T + t, that a TTT step reads (built on the host)."""

    needed: torch.Tensor  # [N] int64: rows j whose target distribution p_j some step is scored against
    scored: list[torch.Tensor]  # per step k, [N_k] int64: rows t scored at step k (loss_mask[t+k+2])
    target: list[torch.Tensor]  # per step k, [N_k] int64: where row t+k+1 sits in `needed`
    counts: torch.Tensor  # [K] float64: N_k, the scored positions per step
    live: list[torch.Tensor]  # per step k, int64: rows whose step-k output is read (scored at a step >= k)

    def map(self, fn) -> "StepIndex":
        """The same index with fn applied to every tensor (e.g. a move to the device)."""
        return StepIndex(
            fn(self.needed),
            [fn(x) for x in self.scored],
            [fn(x) for x in self.target],
            fn(self.counts),
            [fn(x) for x in self.live],
        )


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


def step_index(
    loss_mask: np.ndarray | torch.Tensor,
    ttt_steps: int,
    cod: COD | None = None,
    sample_ids: Sequence[int] = (),
    epoch: int = 0,
) -> StepIndex:
    """The rows each TTT step reads, from a [B, T] 0/1 loss mask (numpy, on the host: no device work).

    Step k scores position t (t < T-k-2) when loss_mask[t+k+2] and trains it towards p_{t+k+1}; p_j is needed when
    loss_mask[j+1] (so every target row a step reads is in `needed`, and padding is never read). With `cod`
    (P-EAGLE), depth k >= 1 scores only COD.keep of each sample's candidates (`sample_ids` seed the choice).
    """
    mask = np.asarray(loss_mask, dtype=bool)
    b, t = mask.shape
    needed = np.zeros((b, t), dtype=bool)
    needed[:, :-1] = mask[:, 1:]
    priority = None
    if cod is not None:  # one random priority per position of each sample
        priority = np.stack([np.random.default_rng([cod.seed, epoch, int(i)]).random(t) for i in sample_ids])
    flat_needed = needed.reshape(-1)
    rank = np.cumsum(flat_needed) - 1  # position of each needed row in `needed`
    scored, target, counts, sels = [], [], [], []
    for k in range(ttt_steps):
        n = max(t - k - 2, 0)
        sel = np.zeros((b, t), dtype=bool)
        sel[:, :n] = mask[:, k + 2 : k + 2 + n]
        if cod is not None and priority is not None and k:
            for row in range(b):
                candidates = np.flatnonzero(sel[row])
                keep = cod.keep(len(candidates), k)
                if keep < len(candidates):
                    dropped = candidates[np.argsort(priority[row, candidates], kind="stable")[keep:]]
                    sel[row, dropped] = False
        rows = np.flatnonzero(sel)
        scored.append(torch.from_numpy(rows.astype(np.int64)))
        target.append(torch.from_numpy(rank[rows + k + 1].astype(np.int64)))  # t + k + 1 < T: the same sample
        counts.append(len(rows))
        sels.append(sel)
    live: list[torch.Tensor] = []
    later = np.zeros((b, t), dtype=bool)
    for sel in reversed(sels):  # a position's step-k output feeds its own step k+1 (hidden state, diagonal key)
        later |= sel
        live.insert(0, torch.from_numpy(np.flatnonzero(later).astype(np.int64)))
    return StepIndex(
        torch.from_numpy(np.flatnonzero(flat_needed).astype(np.int64)),
        scored,
        target,
        torch.tensor(counts, dtype=torch.float64),
        live,
    )


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


@dataclass
class BlockIndex:
    """What a block method's batch reads, built on the host: the blocks (anchors) and, per proposal d of a block (the
    "steps" of the metrics: d = 0 proposes x_{a+1}), the block rows scored and the target rows they are scored
    against. Proposal d is block row j = d + 1 (DFlash: the anchor row proposes nothing) or j = d (DSpark)."""

    needed: torch.Tensor  # [N] int64: rows b * T + i whose target distribution p_i some block row is scored on
    scored: list[torch.Tensor]  # per proposal d, [N_d] int64: rows (b * A + a) * S + j of the block hidden states
    target: list[torch.Tensor]  # per proposal d, [N_d] int64: where row b * T + anchor + d sits in `needed`
    counts: torch.Tensor  # [D] float64: N_d (D = S - 1, DSpark S)
    anchors: torch.Tensor  # [B, A] int64: block starts, ascending per sample (padding: 1, never scored)
    chunk_limits: list[int]  # per chunk of attention.anchor_chunks(A, S): its largest anchor over the batch

    def map(self, fn) -> "BlockIndex":
        return BlockIndex(
            fn(self.needed),
            [fn(x) for x in self.scored],
            [fn(x) for x in self.target],
            fn(self.counts),
            fn(self.anchors),
            self.chunk_limits,
        )


def block_index(
    loss_mask: np.ndarray | torch.Tensor, anchors: Anchors, sample_ids: Sequence[int] = (), epoch: int = 0
) -> BlockIndex:
    """The blocks of a [B, T] 0/1 loss mask (numpy, on the host) and the rows each block proposal reads.

    Proposal d of the block at anchor a proposes x_{a+d+1}: it is scored when a + d + 1 < T and loss_mask[a+d+1],
    and trained towards p_{a+d} (the target's distribution of that token), the same alignment as every method. It is
    block row d + 1 (DFlash: block position j proposes x_{a+j}) or, `anchors.from_anchor`, block row d (DSpark)."""
    mask = np.asarray(loss_mask, dtype=bool)
    b, t = mask.shape
    size = anchors.block_size
    ids = list(sample_ids) or list(range(b))
    drawn = [anchors.draw(mask[row], epoch, ids[row]) for row in range(b)]
    num = max(1, max(len(d) for d in drawn))
    starts = np.ones((b, num), dtype=np.int64)
    live = np.zeros((b, num), dtype=bool)
    for row, d in enumerate(drawn):
        starts[row, : len(d)], live[row, : len(d)] = d, True
    first = 0 if anchors.from_anchor else 1  # the block row of proposal 0
    j = np.arange(first, size)
    pos = starts[:, :, None] + (j - first + 1)[None, None, :]  # [B, A, D] the proposed token's position
    scored = live[:, :, None] & (pos < t)
    scored &= np.take_along_axis(mask, np.minimum(pos, t - 1).reshape(b, -1), axis=1).reshape(pos.shape)
    rows_needed = np.zeros(b * t, dtype=bool)
    flat_target = np.arange(b)[:, None, None] * t + pos - 1  # row of p_{a+d}
    rows_needed[flat_target[scored]] = True
    rank = np.cumsum(rows_needed) - 1
    block_rows = (np.arange(b)[:, None, None] * num + np.arange(num)[None, :, None]) * size + j[None, None, :]
    out_scored, out_target, counts = [], [], []
    for k in range(len(j)):
        sel = scored[:, :, k]
        out_scored.append(torch.from_numpy(block_rows[:, :, k][sel].astype(np.int64)))
        out_target.append(torch.from_numpy(rank[flat_target[:, :, k][sel]].astype(np.int64)))
        counts.append(int(sel.sum()))
    limits = [int(starts[:, a0:a1].max()) for a0, a1 in anchor_chunks(num, size)]
    return BlockIndex(
        torch.from_numpy(np.flatnonzero(rows_needed).astype(np.int64)),
        out_scored,
        out_target,
        torch.tensor(counts, dtype=torch.float64),
        torch.from_numpy(starts),
        limits,
    )


def batch_index(
    loss_mask: np.ndarray, ttt_steps: int, sampling: "COD | Anchors | None", sample_ids: Sequence[int], epoch: int
) -> "StepIndex | BlockIndex":
    """The index a batch's method reads: DFlash blocks (`sampling` is Anchors) or TTT steps (P-EAGLE's COD)."""
    if isinstance(sampling, Anchors):
        return block_index(loss_mask, sampling, sample_ids, epoch)
    return step_index(loss_mask, ttt_steps, sampling, sample_ids, epoch)


# ---------------------------------------------------------------------------------------------- the target's side


@dataclass
class TargetDistribution:
    """The target's p_j at the needed rows (StepIndex.needed), compact: row i is needed[i]."""

    probs: torch.Tensor  # [N, Vd] p_j restricted to the draft vocabulary, renormalised (fp32)
    neg_entropy: torch.Tensor  # [N] sum_v probs log probs (so KL = neg_entropy - sum probs log q)
    mass: torch.Tensor | None = None  # [N] target probability mass inside the draft vocabulary (full=True)
    argmax: torch.Tensor | None = None  # [N] target argmax over the FULL vocabulary, target ids (full=True)


@torch.no_grad()
def target_distribution(
    rows: torch.Tensor,
    final_norm: nn.Module,
    lm_head_weight: torch.Tensor,
    draft_weight: torch.Tensor,
    *,
    full: bool = True,
    chunk_elements: int = LOGIT_CHUNK_ELEMENTS,
) -> TargetDistribution:
    """p_j from layer-N states `rows` [N, H] (un-normalised) through the target's final norm and lm_head.

    The loss needs the draft vocabulary only: `draft_weight` [Vd, H] is the lm_head's draft-vocabulary rows, a
    [N, Vd] matmul. full=True also runs the whole lm_head for the metrics (the target's top-1, the mass inside
    the draft vocabulary); probs are computed the same way either way. A few rows at a time (bounded logits).
    """
    n, device = rows.shape[0], rows.device
    probs = torch.empty(n, draft_weight.shape[0], device=device)
    neg_ent = torch.empty(n, device=device)
    mass = torch.empty(n, device=device) if full else None
    argmax = torch.empty(n, dtype=torch.int64, device=device) if full else None
    width = lm_head_weight.shape[0] if full else draft_weight.shape[0]
    chunk = max(1, chunk_elements // width)
    for a in range(0, n, chunk):
        x = final_norm(rows[a : a + chunk].to(lm_head_weight.dtype))
        logits = (x @ draft_weight.T).float()  # [chunk, Vd]
        logp = torch.log_softmax(logits, dim=-1)
        p = logp.exp()
        probs[a : a + chunk] = p
        neg_ent[a : a + chunk] = (p * logp).sum(-1)
        if mass is not None and argmax is not None:  # full; a whole-vocabulary draft (DFlash) has these logits already
            all_logits = logits if draft_weight is lm_head_weight else x @ lm_head_weight.T  # [chunk, V]
            top, lse = _top1_logsumexp(all_logits)
            argmax[a : a + chunk] = top
            mass[a : a + chunk] = torch.exp(torch.logsumexp(logits, -1) - lse)
    return TargetDistribution(probs, neg_ent, mass, argmax)


def _top1_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax, logsumexp) of each row of `logits` [N, V] (bf16 logits reduced in fp32; fp64 stays fp64), a slice
    of rows at a time (`_slices`): a slice that stays in the CPU's cache is read twice (max, then the exp-sum around
    it) instead of materialising fp32 copies and exp temporaries of the whole [N, V] (on a 2-core CPU 5-10x faster
    than argmax + logsumexp over a [341, 49152] chunk)."""
    n, acc = logits.shape[0], torch.promote_types(logits.dtype, torch.float32)
    top = torch.empty(n, dtype=torch.int64, device=logits.device)
    lse = torch.empty(n, dtype=acc, device=logits.device)
    rows, scratch = _slices(logits, acc)
    for a in range(0, n, rows):
        z = scratch[: min(rows, n - a)].copy_(logits[a : a + rows])
        m, top[a : a + rows] = z.max(-1)
        lse[a : a + rows] = z.sub_(m[:, None]).exp_().sum(-1).log_().add_(m)
    return top, lse


def _slices(like: torch.Tensor, dtype: torch.dtype) -> tuple[int, torch.Tensor]:
    """(rows per slice, one [rows, V] buffer in `dtype` the row-slice loop over `like` [N, V] reuses: a fresh
    tensor per slice costs more than the arithmetic)."""
    n, width = like.shape
    rows = _slice_rows(like.device, width)
    return rows, torch.empty(min(rows, n), width, dtype=dtype, device=like.device)


def _slice_rows(device: torch.device, width: int) -> int:
    """Rows of a [rows, width] logits slice: REDUCE_ROWS on a CPU, LOGIT_CHUNK_ELEMENTS' worth on a GPU."""
    return REDUCE_ROWS if device.type == "cpu" else max(1, LOGIT_CHUNK_ELEMENTS // max(width, 1))


class TargetHead:
    """The target's final norm and lm_head: layer-N states -> the target's distribution over the draft vocabulary,
    at the rows a batch needs. Keeps the lm_head's draft-vocabulary rows (a [Vd, H] copy, made once), or the lm_head
    itself when the draft vocabulary is the target's whole one in order (DFlash): then, and for any block drafter's
    batch (a DFlash draft over a reduced vocabulary), the distribution stays the normed rows it is computed from
    (`TargetStates`, [N, H] instead of [N, V]; block_loss.py). `dtype`: the autocast
    dtype the run computes in (bf16), kept in it once rather than cast by autocast at every step (the head is
    frozen)."""

    def __init__(
        self, norm: nn.Module, weight: torch.Tensor, draft_to_target: torch.Tensor, dtype: torch.dtype | None = None
    ):
        weight = weight if dtype is None else weight.to(dtype)
        self.norm, self.weight = norm, weight
        ids = draft_to_target.to(weight.device)
        whole = ids.numel() == weight.shape[0] and torch.equal(ids, torch.arange(ids.numel(), device=ids.device))
        self.draft_weight = weight if whole else weight[ids].contiguous()

    def __call__(
        self, last_hidden: torch.Tensor, index: StepIndex | BlockIndex, full: bool = True
    ) -> TargetDistribution | TargetStates:
        """last_hidden [B, T, H] (any strides: only the needed rows are read)."""
        b, t, h = last_hidden.shape
        rows = last_hidden.reshape(b * t, h) if last_hidden.is_contiguous() else last_hidden.flatten(0, 1)
        rows = rows.index_select(0, index.needed)
        if self.draft_weight is self.weight or isinstance(index, BlockIndex):  # ttt_forward: p a slice at a time
            chunk = max(1, LOGIT_CHUNK_ELEMENTS // self.weight.shape[0])
            draft = None if self.draft_weight is self.weight else self.draft_weight  # a block drafter's reduced vocab
            return target_states(rows, self.norm, self.weight, full=full, chunk_rows=chunk, draft_weight=draft)
        return target_distribution(rows, self.norm, self.weight, self.draft_weight, full=full)


def materialised(target: TargetDistribution | TargetStates) -> TargetDistribution:
    """The distribution with its probs [N, V] (an EAGLE-3 draft over the target's whole vocabulary reads them):
    target_distribution's numbers from the normed rows TargetStates keeps."""
    if isinstance(target, TargetDistribution):
        return target
    w = target.weight
    if target.mass is None:
        return target_distribution(target.states, nn.Identity(), w, w, full=target.argmax is not None)
    # a reduced draft vocabulary: p over its rows as target_distribution's, the top-1 and mass TargetStates kept
    probs = torch.log_softmax(torch.mm(target.states, w.T).float(), -1).exp_()
    return TargetDistribution(probs, target.neg_entropy, target.mass, target.argmax)


# ---------------------------------------------------------------------------------------------- loss


class TargetKL(torch.autograd.Function):
    """KL(p || softmax(z)) per row from the draft's logits z [N, V] and the target's probs[rows] [N, V], fused:
    forward neg_entropy - sum p z + logsumexp(z), backward (softmax(z) - p) * grad. No log-softmax [N, V] is kept
    (or made), and the gathered p is not saved: the backward gathers it again from the shared `probs`. `lse`, the
    rows' logsumexp, when the caller has it (ttt_forward's metrics share it). A slice of rows at a time."""

    @staticmethod
    def forward(ctx, z, probs, rows, neg_entropy, lse=None):
        acc = torch.promote_types(z.dtype, torch.float32)  # bf16 logits are summed in fp32; fp64 stays fp64
        lse = _top1_logsumexp(z)[1] if lse is None else lse.to(acc)
        kl, (step, scratch) = torch.empty(z.shape[0], dtype=acc, device=z.device), _slices(z, acc)
        for a in range(0, z.shape[0], step):
            b, r = a + step, rows[a : a + step]
            pz = scratch[: len(r)].copy_(probs.index_select(0, r)).mul_(z[a:b])  # p * z
            kl[a:b] = neg_entropy.index_select(0, r).to(acc) - pz.sum(-1) + lse[a:b]
        ctx.save_for_backward(z, probs, rows, lse)
        return kl

    @staticmethod
    def backward(ctx, grad):
        z, probs, rows, lse = ctx.saved_tensors
        dz, (step, scratch) = torch.empty_like(z), _slices(z, lse.dtype)
        for a in range(0, z.shape[0], step):
            b = a + step
            q = scratch[: dz[a:b].shape[0]].copy_(z[a:b]).sub_(lse[a:b, None]).exp_()  # softmax(z)
            q.sub_(probs.index_select(0, rows[a:b])).mul_(grad[a:b, None])
            dz[a:b] = q
        return dz, None, None, None, None


def target_kl(
    z: torch.Tensor, target: TargetDistribution, rows: torch.Tensor, lse: torch.Tensor | None = None
) -> torch.Tensor:
    """[N] forward KL(p_rows || softmax(z)) over the draft vocabulary."""
    return TargetKL.apply(z, target.probs, rows, target.neg_entropy, lse)


@torch.no_grad()
def expected_acceptance(
    z: torch.Tensor, lse: torch.Tensor, target: TargetDistribution, rows: torch.Tensor
) -> torch.Tensor:
    """[N] sum_v min(p_target(v), q_draft(v)) per row, p over the full vocabulary (probs x mass), q = softmax(z)
    from its logsumexp `lse`; a slice of rows at a time."""
    out = torch.empty(z.shape[0], dtype=lse.dtype, device=z.device)
    step, scratch = _slices(z, lse.dtype)
    for a in range(0, z.shape[0], step):
        assert target.mass is not None  # a full=True distribution
        b, r = a + step, rows[a : a + step]
        q = scratch[: len(r)].copy_(z[a:b]).sub_(lse[a:b, None]).exp_()
        p = target.probs.index_select(0, r).mul_(target.mass.index_select(0, r)[:, None])
        out[a:b] = torch.minimum(p, q, out=q).sum(-1)
    return out


def step_counts(loss_mask: torch.Tensor, ttt_steps: int) -> torch.Tensor:
    """Scored (loss-masked) positions per TTT step [K] (StepIndex.counts without the rows)."""
    t = loss_mask.shape[1]
    return torch.tensor(
        [float(loss_mask[:, k + 2 :].sum()) if k + 2 < t else 0.0 for k in range(ttt_steps)], dtype=torch.float64
    )


# ---------------------------------------------------------------------------------------------- the unrolled draft


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

    With the batch's `index`, a layer's MLP runs only on the positions read later (`StepIndex.live`): the rows
    scored at this step or a later one (about a third fewer on chat data). Not at step 0 below the last layer,
    whose outputs are the next layer's step-0 keys, read by every later position. The hidden states of the other
    rows then differ, and nothing reads them.
    """
    b, t = input_ids.shape
    cache = KVCache(len(draft.layers), kernel)
    hidden = draft.fuse(aux_hidden)  # [B, T, H]
    positions = torch.arange(t, device=input_ids.device).expand(b, t)
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
        rows = None if index is None else [index.live[k] if k or i == last else None for i in range(last + 1)]
        out = draft.forward_hidden(ids, hidden, positions + k, cache, mode=mode, checkpointed=checkpointed, rows=rows)
        yield out
        hidden = draft.feedback(out)  # EAGLE-3: feeds step k+1 (Eagle 3.1: normed)


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
    anchors = index.anchors
    size = draft.spec.block_size
    assert size is not None  # a DFlash spec's
    block_ids = draft.block_ids(input_ids.gather(1, anchors)).flatten(1)  # [B, A*S]
    block_positions = (anchors[:, :, None] + torch.arange(size, device=anchors.device)).flatten(1)
    positions = torch.arange(t, device=input_ids.device).expand(b, t)
    if attention == "naive":

        def attend(q, k, v, kc, vc):
            return naive_block_attention(q, k, v, kc, vc, anchors)
    else:

        def attend(q, k, v, kc, vc):
            return block_attention(q, k, v, kc, vc, anchors, index.chunk_limits, kernel=attention)

    hidden = draft.forward_hidden(
        block_ids, block_positions, draft.context(aux_hidden), positions, attend, checkpointed=checkpointed
    )
    for _ in range(size - 1):
        yield hidden


@dataclass
class TTTResult:
    loss: torch.Tensor  # scalar to backpropagate: sum_k w_k * sum_t mask * KL / normaliser_k
    sums: torch.Tensor  # [4, K] float64 on the device, detached: KL sum, correct top-1 (metrics only), expected
    #                     acceptance sum_v min(p_target, q_draft) (metrics only), scored positions

    @property
    def kl_sum(self) -> torch.Tensor:
        return self.sums[KL]

    @property
    def count(self) -> torch.Tensor:
        return self.sums[COUNT]


def ttt_forward(
    draft: Eagle3Draft | DFlashDraft,
    input_ids: torch.Tensor,
    aux_hidden: torch.Tensor,
    target: TargetDistribution | TargetStates,
    index: StepIndex | BlockIndex,
    ttt_steps: int,
    step_weight: float = 0.8,
    normaliser: torch.Tensor | None = None,
    metrics: bool = True,
    mode: str = "ttt",
    checkpointed: bool = False,
    live_rows: bool = True,
    kernel: str = "auto",
) -> TTTResult:
    """Unroll `ttt_steps` draft steps over a right-padded batch and score them against the target.

    input_ids [B, T]; aux_hidden [B, T, num_aux * H] (aux layers concatenated in id order); `index` the batch's
    StepIndex, on the device. normaliser [K] is the number of scored positions per step over everything averaged
    together (default: this batch), so gradients summed over micro-batches and ranks equal the gradient of one
    combined batch. metrics=False skips the top-1 and acceptance sums (they need the target's full vocabulary).
    live_rows: each layer's MLP runs only where its output is read (`ttt_hidden_states`); the loss is the same.
    kernel: the attention's ("auto": flex on a GPU, chunked elsewhere; `train --attention-kernel`).
    """
    device = input_ids.device
    normaliser = (index.counts if normaliser is None else normaliser).to(device)
    d2t = draft.d2t
    sums = torch.zeros(4, ttt_steps, dtype=torch.float64, device=device)
    sums[COUNT] = index.counts.to(device)
    loss = aux_hidden.new_zeros((), dtype=torch.float32)
    if isinstance(draft, DFlashDraft):  # one forward; block position j is "step" j-1
        assert isinstance(index, BlockIndex)  # batch_index builds one for a DFlash run
        steps = dflash_hidden_states(
            draft, input_ids, aux_hidden, index, checkpointed, "naive" if mode == "naive" else kernel
        )
        # TargetHead's for the whole vocabulary, and the head BlockKL computes (DFlashDraft.logits, not a subclass's
        # own): never [N, V] (block_loss.py)
        if isinstance(target, TargetStates) and type(draft).logits is DFlashDraft.logits:
            hidden = next(steps)
            return _block_loss(draft, hidden, input_ids, target, index, step_weight, normaliser, metrics, sums, loss)
    else:
        assert isinstance(index, StepIndex)  # batch_index builds one for an EAGLE-3 / P-EAGLE run
        steps = ttt_hidden_states(
            draft, input_ids, aux_hidden, ttt_steps, mode, checkpointed, kernel, index if live_rows else None
        )
    target = materialised(target)
    for k, hidden in enumerate(steps):
        rows, at = index.scored[k], index.target[k]  # may be empty: the lm_head still joins the graph (DDP)
        # Only scored positions reach the lm_head (its matmuls dominate the step); the rest only feed attention.
        z = draft.logits(hidden.flatten(0, 1).index_select(0, rows))  # [N_k, Vd]
        top, lse = _top1_logsumexp(z.detach())  # shared by the loss and the metrics
        step_loss = target_kl(z, target, at, lse).sum()
        loss = loss + (step_weight**k) * step_loss / normaliser[k].clamp(min=1).to(step_loss.dtype)
        sums[KL, k] = step_loss.detach()
        if metrics:
            assert target.argmax is not None  # metrics need a full=True distribution
            sums[CORRECT, k] = (top + d2t[top] == target.argmax.index_select(0, at)).sum()
            sums[ACCEPT, k] = expected_acceptance(z.detach(), lse, target, at).sum()
    return TTTResult(loss=loss, sums=sums)


def _block_loss(
    draft: DFlashDraft,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    target: TargetStates,
    index: BlockIndex,
    step_weight: float,
    normaliser: torch.Tensor,
    metrics: bool,
    sums: torch.Tensor,
    loss: torch.Tensor,
) -> TTTResult:
    """ttt_forward's scoring of a block method's proposals over TargetStates (block_loss.score_blocks: the head's
    matmul, the target's p, KL, metrics and the rows' gradient a slice at a time; DSpark's Markov bias and confidence
    loss), its sums then filled per proposal as ttt_forward's loop fills them."""
    sub = _slice_rows(hidden.device, target.weight.shape[0])
    rows = max(sub, HEAD_ROWS) if hidden.device.type == "cpu" else sub
    extra_loss, per_step = score_blocks(
        draft, hidden, input_ids, target, index, step_weight, normaliser, metrics, rows, sub
    )
    for k, (step_kl, step_correct, step_accept) in enumerate(per_step):
        step_loss = step_kl.sum()
        loss = loss + (step_weight**k) * step_loss / normaliser[k].clamp(min=1).to(step_loss.dtype)
        sums[KL, k] = step_loss.detach()
        if metrics:
            sums[CORRECT, k] = step_correct.sum()
            sums[ACCEPT, k] = step_accept.sum()
    return TTTResult(loss=loss + extra_loss, sums=sums)


def summarise(
    kl_sum: torch.Tensor, correct: torch.Tensor, accept_sum: torch.Tensor, count: torch.Tensor, step_weight: float
) -> dict:
    """Per-step accuracy / expected acceptance / KL and the simulated acceptance length 1 + sum_k prod_{i<=k} acc_i."""
    kl_sum, correct, accept_sum, count = (x.detach().double().cpu() for x in (kl_sum, correct, accept_sum, count))
    n = count.clamp(min=1)
    acc = (correct / n).tolist()
    length, run = 1.0, 1.0
    for a in acc:
        run *= a
        length += run
    weights = torch.tensor([step_weight**k for k in range(len(acc))], dtype=torch.float64)
    return {
        "loss": float((weights * kl_sum / n).sum()),
        "kl": [round(float(x), 5) for x in (kl_sum / n)],
        "acc": [round(a, 5) for a in acc],
        "accept": [round(float(x), 5) for x in (accept_sum / n)],
        "acceptance_length": round(length, 5),
        "tokens": int(count[0]) if len(count) else 0,
        "scored": [int(x) for x in count],  # per step (P-EAGLE: per depth, after COD sampling)
    }


class TTTModel(nn.Module):
    """The draft behind one forward call (what DDP / FSDP2 wrap): forward(...) = ttt_forward(draft, ...)."""

    def __init__(self, draft: Eagle3Draft | DFlashDraft, kernel: str = "auto"):
        super().__init__()
        self.draft = draft
        self.kernel = kernel  # the attention kernel (`ttt_forward`)

    def forward(
        self,
        input_ids,
        aux_hidden,
        target,
        index,
        ttt_steps,
        step_weight=0.8,
        normaliser=None,
        metrics=True,
        mode="ttt",
        checkpointed=False,
    ) -> TTTResult:
        return ttt_forward(
            self.draft,
            input_ids,
            aux_hidden,
            target,
            index,
            ttt_steps,
            step_weight,
            normaliser,
            metrics,
            mode,
            checkpointed,
            kernel=self.kernel,
        )
