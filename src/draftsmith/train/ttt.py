"""Training-time test (TTT): the unrolled draft forward, the target's distribution, the loss and the metrics.

Alignment (DESIGN.md; the reference implementations shipped an off-by-one here). Tokens x_0..x_{T-1}; the target's
state at position j (layer N) gives p_j, its distribution of token x_{j+1}. At TTT step k the draft at position t
  - reads the embedding of x_{t+k+1} and the fused target features f_t (k = 0) or its own step k-1 output at t,
  - sits at RoPE position t+k and attends causally to step-0 keys s <= t plus its own keys of steps 1..k at t,
  - predicts token x_{t+k+2}: it is trained towards p_{t+k+1}, with weight loss_mask[t+k+2] (the predicted token's).
So step k has T-k-2 scored positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.train.model import Eagle3Draft, KVCache

# Target logits are materialised for at most this many elements at a time (a 150k vocabulary stays bounded).
LOGIT_CHUNK_ELEMENTS = 1 << 24


@dataclass
class TargetDistribution:
    probs: torch.Tensor  # [B, T, Vd] the target's p_j restricted to the draft vocabulary, renormalised (fp32)
    neg_entropy: torch.Tensor  # [B, T] sum_v probs log probs (so KL = neg_entropy - sum probs log q)
    mass: torch.Tensor  # [B, T] target probability mass inside the draft vocabulary
    argmax: torch.Tensor  # [B, T] target argmax over the FULL vocabulary (target ids)


def needed_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: positions j whose p_j some TTT step is scored against, i.e. loss_mask[j + 1] (any step k reads
    p_{t+k+1} only where loss_mask[t+k+2]). On chat data about a quarter of positions are not needed."""
    return F.pad(loss_mask[:, 1:].bool(), (0, 1))


