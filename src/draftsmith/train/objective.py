"""What both training objectives share: the target's side (its distribution at the rows a batch needs), the fused KL
and the metrics over a draft's logits, the result a forward returns, and the forward every run calls (`TTTModel`).

A method's objective is one of two modules, chosen once from the method (`DraftMethod.sampling` draws its batches'
index; the index scores the batch):
  - the unrolled objective (unrolled.py: EAGLE-3, Eagle 3.1, P-EAGLE): `StepIndex`, the TTT steps or parallel depths
    of the draft unrolled over the batch, one draft forward per step;
  - the block objective (blocks.py: DFlash, DSpark): `BlockIndex`, blocks at sampled anchors, one draft forward per
    batch, scored by the fused block loss (block_loss.py).
Both train draft proposal d of a position towards the target's distribution of that token, with weight
step_weight**d, and name proposal d "step" d in their metrics, so every number below (KL, accuracy, acceptance per
step) reads the same for every method.

No host synchronisation inside a step: which rows are scored at each step, and which rows of the target's
distribution they read, are index tensors built on the host with the batch (by the collate function), so every gather
below has a size known before the step runs. Metrics are summed on the device; the metrics that need the target's
full vocabulary (its top-1 and the mass inside the draft vocabulary) are computed only when asked for (logged steps,
evaluation): the loss needs the draft vocabulary alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, Self, TypeVar

import torch
from torch import nn

from draftsmith.methods.attention import Tree
from draftsmith.train.block_loss import TargetStates, target_states

# Target logits are materialised for at most this many elements at a time (a 150k vocabulary stays bounded).
LOGIT_CHUNK_ELEMENTS = 1 << 24
# Rows of logits a CPU reduces at a time (top-1, logsumexp, the KL and its gradient, the acceptance): each
# operation of a reduction finds the slice the previous one left in the caches ([64, 8192] fp32 is 2 MiB) instead
# of streaming the whole [N, V] through memory once per operation; 64 measured best on a 2-core Xeon (32-256
# tried). A GPU takes LOGIT_CHUNK_ELEMENTS at a time (few kernel launches, bounded memory).
REDUCE_ROWS = 64
# Rows of TTTResult.sums.
KL, CORRECT, ACCEPT, COUNT = range(4)

DraftT = TypeVar("DraftT", contravariant=True)


@dataclass(frozen=True)
class Pass:
    """How a training forward runs: its steps, their weights, and what it computes beside the loss."""

    ttt_steps: int  # the steps (depths, block proposals) scored
    normaliser: torch.Tensor  # [K] on the device: step k's loss is its KL sum over normaliser[k]
    step_weight: float = 0.8  # step k's loss weight is step_weight**k
    metrics: bool = True  # the top-1 and acceptance sums (they need the target's full vocabulary)
    mode: str = "ttt"  # the attention: "ttt" (training), "naive" (one explicit mask: tests)
    checkpointed: bool = False  # activation checkpointing
    live_rows: bool = True  # the unrolled draft's MLPs only where their output is read (the same loss)
    kernel: str = "auto"  # the attention kernel ("auto": flex on a GPU, chunked elsewhere; --attention-kernel)


class Rows(Protocol):
    """What the target's side reads of a batch's index."""

    needed: torch.Tensor  # [N] int64: rows b * T + t whose target distribution some step is scored against
    scored: list[torch.Tensor]  # per step k, [N_k] int64: the rows of the step's hidden states scored
    target: list[torch.Tensor]  # per step k, [N_k] int64: where their target rows sit in `needed`
    counts: torch.Tensor  # [K] float64: the positions each step scores
    keeps_states: ClassVar[bool]  # the target's side stays [N, H] states (TargetStates: the block objective)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Rows:
        """The same index with fn applied to every tensor (e.g. a move to the device)."""
        ...


class MapsTensors:
    """`Rows.map` for an index dataclass: fn applied to each tensor field and to each tensor of a list field."""

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Self:
        def apply(value: object) -> object:
            if isinstance(value, Tree):
                return value.map(fn)
            if isinstance(value, list):
                return [fn(x) if isinstance(x, torch.Tensor) else x for x in value]
            return fn(value) if isinstance(value, torch.Tensor) else value

        fields = dataclasses.fields(self)  # type: ignore[arg-type]  # the subclasses are dataclasses
        return dataclasses.replace(self, **{f.name: apply(getattr(self, f.name)) for f in fields})  # type: ignore[type-var]  # as above


class Index(Rows, Protocol[DraftT]):
    """A batch's index, built on the host by its objective: what each step scores, and how the draft is scored."""

    def score(
        self,
        draft: DraftT,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        target: TargetDistribution | TargetStates,
        run: Pass,
    ) -> TTTResult:
        """The objective's forward over the batch (`ttt_forward`)."""
        ...


# ---------------------------------------------------------------------------------------------- the target's side


@dataclass
class TargetDistribution:
    """The target's p_j at the needed rows (an index's `needed`), compact: row i is needed[i]."""

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
    rows = slice_rows(like.device, width)
    return rows, torch.empty(min(rows, n), width, dtype=dtype, device=like.device)


