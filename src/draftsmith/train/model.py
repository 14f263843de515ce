"""The EAGLE-3 draft model (vLLM `Eagle3LlamaForCausalLM` compatible weights).

Reads top to bottom: spec -> norm and rotary helpers -> attention -> MLP -> decoder layer -> the draft.

    features  = fc(cat(aux_1, aux_2, aux_3))                 # [B, T, 3H] -> [B, T, H], step 0 only
    layer 0   : x = cat(input_layernorm(embed(ids)), hidden_norm(h))   # [B, T, 2H] into q/k/v
                h = h + attn(x); h = h + mlp(post_attention_layernorm(h))
    layer i>0 : a plain pre-norm Llama layer over h
    logits    = lm_head(norm(h))                             # draft vocabulary; h (pre-norm) feeds the next step

State-dict names are vLLM's own module names: `embed_tokens.weight`, `fc.weight`, `layers.{i}.*`, `norm.weight`,
`lm_head.weight`, `d2t`, `t2d` (vLLM's loader maps the `midlayer.` of its files to `layers.0.`). The embedding is
the target's, frozen: `draft_tensors` leaves it out of everything saved, and it is reloaded from the target.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from draftsmith.config.methods import DEFAULT_METHOD
from draftsmith.core import hfcompat, targets
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.layers import check_layer_ids, check_servable_layer_ids
from draftsmith.train.attention import KVCache, cached_attention, naive_ttt_attention, ttt_attention

# The target's token embedding: part of the module, never of what is saved (checkpoints, exports).
EMBEDDING = "embed_tokens.weight"


class DraftSpec(BaseModel):
    """Everything that fixes the draft's shapes, named as in vLLM's / HF's Llama config; built from the target's
    config (`from_target_config`) and recorded in every checkpoint and export manifest."""

    model_config = ConfigDict(extra="forbid")

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int = Field(ge=1, description="the draft's decoder layers")
    rms_norm_eps: float
    hidden_act: Literal["silu"]
    max_position_embeddings: int
    rope_parameters: dict[str, Any] = Field(description="the target's RoPE, transformers 5 style")
    vocab_size: int = Field(description="the target's vocabulary (embedding rows, t2d length)")
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int] = Field(
        description="vLLM's layer ids (0 = embeddings, k = output of decoder layer "
        "k-1) in the order fc concatenates them; eagle_aux_hidden_state_layer_ids"
    )
    mask_token_id: int | None = Field(
        None,
        description="the target token id a parallel slot or a block's mask position reads (P-EAGLE's ptd_token_id, "
        "DFlash's dflash_config.mask_token_id: what vLLM embeds there); None: a draft with no such positions",
    )
    method: str = Field(
        DEFAULT_METHOD,
        description="the drafting method (draftsmith.train.methods): eagle3, peagle (parallel drafting) or dflash",
    )
    fc_norm: bool = Field(
        False,
        description="Eagle 3.1: an RMSNorm on each captured layer's states before fc (vLLM's config.json fc_norm)",
    )
    norm_output: bool = Field(
        False,
        description="Eagle 3.1: the next step reads the normed output, not the pre-norm one (vLLM's norm_output)",
    )
    block_size: int | None = Field(
        None,
        ge=2,
        description="a block drafter's block: the anchor (the last verified token) and block_size - 1 mask "
        "positions; vLLM proposes block_size - 1 tokens",
    )
    markov_rank: int | None = Field(
        None,
        ge=1,
        description="DSpark's Markov head rank (markov_w1 and markov_w2: [vocab, rank]); None: no Markov head",
    )

    @classmethod
    def from_target_config(
        cls, config: dict, draft_vocab_size: int, num_hidden_layers: int, aux_layer_ids: list[int]
    ) -> DraftSpec:
        """The draft for a target, from the target's config.json alone: its decoder-layer shapes, norm eps, RoPE
        and vocabulary (the draft vocabulary is clipped to it).

        Llama-like configs (Llama, Qwen3), MoE configs (`intermediate_size` is the dense MLP's), multi-head latent
        attention (DeepSeek-V3, Kimi-K2) and multimodal wrappers (`text_config`). Attention: the target's own head
        shape where it has a usable one (head_dim, else hidden_size / num_attention_heads, with its
        num_key_value_heads); an MLA config has none (its head_dim, when transformers writes one, is only the RoPE
        part of a latent head, and 7168 / 128 heads = 56 is a head size vLLM's CPU attention refuses), so the draft
        gets `draft_attention_shape(hidden_size)`. RoPE: the target's parameters (type, theta, scaling) applied to
        the draft's own head size -- for DeepSeek/Kimi the yarn of the target's 64-wide RoPE part on 128-wide draft
        heads; transformers (training, the reference decoder) and vLLM's Llama-EAGLE-3 layer compute the same
        tables from it (tests/test_families.py compares them). Aux layer ids vLLM could not serve the draft with
        are refused (`check_servable_layer_ids`).
        """
        text = config.get("text_config") or config
        missing = [
            k
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_attention_heads",
                "num_hidden_layers",
                "rms_norm_eps",
                "max_position_embeddings",
                "vocab_size",
            )
            if text.get(k) is None
        ]
        if missing:
            raise DraftsmithError(
                f"target config: no {', '.join(missing)}; the EAGLE-3 draft copies these from a "
                "Llama-like decoder config (text_config for a multimodal model)"
            )
        hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
        if text.get("hidden_act", "silu") != "silu":
            raise DraftsmithError(
                f"target config: hidden_act {text['hidden_act']!r}; the EAGLE-3 draft supports silu only"
            )
        if "kv_lora_rank" not in text and (text.get("head_dim") or hidden % heads == 0):
            kv_heads = int(text.get("num_key_value_heads") or heads)
            head_dim = int(text.get("head_dim") or hidden // heads)
        else:  # multi-head latent attention, or heads that do not divide the hidden size
            heads, kv_heads, head_dim = cls.draft_attention_shape(hidden)
        rope = hfcompat.rope_parameters_of(text)  # written by transformers 4 or 5
        rope.pop("partial_rotary_factor", None)  # the draft rotates its whole head (Qwen3-Next's target: 1/4)
        vocab = int(text["vocab_size"])
        check_layer_ids(list(aux_layer_ids), int(text["num_hidden_layers"]))
        check_servable_layer_ids(list(aux_layer_ids), config, "draft")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(text["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            num_hidden_layers=num_hidden_layers,
            rms_norm_eps=float(text["rms_norm_eps"]),
            hidden_act="silu",
            max_position_embeddings=int(text["max_position_embeddings"]),
            rope_parameters=rope,
            vocab_size=vocab,
            draft_vocab_size=min(draft_vocab_size, vocab),
            target_hidden_size=hidden,
            aux_layer_ids=[int(i) for i in aux_layer_ids],
        )

    @staticmethod
    def draft_attention_shape(hidden_size: int) -> tuple[int, int, int]:
        """(heads, KV heads, head_dim) of a draft whose target has no attention shape the draft can copy.

        head_dim 128 when hidden_size is a multiple of 128, else 64: head sizes every vLLM attention backend takes
        (CPU and GPU). heads = hidden_size / head_dim, so q and o stay hidden x hidden as in a Llama layer. KV heads:
        the largest divisor of heads up to 8 (grouped-query attention with Llama-3's 8 KV heads; with heads a multiple
        of 8, both split evenly over a tensor-parallel group of 8). DeepSeek-V3, Kimi-K2/K2.5 (hidden 7168): 56 heads
        x 128 with 8 KV heads, a seventh of full multi-head attention's K/V weights (the target's 128 or 64 heads
        would give 56- or 112-wide heads).
        """
        head_dim = 128 if hidden_size % 128 == 0 else 64
        if hidden_size % head_dim:
            raise DraftsmithError(
                f"target config: hidden_size {hidden_size} is not a multiple of 64, so the EAGLE-3 "
                "draft has no head size of its own (64 or 128) for it, and the config gives none to "
                "copy (head_dim, or num_attention_heads dividing hidden_size)"
            )
        heads = hidden_size // head_dim
        kv_heads = max(d for d in range(1, min(8, heads) + 1) if heads % d == 0)
        return heads, kv_heads, head_dim


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
        self.num_heads, self.num_kv_heads, self.head_dim = (
            spec.num_attention_heads,
            spec.num_key_value_heads,
            spec.head_dim,
        )
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
        return ttt_attention(q, keys, values, kernel=kv.kernel)
    if mode == "naive":
        return naive_ttt_attention(q, *kv.append(layer_idx, k, v))
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


class DecoderLayer(nn.Module):
    """Layer 0 reads cat(input_layernorm(embed), hidden_norm(h)) (2H) with residual h; later layers are plain Llama."""

    def __init__(self, spec: DraftSpec, layer_idx: int):
        super().__init__()
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.layer_idx = layer_idx
        self.first = first = layer_idx == 0
        self.input_layernorm = RMSNorm(h, eps)
        if first:
            self.hidden_norm = RMSNorm(h, eps)
        self.self_attn = Attention(spec, 2 * h if first else h)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(spec)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        mode: str,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """rows (training): the positions (of [B*T]) anything downstream reads; the MLP, position-wise, runs on those
        alone and the others keep the attention's output (nothing reads them)."""
        if self.first:
            x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)  # [B, T, 2H]
        else:
            x = self.input_layernorm(hidden)
        hidden = hidden + self.self_attn(x, cos, sin, cache, self.layer_idx, mode)
        if rows is None:
            return hidden + self.mlp(self.post_attention_layernorm(hidden))
        flat = hidden.flatten(0, 1)
        update = self.mlp(self.post_attention_layernorm(flat.index_select(0, rows)))
        return flat.index_add(0, rows, update).view_as(hidden)