@torch.no_grad()
def target_distribution(last_hidden: torch.Tensor, final_norm: nn.Module, lm_head_weight: torch.Tensor,
                        draft_to_target: torch.Tensor, chunk_elements: int = LOGIT_CHUNK_ELEMENTS,
                        needed: torch.Tensor | None = None) -> TargetDistribution:
    """p_j from layer N (un-normalised) through the target's final norm and lm_head, a few tokens at a time.

    With `needed` [B, T] only those positions go through the head (the target's full-vocabulary matmul is a large
    part of a training step); the others are left zero, and nothing reads them.
    """
    b, t, h = last_hidden.shape
    flat = last_hidden.reshape(b * t, h)
    ids = draft_to_target.to(lm_head_weight.device)
    device = last_hidden.device
    rows = torch.arange(b * t, device=device) if needed is None else needed.reshape(-1).nonzero().squeeze(1)
    # Filled chunk by chunk at the computed rows; rows not needed stay zero.
    probs = torch.zeros(b * t, ids.numel(), device=device)
    neg_ent, mass = torch.zeros(b * t, device=device), torch.zeros(b * t, device=device)
    argmax = torch.zeros(b * t, dtype=torch.int64, device=device)
    chunk = max(1, chunk_elements // lm_head_weight.shape[0])
    for start in range(0, rows.numel(), chunk):
        at = rows[start:start + chunk]
        x = final_norm(flat[at].to(lm_head_weight.dtype))
        logits = (x @ lm_head_weight.T).float()  # [chunk, V]
        full_logp = torch.log_softmax(logits, dim=-1)
        argmax[at] = logits.argmax(-1)
        logp = torch.log_softmax(logits[:, ids], dim=-1)  # [chunk, Vd]
        p = logp.exp()
        probs[at] = p
        neg_ent[at] = (p * logp).sum(-1)
        mass[at] = full_logp[:, ids].exp().sum(-1)
    return TargetDistribution(probs=probs.view(b, t, -1), neg_entropy=neg_ent.view(b, t), mass=mass.view(b, t),
                              argmax=argmax.view(b, t))


def step_views(k: int, input_ids: torch.Tensor, loss_mask: torch.Tensor, target: TargetDistribution):
    """What step k sees and is scored against, over its scored positions t = 0..T-k-3.

    Returns (input ids [B, T] for the forward: x_{t+k+1}, zero-padded), and for the scored positions:
    (target probs p_{t+k+1}, neg-entropy, mass, target argmax, mask = loss_mask[t+k+2]).
    """
    t = input_ids.shape[1]
    ids = F.pad(input_ids[:, k + 1:], (0, k + 1))
    n = max(t - k - 2, 0)
    sl = slice(k + 1, k + 1 + n)
    return (ids, target.probs[:, sl], target.neg_entropy[:, sl], target.mass[:, sl], target.argmax[:, sl],
            loss_mask[:, k + 2:k + 2 + n])


def step_counts(loss_mask: torch.Tensor, ttt_steps: int) -> torch.Tensor:
    """Scored (loss-masked) positions per TTT step [K] — the loss normaliser, summed over ranks and micro-batches."""
    t = loss_mask.shape[1]
    return torch.stack([loss_mask[:, k + 2:].sum() if k + 2 < t else loss_mask.new_zeros(()).sum()
                        for k in range(ttt_steps)]).double()


@dataclass
class TTTResult:
    loss: torch.Tensor  # scalar to backpropagate: sum_k w_k * sum_t mask * KL / normaliser_k
    kl_sum: torch.Tensor  # [K] sum of masked KL per step (detached, fp64)
    correct: torch.Tensor  # [K] masked positions where the draft's top-1 equals the target's (full-vocab) top-1
    accept_sum: torch.Tensor  # [K] sum of expected acceptance sum_v min(p_target, q_draft)
    count: torch.Tensor  # [K] masked positions


def ttt_forward(draft: Eagle3Draft, input_ids: torch.Tensor, loss_mask: torch.Tensor, aux_hidden: torch.Tensor,
                target: TargetDistribution, ttt_steps: int, step_weight: float = 0.8,
                normaliser: torch.Tensor | None = None, mode: str = "ttt") -> TTTResult:
    """Unroll `ttt_steps` draft steps over a right-padded batch.

    input_ids/loss_mask [B, T] (the mask is 0/1: a position is scored or not); aux_hidden [B, T, num_aux * H] (aux
    layers concatenated in id order). normaliser [K]
    is the number of scored positions per step over everything averaged together (default: this batch), so gradients
    summed over micro-batches and ranks equal the gradient of one combined batch.
    """
    b, t = input_ids.shape
    mask_f = loss_mask.to(torch.float32)
    if normaliser is None:
        normaliser = step_counts(loss_mask, ttt_steps)
    cache = KVCache(len(draft.layers))
    hidden = draft.fuse(aux_hidden)  # [B, T, H]
    positions = torch.arange(t, device=input_ids.device).expand(b, t)
    d2t = draft.d2t
    loss = aux_hidden.new_zeros((), dtype=torch.float32)
    kl_sum, correct, accept_sum, count = (torch.zeros(ttt_steps, dtype=torch.float64) for _ in range(4))
    for k in range(ttt_steps):
        ids, p, neg_ent, mass, tgt_argmax, mask = step_views(k, input_ids, mask_f, target)
        hidden = draft.forward_hidden(ids, hidden, positions + k, cache, mode=mode)  # [B, T, H], feeds step k+1
        n = p.shape[1]
        if n == 0:
            continue
        # Only scored positions reach the lm_head (its matmuls dominate the step); the rest only feed attention.
        sel = mask > 0  # [B, n]
        logq = torch.log_softmax(draft.logits(hidden[:, :n][sel]), dim=-1,
                                 dtype=torch.promote_types(hidden.dtype, torch.float32))  # [N, Vd]
        p_sel = p[sel]
        kl = neg_ent[sel] - (p_sel * logq).sum(-1)  # [N] forward KL(p || q) over the draft vocabulary
        step_loss = kl.sum()
        loss = loss + (step_weight ** k) * step_loss / normaliser[k].clamp(min=1).to(step_loss.dtype)
        with torch.no_grad():
            draft_top = logq.argmax(-1)
            draft_top_target = draft_top + d2t[draft_top]
            accept = torch.minimum(p_sel * mass[sel][:, None], logq.exp()).sum(-1)
            kl_sum[k] = step_loss.detach().double().cpu()
            correct[k] = (draft_top_target == tgt_argmax[sel]).sum().double().cpu()
            accept_sum[k] = accept.sum().double().cpu()
            count[k] = sel.sum().double().cpu()
    return TTTResult(loss=loss, kl_sum=kl_sum, correct=correct, accept_sum=accept_sum, count=count)


def summarise(kl_sum: torch.Tensor, correct: torch.Tensor, accept_sum: torch.Tensor, count: torch.Tensor,
              step_weight: float) -> dict:
    """Per-step accuracy / expected acceptance / KL and the simulated acceptance length 1 + sum_k prod_{i<=k} acc_i."""
    n = count.clamp(min=1)
    acc = (correct / n).tolist()
    length, run = 1.0, 1.0
    for a in acc:
        run *= a
        length += run
    weights = torch.tensor([step_weight ** k for k in range(len(acc))], dtype=torch.float64)
    return {
        "loss": float((weights * kl_sum / n).sum()),
        "kl": [round(float(x), 5) for x in (kl_sum / n)],
        "acc": [round(a, 5) for a in acc],
        "accept": [round(float(x), 5) for x in (accept_sum / n)],
        "acceptance_length": round(length, 5),
        "tokens": int(count[0]) if len(count) else 0,
    }


class TTTModel(nn.Module):
    """The draft behind one forward call (what DDP / FSDP2 wrap): forward(...) = ttt_forward(draft, ...)."""

    def __init__(self, draft: Eagle3Draft):
        super().__init__()
        self.draft = draft

    def forward(self, input_ids, loss_mask, aux_hidden, target, ttt_steps, step_weight=0.8, normaliser=None,
                mode="ttt") -> TTTResult:
        return ttt_forward(self.draft, input_ids, loss_mask, aux_hidden, target, ttt_steps, step_weight, normaliser,
                           mode)
