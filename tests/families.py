"""The target families draftsmith is tested on: tiny random checkpoints shaped like the real models.

Each family keeps the structure of the model people serve and shrinks only its sizes:

    llama        LlamaForCausalLM (tests/conftest.py's tiny target)
    qwen3        Qwen3ForCausalLM: GQA with per-head q/k RMS norms (Qwen3-8B)
    qwen3_moe    Qwen3MoeForCausalLM: every layer MoE, top-k routing, no shared expert (Qwen3-30B-A3B)
    deepseek_v3  DeepseekV3ForCausalLM: multi-head latent attention (kv_lora_rank 512, qk_rope_head_dim 64 as
                 published: vLLM's MLA kernels take no other head size), dense first layer, then MoE with a shared
                 expert and noaux_tc grouped routing (DeepSeek-V3)
    kimi_k25     KimiK25ForConditionalGeneration: Kimi-K2's DeepSeek-V3 text backbone inside a multimodal wrapper
                 (vision tower + projector), as Kimi-K2.5 ships
    gpt_oss      GptOssForCausalLM: sliding-window and full attention layers alternating, attention sinks, biased
                 q/k/v/o, MoE with top-k routing and a clamped SwiGLU, YaRN rope; harmony chat format (gpt-oss-20b)
    qwen3_next   Qwen3NextForCausalLM: hybrid attention, three gated delta-net (linear attention) layers to one
                 gated full attention layer with partial rope, MoE with a gated shared expert (Qwen3-Next-80B-A3B)

`PUBLISHED[name]` is the real model's config.json (the fields that shape the computation, as published); the tiny
config is that dict with widths, depth, experts and vocabulary overridden (`TINY_OVERRIDES`), so everything else
(routing method, norms, rope scaling, layer pattern) is the real one. Every family has a real byte-level BPE
tokenizer with the family's own special tokens and a faithful, simplified chat template.

    path = families.target_dir("deepseek_v3")     # built once per process (a pytest session), then reused
    path = families.build("qwen3", some_dir, head_scale=50.0)   # a fresh one (head_scale: decisive greedy tokens)

Importable from tests (`from families import ...`) and from benchmarks (put tests/ on sys.path first).
"""

from __future__ import annotations

import atexit
import copy
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# ------------------------------------------------------------------------------------------- published configs

PUBLISHED: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-3.1-8B-Instruct
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    },
    # Qwen/Qwen3-8B
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
    },
    # Qwen/Qwen3-30B-A3B
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
    },
    # deepseek-ai/DeepSeek-V3 (its fp8 quantization_config left out: the tiny checkpoints are float32)
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "vocab_size": 129280,
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
    },
    # moonshotai/Kimi-K2.5: Kimi-K2's text backbone (a DeepSeek-V3 with 384 experts, 64 heads, one dense layer)
    # in a multimodal wrapper; the vision tower is transformers' Kimi_K25VisionConfig default.
    "kimi_k25": {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "kimi_k2",
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "num_hidden_layers": 61,
            "num_attention_heads": 64,
            "num_key_value_heads": 64,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "n_routed_experts": 384,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "n_group": 1,
            "topk_group": 1,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.827,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "vocab_size": 163840,
            "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-05,
            "rope_theta": 50000.0,
            "rope_scaling": {
                "type": "yarn",
                "factor": 64.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            "tie_word_embeddings": False,
            "hidden_act": "silu",
            "attention_bias": False,
        },
        "vision_config": {
            "model_type": "kimi_k25_vision",
            "patch_size": 14,
            "hidden_size": 1152,
            "num_hidden_layers": 27,
            "num_attention_heads": 16,
            "intermediate_size": 4304,
            "merge_kernel_size": [2, 2],
        },
        "tie_word_embeddings": False,
    },
    # openai/gpt-oss-20b (its mxfp4 quantization_config left out: the tiny checkpoints are float32). The window is
    # on the even layers, as layer_types says and as vLLM's gpt_oss.py assumes (`layer_idx % 2 == 0`, it does not
    # read layer_types).
    "gpt_oss": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "experts_per_token": 4,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "swiglu_limit": 7.0,
        "vocab_size": 201088,
        "max_position_embeddings": 131072,
        "initial_context_length": 4096,
        "rms_norm_eps": 1e-05,
        "rope_theta": 150000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "attention_bias": True,
        "router_aux_loss_coef": 0.9,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    },
    # Qwen/Qwen3-Next-80B-A3B-Instruct: layer i is full attention when (i + 1) % full_attention_interval == 0,
    # gated delta-net otherwise; every layer MoE (512 experts, top-10) plus a shared expert
    "qwen3_next": {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "hidden_size": 2048,
        "intermediate_size": 5120,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_hidden_layers": 48,
        "full_attention_interval": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "partial_rotary_factor": 0.25,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000000,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
    },
}

