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
import re
from typing import Literal, Protocol

from pydantic import BaseModel, Field

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.target_config import text_config

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
    # the parameters of each kind of module, for sizing a checkpoint that stores them differently (quantisation)
    kinds: dict[str, int] = Field(
        default_factory=dict,
        description="routed experts, shared experts, attention, "
        "dense MLP, LM head, embedding -> parameters (norms and routers aside)",
    )


def _need(text: dict, *keys: str) -> list[int]:
    missing = [k for k in keys if text.get(k) is None]
    if missing:
        raise DraftsmithError(
            f"target config: no {', '.join(missing)}; the size arithmetic reads these from a "
            "decoder-only config.json (text_config for a multimodal model)"
        )
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
    return (
        hidden * (2 * key_dim + 2 * value_dim)
        + hidden * 2 * value_heads
        + (2 * key_dim + value_dim) * int(text.get("linear_conv_kernel_dim") or 4)
        + 2 * value_heads
        + int(text["linear_value_head_dim"])
        + value_dim * hidden
    )


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
    text = text_config(config)
    hidden, num_layers, vocab, intermediate = _need(
        text, "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size"
    )
    _need(text, "num_attention_heads")
    attention, kind = _attention_params(text, hidden)
    attention_all = num_layers * attention
    if text.get("model_type") == "qwen3_next":  # Qwen3-Next: q_proj also writes the output gate
        attention_all += num_layers * hidden * int(text["num_attention_heads"]) * int(text["head_dim"])
    linear = _linear_attention_layers(text, num_layers)
    if linear:  # hybrids: these layers are gated delta-net (linear attention) instead
        attention_all += len(linear) * (
            _linear_attention_params(text, hidden)
            - attention
            - hidden * int(text["num_attention_heads"]) * int(text["head_dim"])
        )
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
    layers_active = attention_all + num_layers * norms + (num_layers - len(moe)) * dense_mlp + len(moe) * moe_active
    tied = bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    embeddings = vocab * hidden * (1 if tied else 2) + hidden  # embedding, LM head, final norm
    kinds = {
        "routed experts": len(moe) * experts * expert_mlp,
        "shared experts": len(moe) * shared_mlp,
        "attention": attention_all,
        "dense MLP": (num_layers - len(moe)) * dense_mlp,
        "LM head": 0 if tied else vocab * hidden,
        "embedding": vocab * hidden,
    }
    return TargetShape(
        hidden_size=hidden,
        num_layers=num_layers,
        vocab_size=vocab,
        params=layers_all + embeddings,
        active_params=layers_active + embeddings,
        attention=kind,
        moe_layers=len(moe),
        experts=experts if moe else 0,
        experts_per_token=per_token if moe else 0,
        shared_experts=shared if moe else 0,
        tied_embeddings=tied,
        kinds={k: v for k, v in kinds.items() if v},
    )


# A module of each kind as DeepSeek-V3 / Kimi-K2 / Llama checkpoints name it: what a quantization_config's `ignore`
# list (names, or "re:" patterns) is matched against.
_KIND_NAMES = {
    "routed experts": "model.layers.3.mlp.experts.0.down_proj",
    "shared experts": "model.layers.3.mlp.shared_experts.down_proj",
    "attention": "model.layers.3.self_attn.o_proj",
    "dense MLP": "model.layers.0.mlp.down_proj",
    "LM head": "lm_head",
}


class StoredWeights(BaseModel):
    """The target's weights as its checkpoint stores them (and vLLM loads them)."""

    bytes: float
    how: str = Field(description="per kind of module, how it is stored and what it takes")
    read: bool = Field(description="False: a quantization_config this arithmetic does not read (bf16 assumed)")


def _ignored(name: str, ignore: list) -> bool:
    return any(name == p or (isinstance(p, str) and p.startswith("re:") and re.fullmatch(p[3:], name)) for p in ignore)


def _bytes_per_weight(config: dict) -> tuple[dict[str, float], str] | None:
    """Bytes per weight of each quantised kind and how, from quantization_config; None where it is not read."""
    q = config.get("quantization_config") or text_config(config).get("quantization_config")
    if not isinstance(q, dict):
        return {}, ""
    method = q.get("quant_method")
    if method == "compressed-tensors":
        groups = [g for g in (q.get("config_groups") or {}).values() if "Linear" in (g.get("targets") or [])]
        weights = (groups[0].get("weights") or {}) if len(groups) == 1 else {}
        bits, group = weights.get("num_bits"), weights.get("group_size")
        if not isinstance(bits, int):
            return None
        per = bits / 8 + (
            (2 + (0 if weights.get("symmetric", True) else 1)) / group
            if weights.get("strategy") == "group" and isinstance(group, int)
            else 0
        )
        how = f"{weights.get('type', 'int')}{bits}" + (f" (group {group}, bf16 scales)" if group else "")
        ignore = q.get("ignore") or []
        return {k: per for k, name in _KIND_NAMES.items() if not _ignored(name, ignore)}, how
    if method == "fp8" and isinstance(q.get("weight_block_size"), list):  # DeepSeek-V3: every Linear but the head
        b1, b2 = q["weight_block_size"]
        per = 1 + 4 / (b1 * b2)
        return {k: per for k in _KIND_NAMES if k != "LM head"}, f"fp8 (blocks {b1}x{b2}, fp32 scales)"
    return None