def ttt_layer_call(
    layer: DecoderLayer,
    *inputs: *tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, KVCache, str],
    checkpointed: bool = False,
) -> torch.Tensor:
    """`layer(*inputs)` (embeds, hidden, cos, sin, cache, mode), optionally under activation checkpointing.

    Checkpointed, the layer's activations (projections, attention, MLP) are dropped after the forward and
    recomputed during the backward; only its inputs, its output and the (k, v) it appends to the cache are kept.
    The layer appends to its layer's entries in `cache`, a side effect a recomputation must not repeat, so the
    checkpointed call runs on a private cache holding this layer's earlier entries (the same tensors) and the
    new (k, v) is appended to the real cache afterwards. Only for modes whose cache grows by one entry per call
    ("ttt", "naive"); without grad there is nothing to save, so the call is plain.
    """
    if not (checkpointed and torch.is_grad_enabled()):
        return layer(*inputs)
    embeds, hidden, cos, sin, cache, mode = inputs
    if mode not in ("ttt", "naive"):
        raise ValueError(f"checkpointing a layer call needs a TTT cache (one entry per call), not mode {mode!r}")
    idx = layer.layer_idx
    earlier = [x for kv in cache.entries(idx) for x in kv]  # flat (k_0, v_0, k_1, v_1, ...)

    def run(
        embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *flat: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        private = cache.fork(idx, [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)])
        out = layer(embeds, hidden, cos, sin, private, mode)
        k, v = private.entries(idx)[-1]
        return out, k, v

    out, k, v = checkpoint(run, embeds, hidden, cos, sin, *earlier, use_reentrant=False)
    cache.append(idx, k, v)
    return out