# What the tiny checkpoints change (vocab_size is the tokenizer's). Head sizes stay ones vLLM's CPU kernels take
# (>= 32; MLA: kv_lora_rank + qk_rope_head_dim = 576 exactly as published).
_TINY_DEEPSEEK = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 2048,
}
TINY_OVERRIDES: dict[str, dict[str, Any]] = {
    "llama": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 2048,
    },
    "qwen3": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 2048,
    },
    "qwen3_moe": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 2048,
    },
    # 8 experts in 2 groups, the best group kept: grouped routing as in V3, first layer dense, three MoE layers
    "deepseek_v3": {
        **_TINY_DEEPSEEK,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4,
            "original_max_position_embeddings": 512,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    },
    "kimi_k25": {
        "text_config": {
            **_TINY_DEEPSEEK,
            "rope_scaling": {
                "type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 512,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        },
        "vision_config": {
            "hidden_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 128,
        },
        # the projector's input norm is as wide as the vision tower (transformers' default, 1152, is the
        # published tower's; vLLM sizes it from vision_config.hidden_size)
        "projection_hidden_size": 64,
    },
    # 8 experts, top-2; a 32-token window (shorter than the test samples, so it masks something); YaRN rescaled
    # to the tiny context as for DeepSeek
    "gpt_oss": {
        "hidden_size": 128,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "experts_per_token": 2,
        "sliding_window": 32,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "max_position_embeddings": 2048,
        "initial_context_length": 512,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 512,
        },
    },
    # three delta-net layers then one full attention layer (the published interval); two value heads per key head
    # as published; 8 experts, top-2. Delta-net head sizes 64: vLLM's CPU kernel takes 64 and 128, not 32 (and runs
    # only in bfloat16: "CPU GDN attention requires BF16.").
    "qwen3_next": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 2048,
    },
}

# ------------------------------------------------------------------------------------------- tokenizers, templates

# Qwen3's template, simplified: ChatML; an assistant turn's reasoning is kept only in the last turn, and the
# generation prompt opens the assistant turn (the model writes its own <think> block).
QWEN3_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{% set content = message['content'] %}"
    "{% if '</think>' in content and not loop.last %}{% set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{% endif %}"
    "{{ '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# DeepSeek-V3's template, simplified: BOS, the system prompt bare, then <｜User｜>/<｜Assistant｜> turns.
DEEPSEEK_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% endif %}{% endfor %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)
# Kimi-K2's template, simplified: a default system turn when there is none; role markers with <|im_middle|>.
KIMI_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>' }}"
    "{% endif %}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|im_system|>system<|im_middle|>' }}"
    "{% elif message['role'] == 'user' %}{{ '<|im_user|>user<|im_middle|>' }}"
    "{% else %}{{ '<|im_assistant|>assistant<|im_middle|>' }}{% endif %}"
    "{{ message['content'] + '<|im_end|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_assistant|>assistant<|im_middle|>' }}{% endif %}"
)
# gpt-oss's harmony template, simplified: `<|start|>role<|message|>content<|end|>` turns (no default system or
# developer turn, no analysis channel, no tools); an assistant turn answers on the final channel, and a
# conversation that ends with an assistant turn ends with <|return|> (the end of generation, what the model learns
# to emit; earlier assistant turns keep <|end|>). The generation prompt is `<|start|>assistant`: the model writes
# its channel itself.
HARMONY_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|start|>assistant<|channel|>final<|message|>' + message['content'] }}"
    "{% if loop.last and not add_generation_prompt %}{{ '<|return|>' }}{% else %}{{ '<|end|>' }}{% endif %}"
    "{% else %}{{ '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}"
)


