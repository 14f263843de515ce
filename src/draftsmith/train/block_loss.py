"""The block methods' loss and metrics a slice of rows at a time: a draft over the target's whole vocabulary with the
target's frozen lm_head (DFlash's, DSpark's) never holds logits [N, V]; nor does a DFlash draft over a reduced draft
vocabulary with its own lm_head (`train --draft-vocab-size`) hold [N, Vd]: the same slices, EAGLE-3's target side
(p renormalised over the draft vocabulary, the mass inside it, the target's top-1 in target ids) and the head's
gradient made with the rows' (BlockKL).

DFlash scores up to B * A * (S - 1) block rows (7,621 of 8,192 at the peers' defaults on a 1,024-token sample), each
over the target's whole vocabulary (49,152 for the default target): keeping the draft's logits of every row for the
backward and the target's distribution of every needed row costs gigabytes. Neither is needed:

  - the target's side (`TargetStates`, what `objective.TargetHead` returns for a whole-vocabulary draft) is kept as what
    p_j is computed from: the target's normed layer-N rows s_j [N, H] and its lm_head W, with sum_v p log p and (for
    the metrics) the target's top-1 per row;
  - `BlockKL` takes the draft's normed rows x [N, H] (after `draft.norm`, which stays in autograd) and, a slice of
    rows at a time, computes the draft's logits z = x W_d^T, the target's p = softmax(s W^T) at the row each is
    scored on, the KL, the draft's top-1 and the expected acceptance sum_v min(p, q), and -- when x needs a gradient --
    the rows' gradient ((softmax(z) - p) * c) W_d ("fused linear cross-entropy"; the frozen W_d gets none, a draft's
    own W_d [Vd, H] the sum of the slices' dz^T x). It keeps those gradients for the backward, not the logits.

The arithmetic is the unfused path's (`target_distribution`'s p, `objective.TargetKL`, `objective.expected_acceptance` over
`DFlashDraft.logits`) in the same dtypes -- logits in the autocast dtype, reductions in fp32, p in fp32 -- so the
loss, its gradient and the metrics equal it to fp32 rounding (tests/test_ttt.py compares them through `ttt_forward`).
DSpark adds each row's Markov bias, a low-rank term markov_w1[prev] markov_w2^T, inside the same slices (BlockKL's
`extra`; both its weights trained) and its confidence loss (`score_blocks`).
The draft's side costs the unfused path's two [N, H] x [H, V] matmuls (its logits, its rows' gradient); the target's
logits are computed where they are read: on a CPU, which takes the rows in the order of their target row, about once
per target row (as the unfused path); on a GPU, which takes them as they come (no host sync), once per scored row,
one more such matmul.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.methods.dflash.modeling import DFlashDraft


class BlockRows(Protocol):
    """What score_blocks reads of a batch's index (train.blocks.BlockIndex)."""

    needed: torch.Tensor  # [N] rows b * T + i whose target distribution some block row is scored on
    scored: list[torch.Tensor]  # per proposal d: the block rows scored
    target: list[torch.Tensor]  # per proposal d: where their target row sits in `needed`


