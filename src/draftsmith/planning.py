"""`draftsmith doctor --target`: what a target's store and its draft's training will cost, from its config.json
alone (no weights read): the text backbone, weights per GPU, the store per token and for a data set, the online
spool for a training rate, the draft and its training memory, whether it fits a GPU. The draft's shapes are the
trainer's own (`DraftSpec.from_target_config`), so this module loads the trainer's model code (torch): doctor
loads it only when a target is given."""

from __future__ import annotations

import math

from draftsmith.config import ExtractConfig, TrainConfig
from draftsmith.core import sizing
from draftsmith.core.layers import resolve_layer_ids
from draftsmith.core.target_config import text_config
from draftsmith.methods.eagle3 import Eagle3Options
from draftsmith.methods.spec import DraftSpec


def sizing_rows(  # noqa: PLR0913 - doctor's sizing options, as its CLI names them
    config: dict,
    *,
    tokens: int | None = None,
    distinct_tokens: int | None = None,
    tensor_parallel_size: int = 1,
    token_budget: int | None = None,
    gpu_memory_gb: float | None = None,
    online_rate: float | None = None,
    spool_lead_s: float = 60.0,
) -> list[tuple[str, str]]:
    """The big-target arithmetic for one config, as (what, how much) rows; the layers, draft vocabulary and TTT
    steps are the stages' defaults. `gpu_memory_gb`: one more row, whether the draft's training fits one GPU of that
    many GiB. `online_rate` (training tokens/s, all ranks): the spool `train --engine vllm` needs for a
    `spool_lead_s` engine lead."""
    shape = sizing.target_shape(config)
    layer_ids = resolve_layer_ids(ExtractConfig().aux_layer_ids, shape.num_layers)
    token_budget = token_budget or TrainConfig().token_budget
    rows = target_rows(config, shape, tensor_parallel_size, gpu_memory_gb)
    per_token = {d: sizing.store_bytes_per_token(shape.hidden_size, len(layer_ids), d) for d in ("bf16", "fp8")}
    rows += store_rows(shape, layer_ids, per_token, tokens, distinct_tokens)
    rows += spool_rows(per_token, online_rate, spool_lead_s, tokens=tokens, tokens_per_step=token_budget)
    rows += draft_rows(config, layer_ids[:-1], token_budget, gpu_memory_gb)
    return rows


def target_rows(
    config: dict, shape: sizing.TargetShape, tensor_parallel_size: int, gpu_memory_gb: float | None
) -> list[tuple[str, str]]:
    """The target itself: its text backbone, its parameters, its weights (per GPU at a tensor parallel size), as
    stored, and the GPUs vLLM loads it on."""
    tp = max(1, tensor_parallel_size)
    moe = (
        f"; MoE: {shape.moe_layers} of {shape.num_layers} layers, {shape.experts} experts, "
        f"{shape.experts_per_token} per token" + (f" + {shape.shared_experts} shared" if shape.shared_experts else "")
        if shape.moe_layers
        else ""
    )

    def weights(devices: int) -> str:
        return ", ".join(
            f"{name} {sizing.human_bytes(sizing.weight_bytes(shape.params, size, devices))}"
            for name, size in (("bf16", 2), ("fp8", 1), ("int4 (group 32)", 0.5 + 2 / 32))
        )

    rows = [
        (
            "text backbone",
            f"{shape.num_layers} layers, hidden {shape.hidden_size}, vocabulary {shape.vocab_size}, "
            f"{'multi-head latent' if shape.attention == 'mla' else 'GQA'} attention{moe}",
        ),
        ("parameters", f"{sizing.human_count(shape.params)} ({sizing.human_count(shape.active_params)} per token)"),
        ("weights", weights(1) + (f"; per GPU at TP={tp}: " + weights(tp) if tp > 1 else "")),
    ]
    stored = sizing.stored_weight_bytes(config, shape)
    if "quantization_config" in config or "quantization_config" in text_config(config):
        unread = "" if stored.read else " (its quantization_config is not one this arithmetic reads: bf16 assumed)"
        rows.append(("weights as stored", f"{sizing.human_bytes(stored.bytes)}: {stored.how}{unread}"))
    rows.append(("vLLM loads it on", vllm_fit_line(stored.bytes, gpu_memory_gb)))
    return rows


