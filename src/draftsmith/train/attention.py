"""Attention kernels of the EAGLE-3 draft: training-time test (TTT), its explicit-mask reference, and decoding.

At TTT step k the query at position t attends causally to the step-0 keys s <= t and to its own keys of steps 1..k
at position t (the draft's own chain); see ttt.py for the alignment. `ttt_attention` is what training runs,
`naive_ttt_attention` the explicit-mask reference it is tested against, `cached_attention` what decoding runs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Training-time-test attention without a [T, T*(k+1)] mask.

    q [B, Hq, T, D] is step k = len(keys) - 1. keys/values[j] [B, Hkv, T, D] are the keys of step j. Query t attends
    causally to step-0 keys s <= t, and to the keys of steps 1..k at its own position t (the draft's own chain).
    Step 0 is plain causal SDPA; for k > 0 the [T, T] step-0 scores and the k diagonal scores share one softmax.
    """
    b, hq, t, d = q.shape
    hkv = keys[0].shape[1]
    if len(keys) == 1:
        return F.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True, enable_gqa=hq != hkv)
    g = hq // hkv
    scale = 1.0 / math.sqrt(d)
    qg = q.view(b, hkv, g, t, d)  # grouped query heads share one kv head, no copy of K/V
    k0, v0 = keys[0][:, :, None], values[0][:, :, None]  # [B, Hkv, 1, T, D]
    scores0 = torch.matmul(qg, k0.transpose(-1, -2)) * scale  # [B, Hkv, g, T, T]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril_()
    scores0 = scores0.masked_fill(~causal, float("-inf"))
    kd = torch.stack(keys[1:], dim=-2)[:, :, None]  # [B, Hkv, 1, T, k, D]
    vd = torch.stack(values[1:], dim=-2)[:, :, None]
    scores_d = (qg.unsqueeze(-2) * kd).sum(-1) * scale  # [B, Hkv, g, T, k]
    softmax_dtype = torch.promote_types(q.dtype, torch.float32)  # fp32 softmax under bf16, fp64 stays fp64
    probs = torch.softmax(torch.cat((scores0, scores_d), dim=-1), dim=-1, dtype=softmax_dtype).to(q.dtype)
    p0, pd = probs[..., :t], probs[..., t:]
    out = torch.matmul(p0, v0) + (pd.unsqueeze(-1) * vd).sum(-2)  # [B, Hkv, g, T, D]
    return out.view(b, hq, t, d)


def naive_ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Reference: every step's keys side by side, masked by an explicit [T, T*(k+1)] mask (tests, benchmark)."""
    b, hq, t, d = q.shape
    hkv = keys[0].shape[1]
    k_all = torch.cat(keys, dim=2).repeat_interleave(hq // hkv, dim=1)  # [B, Hq, T*(k+1), D]
    v_all = torch.cat(values, dim=2).repeat_interleave(hq // hkv, dim=1)
    idx = torch.arange(t, device=q.device)
    causal = idx[None, :] <= idx[:, None]  # [T, T]
    diagonal = idx[None, :] == idx[:, None]
    mask = torch.cat([causal] + [diagonal] * (len(keys) - 1), dim=1)  # [T, T*(k+1)]
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Decoding: the S new queries are the last S positions of the K/V (past + new); causal with that offset."""
    s, total = q.shape[2], k.shape[2]
    mask = torch.ones(s, total, dtype=torch.bool, device=q.device).tril_(diagonal=total - s)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
