"""Big-target arithmetic from a config.json alone: what the target weighs, what its store takes on disk, and what
training its draft takes in memory -- before any weight is read or any token is run.

    shape = target_shape(config)                    # sizes of the text backbone (a wrapper's text_config)
    shape.params, shape.active_params               # parameters in all, and those one token runs through (MoE)
    store_bytes_per_token(shape.hidden_size, 4, "bf16")   # one token's row in the store (layer ids: aux + N)
    training_memory(draft, token_budget=8192, ...)  # the draft's training: parameters, optimizer, target head,
                                                    # activations (an estimate, see the function)
    spool_bytes(bytes_per_token, 20_000, 60)        # online training: the spool bound for a 60 s engine lead

`draftsmith doctor --target DIR` prints these for a target; `draftsmith extract` refuses, in one line, a store the
disk cannot hold (extract/common.py). The published configs the tests check this against are in tests/families.py.
"""

from __future__ import annotations

import math
from typing import Literal, Protocol

from pydantic import BaseModel, Field

from draftsmith.core.errors import DraftsmithError

StorageDtype = Literal["bf16", "fp8"]
# Besides its states, a stored token keeps its input id (int32) and loss-mask flag (bool).
TOKEN_OVERHEAD_BYTES = 4 + 1
GiB = float(1 << 30)


class TargetShape(BaseModel):
    """The text backbone's sizes, read from config.json (a multimodal wrapper's `text_config`)."""

    hidden_size: int
    num_layers: int
    vocab_size: int
    params: int = Field(description="parameters of the text backbone with embedding and LM head")
    active_params: int = Field(description="parameters one token runs through (MoE: routed experts per token only)")
    attention: Literal["mha/gqa", "mla"]
    moe_layers: int = 0
    experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    tied_embeddings: bool = False


def _text(config: dict) -> dict:
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def _need(text: dict, *keys: str) -> list[int]:
    missing = [k for k in keys if text.get(k) is None]
    if missing:
        raise DraftsmithError(f"target config: no {', '.join(missing)}; the size arithmetic reads these from a "
                              "decoder-only config.json (text_config for a multimodal model)")
    return [int(text[k]) for k in keys]