def store_rows(
    shape: sizing.TargetShape,
    layer_ids: list[int],
    per_token: dict[str, int],
    tokens: int | None,
    distinct: int | None = None,
) -> list[tuple[str, str]]:
    """The hidden-state store: its layer ids, its bytes per token, and its size for `tokens` (one context per
    generation), for the `distinct` tokens of samples sharing prefixes (what extract stores), and for a million."""
    aux = layer_ids[:-1]
    rows = [
        ("store layer ids", f"{','.join(map(str, layer_ids))} (aux {','.join(map(str, aux))}, then N)"),
        (
            "store bytes per token",
            f"bf16 {per_token['bf16']:,}, fp8 {per_token['fp8']:,} ({len(layer_ids)} layers x {shape.hidden_size})",
        ),
    ]

    def size(count: int) -> str:  # bf16, fp8
        return ", ".join(f"{dtype} {sizing.human_bytes(count * n)}" for dtype, n in per_token.items())

    for count in ([tokens] if tokens else []) + [1_000_000]:
        rows.append((f"store for {count:,} tokens", size(count)))
        if count == tokens and distinct and distinct < count:
            less = f"what extract writes ({count / distinct:.1f}x less)"
            rows.append((f"store for {distinct:,} distinct tokens", f"{size(distinct)}: {less}"))
    return rows


def draft_rows(config: dict, aux: list[int], token_budget: int, gpu_memory_gb: float | None) -> list[tuple[str, str]]:
    """The default method's draft for this target: its parameters, its training memory, whether it fits a GPU."""
    options = Eagle3Options()  # the default method's (train --method eagle3)
    draft = DraftSpec.from_target_config(config, options.draft_vocab_size, options.default_num_layers, aux)
    ttt_steps = options.depths
    memory = sizing.training_memory(draft, token_budget=token_budget, ttt_steps=ttt_steps)
    rows = [
        (
            "draft",
            f"{sizing.human_count(memory.draft_params)} trainable parameters (1 layer, hidden "
            f"{draft.hidden_size}, {draft.num_attention_heads} heads x {draft.head_dim}, "
            f"{draft.num_key_value_heads} KV heads, MLP {draft.intermediate_size}, draft vocabulary "
            f"{draft.draft_vocab_size})",
        ),
        (
            "draft training memory (estimate)",
            f"{sizing.human_bytes(memory.total)} per GPU at {token_budget} tokens per "
            f"micro-batch, {ttt_steps} TTT steps: weights + AdamW "
            f"{sizing.human_bytes(memory.weights_and_optimizer)}, target embedding + head (bf16) "
            f"{sizing.human_bytes(memory.target_head)}, activations {sizing.human_bytes(memory.activations)}",
        ),
    ]
    if gpu_memory_gb is not None:
        fit = training_fit_line(draft, gpu_memory_gb, token_budget=token_budget, ttt_steps=ttt_steps)
        rows.append((f"fits one {gpu_memory_gb:g} GiB GPU?", fit))
    return rows


GPU_KINDS_GIB = {"80 GiB (H100, A100)": 80.0, "141 GiB (H200)": 141.0}


def vllm_fit_line(weights_bytes: float, gpu_memory_gb: float | None) -> str:
    """Per GPU kind, the smallest tensor parallel size at which vLLM holds the weights (sizing.vllm_fits: 0.9 of the
    GPU, 4 GiB left for activations and a KV cache)."""
    kinds = dict(GPU_KINDS_GIB)
    if gpu_memory_gb is not None:
        kinds = {f"{gpu_memory_gb:g} GiB": gpu_memory_gb, **kinds}
    parts = []
    for name, gib in kinds.items():
        sizes = [(tp, *sizing.vllm_fits(weights_bytes, tp, gib * sizing.GiB)) for tp in (1, 2, 4, 8)]
        tp, fits, per, usable = next((s for s in sizes if s[1]), sizes[-1])  # else TP=8's
        where = f"TP={tp}" if fits else "not at TP=8"
        parts.append(f"{name}: {where} ({sizing.human_bytes(per)} per GPU of {sizing.human_bytes(usable)})")
    return "; ".join(parts) + " (0.9 of each GPU, 4 GiB kept for activations and the KV cache)"