def stored_weight_bytes(config: dict, shape: TargetShape | None = None) -> StoredWeights:
    """What the weights take as stored: the kinds a quantization_config covers (compressed-tensors int groups with
    bf16 scales, Kimi-K2.5's int4 routed experts; DeepSeek-V3's block fp8) at their bytes per weight, bf16 the rest.
    `shape`: the config's target_shape, where the caller has it."""
    shape = shape or target_shape(config)
    read = _bytes_per_weight(config)
    per_kind, how = read if read is not None else ({}, "")
    quantised = sum(n * per_kind[k] for k, n in shape.kinds.items() if k in per_kind)
    rest = shape.params - sum(n for k, n in shape.kinds.items() if k in per_kind)
    parts = []
    if per_kind:
        names = [k for k in shape.kinds if k in per_kind]
        parts.append(f"{', '.join(names)} {how} {human_bytes(quantised)}")
    parts.append(f"{'the rest' if per_kind else 'all'} bf16 {human_bytes(2 * rest)}")
    return StoredWeights(bytes=quantised + 2 * rest, how="; ".join(parts), read=read is not None)


def vllm_fits(
    weights_bytes: float,
    tensor_parallel_size: int,
    gpu_bytes: float,
    memory_fraction: float = 0.9,
    headroom: float = 4 * GiB,
) -> tuple[bool, float, float]:
    """Whether vLLM loads weights of `weights_bytes` over `tensor_parallel_size` GPUs of `gpu_bytes` each: (fits,
    weights per GPU, what vLLM may use of one GPU less `headroom` for activations and a KV cache at all)."""
    per_gpu = weights_bytes / max(1, tensor_parallel_size)
    usable = gpu_bytes * memory_fraction - headroom
    return per_gpu <= usable, per_gpu, usable


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
        raise DraftsmithError(
            f"spool size: the rate ({tokens_per_s:g} tokens/s), lead ({lead_s:g} s) and bytes "
            f"per token ({bytes_per_token}) must all be > 0"
        )
    ahead = SPOOL_CHUNKS - 1
    return math.ceil(tokens_per_s * lead_s * bytes_per_token * SPOOL_CHUNKS / ahead)


def min_spool_bytes(bytes_per_token: int, tokens_per_step: int) -> int:
    """The smallest spool bound: SPOOL_CHUNKS chunks of one optimizer step each, `tokens_per_step` = token_budget x
    grad_accum x world tokens a step (a chunk never splits a step)."""
    return SPOOL_CHUNKS * tokens_per_step * bytes_per_token


def check_disk(needed: int, free: int, *, where: str, what: str) -> None:
    """Refuse, in one line, to start writing `needed` bytes where only `free` are left (a 2 % margin kept)."""
    if needed > free * 0.98:
        raise DraftsmithError(
            f"{where}: {what} needs {needed / GiB:,.1f} GiB but only {free / GiB:,.1f} GiB are "
            "free there; free some space, write elsewhere (--output), store fp8 (--dtype fp8, "
            "half of bf16) or extract fewer samples (--max-samples / --shard)"
        )


# --------------------------------------------------------------------------------------------------- training


class DraftShape(Protocol):
    """What the memory estimate reads of a draft spec (methods/spec.py's DraftSpec has these fields)."""

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


def training_memory(
    draft: DraftShape, *, token_budget: int, ttt_steps: int = 7, activation_bytes: int = 2, frozen_bytes: int = 2
) -> TrainingMemory:
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
    return TrainingMemory(
        draft_params=params,
        weights_and_optimizer=float(optimizer),
        target_head=float(head),
        activations=activations,
        total=float(optimizer + head + activations),
    )


class TrainingFit(BaseModel):
    """Whether one training process fits a GPU of a given size (`training_fit`)."""

    gpu_bytes: float
    usable_bytes: float = Field(
        description="what the estimate may take: the GPU less headroom for the CUDA context and allocator slack"
    )
    needed_bytes: float
    fits: bool
    max_token_budget: int = Field(
        description="the largest tokens per micro-batch that fit (0: not even the "
        "weights, optimizer and target head do)"
    )


def training_fit(
    draft: DraftShape, gpu_bytes: float, *, token_budget: int, ttt_steps: int = 7, headroom: float = 0.1
) -> TrainingFit:
    """Whether `training_memory` at `token_budget` fits a GPU of `gpu_bytes`, keeping `headroom` (a fraction) for
    what the estimate leaves out, and the largest token budget that would (activations grow linearly with it)."""
    memory = training_memory(draft, token_budget=token_budget, ttt_steps=ttt_steps)
    usable = gpu_bytes * (1.0 - headroom)
    fixed = memory.weights_and_optimizer + memory.target_head
    per_token = memory.activations / token_budget
    max_budget = max(0, int((usable - fixed) // per_token)) if usable > fixed else 0
    return TrainingFit(
        gpu_bytes=gpu_bytes,
        usable_bytes=usable,
        needed_bytes=memory.total,
        fits=memory.total <= usable,
        max_token_budget=max_budget,
    )


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; binary units, three significant figures."""
    units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    k = 0 if n < 1024 else min(len(units) - 1, int(math.log(n, 1024)))
    value = n / 1024**k
    return f"{value:.0f} {units[k]}" if k == 0 else f"{value:.3g} {units[k]}"


def human_count(n: float) -> str:
    """8_030_261_248 -> '8.03B'."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(int(n))