@dataclass(frozen=True)
class TokenizerSpec:
    special_tokens: tuple[str, ...]
    bos: str
    eos: str
    pad: str
    chat_template: str


TOKENIZERS: dict[str, TokenizerSpec] = {
    "qwen3": TokenizerSpec(
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"),
        bos="<|endoftext|>",
        eos="<|im_end|>",
        pad="<|endoftext|>",
        chat_template=QWEN3_TEMPLATE,
    ),
    "deepseek_v3": TokenizerSpec(
        ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>", "<｜Assistant｜>"),
        bos="<｜begin▁of▁sentence｜>",
        eos="<｜end▁of▁sentence｜>",
        pad="<｜▁pad▁｜>",
        chat_template=DEEPSEEK_TEMPLATE,
    ),
    "kimi_k25": TokenizerSpec(
        (
            "[BOS]",
            "[EOS]",
            "[PAD]",
            "<|im_end|>",
            "<|im_user|>",
            "<|im_assistant|>",
            "<|im_system|>",
            "<|im_middle|>",
            "<|media_pad|>",
        ),
        bos="[BOS]",
        eos="<|im_end|>",
        pad="[PAD]",
        chat_template=KIMI_TEMPLATE,
    ),
    "gpt_oss": TokenizerSpec(
        (
            "<|startoftext|>",
            "<|endoftext|>",
            "<|return|>",
            "<|constrain|>",
            "<|channel|>",
            "<|start|>",
            "<|end|>",
            "<|message|>",
            "<|call|>",
        ),
        bos="<|startoftext|>",
        eos="<|return|>",
        pad="<|endoftext|>",
        chat_template=HARMONY_TEMPLATE,
    ),
}
TOKENIZERS["qwen3_moe"] = TOKENIZERS["qwen3_next"] = TOKENIZERS["qwen3"]

# Files a checkpoint ships besides config, weights and tokenizer. vLLM builds Kimi-K2.5's multimodal processing
# info when it reads the config (even with language_model_only), which reads preprocessor_config.json: Kimi-K2.5's
# media_proc_cfg and, as the published checkpoint has it, an auto_map to the image processor it ships as remote
# code. vLLM >= 0.28 brings its own processor for it; vLLM 0.16 loads the remote one (trust_remote_code=True even for
# text prompts), here a stand-in (REMOTE_CODE).
EXTRA_FILES: dict[str, dict[str, Any]] = {
    "kimi_k25": {
        "preprocessor_config.json": {
            "media_proc_cfg": {
                "in_patch_limit": 16384,
                "patch_size": 14,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
                "merge_kernel_size": 2,
                "fixed_output_tokens": None,
                "patch_limit_on_one_side": 512,
                "in_patch_limit_each_frame": 4096,
                "in_patch_limit_video": None,
                "sample_fps": 2.0,
                "max_num_frames_each_video": None,
                "temporal_merge_kernel_size": 4,
                "timestamp_mode": "hh:mm:ss.fff",
            },
            "auto_map": {"AutoImageProcessor": "kimi_k25_vision_processing.KimiK25VisionProcessor"},
        }
    },
}
# Remote code a checkpoint ships, from tests/data/<family>/: Kimi-K2.5's image processor (a stand-in that sizes
# media as vLLM asks and returns zero pixels: text prompts only).
REMOTE_CODE: dict[str, tuple[str, ...]] = {"kimi_k25": ("kimi_k25_vision_processing.py",)}


def build_tokenizer(spec: TokenizerSpec, vocab_size: int = 320):
    """A real byte-level BPE fast tokenizer with the family's special tokens, trained on conftest's tiny corpus."""
    from conftest import _CORPUS
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(spec.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=spec.bos, eos_token=spec.eos, pad_token=spec.pad, unk_token=None
    )
    fast.chat_template = spec.chat_template
    return fast


# ------------------------------------------------------------------------------------------- the builders