def spool_rows(
    per_token: dict[str, int], online_rate: float | None, lead_s: float, *, tokens: int | None, tokens_per_step: int
) -> list[tuple[str, str]]:
    """The online spool rows: the `--spool-gb` for `online_rate` training tokens/s with the engines `lead_s` seconds
    ahead (`sizing.spool_bytes`, never below 4 chunks of one step of `tokens_per_step`), in bf16 and fp8, beside the
    offline store of `tokens`; without a rate, one row saying how to ask. `per_token`: the store row by dtype."""
    if online_rate is None:
        return [("online spool", "--online-rate TOKENS_PER_S: the spool `train --engine vllm` needs")]
    floor = {d: sizing.min_spool_bytes(b, tokens_per_step) for d, b in per_token.items()}
    bound = {d: max(sizing.spool_bytes(b, online_rate, lead_s), floor[d]) for d, b in per_token.items()}
    flag = {d: f"{math.ceil(b / sizing.GiB * 10) / 10:g}" for d, b in bound.items()}  # GiB, rounded up
    line = (
        f"{sizing.human_bytes(bound['bf16'])} bf16 / {sizing.human_bytes(bound['fp8'])} fp8: --spool-gb "
        f"{flag['bf16']} (--spool-dtype fp8: --spool-gb {flag['fp8']})"
    )
    if tokens:
        line += (
            f"; vs the offline store of {tokens:,} tokens: {sizing.human_bytes(tokens * per_token['bf16'])} "
            f"bf16 / {sizing.human_bytes(tokens * per_token['fp8'])} fp8"
        )
    least = (
        f"{sizing.SPOOL_CHUNKS} chunks of one optimizer step, {tokens_per_step:,} tokens a step (--token-budget "
        f"x --grad-accum x ranks): {sizing.human_bytes(floor['bf16'])} bf16 / "
        f"{sizing.human_bytes(floor['fp8'])} fp8"
    )
    return [
        (f"online spool ({_number(online_rate)} tok/s, {_number(lead_s)} s lead)", line),
        ("online spool floor", least),
    ]


def _number(x: float) -> str:
    """20000.0 -> '20,000', 2.5 -> '2.5' (never an exponent)."""
    return f"{x:,.0f}" if x == int(x) else f"{x:,.2f}".rstrip("0")


def training_fit_line(draft, gpu_memory_gb: float, *, token_budget: int, ttt_steps: int) -> str:
    """One line: whether the draft's training (one process) fits a GPU of `gpu_memory_gb` GiB (`sizing.training_fit`,
    10 % kept for the CUDA context and allocator slack), and the largest --token-budget that does."""
    fit = sizing.training_fit(draft, gpu_memory_gb * sizing.GiB, token_budget=token_budget, ttt_steps=ttt_steps)
    usage = (
        f"{sizing.human_bytes(fit.needed_bytes)} of the {sizing.human_bytes(fit.usable_bytes)} usable "
        f"(90 %) at --token-budget {token_budget}"
    )
    if fit.max_token_budget < 16:
        return (
            f"no: {usage}, and the weights, AdamW state and target head alone do not fit; use a GPU with more "
            "memory or shard the draft (--distributed fsdp2 under torchrun)"
        )
    most = f"--token-budget up to {fit.max_token_budget:,} fits"
    if fit.fits:
        return f"yes: {usage}; {most}"
    return f"no: {usage}; {most} (raise --grad-accum to keep the batch)"


__all__ = ["GPU_KINDS_GIB", "sizing_rows", "spool_rows", "training_fit_line", "vllm_fit_line"]