@dataclass
class TargetStates:
    """The target's p_j at the needed rows (BlockIndex.needed; row i is needed[i]) for a block drafter, kept as what it
    is computed from: p_j = softmax(states_j @ weight^T) over the draft vocabulary. [N, H], not [N, V].

    A reduced draft vocabulary (weight: the target lm_head's draft-vocabulary rows) gets EAGLE-3's distribution
    (objective.target_distribution): p renormalised over the draft vocabulary for the loss, the mass inside it and the
    target's top-1 over its whole vocabulary for the metrics (the expected acceptance reads p * mass)."""

    states: torch.Tensor  # [N, H] final_norm(layer-N state), in the logits' dtype (the autocast dtype under autocast)
    weight: torch.Tensor  # [Vd, H] the target's lm_head (its draft-vocabulary rows), in the same dtype
    neg_entropy: torch.Tensor  # [N] fp32 sum_v p log p (over the draft vocabulary)
    argmax: torch.Tensor | None = None  # [N] the target's top-1 over its WHOLE vocabulary, a target id (full=True)
    mass: torch.Tensor | None = None  # [N] fp32 target mass inside a reduced draft vocabulary (full=True; None: whole)

    def logits(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[R, Vd] the target's logits at needed rows `rows` over the draft vocabulary, in the logits' dtype."""
        return torch.mm(self.states.index_select(0, rows), self.weight.T, out=out)


@torch.no_grad()
def target_states(
    rows: torch.Tensor,
    final_norm: nn.Module,
    weight: torch.Tensor,
    *,
    full: bool = True,
    chunk_rows: int = 1,
    draft_weight: torch.Tensor | None = None,
) -> TargetStates:
    """TargetStates from layer-N states `rows` [N, H] (un-normalised): the final norm as objective.target_distribution
    applies it, then sum p log p (and the top-1) of each row's logits, `chunk_rows` rows at a time. `draft_weight`
    [Vd, H]: the lm_head `weight`'s rows of a reduced draft vocabulary, p over them (full: the whole head's top-1 and
    the mass inside them too)."""
    head = weight if draft_weight is None else draft_weight
    x = final_norm(rows.to(weight.dtype))
    dtype = torch.matmul(x[:0], head[:0].T).dtype  # what x @ W^T computes in here (autocast's dtype under autocast)
    n, device = x.shape[0], x.device
    reduced = draft_weight is not None
    states = TargetStates(
        x.to(dtype),
        head.to(dtype),
        torch.empty(n, device=device),
        torch.empty(n, dtype=torch.int64, device=device) if full else None,
        torch.empty(n, device=device) if full and reduced else None,
    )
    whole = weight.to(dtype) if states.mass is not None else None  # once, not per chunk
    for a in range(0, n, chunk_rows):
        logits = torch.mm(states.states[a : a + chunk_rows], states.weight.T).float()
        logp = torch.log_softmax(logits, dim=-1)
        states.neg_entropy[a : a + chunk_rows] = (logp.exp() * logp).sum(-1)
        if states.argmax is not None and states.mass is None:
            states.argmax[a : a + chunk_rows] = logits.max(-1)[1]
        elif states.argmax is not None and states.mass is not None and whole is not None:  # top-1, mass: whole head
            everything = torch.mm(states.states[a : a + chunk_rows], whole.T).float()
            states.argmax[a : a + chunk_rows] = everything.max(-1)[1]
            states.mass[a : a + chunk_rows] = torch.exp(torch.logsumexp(logits, -1) - torch.logsumexp(everything, -1))
    return states


# BlockKL's inputs in order; its backward names the gradients it gives (the rest get none).
_INPUTS = ("x", "head_weight", "target", "at", "hint", "extra", "extra_weight", "to_target", "options")


@dataclass(frozen=True)
class KLOptions:
    """How BlockKL slices its rows and what it computes beside the KL."""

    rows: int = 128  # rows of the head's matmuls at a time
    sub: int = 64  # rows of the reductions over their logits at a time (<= rows)
    metrics: bool = True  # the top-1 agreement and the expected acceptance
    group: bool = False  # take the rows by target row (a CPU: each target row's logits computed once)
    acceptance: bool = False  # the expected acceptance without the other metrics (DSpark's confidence target)


@dataclass
class _Scratch:
    """One BlockKL forward's outputs and the buffers its slices reuse."""

    kl: torch.Tensor  # [N] acc
    correct: torch.Tensor  # [N] bool
    accept: torch.Tensor  # [N] acc
    zb: torch.Tensor  # [rows, Vd] the draft's logits of a matmul slice
    tb: torch.Tensor  # [rows, Vd] the target's logits of its target rows
    pb: torch.Tensor  # p of the slice's target rows, fp32 (target_distribution's probs)
    dzb: torch.Tensor | None  # the slice's logits' gradient
    zf: torch.Tensor  # [sub, Vd] the draft's logits in acc; then min(p, q)
    tmp: torch.Tensor  # exp(z - max), p * z, then softmax(z) and its gradient
    pg: torch.Tensor | None  # p gathered for the rows (grouped)
    pm: torch.Tensor | None  # p * mass (a reduced vocabulary)

    @classmethod
    def make(
        cls,
        n: int,
        vd: int,
        zdt: torch.dtype,
        acc: torch.dtype,
        target: TargetStates,
        device: torch.device,
        options: KLOptions,
        any_grad: bool,
    ) -> _Scratch:
        big, small = (min(options.rows, n), vd), (min(options.sub, n), vd)
        zb = torch.empty(big, dtype=zdt, device=device)
        zf = torch.empty(small, dtype=acc, device=device)
        return cls(
            torch.empty(n, dtype=acc, device=device),
            torch.zeros(n, dtype=torch.bool, device=device),
            torch.zeros(n, dtype=acc, device=device),
            zb,
            torch.empty(big, dtype=target.weight.dtype, device=device),
            torch.empty(big, device=device),
            torch.empty_like(zb) if any_grad else None,
            zf,
            torch.empty_like(zf),
            torch.empty(small, device=device) if options.group else None,
            torch.empty(small, device=device) if target.mass is not None else None,
        )

    def reduce(  # noqa: PLR0913 - one slice's tensors, named as BlockKL's inputs
        self,
        z: torch.Tensor,
        p_all: torch.Tensor,
        which: torch.Tensor | None,
        ats: torch.Tensor,
        ids: torch.Tensor,
        target: TargetStates,
        hint: torch.Tensor,
        to_target: torch.Tensor | None,
        options: KLOptions,
        dz: torch.Tensor | None,
    ) -> None:
        """The reductions over a matmul slice's logits z, `options.sub` rows at a time: each row's KL, metrics and
        (dz) its logits' gradient scaled by its hint."""
        acc = self.zf.dtype
        for c in range(0, z.shape[0], options.sub):
            d = min(c + options.sub, z.shape[0])
            r, i = ats[c:d], ids[c:d]
            if self.pg is None:
                p = p_all[c:d]
            else:
                assert which is not None  # set with `order`, which `pg` goes with
                p = torch.index_select(p_all, 0, which[c:d], out=self.pg[: d - c])
            zs, ts = self.zf[: d - c].copy_(z[c:d]), self.tmp[: d - c]  # reduced in acc
            m, top = zs.max(-1)
            lse = torch.sub(zs, m[:, None], out=ts).exp_().sum(-1).log_().add_(m)  # objective._top1_logsumexp's
            self.kl[i] = target.neg_entropy.index_select(0, r).to(acc) - torch.mul(p, zs, out=ts).sum(-1) + lse
            q = torch.sub(zs, lse[:, None], out=ts).exp_()  # softmax(z)
            if options.metrics:
                top = top if to_target is None else to_target.index_select(0, top)  # target ids
                self.correct[i] = top == target.argmax.index_select(0, r)  # type: ignore[union-attr]  # block_kl: metrics need the top-1
            if options.metrics or options.acceptance:
                pw = p  # p over the whole vocabulary: a reduced one's p * mass (objective.expected_acceptance)
                if target.mass is not None and self.pm is not None:
                    pw = torch.mul(p, target.mass.index_select(0, r)[:, None], out=self.pm[: d - c])
                self.accept[i] = torch.minimum(pw, q, out=zs).sum(-1)
            if dz is not None:  # TargetKL.backward's dz, in the logits' dtype
                dz[c:d] = q.sub_(p).mul_(hint.index_select(0, i)[:, None])