# ---------------------------------------------------------------------------------------------- the draft


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


class Eagle3Draft(DraftModule):
    d2t: torch.Tensor  # buffers
    t2d: torch.Tensor

    def __init__(self, spec: DraftSpec):
        super().__init__(spec)
        h = spec.hidden_size
        if spec.fc_norm:  # Eagle 3.1: each captured layer's states normed before fc
            self.fc_norm = nn.ModuleList(
                RMSNorm(spec.target_hidden_size, spec.rms_norm_eps) for _ in spec.aux_layer_ids
            )
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_hidden_layers))
        self.norm = RMSNorm(h, spec.rms_norm_eps)
        self.lm_head = nn.Linear(h, spec.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(spec)
        if spec.mask_token_id is not None:  # P-EAGLE: the aux features every parallel slot reads (vLLM's mask_hidden)
            self.mask_hidden = nn.Parameter(torch.zeros(1, len(spec.aux_layer_ids) * spec.target_hidden_size))
        # d2t[i] = target_id(i) - i (what vLLM reads); t2d: which target ids are in the draft vocabulary.
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(spec.vocab_size, dtype=torch.bool))

    @classmethod
    def from_target(
        cls,
        spec: DraftSpec,
        target: nn.Module,
        draft_to_target: torch.Tensor,
        lm_head_init: str = "target",
        seed: int = 0,
    ) -> Eagle3Draft:
        """A fresh draft: frozen embedding copied from the target, lm_head from the target's draft-vocab rows."""
        draft = cls(spec)
        draft.init_weights(seed)
        draft.set_draft_vocab(draft_to_target)
        draft.set_target(targets.embed_tokens(target).weight)
        if lm_head_init == "target":
            draft.head_from_target(targets.lm_head(target).weight)
        return draft

    def set_target(self, embed_weight: torch.Tensor, head_weight: torch.Tensor | None = None) -> None:
        """The target's embedding (frozen, never saved); the head is the draft's own (its lm_head)."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed_weight)

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, num_aux * H_target] (aux layers concatenated in id order) -> [B, T, H]; Eagle 3.1 norms each
        layer's chunk first (vLLM's combine_hidden_states)."""
        if self.spec.fc_norm:
            chunks = aux_hidden.chunk(len(self.fc_norm), dim=-1)
            aux_hidden = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=False)], dim=-1)
        return self.fc(aux_hidden)

    def feedback(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the next step reads of this step's pre-norm output [..., H]: itself, or (Eagle 3.1, norm_output)
        the normed output the lm_head reads (vLLM's aux_output)."""
        return self.norm(hidden).to(hidden.dtype) if self.spec.norm_output else hidden

    def mask_features(self) -> torch.Tensor:
        """P-EAGLE: fc(mask_hidden) [1, H], the fused features of every parallel slot (vLLM fuses it the same way)."""
        return self.fuse(self.mask_hidden)

    def forward_hidden(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache | None = None,
        *,
        checkpointed: bool = False,
        rows: list[torch.Tensor | None] | None = None,
        mode: str = "decode",
    ) -> torch.Tensor:
        """One draft step up to the pre-norm hidden state [B, T, H] (what the next step reads). input_ids [B, T],
        hidden [B, T, H] (fused features or the previous step's output).

        cache: `KVCache(num_layers)` kept across calls (None: a fresh one). mode "ttt" (training), "naive" (the
        explicit-mask reference) or "decode" (the K/V cache grows along the sequence). checkpointed (training
        modes): each layer's activations are recomputed in the backward instead of kept (`ttt_layer_call`).
        rows (training, not checkpointed): per layer, the positions whose output is read downstream, or None.
        """
        if cache is None:
            cache = KVCache(len(self.layers))
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rotary(position_ids, hidden.dtype)
        for i, layer in enumerate(self.layers):
            if rows is not None and rows[i] is not None and not checkpointed:
                hidden = layer(embeds, hidden, cos, sin, cache, mode, rows[i])
            else:
                hidden = ttt_layer_call(layer, embeds, hidden, cos, sin, cache, mode, checkpointed=checkpointed)  # type: ignore[arg-type]  # self.layers holds DecoderLayers (a ModuleList yields Module)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [..., H] -> logits over the draft vocabulary [..., Vd]."""
        return self.lm_head(self.norm(hidden))

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache | None = None,
        mode: str = "decode",
        logits_to_keep: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step: (logits over the draft vocabulary [B, T, Vd], the hidden state [B, T, H] the next step
        reads: `feedback` of the pre-norm output). logits_to_keep > 0: logits of the last that many positions only
        (as in transformers)."""
        hidden = self.forward_hidden(input_ids, hidden, position_ids, cache, mode=mode)
        return self.logits(hidden[:, -logits_to_keep:]), self.feedback(hidden)


def draft_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a draft saves of its state dict: everything but the target's embedding."""
    return {name: tensor for name, tensor in state_dict.items() if name != EMBEDDING}
