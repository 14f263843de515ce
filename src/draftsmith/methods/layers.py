"""What every draft module is built of: the norm, RoPE, attention and MLP of a Llama layer, the module base every
method's draft extends (`DraftModule`: its spec, the target's frozen embedding, the init and the strict load), and
what a draft saves of its state dict (`draft_tensors`).

State-dict names are vLLM's own module names: `embed_tokens.weight`, `fc.weight`, `layers.{i}.*`, `norm.weight`,
`lm_head.weight`, `d2t`, `t2d`. The embedding is the target's, frozen: `draft_tensors` leaves it out of everything
saved, and it is reloaded from the target.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from draftsmith.core import hfcompat
from draftsmith.core.errors import DraftsmithError
from draftsmith.methods.attention import KVCache, cached_attention, naive_ttt_attention, ttt_attention
from draftsmith.methods.spec import DraftSpec

# The target's token embedding: part of the module, never of what is saved (checkpoints, exports).
EMBEDDING = "embed_tokens.weight"


# ---------------------------------------------------------------------------------------------- norm and RoPE


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))  # bf16 normed in fp32; fp64 (the parity tests) stays
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inverse_frequencies(spec: DraftSpec) -> tuple[torch.Tensor, float]:
    """inv_freq [head_dim/2] and the cos/sin scale, from the target's RoPE parameters."""
    rope = spec.rope_parameters
    rope_type = rope.get("rope_type", "default")
    dim = spec.head_dim
    if rope_type == "default":
        theta = float(rope.get("rope_theta", 10000.0))
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)).float(), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise DraftsmithError(f"target RoPE type {rope_type!r} is not supported by the draft")
    hf = LlamaConfig(
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        head_dim=dim,
        max_position_embeddings=spec.max_position_embeddings,
        **hfcompat.rope_config_kwargs(LlamaConfig, rope),
    )
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf, None)
    return inv_freq.float(), float(scale)


class RotaryEmbedding(nn.Module):
    inv_freq: torch.Tensor

    def __init__(self, spec: DraftSpec):
        super().__init__()
        inv_freq, self.scale = rope_inverse_frequencies(spec)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D]; cos/sin [B, T, D]."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


# ---------------------------------------------------------------------------------------------- attention


class Attention(nn.Module):
    def __init__(self, spec: DraftSpec, input_size: int):
        super().__init__()
        self.num_heads, self.num_kv_heads = spec.num_attention_heads, spec.num_key_value_heads
        self.head_dim = spec.head_dim
        self.q_proj = nn.Linear(input_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, spec.hidden_size, bias=False)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # [B, Hq, T, D]
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer_idx: int, mode: str
    ) -> torch.Tensor:
        """cache: this layer's (k, v) at layer_idx; mode "ttt": one entry per TTT step; "decode": one growing
        entry."""
        return self.output(_attend(*self.project(x, cos, sin), cache, layer_idx, mode))

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """The heads' outputs [B, Hq, T, D] through o_proj -> [B, T, H]."""
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


@torch.compiler.disable
def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVCache, layer_idx: int, mode: str) -> torch.Tensor:
    """This step's k, v into layer `layer_idx`'s cache, and q's attention over it. Never traced into a compiled
    layer (`--compile`): the attention brings its own compiled kernel (flex) or autograd function (chunked), and in
    the layer's graph the cache's length and the kernels' per-length code would make dynamo compile a graph per TTT
    step and per sequence length, until its recompile limit sends the layer back to eager. The layer passes the
    cache object through without reading it, so its graph guards on none of it."""
    if mode == "ttt":
        keys, values = kv.append(layer_idx, k, v)
        return ttt_attention(q, keys, values, kernel=kv.kernel, tree=kv.tree)
    if mode == "naive":
        return naive_ttt_attention(q, *kv.append(layer_idx, k, v), tree=kv.tree)
    k, v = kv.extend(layer_idx, k, v)
    return cached_attention(q, k, v)


# ---------------------------------------------------------------------------------------------- MLP and layer


class MLP(nn.Module):
    def __init__(self, spec: DraftSpec):
        super().__init__()
        h, i = spec.hidden_size, spec.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftModule(nn.Module):
    """What every method's draft module shares: its spec, the target's frozen embedding (never saved), the
    initialisation and the strict load of its own tensors."""

    spec: DraftSpec
    embed_tokens: nn.Embedding
    d2t: torch.Tensor  # buffers: d2t [draft_vocab] int64 offsets, t2d [vocab] bool
    t2d: torch.Tensor
    lm_head: nn.Linear  # a head of its own (a DFlash draft over the target's whole vocabulary has none)

    def __init__(self, spec: DraftSpec):
        """The spec, the target's embedding (frozen) and fc over the captured layers: every draft's first modules."""
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        self.fc = nn.Linear(len(spec.aux_layer_ids) * spec.target_hidden_size, spec.hidden_size, bias=False)

    @property
    def head(self) -> torch.Tensor:
        """[Vd, H] the weight the logits read: the draft's own lm_head."""
        return self.lm_head.weight

    def init_weights(self, seed: int = 0) -> None:
        """Small normal init for trainable weights, ones for norms (the Llama convention)."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            with torch.no_grad():
                if "norm" in name:  # every RMSNorm's weight (fc_norm.{i}.weight included)
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)

    def set_draft_vocab(self, draft_to_target: torch.Tensor) -> None:
        """draft_to_target: sorted target ids [draft_vocab] -> fills d2t and t2d."""
        ids = torch.as_tensor(draft_to_target, dtype=torch.int64, device=self.d2t.device)
        if ids.numel() != self.spec.draft_vocab_size:
            raise ValueError(f"draft vocabulary has {ids.numel()} ids, the spec says {self.spec.draft_vocab_size}")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def head_from_target(self, head: torch.Tensor) -> None:
        """The draft's own lm_head from the target's lm_head `head` [V, H]: its rows of the draft vocabulary."""
        with torch.no_grad():
            self.lm_head.weight.copy_(head[self.draft_to_target.to(head.device)].float())

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[draft_vocab] the target id of each draft id (d2t[i] = target_id(i) - i)."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def load_draft_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load the draft's own tensors (`draft_tensors` of a state dict: all of it but the target's embedding,
        which stays as it is), strictly."""
        self.load_state_dict({**tensors, EMBEDDING: self.embed_tokens.weight}, strict=True)


def draft_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a draft saves of its state dict: everything but the target's embedding."""
    return {name: tensor for name, tensor in state_dict.items() if name != EMBEDDING}