class BlockKL(torch.autograd.Function):
    """Per row i of the draft's normed rows x [N, H]: KL(p_{at_i} || softmax(x_i W_d^T)) over the whole vocabulary,
    and (metrics) whether the draft's top-1 is the target's and sum_v min(p, q). The head's matmuls take `options.rows` rows
    at a time (a matmul of few rows streams the whole [V, H] head for little work), the reductions over their logits
    `options.sub` rows at a time (a slice the caches hold between one operation and the next: objective.REDUCE_ROWS).

    `hint` [N]: the gradient the caller will give each row's KL (ttt_forward: its loss weight). The rows' gradient
    is made in the forward, scaled by it before the logits' dtype rounds it (as the unfused backward rounds its
    dz); the backward rescales it by grad / hint, exact for any grad (the gradient is linear in it) and a no-op
    when the grad is the hint. A row whose hint is 0 gets no gradient.

    `extra` [N, r] and `extra_weight` [V, r]: a trainable low-rank term added to every row's logits, z = x W_d^T +
    extra W_e^T (DSpark's Markov bias: markov_w1[prev] and markov_w2). Both get their gradient; W_e's, a sum over
    rows, is made in the forward with the hint too, so the backward can only rescale it by one factor: it refuses a
    grad that is not the hint times one number (ttt_forward's losses always are). `acceptance`: compute the expected
    acceptance without the other metrics (DSpark's confidence target).

    A reduced draft vocabulary (DFlash with --draft-vocab-size): W_d [Vd, H] is the draft's own lm_head and gets its
    gradient as W_e does (dz^T x, a sum over rows made in the forward); the target's side is EAGLE-3's (TargetStates
    with its mass): the KL against p renormalised over the draft vocabulary, the top-1 compared in target ids
    (`to_target` [Vd], the draft's draft_to_target) and the acceptance sum_v min(p * mass, q), as ttt_forward scores
    an EAGLE-3 draft."""

    @staticmethod
    def forward(  # noqa: PLR0913 - one slice's tensors, named as BlockKL's inputs
        ctx: Any,
        x: torch.Tensor,
        head_weight: torch.Tensor,
        target: TargetStates,
        at: torch.Tensor,
        hint: torch.Tensor,
        extra: torch.Tensor | None,
        extra_weight: torch.Tensor | None,
        to_target: torch.Tensor | None,
        options: KLOptions,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        wants = dict(zip(_INPUTS, ctx.needs_input_grad, strict=False))
        n, device = x.shape[0], x.device
        zdt = F.linear(x[:0], head_weight[:0].to(x.dtype)).dtype  # DFlashDraft.logits's dtype (autocast's)
        acc = torch.promote_types(zdt, torch.float32)  # bf16 logits are reduced in fp32; fp64 stays fp64
        w = head_weight.detach().to(zdt)  # once: autocast would cast it again at every slice; then mm = F.linear's
        we = None if extra_weight is None else extra_weight.detach().to(zdt)
        grad = x.new_empty(x.shape) if wants["x"] else None
        grad_extra = extra.new_empty(extra.shape) if extra is not None and wants["extra"] else None
        grad_we = torch.zeros(we.shape, dtype=acc, device=device) if we is not None and wants["extra_weight"] else None
        grad_w = torch.zeros(w.shape, dtype=acc, device=device) if wants["head_weight"] else None
        any_grad = grad is not None or grad_extra is not None or grad_we is not None or grad_w is not None
        # group: the rows in the order of their target row, so the rows of a matmul slice read a few target rows,
        # whose logits and p are computed once (DFlash reads each from up to S - 1 block positions). It reads the
        # slices' sizes on the host: free on a CPU; a GPU takes the rows as they come (one target row per row).
        order = torch.argsort(at, stable=True) if options.group else None
        s = _Scratch.make(n, w.shape[0], zdt, acc, target, device, options, any_grad)
        for a in range(0, n, options.rows):  # the matmuls `rows` rows at a time, the reductions `sub` rows at a time
            b = min(a + options.rows, n)
            ids = torch.arange(a, b, device=device) if order is None else order[a:b]  # the rows, in x
            ats = at.index_select(0, ids)  # their target rows
            xs = x[a:b] if order is None else x.index_select(0, ids)
            z = torch.mm(xs.to(zdt), w.T, out=s.zb[: b - a])  # the draft's logits (DFlashDraft.logits)
            es = None
            if we is not None:  # the low-rank term (DSparkDraft.block_logits' Markov bias)
                es = (extra[a:b] if order is None else extra.index_select(0, ids)).to(zdt)  # type: ignore[index, union-attr]  # extra_weight comes with extra
                z.addmm_(es, we.T)
            if order is None:
                t, which = target.logits(ats, out=s.tb[: b - a]), None
            else:  # the target rows the slice reads, each once; which[i]: row i's among them
                once, which = torch.unique_consecutive(ats, return_inverse=True)
                t = target.logits(once, out=s.tb[: len(once)])
            p_all = torch.log_softmax(s.pb[: len(t)].copy_(t), -1).exp_()  # target_distribution's probs
            dz = None if s.dzb is None else s.dzb[: b - a]
            s.reduce(z, p_all, which, ats, ids, target, hint, to_target, options, dz)
            if grad is not None and dz is not None:  # the linear's backward, dz @ W_d, in its dtypes
                grad[ids] = torch.mm(dz, w).to(x.dtype)
            if grad_w is not None and dz is not None:  # the draft's own head: dz^T x of the slices, summed in fp32
                grad_w.addmm_(dz.T.to(acc), xs.to(zdt).to(acc))  # (under autocast: bf16 products rounded once)
            if dz is not None and es is not None and we is not None:  # the low-rank term's backward
                if grad_extra is not None:
                    grad_extra[ids] = torch.mm(dz, we).to(extra.dtype)  # type: ignore[union-attr]  # grad_extra: extra is set
                if grad_we is not None:
                    grad_we += torch.mm(dz.T, es)
        ctx.mark_non_differentiable(s.correct, s.accept)
        ctx.extra_weight_dtype = None if extra_weight is None else extra_weight.dtype
        ctx.head_dtype = head_weight.dtype
        ctx.save_for_backward(grad, grad_extra, grad_we, grad_w, hint)
        return s.kl, s.correct, s.accept

    @staticmethod
    def backward(
        ctx: Any, grad_kl: torch.Tensor, _correct: torch.Tensor, _accept: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        grad, grad_extra, grad_we, grad_w, hint = ctx.saved_tensors
        live = hint != 0
        scale = torch.where(live, grad_kl / torch.where(live, hint, 1), 0)
        rescaled = [None if g is None else g * scale[:, None].to(g.dtype) for g in (grad, grad_extra)]
        if grad_we is not None or grad_w is not None:  # sums over rows: one factor for all of them
            factors = scale[live]
            factor = factors[0] if len(factors) else scale.new_zeros(())
            if not torch.allclose(factors, factor.expand_as(factors), rtol=1e-4, atol=0):
                raise RuntimeError(
                    "BlockKL: the head's and the low-rank weight's gradients were made for the hint; this backward "
                    "gives the rows other weights (give block_kl the hint the loss weighs them by)"
                )
            grad_we = None if grad_we is None else (grad_we * factor).to(ctx.extra_weight_dtype)
            grad_w = None if grad_w is None else (grad_w * factor).to(ctx.head_dtype)
        grads = {"x": rescaled[0], "head_weight": grad_w, "extra": rescaled[1], "extra_weight": grad_we}
        return tuple(grads.get(name) for name in _INPUTS)


def block_kl(  # noqa: PLR0913 - BlockKL's inputs and its options, named
    x: torch.Tensor,
    head_weight: torch.Tensor,
    target: TargetStates,
    at: torch.Tensor,
    hint: torch.Tensor | None = None,
    rows: int = 128,
    sub: int = 64,
    metrics: bool = True,
    group: bool | None = None,
    extra: torch.Tensor | None = None,
    extra_weight: torch.Tensor | None = None,
    acceptance: bool = False,
    to_target: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(KL [N] with its gradient to x, draft top-1 == target top-1 [N] bool, expected acceptance [N]) of the draft's
    normed rows x [N, H] through head_weight [Vd, H] (the target's, frozen; a reduced vocabulary's own lm_head,
    trainable, with `to_target` [Vd] its target ids) plus extra [N, r] through the trainable extra_weight [Vd, r],
    row i scored on the target's needed row at[i] (BlockKL; without metrics the last two are zeros, the acceptance
    computed with `acceptance`). The head's matmuls run `rows` rows at a time, the reductions over their
    logits `sub` rows at a time; `group` (default: on a CPU) takes the rows by target row (BlockKL)."""
    if metrics and target.argmax is None:
        raise ValueError("block_kl: the metrics need the target's top-1 (target_states(..., full=True))")
    if hint is None:
        hint = torch.ones(x.shape[0], dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
    group = x.device.type == "cpu" if group is None else group
    rows = max(1, rows)
    options = KLOptions(rows, max(1, min(sub, rows)), metrics, group, acceptance)
    return BlockKL.apply(x, head_weight, target, at, hint, extra, extra_weight, to_target, options)


def score_blocks(  # noqa: PLR0913 - BlockKL's inputs and its options, named
    draft: DFlashDraft,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    target: TargetStates,
    index: BlockRows,
    step_weight: float,
    normaliser: torch.Tensor,
    metrics: bool,
    rows: int,
    sub: int,
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """A block method's proposals scored: the scored rows of the block hidden states [B, A*S, H] through draft.norm
    (autograd), then block_kl over all of them a slice at a time -> (the loss beside the KL: DSpark's confidence
    term, else 0; per proposal d, its rows' KL with its gradient, top-1 matches and acceptance). Each row's hint is
    the gradient ttt_forward's loss gives its KL, (1 / normaliser_d) * step_weight**d.

    What a block method adds, the draft says (DFlashDraft's hooks, DSparkDraft's terms): `row_terms`, the low-rank
    term a row's logits add from the token before its proposal (teacher forcing: x_{a+d}, the token at the target row
    it is scored on; DSpark's Markov bias), through block_kl's trainable low-rank term; `row_loss`, a loss per row
    beside the KL given each row's expected acceptance (DSpark's confidence), weighed by the row's hint."""
    sizes = [len(r) for r in index.scored]
    x = draft.norm(hidden.flatten(0, 1).index_select(0, torch.cat(index.scored)))  # [N, H] (may be empty)
    at = torch.cat(index.target)
    acc = torch.promote_types(x.dtype, torch.float32)  # the KL's dtype
    one = torch.ones((), dtype=acc, device=x.device)
    hint = torch.cat(
        [((one / normaliser[k].clamp(min=1).to(acc)) * step_weight**k).expand(n) for k, n in enumerate(sizes)]
    )
    prev = input_ids.flatten().index_select(0, index.needed.index_select(0, at))  # x_{a+d}
    terms = draft.row_terms(prev)
    embedded, w_e = terms if terms is not None else (None, None)
    to_target = draft.draft_to_target if draft.own_head else None  # a reduced draft vocabulary's target ids
    kl, correct, accept = block_kl(
        x, draft.head, target, at, hint, rows, sub, metrics, None, embedded, w_e, draft.scores_acceptance, to_target
    )
    row_loss = draft.row_loss(x, terms, accept)
    extra_loss = hint.new_zeros(()) if row_loss is None else (row_loss.float() * hint.float()).sum()
    return extra_loss, list(zip(kl.split(sizes), correct.split(sizes), accept.split(sizes), strict=False))
