"""The DFlash draft model (vLLM `DFlashDraftModel` compatible weights, qwen3_dflash.py): a block drafter.

Reads top to bottom: what a layer keeps for the backward -> attention over the block and the context -> decoder
layer -> the draft. The spec, the norm, RoPE and MLP modules and the shared module behaviour (`DraftModule`) are
methods/layers.py's and methods/spec.py's.

Memory: a training forward runs every layer over B * A * S block rows (8,192 at the peers' defaults), so what autograd
keeps per layer is what bounds a step's peak, not the attention (block_attention keeps no scores). The layers compute
exactly what model.py's modules compute, keeping less: `LeanRMSNorm` keeps its input and one rstd per row (not the
fp32 copy and the normed rows), `lean_mlp` keeps the MLP's gate and up projections (not silu(gate), nor the
product: recomputed in the backward), and the projections reading one input (q / k / v, gate / up) keep it once
(`linears`: under autocast each would cast it, and keep its own copy). benchmarks/block_memory.py measures it
(docs/benchmarks.md, "DFlash at the peers' defaults: memory").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Self

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from draftsmith.core import targets
from draftsmith.methods.attention import KVCache, full_attention
from draftsmith.methods.layers import MLP, Attention, DraftModule, RMSNorm, RotaryEmbedding, apply_rope
from draftsmith.methods.spec import DraftSpec


def own_head(spec: DraftSpec) -> bool:
    """Whether a block drafter of `spec` has a draft vocabulary (and lm_head) of its own: one smaller than the
    target's; else it reads the target's frozen lm_head over the whole vocabulary."""
    return spec.draft_vocab_size < spec.vocab_size


# ---------------------------------------------------------------------------------------------- what is kept


class RMSNormFunction(torch.autograd.Function):
    """model.RMSNorm's forward (weight * (x_fp32 * rstd).to(x.dtype)) keeping x and rstd [..., 1] for the backward;
    the backward recomputes the normed rows and follows autograd's chain through the same ops and dtypes."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # bf16 normed in fp32; fp64 stays
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        with torch.autocast(grad.device.type, enabled=False):
            xf = x.to(rstd.dtype)
            normed = (xf * rstd).to(x.dtype)
            grad_weight = None
            if ctx.needs_input_grad[1]:
                grad_weight = (grad * normed).sum_to_size(weight.shape).to(weight.dtype)
            g = (grad * weight).to(x.dtype).to(rstd.dtype)  # through .to(x.dtype): the gradient of xf * rstd
            grad_rstd = (g * xf).sum(-1, keepdim=True)
            grad_mean = grad_rstd * (-0.5 * rstd.pow(3))  # d rsqrt(m + eps) / dm
            grad_x = g * rstd + xf * (grad_mean * (2.0 / x.shape[-1]))  # d mean(x^2) / dx = 2x / D
        return grad_x.to(x.dtype), grad_weight, None