def slice_rows(device: torch.device, width: int) -> int:
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

    def __call__(self, last_hidden: torch.Tensor, index: Rows, full: bool = True) -> TargetDistribution | TargetStates:
        """last_hidden [B, T, H] (any strides: only the needed rows are read)."""
        b, t, h = last_hidden.shape
        rows = last_hidden.reshape(b * t, h) if last_hidden.is_contiguous() else last_hidden.flatten(0, 1)
        rows = rows.index_select(0, index.needed)
        if self.draft_weight is self.weight or index.keeps_states:  # ttt_forward: p a slice at a time
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
    def forward(
        ctx: Any,
        z: torch.Tensor,
        probs: torch.Tensor,
        rows: torch.Tensor,
        neg_entropy: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
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
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
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


@dataclass
class TTTResult:
    loss: torch.Tensor  # scalar to backpropagate: sum_k w_k * sum_t mask * KL / normaliser_k
    sums: torch.Tensor  # [4, K] float64 on the device, detached: KL sum, correct top-1 (metrics only), expected
    #                     acceptance sum_v min(p_target, q_draft) (metrics only), scored positions

    @property
    def count(self) -> torch.Tensor:
        return self.sums[COUNT]


class Head(Protocol):
    """What `score_steps` reads of a draft: its head over the draft vocabulary and the draft ids' target offsets."""

    d2t: torch.Tensor

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def score_steps(
    draft: Head, steps: Iterable[torch.Tensor], target: TargetDistribution | TargetStates, index: Rows, run: Pass
) -> TTTResult:
    """Each step's hidden states [B, T', H] scored against the target: its scored rows through the draft's head, the
    KL to the target's distribution (weighted step_weight**k, over run.normaliser[k]), and the metrics."""
    sums, loss = new_sums(index, run)
    target = materialised(target)
    d2t = draft.d2t
    for k, hidden in enumerate(steps):
        rows, at = index.scored[k], index.target[k]  # may be empty: the lm_head still joins the graph (DDP)
        # Only scored positions reach the lm_head (its matmuls dominate the step); the rest only feed attention.
        z = draft.logits(hidden.flatten(0, 1).index_select(0, rows))  # [N_k, Vd]
        top, lse = _top1_logsumexp(z.detach())  # shared by the loss and the metrics
        step_loss = target_kl(z, target, at, lse).sum()
        loss = loss + step_loss_term(run, k, step_loss)
        sums[KL, k] = step_loss.detach()
        if run.metrics:
            assert target.argmax is not None  # metrics need a full=True distribution
            sums[CORRECT, k] = (top + d2t[top] == target.argmax.index_select(0, at)).sum()
            sums[ACCEPT, k] = expected_acceptance(z.detach(), lse, target, at).sum()
    return TTTResult(loss=loss, sums=sums)


def ttt_forward(  # noqa: PLR0913 - the forward's tensors and settings, as the trainer holds them
    draft: DraftT,
    input_ids: torch.Tensor,
    aux_hidden: torch.Tensor,
    target: TargetDistribution | TargetStates,
    index: Index[DraftT],
    ttt_steps: int,
    step_weight: float = 0.8,
    normaliser: torch.Tensor | None = None,
    metrics: bool = True,
    mode: str = "ttt",
    checkpointed: bool = False,
    live_rows: bool = True,
    kernel: str = "auto",
) -> TTTResult:
    """Score a right-padded batch: the draft's forward as its objective runs it (the batch's `index`, on the device:
    unrolled.StepIndex or blocks.BlockIndex), against the target.

    input_ids [B, T]; aux_hidden [B, T, num_aux * H] (aux layers concatenated in id order). normaliser [K] is the
    number of scored positions per step over everything averaged together (default: this batch), so gradients summed
    over micro-batches and ranks equal the gradient of one combined batch. The other settings are `Pass`'s.
    """
    normaliser = (index.counts if normaliser is None else normaliser).to(input_ids.device)
    run = Pass(ttt_steps, normaliser, step_weight, metrics, mode, checkpointed, live_rows, kernel)
    return index.score(draft, input_ids, aux_hidden, target, run)


def step_loss_term(run: Pass, k: int, step_loss: torch.Tensor) -> torch.Tensor:
    """Step k's part of the loss: its KL sum `step_loss`, weighted step_weight**k, over its normaliser."""
    return (run.step_weight**k) * step_loss / run.normaliser[k].clamp(min=1).to(step_loss.dtype)


def new_sums(index: Rows, run: Pass) -> tuple[torch.Tensor, torch.Tensor]:
    """(TTTResult.sums, loss) of a batch before scoring: zeros and the positions each step scores; 0 (fp32)."""
    sums = torch.zeros(4, run.ttt_steps, dtype=torch.float64, device=run.normaliser.device)
    sums[COUNT] = index.counts.to(sums.device)
    return sums, run.normaliser.new_zeros((), dtype=torch.float32)


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


class TTTModel(nn.Module, Generic[DraftT]):
    """The draft behind one forward call (what DDP / FSDP2 wrap): forward(...) = ttt_forward(draft, ...)."""

    def __init__(self, draft: DraftT, kernel: str = "auto"):
        super().__init__()
        self.draft = draft
        self.kernel = kernel  # the attention kernel (`ttt_forward`)

    def forward(  # noqa: PLR0913 - the forward's tensors and settings, as the trainer holds them
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        target: TargetDistribution | TargetStates,
        index: Index[DraftT],
        ttt_steps: int,
        *,
        normaliser: torch.Tensor | None = None,
        step_weight: float = 0.8,
        metrics: bool = True,
        mode: str = "ttt",
        checkpointed: bool = False,
    ) -> TTTResult:
        """`ttt_forward` of the draft with the model's attention kernel; its settings by name."""
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