FAMILIES = ("llama", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k25", "gpt_oss", "qwen3_next")
MLA_FAMILIES = ("deepseek_v3", "kimi_k25")


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def tiny_config(name: str, vocab_size: int) -> dict[str, Any]:
    """The published config with the tiny sizes (and the tokenizer's vocabulary)."""
    config = _merge(PUBLISHED[name], TINY_OVERRIDES[name])
    (config.get("text_config") or config)["vocab_size"] = vocab_size
    return config


def _token_ids(tokenizer, config: dict[str, Any]) -> None:
    text = config.get("text_config") or config
    text.update(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    if "text_config" in config:
        media = tokenizer.convert_tokens_to_ids("<|media_pad|>")
        config.update(image_token_id=media, video_token_id=media, media_placeholder_token_id=media)


def unsupported(name: str) -> str | None:
    """Why the installed transformers cannot build the `name` family (it does not know the model type), else None:
    Kimi-K2.5's wrapper (kimi_k25) exists in transformers 5 only, so its tests skip under transformers 4.57
    (gpt_oss came in 4.55, qwen3_next in 4.57)."""
    from transformers import AutoConfig

    model_type = PUBLISHED[name]["model_type"]
    try:
        AutoConfig.for_model(model_type)
    except (ValueError, KeyError):
        return f"this transformers has no {model_type!r} model type (needed to build the tiny {name} target)"
    return None


def build(
    name: str, path: Path, *, seed: int = 0, head_scale: float | None = None, overrides: dict[str, Any] | None = None
) -> Path:
    """Save the tiny random `name` target with its tokenizer as an HF directory at `path`.

    `head_scale` multiplies the lm_head so random logits are far from flat (greedy tokens then do not flip on
    last-bit differences, e.g. a tensor-parallel all-reduce order). `overrides` changes the tiny config further
    (merged like TINY_OVERRIDES, e.g. {"n_group": 1, "topk_group": 1}: DeepSeek-V3 with Kimi-K2's routing).
    """
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
    )

    path = Path(path)
    reason = unsupported(name)
    if reason:
        import pytest

        pytest.skip(reason)
    if name == "llama":
        from conftest import build_tiny_target

        build_tiny_target(
            path,
            num_layers=TINY_OVERRIDES["llama"]["num_hidden_layers"],
            hidden_size=TINY_OVERRIDES["llama"]["hidden_size"],
            seed=seed,
        )
        if head_scale:
            _scale_head(path, head_scale)
        return path
    spec = TOKENIZERS[name]
    tokenizer = build_tokenizer(spec)
    config_dict = _merge(tiny_config(name, len(tokenizer)), overrides or {})
    _token_ids(tokenizer, config_dict)
    architecture = config_dict["architectures"][0]
    fields = {k: v for k, v in config_dict.items() if k not in ("architectures", "model_type")}
    config = AutoConfig.for_model(config_dict["model_type"], **fields)
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if "text_config" in config_dict else AutoModelForCausalLM  # a wrapper
    model = auto.from_config(config, dtype=torch.float32).eval()
    _randomise(model, name)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    _write_config(path, config_dict, architecture)
    _portable_tokenizer_config(path)
    if "text_config" in config_dict:
        _published_weight_names(path)
    for file, content in EXTRA_FILES.get(name, {}).items():
        (path / file).write_text(json.dumps(content, indent=2))
    for file in REMOTE_CODE.get(name, ()):
        shutil.copyfile(Path(__file__).parent / "data" / name / file, path / file)
    if head_scale:
        _scale_head(path, head_scale)
    return path


# Parameters transformers initialises to zero that vLLM reads, by name suffix: DeepSeek's router bias (every
# family that has one), gpt-oss's attention and expert biases (its gate_up bias interleaves gate and up as the
# weight does).
_ZERO_INITIALISED: dict[str, tuple[str, ...]] = {"gpt_oss": ("_proj.bias", "_proj_bias")}


def _randomise(model: torch.nn.Module, family: str) -> None:
    """Give zero-initialised parameters that vLLM reads small random values, so a wrong mapping of them would show
    in the states."""
    suffixes = ("e_score_correction_bias", *_ZERO_INITIALISED.get(family, ()))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(suffixes):
                param.normal_(0.0, 0.02)


def _write_config(path: Path, published_shape: dict[str, Any], architecture: str) -> None:
    """config.json as transformers saved it, with the published architecture name and routing keys.

    transformers names Kimi-K2.5's class `Kimi_K25ForConditionalGeneration`; the checkpoint (and vLLM's registry)
    say `KimiK25ForConditionalGeneration`. Keys transformers' DeepseekV3Config does not keep (`topk_method`,
    `scoring_func` ...) are written back as published, since vLLM reads them. So are a wrapper's text `rope_theta`
    and `rope_scaling`, which transformers 5 saves as `rope_parameters` only: vLLM 0.16 reads Kimi-K2.5's text
    config with transformers 4.57's DeepseekV3Config, which would take the default theta and no YaRN (transformers 5
    reads both spellings alike).
    """
    file = path / "config.json"
    saved = json.loads(file.read_text())
    saved["architectures"] = [architecture]
    for section in (None, "text_config"):
        ours = published_shape if section is None else published_shape.get(section)
        theirs = saved if section is None else saved.get(section)
        if not isinstance(ours, dict) or not isinstance(theirs, dict):
            continue
        for key in ("topk_method", "scoring_func", "moe_layer_freq") + (
            ("rope_theta", "rope_scaling") if section else ()
        ):
            if key in ours:
                theirs.setdefault(key, ours[key])
    file.write_text(json.dumps(saved, indent=2, sort_keys=True))


def _published_weight_names(path: Path) -> None:
    """Kimi-K2.5's tensor names as its checkpoint has them (`language_model.model.layers.N`, `mm_projector.*`,
    `vision_tower.patch_embed.*`).

    transformers reverses its load-time renaming on save, including a `blocks -> layers` rule meant for the vision
    tower, so it writes the text layers as `language_model.model.blocks.N`, and the vision tower's patch embedding
    as `vision_tower.encoder.patch_embed.*`; vLLM knows neither. transformers loads both spellings to the same model.
    """
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    state = load_file(str(file))
    renamed = {
        k.replace("language_model.model.blocks.", "language_model.model.layers.")
        .replace("model.mm_projector.", "mm_projector.")
        .replace("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."): v
        for k, v in state.items()
    }
    save_file(renamed, str(file), metadata={"format": "pt"})


def _portable_tokenizer_config(path: Path) -> None:
    """tokenizer_config.json naming the class every transformers >= 4.57 reads: transformers 5 saves its fast
    tokenizer as `TokenizersBackend`, a name 4.57 (vLLM 0.11-0.19's) does not know, and a checkpoint built in the
    main venv is read by the release venvs' vLLM (tests/test_vllm_release_engines.py). Both load the same
    tokenizer.json."""
    file = path / "tokenizer_config.json"
    saved = json.loads(file.read_text())
    if saved.get("tokenizer_class") == "TokenizersBackend":
        saved["tokenizer_class"] = "PreTrainedTokenizerFast"
        file.write_text(json.dumps(saved, indent=2, sort_keys=True))


def _scale_head(path: Path, factor: float) -> None:
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    state = load_file(str(file))
    names = [k for k in state if k.endswith("lm_head.weight")]
    assert names, f"{path}: no lm_head.weight to scale"
    for k in names:
        state[k] = state[k] * factor
    save_file(state, str(file), metadata={"format": "pt"})


_CACHE: dict[tuple[str, int, float | None], Path] = {}
_ROOT: list[Path] = []


def target_dir(name: str, *, seed: int = 0, head_scale: float | None = None) -> Path:
    """The tiny `name` target, built the first time it is asked for in this process and reused after."""
    key = (name, seed, head_scale)
    if key not in _CACHE:
        if not _ROOT:
            _ROOT.append(Path(tempfile.mkdtemp(prefix="draftsmith-families-")))
            atexit.register(shutil.rmtree, _ROOT[0], ignore_errors=True)
        tag = f"{name}-s{seed}" + (f"-h{head_scale:g}" if head_scale else "")
        _CACHE[key] = build(name, _ROOT[0] / tag, seed=seed, head_scale=head_scale)
    return _CACHE[key]


__all__ = [
    "FAMILIES",
    "MLA_FAMILIES",
    "PUBLISHED",
    "TINY_OVERRIDES",
    "build",
    "build_tokenizer",
    "target_dir",
    "tiny_config",
    "unsupported",
]
