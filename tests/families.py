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
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu",
    },
    # Qwen/Qwen3-8B
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000, "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
    },
    # Qwen/Qwen3-30B-A3B
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000, "tie_word_embeddings": False,
        "hidden_act": "silu", "attention_bias": False,
    },
    # deepseek-ai/DeepSeek-V3 (its fp8 quantization_config left out: the tiny checkpoints are float32)
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc",
        "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5, "first_k_dense_replace": 3,
        "moe_layer_freq": 1, "vocab_size": 129280, "max_position_embeddings": 163840, "rms_norm_eps": 1e-06,
        "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
    },
    # moonshotai/Kimi-K2.5: Kimi-K2's text backbone (a DeepSeek-V3 with 384 experts, 64 heads, one dense layer)
    # in a multimodal wrapper; the vision tower is transformers' Kimi_K25VisionConfig default.
    "kimi_k25": {
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": {
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "hidden_size": 7168,
            "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
            "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 384,
            "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
            "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.827,
            "first_k_dense_replace": 1, "moe_layer_freq": 1, "vocab_size": 163840, "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-05, "rope_theta": 50000.0,
            "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
            "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
        },
        "vision_config": {"model_type": "kimi_k25_vision", "patch_size": 14, "hidden_size": 1152,
                          "num_hidden_layers": 27, "num_attention_heads": 16, "intermediate_size": 4304,
                          "merge_kernel_size": [2, 2]},
        "tie_word_embeddings": False,
    },
}

