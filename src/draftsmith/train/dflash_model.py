"""The DFlash draft model (vLLM `DFlashDraftModel` compatible weights, qwen3_dflash.py): a block drafter.

Reads top to bottom: attention over the block and the context -> decoder layer -> the draft. The spec, the norm,
RoPE and MLP pieces and the shared module behaviour (`DraftModule`) are train/model.py's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from draftsmith.core import targets
from draftsmith.train.attention import full_attention
from draftsmith.train.model import MLP, DraftModule, DraftSpec, KVCache, RMSNorm, RotaryEmbedding, apply_rope


class DFlashAttention(nn.Module):
    """Qwen3 attention (q_norm / k_norm per head) whose keys and values come from two inputs: the block's own
    positions and the context, the fused target states of every verified position before the anchor."""

    def __init__(self, spec: DraftSpec):
        super().__init__()
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.num_heads, self.num_kv_heads, self.head_dim = (
            spec.num_attention_heads,
            spec.num_key_value_heads,
            spec.head_dim,
        )
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)

    def _heads(self, proj: nn.Linear, norm: RMSNorm | None, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        y = proj(x).view(b, t, n, self.head_dim)
        return (y if norm is None else norm(y)).transpose(1, 2)  # [B, heads, T, D]

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) [B, Hkv, T, D] of inputs x [B, T, H] at the positions cos/sin were made for."""
        k = apply_rope(self._heads(self.k_proj, self.k_norm, x, self.num_kv_heads), cos, sin)
        return k, self._heads(self.v_proj, None, x, self.num_kv_heads)

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(self._heads(self.q_proj, self.q_norm, x, self.num_heads), cos, sin)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DFlashLayer(nn.Module):
    """A pre-norm Qwen3 layer over the block; its attention also reads the context's keys and values, which it
    projects from the context (the fused target states after hidden_norm, no input_layernorm: vLLM's
    precompute_and_store_context_kv)."""

    def __init__(self, spec: DraftSpec, layer_idx: int):
        super().__init__()
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = DFlashAttention(spec)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(spec)

    def forward(self, hidden: torch.Tensor, cos, sin, context, attend) -> torch.Tensor:
        """hidden [B, Q, H] (the block positions); context: (features [B, T, H], cos, sin) whose K/V this layer
        projects (inside its forward: FSDP2 has the layer's weights gathered only there), or the cached (k, v) of
        decoding; attend(q, k_block, v_block, k_context, v_context) -> [B, Hq, Q, D] decides who sees what
        (training: each block its own prefix, `block_attention`; decoding: everything)."""
        context_kv = self.self_attn.keys_values(*context) if len(context) == 3 else context
        x = self.input_layernorm(hidden)
        k, v = self.self_attn.keys_values(x, cos, sin)
        out = attend(self.self_attn.query(x, cos, sin), k, v, *context_kv)
        hidden = hidden + self.self_attn.output(out)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDraft(DraftModule):
    """A block drafter (vLLM's `DFlashDraftModel`, qwen3_dflash.py). One forward proposes a whole block:

        context  = hidden_norm(fc(cat(target layers)))        # [T, H], each verified position before the anchor
        block    = embed([x_anchor, mask, ..., mask])          # block_size positions anchor .. anchor + S - 1
        layer i  : K/V of the context (k_proj / v_proj / k_norm of layer i) and of the block; the block's queries
                   see the whole context and the whole block (no causal order inside it)
        logits   = lm_head(norm(h))                            # block position j proposes x_{anchor + j}, j >= 1

    The embedding and the lm_head are the target's, frozen, and never saved: the embedding as Eagle3Draft's
    (`EMBEDDING`), the head as a buffer outside the state dict. The draft vocabulary is the target's (d2t / t2d are
    the identity, outside the state dict), so a saved DFlash draft is exactly vLLM's file: `fc`, `hidden_norm`,
    `layers.*`, `norm`.
    """

    head_weight: torch.Tensor  # buffers
    d2t: torch.Tensor
    t2d: torch.Tensor

    def __init__(self, spec: DraftSpec):
        super().__init__()
        if spec.block_size is None or spec.mask_token_id is None:
            raise ValueError("DFlashDraft needs a spec with block_size and mask_token_id")
        self.spec = spec
        h = spec.hidden_size
        self.embed_tokens = nn.Embedding(spec.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        self.fc = nn.Linear(len(spec.aux_layer_ids) * spec.target_hidden_size, h, bias=False)
        self.hidden_norm = RMSNorm(h, spec.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(spec, i) for i in range(spec.num_hidden_layers))
        self.norm = RMSNorm(h, spec.rms_norm_eps)
        self.rotary = RotaryEmbedding(spec)
        self.register_buffer("head_weight", torch.zeros(spec.vocab_size, h), persistent=False)  # the target's
        self.register_buffer("d2t", torch.zeros(spec.vocab_size, dtype=torch.int64), persistent=False)
        self.register_buffer("t2d", torch.ones(spec.vocab_size, dtype=torch.bool), persistent=False)

    @property
    def draft_to_target(self) -> torch.Tensor:
        return torch.arange(self.spec.vocab_size, device=self.d2t.device)

    @classmethod
    def from_target(cls, spec: DraftSpec, target: nn.Module, seed: int = 0) -> "DFlashDraft":
        """A fresh draft with the target's embedding and lm_head."""
        draft = cls(spec)
        draft.init_weights(seed)
        draft.set_target(targets.embed_tokens(target).weight, targets.lm_head(target).weight)
        return draft

    def set_target(self, embed_weight: torch.Tensor, head_weight: torch.Tensor | None = None) -> None:
        """The target's embedding and lm_head, both frozen and never saved."""
        if head_weight is None:
            raise ValueError("a DFlash draft needs the target's lm_head")
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed_weight)
            self.head_weight.copy_(head_weight)

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(aux_hidden)

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
        attend,
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
        itself, in one forward -> (logits of the mask positions [B, S-1, V], the proposals; pre-norm hidden
        [B, S, H]). The block leaves nothing behind."""
        context = self.hidden_norm(features)
        cos, sin = self.rotary(feature_positions, context.dtype)
        for layer, entries in zip(self.layers, cache.layers):
            k, v = layer.self_attn.keys_values(context, cos, sin)  # type: ignore[union-attr, operator]  # DFlashLayers
            if entries:
                entries[0] = (torch.cat((entries[0][0], k), dim=2), torch.cat((entries[0][1], v), dim=2))
            else:
                entries.append((k, v))
        hidden = self.forward_hidden(block_ids, block_positions, [e[0] for e in cache.layers], None, full_attention)
        return self.logits(hidden[:, 1:]), hidden  # the anchor's own output proposes nothing

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [..., H] -> logits over the target's vocabulary [..., V] (the target's lm_head)."""
        x = self.norm(hidden)
        return F.linear(x, self.head_weight.to(x.dtype))
