"""The draft artefact's spec (`DraftSpec`). Plain pydantic: no torch."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from draftsmith.core import hfcompat
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.layers import check_layer_ids, check_servable_layer_ids
from draftsmith.methods import DEFAULT_METHOD, MethodName

# What a draft copies from its target's (text) config
REQUIRED: tuple[str, ...] = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers")
REQUIRED += ("rms_norm_eps", "max_position_embeddings", "vocab_size")


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
    method: MethodName = Field(
        DEFAULT_METHOD,
        description="the drafting method (draftsmith.methods): eagle3, eagle3.1, peagle (parallel drafting), dflash or "
        "dspark",
    )
    fc_norm: bool = Field(
        False,
        description="Eagle 3.1: an RMSNorm on each captured layer's states before fc (vLLM's config.json fc_norm)",
    )
    norm_output: bool = Field(
        False, description="Eagle 3.1: the next step reads the normed output, not the pre-norm one (vLLM's norm_output)"
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
        missing = [k for k in REQUIRED if text.get(k) is None]
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