class LeanRMSNorm(RMSNorm):
    """model.RMSNorm (same weight, same output) through `RMSNormFunction`: keeps x and rstd, not the fp32 copy of x
    and the normed rows (two [N, H] fp32 tensors per norm of the fp32 residual stream)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RMSNormFunction.apply(x, self.weight, self.eps)


class Linears(torch.autograd.Function):
    """F.linear(x, w) for each w of `weights` (one dtype: the autocast dtype under autocast), keeping x in that dtype
    once: autocast casts x for every linear reading it and each linear keeps its own copy. The backward is autograd's:
    per linear dx = dy @ w in the weights' dtype, cast to x's dtype (the cast's backward) before the sum."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        xc = x.to(weights[0].dtype)
        ctx.save_for_backward(xc, *weights)
        ctx.x_dtype = x.dtype
        return tuple(F.linear(xc, w) for w in weights)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xc, *weights = ctx.saved_tensors
        with torch.autocast(xc.device.type, enabled=False):
            grad_x = None
            if ctx.needs_input_grad[0]:
                for g, w in zip(grads, weights, strict=False):
                    part = g.matmul(w).to(ctx.x_dtype)
                    grad_x = part if grad_x is None else grad_x + part
            rows = xc.flatten(0, -2)
            grad_ws = [
                g.flatten(0, -2).T.mm(rows) if need else None
                for g, need in zip(grads, ctx.needs_input_grad[1:], strict=False)
            ]
        return grad_x, *grad_ws


def _weights(x: torch.Tensor, *modules: nn.Linear) -> list[torch.Tensor]:
    """The modules' weights as a linear computes with them: cast to the autocast dtype when autocast is on."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return [m.weight.to(torch.get_autocast_dtype(device_type)) for m in modules]
    return [m.weight for m in modules]


def linears(x: torch.Tensor, *modules: nn.Linear) -> tuple[torch.Tensor, ...]:
    """(m(x) for m in modules), bias-free nn.Linears reading one input, keeping it once (`Linears`)."""
    return Linears.apply(x, *_weights(x, *modules))


class SwiGLUDown(torch.autograd.Function):
    """down(silu(gate) * up) = F.linear(silu(g) * u, w), keeping g, u and w: the product (down's input) and silu(g)
    are recomputed in the backward (elementwise) instead of kept, half of what the MLP keeps ([N, I] each). The
    backward runs autograd's own ops (the linear's two matmuls, the product's, aten.silu_backward) in their dtypes."""

    @staticmethod
    def forward(ctx: Any, g: torch.Tensor, u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(g, u, w)
        return F.linear(F.silu(g) * u, w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        g, u, w = ctx.saved_tensors
        with torch.autocast(grad.device.type, enabled=False):
            s = F.silu(g)
            grad_w = None
            if ctx.needs_input_grad[2]:
                grad_w = grad.flatten(0, -2).T.mm((s * u).flatten(0, -2))
            grad_h = grad.matmul(w)
            grad_g = torch.ops.aten.silu_backward(grad_h * u, g) if ctx.needs_input_grad[0] else None
            grad_u = grad_h * s if ctx.needs_input_grad[1] else None
        return grad_g, grad_u, grad_w


def lean_mlp(mlp: MLP, x: torch.Tensor) -> torch.Tensor:
    """mlp(x) (model.MLP: down(silu(gate(x)) * up(x))), keeping x once and g, u (`linears`, `SwiGLUDown`)."""
    g, u = linears(x, mlp.gate_proj, mlp.up_proj)
    return SwiGLUDown.apply(g, u, *_weights(x, mlp.down_proj))


# ---------------------------------------------------------------------------------------------- attention


class DFlashAttention(Attention):
    """Qwen3 attention (q_norm / k_norm per head) whose keys and values come from two inputs: the block's own
    positions and the context, the fused target states of every verified position before the anchor (DFlashLayer
    calls `keys_values`, `project` and `output`)."""

    def __init__(self, spec: DraftSpec):
        super().__init__(spec, spec.hidden_size)
        self.q_norm = LeanRMSNorm(self.head_dim, spec.rms_norm_eps)
        self.k_norm = LeanRMSNorm(self.head_dim, spec.rms_norm_eps)

    def _heads(self, proj: nn.Linear, norm: RMSNorm | None, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        y = proj(x).view(b, t, n, self.head_dim)
        return (y if norm is None else norm(y)).transpose(1, 2)  # [B, heads, T, D]

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) [B, Hkv, T, D] of inputs x [B, T, H] at the positions cos/sin were made for."""
        k = apply_rope(self._heads(self.k_proj, self.k_norm, x, self.num_kv_heads), cos, sin)
        return k, self._heads(self.v_proj, None, x, self.num_kv_heads)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, *keys_values(x)) [B, heads, T, D] (q: q_proj, q_norm and RoPE as keys_values makes k), the three
        projections keeping x once (`linears`)."""
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, -1, self.head_dim) for y in linears(x, self.q_proj, self.k_proj, self.v_proj))
        q = apply_rope(self.q_norm(q).transpose(1, 2), cos, sin)
        k = apply_rope(self.k_norm(k).transpose(1, 2), cos, sin)
        return q, k, v.transpose(1, 2)


class DFlashLayer(nn.Module):
    """A pre-norm Qwen3 layer over the block; its attention also reads the context's keys and values, which it
    projects from the context (the fused target states after hidden_norm, no input_layernorm: vLLM's
    precompute_and_store_context_kv)."""

    def __init__(self, spec: DraftSpec, layer_idx: int):
        super().__init__()
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.layer_idx = layer_idx
        self.input_layernorm = LeanRMSNorm(h, eps)
        self.self_attn = DFlashAttention(spec)
        self.post_attention_layernorm = LeanRMSNorm(h, eps)
        self.mlp = MLP(spec)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor],
        attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """hidden [B, Q, H] (the block positions); context: (features [B, T, H], cos, sin) whose K/V this layer
        projects (inside its forward: FSDP2 has the layer's weights gathered only there), or the cached (k, v) of
        decoding; attend(q, k_block, v_block, k_context, v_context) -> [B, Hq, Q, D] decides who sees what
        (training: each block its own prefix, `block_attention`; decoding: everything)."""
        context_kv = self.self_attn.keys_values(*context) if len(context) == 3 else context
        out = attend(*self.self_attn.project(self.input_layernorm(hidden), cos, sin), *context_kv)
        hidden = hidden + self.self_attn.output(out)
        return hidden + lean_mlp(self.mlp, self.post_attention_layernorm(hidden))


class DFlashDraft(DraftModule):
    """A block drafter (vLLM's `DFlashDraftModel`, qwen3_dflash.py). One forward proposes a whole block:

        context  = hidden_norm(fc(cat(target layers)))        # [T, H], each verified position before the anchor
        block    = embed([x_anchor, mask, ..., mask])          # block_size positions anchor .. anchor + S - 1
        layer i  : K/V of the context (k_proj / v_proj / k_norm of layer i) and of the block; the block's queries
                   see the whole context and the whole block (no causal order inside it)
        logits   = lm_head(norm(h))                            # block position j proposes x_{anchor + j}, j >= 1

    The embedding is the target's, frozen and never saved (Eagle3Draft's `EMBEDDING`). The head, by the spec's draft
    vocabulary:
      - the target's whole vocabulary (draft_vocab_size == vocab_size, the default): the target's lm_head, frozen, a
        buffer outside the state dict, d2t / t2d the identity outside it too; a saved draft is exactly vLLM's file:
        `fc`, `hidden_norm`, `layers.*`, `norm`;
      - a reduced one (`train --draft-vocab-size`, as EAGLE-3's): its own trainable `lm_head` [Vd, H] and the d2t /
        t2d buffers, saved (vLLM's loader reads `lm_head.weight` and d2t, skips t2d; speculators' keeps both).
    """

    head_weight: torch.Tensor  # the target's lm_head buffer (whole vocabulary only)

    def __init__(self, spec: DraftSpec):
        if spec.block_size is None or spec.mask_token_id is None:
            raise ValueError("DFlashDraft needs a spec with block_size and mask_token_id")
        super().__init__(spec)
        h = spec.hidden_size
        self.hidden_norm = LeanRMSNorm(h, spec.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(spec, i) for i in range(spec.num_hidden_layers))
        self.norm = LeanRMSNorm(h, spec.rms_norm_eps)
        self.rotary = RotaryEmbedding(spec)
        self.own_head = own_head(spec)
        if self.own_head:  # a reduced draft vocabulary: EAGLE-3's head and maps
            self.lm_head = nn.Linear(h, spec.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(spec.vocab_size, dtype=torch.bool))
        else:  # the target's, whole: the identity maps
            self.register_buffer("head_weight", torch.zeros(spec.vocab_size, h), persistent=False)
            self.register_buffer("d2t", torch.zeros(spec.vocab_size, dtype=torch.int64), persistent=False)
            self.register_buffer("t2d", torch.ones(spec.vocab_size, dtype=torch.bool), persistent=False)

    @property
    def head(self) -> torch.Tensor:
        """[Vd, H] the weight the logits read: the draft's own lm_head (trainable), else the target's (frozen)."""
        return self.lm_head.weight if self.own_head else self.head_weight

    @classmethod
    def from_target(
        cls,
        spec: DraftSpec,
        target: nn.Module,
        seed: int = 0,
        draft_to_target: torch.Tensor | None = None,
        lm_head_init: str = "target",
    ) -> Self:
        """A fresh draft with the target's embedding and lm_head; a reduced draft vocabulary (`draft_to_target`, the
        spec's draft_vocab_size sorted target ids) gets its own lm_head from the target's rows of it (lm_head_init
        "target", as Eagle3Draft.from_target) or random ones."""
        draft = cls(spec)
        draft.init_weights(seed)
        head = targets.lm_head(target).weight
        draft.set_target(targets.embed_tokens(target).weight, head)
        if draft.own_head:
            if draft_to_target is None:
                raise ValueError("a DFlash draft over a reduced vocabulary needs its draft_to_target ids")
            draft.set_draft_vocab(draft_to_target)
            if lm_head_init == "target":
                draft.head_from_target(head)
        return draft

    def set_target(self, embed_weight: torch.Tensor, head_weight: torch.Tensor | None = None) -> None:
        """The target's embedding and (whole vocabulary) lm_head, both frozen and never saved; a draft with its own
        lm_head does not read the target's."""
        if head_weight is None and not self.own_head:
            raise ValueError("a DFlash draft over the target's vocabulary needs the target's lm_head")
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed_weight)
            if not self.own_head:
                assert head_weight is not None
                self.head_weight.copy_(head_weight)

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(aux_hidden)

    # What a block method adds to the loss (train.block_loss.score_blocks asks; DSparkDraft answers): DFlash nothing.
    scores_acceptance: ClassVar[bool] = False  # row_loss reads each scored row's expected acceptance
    proposing_rows: ClassVar[slice] = slice(1, None)  # the block rows a round proposes from: the mask positions

    def row_terms(self, prev_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(E [N, r], W [V, r]): the low-rank term E @ W^T each scored row's logits add, from the token before its
        proposal `prev_ids` [N] (target ids); None: the head's logits alone."""
        return None

    def row_loss(
        self, hidden_normed: torch.Tensor, terms: tuple[torch.Tensor, torch.Tensor] | None, accept: torch.Tensor
    ) -> torch.Tensor | None:
        """A loss per scored row [N] trained beside the KL, from norm(h) [N, H], `row_terms`' and each row's expected
        acceptance [N] (detached); None: the KL alone."""
        return None

    def context(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """The context every layer projects its keys and values from: hidden_norm(fc(aux)) [B, T, H]."""
        return self.hidden_norm(self.fc(aux_hidden))

    def block_ids(self, anchor_ids: torch.Tensor, size: int | None = None) -> torch.Tensor:
        """[..., S]: each anchor token followed by S - 1 mask tokens (S: `size`, default the block size)."""
        assert self.spec.block_size is not None and self.spec.mask_token_id is not None  # a dflash spec's
        masks = anchor_ids.new_full((*anchor_ids.shape, (size or self.spec.block_size) - 1), self.spec.mask_token_id)
        return torch.cat((anchor_ids[..., None], masks), dim=-1)

    def forward_hidden(
        self,
        block_ids: torch.Tensor,
        block_positions: torch.Tensor,
        context: torch.Tensor | list[tuple[torch.Tensor, torch.Tensor]],
        context_positions: torch.Tensor | None,
        attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        checkpointed: bool = False,
    ) -> torch.Tensor:
        """The block's pre-norm hidden states [B, Q, H]: block_ids / block_positions [B, Q], context [B, T, H] (or
        per-layer cached (k, v) when `context` is a list: decoding) at context_positions [B, T]."""
        hidden = self.embed_tokens(block_ids).to(context.dtype if torch.is_tensor(context) else context[0][0].dtype)
        cos, sin = self.rotary(block_positions, hidden.dtype)
        if torch.is_tensor(context):
            cos_c, sin_c = self.rotary(context_positions, hidden.dtype)
        for i, layer in enumerate(self.layers):
            kv = (context, cos_c, sin_c) if torch.is_tensor(context) else context[i]
            if checkpointed and torch.is_grad_enabled():
                hidden = checkpoint(layer, hidden, cos, sin, kv, attend, use_reentrant=False)
            else:
                hidden = layer(hidden, cos, sin, kv, attend)
        return hidden

    def forward(
        self,
        block_ids: torch.Tensor,
        block_positions: torch.Tensor,
        features: torch.Tensor,
        feature_positions: torch.Tensor,
        cache: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoding one DFlash round as vLLM runs it: the fused target features [B, T, H] (`fuse`) at
        feature_positions [B, T] join the context -- each layer's K/V of them appended to `cache` (vLLM writes them
        into the draft's KV cache) --, then the block [B, S] at block_positions sees the whole cached context and
        itself, in one forward -> (logits of the `proposing_rows` [B, S-1, Vd] (DSpark: every row, [B, S, V]), the
        proposals; pre-norm hidden [B, S, H]). The block leaves nothing behind."""
        context = self.hidden_norm(features)
        cos, sin = self.rotary(feature_positions, context.dtype)
        for i, layer in enumerate(self.layers):
            cache.extend(i, *layer.self_attn.keys_values(context, cos, sin))  # type: ignore[union-attr, operator]
        hidden = self.forward_hidden(block_ids, block_positions, cache.context(), None, full_attention)
        return self.logits(hidden[:, self.proposing_rows]), hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [..., H] -> logits over the draft vocabulary [..., Vd] (`head`; draft ids, d2t maps them)."""
        x = self.norm(hidden)
        return F.linear(x, self.head.to(x.dtype))