# What the tiny checkpoints change (vocab_size is the tokenizer's). Head sizes stay ones vLLM's CPU kernels take
# (>= 32; MLA: kv_lora_rank + qk_rope_head_dim = 576 exactly as published).
_TINY_DEEPSEEK = {
    "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64, "qk_nope_head_dim": 32, "v_head_dim": 32,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 2048,
}
TINY_OVERRIDES: dict[str, dict[str, Any]] = {
    "llama": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 2048},
    "qwen3": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 2048},
    "qwen3_moe": {"hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 4,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8,
                  "num_experts_per_tok": 2, "max_position_embeddings": 2048},
    # 8 experts in 2 groups, the best group kept: grouped routing as in V3, first layer dense, three MoE layers
    "deepseek_v3": {**_TINY_DEEPSEEK, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
                    "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 512,
                                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}},
    "kimi_k25": {"text_config": {**_TINY_DEEPSEEK,
                                 "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 512, "beta_fast": 32.0,
                                                  "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}},
                 "vision_config": {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                                   "intermediate_size": 128}},
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


@dataclass(frozen=True)
class TokenizerSpec:
    special_tokens: tuple[str, ...]
    bos: str
    eos: str
    pad: str
    chat_template: str


TOKENIZERS: dict[str, TokenizerSpec] = {
    "qwen3": TokenizerSpec(("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"),
                           bos="<|endoftext|>", eos="<|im_end|>", pad="<|endoftext|>", chat_template=QWEN3_TEMPLATE),
    "deepseek_v3": TokenizerSpec(("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>",
                                  "<｜Assistant｜>"), bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>",
                                 pad="<｜▁pad▁｜>", chat_template=DEEPSEEK_TEMPLATE),
    "kimi_k25": TokenizerSpec(("[BOS]", "[EOS]", "[PAD]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
                               "<|im_system|>", "<|im_middle|>", "<|media_pad|>"), bos="[BOS]", eos="<|im_end|>",
                              pad="[PAD]", chat_template=KIMI_TEMPLATE),
}
TOKENIZERS["qwen3_moe"] = TOKENIZERS["qwen3"]

# Files a checkpoint ships besides config, weights and tokenizer. vLLM builds Kimi-K2.5's multimodal processing
# info when it reads the config (even with language_model_only), which reads preprocessor_config.json: this is
# Kimi-K2.5's media_proc_cfg without the auto_map to its remote code (vLLM has its own processor for it).
EXTRA_FILES: dict[str, dict[str, Any]] = {
    "kimi_k25": {"preprocessor_config.json": {"media_proc_cfg": {
        "in_patch_limit": 16384, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "merge_kernel_size": 2, "fixed_output_tokens": None, "patch_limit_on_one_side": 512,
        "in_patch_limit_each_frame": 4096, "in_patch_limit_video": None, "sample_fps": 2.0,
        "max_num_frames_each_video": None, "temporal_merge_kernel_size": 4, "timestamp_mode": "hh:mm:ss.fff"}}},
}


def build_tokenizer(spec: TokenizerSpec, vocab_size: int = 320):
    """A real byte-level BPE fast tokenizer with the family's special tokens, trained on conftest's tiny corpus."""
    from conftest import _CORPUS
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(spec.special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=spec.bos, eos_token=spec.eos, pad_token=spec.pad,
                                   unk_token=None)
    fast.chat_template = spec.chat_template
    return fast


# ------------------------------------------------------------------------------------------- the builders

FAMILIES = ("llama", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k25")
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
    text.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    if "text_config" in config:
        media = tokenizer.convert_tokens_to_ids("<|media_pad|>")
        config.update(image_token_id=media, video_token_id=media, media_placeholder_token_id=media)


def unsupported(name: str) -> str | None:
    """Why the installed transformers cannot build the `name` family (it does not know the model type), else None:
    Kimi-K2.5's wrapper (kimi_k25) exists in transformers 5 only, so its tests skip under transformers 4.57."""
    from transformers import AutoConfig

    model_type = PUBLISHED[name]["model_type"]
    try:
        AutoConfig.for_model(model_type)
    except (ValueError, KeyError):
        return f"this transformers has no {model_type!r} model type (needed to build the tiny {name} target)"
    return None


def build(name: str, path: Path, *, seed: int = 0, head_scale: float | None = None) -> Path:
    """Save the tiny random `name` target with its tokenizer as an HF directory at `path`.

    `head_scale` multiplies the lm_head so random logits are far from flat (greedy tokens then do not flip on
    last-bit differences, e.g. a tensor-parallel all-reduce order).
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

        build_tiny_target(path, num_layers=TINY_OVERRIDES["llama"]["num_hidden_layers"],
                          hidden_size=TINY_OVERRIDES["llama"]["hidden_size"], seed=seed)
        if head_scale:
            _scale_head(path, head_scale)
        return path
    spec = TOKENIZERS[name]
    tokenizer = build_tokenizer(spec)
    config_dict = tiny_config(name, len(tokenizer))
    _token_ids(tokenizer, config_dict)
    architecture = config_dict["architectures"][0]
    fields = {k: v for k, v in config_dict.items() if k not in ("architectures", "model_type")}
    config = AutoConfig.for_model(config_dict["model_type"], **fields)
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if "text_config" in config_dict else AutoModelForCausalLM  # a wrapper
    model = auto.from_config(config, dtype=torch.float32).eval()
    _randomise(model)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    _write_config(path, config_dict, architecture)
    if "text_config" in config_dict:
        _published_weight_names(path)
    for file, content in EXTRA_FILES.get(name, {}).items():
        (path / file).write_text(json.dumps(content, indent=2))
    if head_scale:
        _scale_head(path, head_scale)
    return path


def _randomise(model: torch.nn.Module) -> None:
    """Give zero-initialised parameters that vLLM reads (DeepSeek's router bias) small random values, so a wrong
    mapping of them would show in the states."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                param.normal_(0.0, 0.02)


def _write_config(path: Path, published_shape: dict[str, Any], architecture: str) -> None:
    """config.json as transformers saved it, with the published architecture name and routing keys.

    transformers names Kimi-K2.5's class `Kimi_K25ForConditionalGeneration`; the checkpoint (and vLLM's registry)
    say `KimiK25ForConditionalGeneration`. Keys transformers' DeepseekV3Config does not keep (`topk_method`,
    `scoring_func` ...) are written back as published, since vLLM reads them.
    """
    file = path / "config.json"
    saved = json.loads(file.read_text())
    saved["architectures"] = [architecture]
    for section in (None, "text_config"):
        ours = published_shape if section is None else published_shape.get(section)
        theirs = saved if section is None else saved.get(section)
        if not isinstance(ours, dict) or not isinstance(theirs, dict):
            continue
        for key in ("topk_method", "scoring_func", "moe_layer_freq"):
            if key in ours:
                theirs.setdefault(key, ours[key])
    file.write_text(json.dumps(saved, indent=2, sort_keys=True))


def _published_weight_names(path: Path) -> None:
    """Kimi-K2.5's tensor names as its checkpoint has them (`language_model.model.layers.N`, `mm_projector.*`).

    transformers reverses its load-time renaming on save, including a `blocks -> layers` rule meant for the vision
    tower, so it writes the text layers as `language_model.model.blocks.N`, which vLLM does not know. transformers
    loads both spellings to the same model.
    """
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    state = load_file(str(file))
    renamed = {k.replace("language_model.model.blocks.", "language_model.model.layers.")
               .replace("model.mm_projector.", "mm_projector."): v for k, v in state.items()}
    save_file(renamed, str(file), metadata={"format": "pt"})


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


__all__ = ["FAMILIES", "MLA_FAMILIES", "PUBLISHED", "TINY_OVERRIDES", "build", "build_tokenizer", "target_dir",
           "tiny_config", "unsupported"]