def _attention_params(text: dict, hidden: int) -> tuple[int, str]:
    heads = int(text["num_attention_heads"])
    if "kv_lora_rank" in text:  # multi-head latent attention (DeepSeek-V2/V3, Kimi-K2)
        rope, nope = int(text["qk_rope_head_dim"]), int(text["qk_nope_head_dim"])
        v_dim, kv_rank = int(text["v_head_dim"]), int(text["kv_lora_rank"])
        q_rank = text.get("q_lora_rank")
        q = hidden * int(q_rank) + int(q_rank) * heads * (nope + rope) if q_rank else hidden * heads * (nope + rope)
        kv = hidden * (kv_rank + rope) + kv_rank * heads * (nope + v_dim)  # (their norms: see target_shape)
        return q + kv + heads * v_dim * hidden, "mla"
    head_dim = int(text.get("head_dim") or hidden // heads)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    params = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    if text.get("attention_bias"):
        params += heads * head_dim + 2 * kv_heads * head_dim
    if text.get("model_type", "").startswith("qwen3"):  # per-head q / k RMS norms
        params += 2 * head_dim
    return params, "mha/gqa"


def _gated_attention(text: dict) -> bool:
    return text.get("model_type") == "qwen3_next"


def _linear_attention_layers(text: dict, num_layers: int) -> list[int]:
    """A hybrid's gated delta-net layers: `layer_types` "linear_attention", else every layer but each
    full_attention_interval-th (Qwen3-Next)."""
    types = text.get("layer_types")
    if types:
        return [i for i, t in enumerate(types[:num_layers]) if t == "linear_attention"]
    interval = text.get("full_attention_interval")
    return [i for i in range(num_layers) if (i + 1) % int(interval) != 0] if interval else []


def _linear_attention_params(text: dict, hidden: int) -> int:
    """One gated delta-net layer (transformers' Qwen3NextGatedDeltaNet): in_proj_qkvz, in_proj_ba, the causal
    conv over q, k, v, dt_bias and A_log per value head, the gated norm, out_proj."""
    key_dim = int(text["linear_num_key_heads"]) * int(text["linear_key_head_dim"])
    value_heads = int(text["linear_num_value_heads"])
    value_dim = value_heads * int(text["linear_value_head_dim"])
    return (hidden * (2 * key_dim + 2 * value_dim) + hidden * 2 * value_heads
            + (2 * key_dim + value_dim) * int(text.get("linear_conv_kernel_dim") or 4) + 2 * value_heads
            + int(text["linear_value_head_dim"]) + value_dim * hidden)


def _moe_layer_ids(text: dict, num_layers: int) -> list[int]:
    """Which decoder layers are MoE: DeepSeek-style (first_k_dense_replace, moe_layer_freq) or Qwen-MoE-style
    (decoder_sparse_step, mlp_only_layers)."""
    if text.get("n_routed_experts"):
        first = int(text.get("first_k_dense_replace") or 0)
        freq = int(text.get("moe_layer_freq") or 1)
        return [i for i in range(num_layers) if i >= first and i % freq == 0]
    if text.get("num_experts") or text.get("num_local_experts"):
        step = int(text.get("decoder_sparse_step") or 1)
        dense = set(text.get("mlp_only_layers") or [])
        return [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]
    return []


def target_shape(config: dict) -> TargetShape:
    """Parameters and sizes of the target's text backbone from its config.json (no weights read)."""
    text = _text(config)
    hidden, num_layers, vocab, intermediate = _need(text, "hidden_size", "num_hidden_layers", "vocab_size",
                                                    "intermediate_size")
    _need(text, "num_attention_heads")
    attention, kind = _attention_params(text, hidden)
    attention_all = num_layers * attention
    if _gated_attention(text):  # Qwen3-Next: q_proj also writes the output gate
        attention_all += num_layers * hidden * int(text["num_attention_heads"]) * int(text["head_dim"])
    linear = _linear_attention_layers(text, num_layers)
    if linear:  # hybrids: these layers are gated delta-net (linear attention) instead
        attention_all += len(linear) * (_linear_attention_params(text, hidden) - attention
                                        - hidden * int(text["num_attention_heads"]) * int(text["head_dim"]))
    norms = 2 * hidden  # input_layernorm, post_attention_layernorm
    if kind == "mla":  # kv_a_layernorm, q_a_layernorm
        norms += int(text["kv_lora_rank"]) + int(text.get("q_lora_rank") or 0)
    moe = _moe_layer_ids(text, num_layers)
    experts = int(text.get("n_routed_experts") or text.get("num_experts") or text.get("num_local_experts") or 0)
    per_token = int(text.get("num_experts_per_tok") or 0)
    shared = int(text.get("n_shared_experts") or 0)
    expert_width = int(text.get("moe_intermediate_size") or intermediate)
    dense_mlp = 3 * hidden * intermediate
    expert_mlp = 3 * hidden * expert_width
    router = experts * hidden + (experts if text.get("topk_method") == "noaux_tc" else 0)
    shared_mlp = shared * expert_mlp
    if text.get("shared_expert_intermediate_size"):  # Qwen3-Next: one gated shared expert of its own width
        shared_mlp = 3 * hidden * int(text["shared_expert_intermediate_size"]) + hidden
    if text.get("model_type") == "gpt_oss":  # biased experts and router; biased o_proj and per-head attention sinks
        expert_mlp += 2 * expert_width + hidden  # gate_up bias [2I], down bias [H]
        router += experts
        attention_all += num_layers * (hidden + int(text["num_attention_heads"]))
    moe_all = experts * expert_mlp + shared_mlp + router
    moe_active = per_token * expert_mlp + shared_mlp + router
    layers_all = attention_all + num_layers * norms + (num_layers - len(moe)) * dense_mlp + len(moe) * moe_all
    layers_active = (attention_all + num_layers * norms + (num_layers - len(moe)) * dense_mlp
                     + len(moe) * moe_active)
    tied = bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    embeddings = vocab * hidden * (1 if tied else 2) + hidden  # embedding, LM head, final norm
    return TargetShape(hidden_size=hidden, num_layers=num_layers, vocab_size=vocab,
                       params=layers_all + embeddings, active_params=layers_active + embeddings, attention=kind,
                       moe_layers=len(moe), experts=experts if moe else 0, experts_per_token=per_token if moe else 0,
                       shared_experts=shared if moe else 0, tied_embeddings=tied)


def weight_bytes(params: int, bytes_per_param: float, tensor_parallel_size: int = 1) -> float:
    """Bytes of weights per device with the weights split evenly over `tensor_parallel_size` devices."""
    return params * bytes_per_param / max(1, tensor_parallel_size)


# --------------------------------------------------------------------------------------------------- the store


def state_bytes_per_token(hidden_size: int, num_layer_ids: int, dtype: StorageDtype) -> int:
    """One token's stored states: [L, H] in bf16, or fp8 e4m3 plus one float32 scale per layer."""
    if dtype == "bf16":
        return num_layer_ids * hidden_size * 2
    return num_layer_ids * hidden_size + 4 * num_layer_ids


def store_bytes_per_token(hidden_size: int, num_layer_ids: int, dtype: StorageDtype) -> int:
    """One token's whole row in the store: its states, input id and loss-mask flag."""
    return state_bytes_per_token(hidden_size, num_layer_ids, dtype) + TOKEN_OVERHEAD_BYTES


def store_bytes(tokens: int, hidden_size: int, num_layer_ids: int, dtype: StorageDtype, samples: int = 0) -> int:
    """Disk a store of `tokens` tokens takes (shard headers and per-sample offsets included as 16 bytes a sample)."""
    return tokens * store_bytes_per_token(hidden_size, num_layer_ids, dtype) + 16 * samples


# --------------------------------------------------------------------------------------------------- the spool

# Online training (`train --engine vllm`) reads its hidden states from a bounded spool of at most this many chunks:
# small stores, each holding the samples of a run of consecutive optimizer steps, at most spool_bytes / SPOOL_CHUNKS.
SPOOL_CHUNKS = 4


def spool_bytes(bytes_per_token: int, tokens_per_s: float, lead_s: float = 60.0) -> int:
    """The spool bound (`--spool-gb`) that lets the engines run `lead_s` seconds of the trainer's consumption
    ahead of it, the trainer reading `tokens_per_s` training tokens a second (all ranks together) of rows of
    `bytes_per_token` (`store_bytes_per_token`: the aux and last layers' states in the spool's dtype, input id and
    loss-mask flag).

    The engines may fill SPOOL_CHUNKS - 1 = 3 chunks ahead while the trainer reads the 4th, so the lead is 3/4 of
    the bound: bound = ceil(tokens_per_s * lead_s * bytes_per_token * 4 / 3). The bound must also hold 4 chunks of
    at least one optimizer step each (`min_spool_bytes`); take the larger of the two."""
    if tokens_per_s <= 0 or lead_s <= 0 or bytes_per_token <= 0:
        raise DraftsmithError(f"spool size: the rate ({tokens_per_s:g} tokens/s), lead ({lead_s:g} s) and bytes "
                              f"per token ({bytes_per_token}) must all be > 0")
    ahead = SPOOL_CHUNKS - 1
    return math.ceil(tokens_per_s * lead_s * bytes_per_token * SPOOL_CHUNKS / ahead)


def min_spool_bytes(bytes_per_token: int, tokens_per_step: int) -> int:
    """The smallest spool bound: SPOOL_CHUNKS chunks of one optimizer step each, `tokens_per_step` = token_budget x
    grad_accum x world tokens a step (a chunk never splits a step)."""
    return SPOOL_CHUNKS * tokens_per_step * bytes_per_token


def check_disk(needed: int, free: int, *, where: str, what: str) -> None:
    """Refuse, in one line, to start writing `needed` bytes where only `free` are left (a 2 % margin kept)."""
    if needed > free * 0.98:
        raise DraftsmithError(f"{where}: {what} needs {needed / GiB:,.1f} GiB but only {free / GiB:,.1f} GiB are "
                              "free there; free some space, write elsewhere (--output), store fp8 (--dtype fp8, "
                              "half of bf16) or extract fewer samples (--max-samples / --shard)")


# --------------------------------------------------------------------------------------------------- training


class DraftShape(Protocol):
    """What the memory estimate reads of a draft spec (train/model.py's DraftSpec has these fields)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int]


def draft_params(draft: DraftShape) -> int:
    """Trainable parameters of an EAGLE-3 draft: fc over the aux layers, its decoder layers (the first takes
    [embedding, features] = 2H into q/k/v), the final norm and the draft-vocabulary LM head. The token embedding
    is the target's, frozen (counted in `training_memory` as the target head)."""
    H, inner = draft.hidden_size, draft.intermediate_size
    q, kv = draft.num_attention_heads * draft.head_dim, draft.num_key_value_heads * draft.head_dim
    fc = len(draft.aux_layer_ids) * draft.target_hidden_size * H
    mlp = 3 * H * inner
    first = 2 * H * (q + 2 * kv) + q * H + mlp + 3 * H  # input_layernorm, hidden_norm, post_attention_layernorm
    later = H * (q + 2 * kv) + q * H + mlp + 2 * H
    return fc + first + (draft.num_hidden_layers - 1) * later + H + H * draft.draft_vocab_size


class TrainingMemory(BaseModel):
    """Bytes per training process (one GPU) for a draft, by part. An estimate: activations are counted per token
    and TTT step from the layer's widths, not measured; allocator slack and CUDA context come on top."""

    draft_params: int
    weights_and_optimizer: float = Field(description="fp32 master weights, gradients and AdamW's two moments")
    target_head: float = Field(description="the target's frozen embedding, final norm and LM head")
    activations: float = Field(description="saved activations, logits and target distributions at the token budget")
    total: float


def training_memory(draft: DraftShape, *, token_budget: int, ttt_steps: int = 7, activation_bytes: int = 2,
                    frozen_bytes: int = 2) -> TrainingMemory:
    """Memory one training process needs for `draft` at `token_budget` tokens per micro-batch.

    activations per token and TTT step: the layer's saved tensors (~10 H + 4 I values: norms, q/k/v, attention
    output, the MLP's gate/up/activation) in `activation_bytes`, plus draft-vocabulary logits and their gradient in
    float32; per token once: the target's distribution over the draft vocabulary (float32) and the stored aux
    features (bf16). `frozen_bytes`: 2 for the bf16 target head on a GPU, 4 for float32 on a CPU.
    """
    params = draft_params(draft)
    optimizer = params * (4 + 4 + 8)
    head = frozen_bytes * (2 * draft.vocab_size * draft.target_hidden_size + draft.target_hidden_size)
    per_step = activation_bytes * (10 * draft.hidden_size + 4 * draft.intermediate_size) + 8 * draft.draft_vocab_size
    features = 2 * len(draft.aux_layer_ids) * draft.target_hidden_size
    per_token = ttt_steps * per_step + 4 * draft.draft_vocab_size + features
    activations = float(token_budget * per_token)
    return TrainingMemory(draft_params=params, weights_and_optimizer=float(optimizer), target_head=float(head),
                          activations=activations, total=float(optimizer + head + activations))


class TrainingFit(BaseModel):
    """Whether one training process fits a GPU of a given size (`training_fit`)."""

    gpu_bytes: float
    usable_bytes: float = Field(description="what the estimate may take: the GPU less headroom for the CUDA "
                                "context and allocator slack")
    needed_bytes: float
    fits: bool
    max_token_budget: int = Field(description="the largest tokens per micro-batch that fit (0: not even the "
                                  "weights, optimizer and target head do)")


def training_fit(draft: DraftShape, gpu_bytes: float, *, token_budget: int, ttt_steps: int = 7,
                 headroom: float = 0.1) -> TrainingFit:
    """Whether `training_memory` at `token_budget` fits a GPU of `gpu_bytes`, keeping `headroom` (a fraction) for
    what the estimate leaves out, and the largest token budget that would (activations grow linearly with it)."""
    memory = training_memory(draft, token_budget=token_budget, ttt_steps=ttt_steps)
    usable = gpu_bytes * (1.0 - headroom)
    fixed = memory.weights_and_optimizer + memory.target_head
    per_token = memory.activations / token_budget
    max_budget = max(0, int((usable - fixed) // per_token)) if usable > fixed else 0
    return TrainingFit(gpu_bytes=gpu_bytes, usable_bytes=usable, needed_bytes=memory.total,
                       fits=memory.total <= usable, max_token_budget=max_budget)


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; binary units, three significant figures."""
    units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    k = 0 if n < 1024 else min(len(units) - 1, int(math.log(n, 1024)))
    value = n / 1024 ** k
    return f"{value:.0f} {units[k]}" if k == 0 else f"{value:.3g} {units[k]}"


def human_count(n: float) -> str:
    """8_030_261_248 -> '8.03B'."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(int(n))


__all__ = ["SPOOL_CHUNKS", "TargetShape", "TrainingFit", "TrainingMemory", "check_disk", "draft_params",
           "human_bytes", "human_count", "min_spool_bytes", "spool_bytes", "state_bytes_per_token", "store_bytes",
           "store_bytes_per_token", "target_shape", "training_fit", "training_memory", "weight_bytes"]
