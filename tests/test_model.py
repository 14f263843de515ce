"""The EAGLE-3 draft: shapes, names, initialisation from the target, RoPE/layers against transformers' Llama."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.core import hfcompat, targets
from draftsmith.core.errors import DraftsmithError
from draftsmith.methods.attention import KVCache
from draftsmith.methods.eagle3.modeling import Eagle3Draft
from draftsmith.methods.layers import EMBEDDING, draft_tensors, rope_inverse_frequencies
from draftsmith.methods.spec import DraftSpec


def _spec(**kw) -> DraftSpec:
    base = dict(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=1,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        target_hidden_size=32,
        vocab_size=50,
        draft_vocab_size=20,
        aux_layer_ids=[1, 2, 3],
    )
    base.update(kw)
    return DraftSpec(**base)


def test_spec_from_target_config(tiny_target_dir):
    spec = DraftSpec.from_target_config(json.loads((tiny_target_dir / "config.json").read_text()), 100000, 2, [1, 2, 4])
    assert spec.hidden_size == 64 and spec.num_attention_heads == 4 and spec.num_key_value_heads == 2
    assert spec.head_dim == 16 and spec.intermediate_size == 128 and spec.num_hidden_layers == 2
    assert spec.draft_vocab_size == spec.vocab_size == 320  # clipped to the target vocabulary
    assert spec.rms_norm_eps == 1e-5 and spec.max_position_embeddings == 2048  # the target's, no defaults
    assert spec.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert spec.aux_layer_ids == [1, 2, 4] and spec.target_hidden_size == 64


# Published config.json files (the fields that shape a draft; MoE routing, quantization etc. left out).
LLAMA_3_1_8B = {
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
    "hidden_act": "silu",
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}
QWEN3_8B = {
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
    "hidden_act": "silu",
}
QWEN3_30B_A3B = {
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
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "hidden_act": "silu",
}
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "hidden_act": "silu",
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}
KIMI_K2_5 = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "text_config": {
        **DEEPSEEK_V3,
        "model_type": "kimi_k2",
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "vocab_size": 163840,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-05,
        "rope_theta": 50000.0,
    },
    "vision_config": {"model_type": "kimi_k25_vision", "hidden_size": 1152, "num_attention_heads": 16},
}


@pytest.mark.parametrize(
    "config, expected",
    [
        (
            LLAMA_3_1_8B,
            dict(
                hidden_size=4096,
                intermediate_size=14336,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=128,
                vocab_size=128256,
                rms_norm_eps=1e-5,
                rope_type="llama3",
            ),
        ),
        (
            QWEN3_8B,
            dict(
                hidden_size=4096,
                intermediate_size=12288,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=128,
                vocab_size=151936,
                rms_norm_eps=1e-6,
                rope_type="default",
            ),
        ),
        # MoE: the dense MLP size, not an expert's
        (
            QWEN3_30B_A3B,
            dict(
                hidden_size=2048,
                intermediate_size=6144,
                num_attention_heads=32,
                num_key_value_heads=4,
                head_dim=128,
                vocab_size=151936,
                rms_norm_eps=1e-6,
                rope_type="default",
            ),
        ),
        # MLA: no head shape to copy (7168 / 128 heads = 56, a size vLLM's CPU attention refuses): the draft's own,
        # 128-wide heads, hidden / 128 of them, 8 KV heads
        (
            DEEPSEEK_V3,
            dict(
                hidden_size=7168,
                intermediate_size=18432,
                num_attention_heads=56,
                num_key_value_heads=8,
                head_dim=128,
                vocab_size=129280,
                rms_norm_eps=1e-6,
                rope_type="yarn",
            ),
        ),
        # as transformers saves it: its head_dim is qk_rope_head_dim, the RoPE part of a head, not a head size
        (
            {**DEEPSEEK_V3, "head_dim": 64, "num_key_value_heads": 128},
            dict(head_dim=128, num_attention_heads=56, num_key_value_heads=8),
        ),
        (
            KIMI_K2_5,
            dict(
                hidden_size=7168,
                num_attention_heads=56,
                num_key_value_heads=8,
                head_dim=128,
                vocab_size=163840,
                rms_norm_eps=1e-5,
                max_position_embeddings=262144,
                rope_type="yarn",
            ),
        ),
        # no head_dim and heads that do not divide the hidden size: the draft's own shape too (64-wide heads here)
        (
            {**QWEN3_8B, "head_dim": None, "hidden_size": 4160, "num_attention_heads": 30},
            dict(head_dim=64, num_attention_heads=65, num_key_value_heads=5),
        ),
    ],
    ids=["llama-3.1", "qwen3", "qwen3-moe", "deepseek-v3", "deepseek-v3-transformers", "kimi-k2.5", "odd-heads"],
)
def test_spec_from_published_target_configs(config, expected):
    spec = DraftSpec.from_target_config(config, 32000, 1, [2, 20, 27])
    got = spec.model_dump()
    got["rope_type"] = spec.rope_parameters["rope_type"]
    assert {k: got[k] for k in expected} == expected
    assert spec.target_hidden_size == spec.hidden_size and spec.draft_vocab_size == 32000
    inv_freq, _ = rope_inverse_frequencies(spec)  # the RoPE the draft runs, from the target's parameters
    assert inv_freq.shape == (spec.head_dim // 2,) and torch.isfinite(inv_freq).all()
    with torch.device("meta"):  # the whole draft builds from the spec (on the meta device: no memory)
        draft = Eagle3Draft(spec)
    assert draft.layers[0].self_attn.q_proj.weight.shape == (
        spec.num_attention_heads * spec.head_dim,
        2 * spec.hidden_size,
    )


@pytest.mark.parametrize(
    "change, match",
    [
        ({"hidden_size": None}, r"^target config: no hidden_size; .*text_config"),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu'.*silu only"),
        (
            {"head_dim": None, "hidden_size": 4100, "num_attention_heads": 30},
            r"hidden_size 4100 is not a multiple of 64, so the EAGLE-3 draft has no head size",
        ),
        # vLLM serves MLA targets' aux states from before each layer: no layer id 0 for their drafts
        (
            {**DEEPSEEK_V3, "num_hidden_layers": 61, "aux_layer_ids": [0, 30, 58]},
            r"^draft: aux layer ids \[0, 30, 58\] include 0 \(the embeddings\), which vLLM cannot hand an EAGLE-3 draft of "
            r"DeepseekV3ForCausalLM .*e\.g\. the defaults 2,30,58",
        ),
        ({"num_hidden_layers": 8}, r"aux layer ids \[20, 27\] out of range: the target has layer ids 0..8"),
    ],
)
def test_spec_refuses_a_config_it_cannot_use(change, match):
    config = {k: v for k, v in {**QWEN3_8B, **change}.items() if v is not None}
    aux = config.pop("aux_layer_ids", [2, 20, 27])
    with pytest.raises(DraftsmithError, match=match):
        DraftSpec.from_target_config(config, 32000, 1, aux)


def test_state_dict_names_are_the_vllm_names():
    draft = Eagle3Draft(_spec(num_hidden_layers=2))
    names = set(draft.state_dict())
    assert {"embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    assert "layers.0.hidden_norm.weight" in names and "layers.1.hidden_norm.weight" not in names
    assert draft.state_dict()["layers.0.self_attn.q_proj.weight"].shape == (32, 64)  # reads 2H
    assert draft.state_dict()["layers.1.self_attn.q_proj.weight"].shape == (32, 32)
    assert draft.fc.weight.shape == (32, 96)
    assert not draft.embed_tokens.weight.requires_grad
    assert all(not n.startswith("rotary") for n in names)
    assert not any(n.endswith(".bias") for n in names)  # no format carries biases
    assert set(draft_tensors(draft.state_dict())) == names - {EMBEDDING}  # the embedding is the target's


def test_load_draft_tensors_keeps_the_embedding():
    draft, other = Eagle3Draft(_spec()), Eagle3Draft(_spec())
    draft.init_weights(1)
    other.init_weights(2)
    embedding = other.embed_tokens.weight.clone()
    other.load_draft_tensors(draft_tensors(draft.state_dict()))
    assert torch.equal(other.fc.weight, draft.fc.weight) and torch.equal(other.embed_tokens.weight, embedding)
    with pytest.raises(RuntimeError, match="Missing key"):
        other.load_draft_tensors({})


def test_from_target_copies_embedding_and_lm_head_rows(tiny_target_dir):
    target = targets.load_target(tiny_target_dir)
    cfg = DraftSpec.from_target_config(json.loads((tiny_target_dir / "config.json").read_text()), 32, 1, [1, 2, 4])
    ids = torch.tensor(sorted(torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(0))[:32].tolist()))
    draft = Eagle3Draft.from_target(cfg, target, ids)
    assert torch.equal(draft.embed_tokens.weight, targets.embed_tokens(target).weight)
    assert torch.equal(draft.lm_head.weight, targets.lm_head(target).weight[ids])
    assert torch.equal(draft.d2t + torch.arange(32), ids)
    assert draft.t2d.sum() == 32 and draft.t2d[ids].all()
    rnd = Eagle3Draft.from_target(cfg, target, ids, lm_head_init="random")
    assert not torch.equal(rnd.lm_head.weight, draft.lm_head.weight)


def test_cached_decoding_equals_full_forward():
    torch.manual_seed(0)
    draft = Eagle3Draft(_spec(num_hidden_layers=2)).double()
    draft.init_weights(1)
    ids = torch.randint(0, 50, (2, 9))
    hidden = torch.randn(2, 9, 32, dtype=torch.float64)
    pos = torch.arange(9).expand(2, 9)
    full_logits, full_hidden = draft(ids, hidden, pos)
    caches = KVCache(2)
    a, ha = draft(ids[:, :5], hidden[:, :5], pos[:, :5], caches)
    b, hb = draft(ids[:, 5:], hidden[:, 5:], pos[:, 5:], caches)
    torch.testing.assert_close(torch.cat((a, b), 1), full_logits)
    torch.testing.assert_close(torch.cat((ha, hb), 1), full_hidden)


def test_plain_layer_and_rope_match_transformers_llama():
    """Layer i>0 is a plain Llama layer: same output as transformers' LlamaDecoderLayer with the same weights."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaDecoderLayer,
        LlamaRotaryEmbedding,
    )

    cfg = _spec(num_hidden_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    draft = Eagle3Draft(cfg).double()
    draft.init_weights(3)
    hf_cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=50,
        **hfcompat.rope_config_kwargs(LlamaConfig, {"rope_type": "default", "rope_theta": 500.0}),
    )
    hf_cfg._attn_implementation = "sdpa"
    hf_layer = LlamaDecoderLayer(hf_cfg, layer_idx=1).double().eval()
    hf_layer.load_state_dict(
        {k[len("layers.1.") :]: v for k, v in draft.state_dict().items() if k.startswith("layers.1.")}
    )
    x = torch.randn(1, 7, 32, dtype=torch.float64)
    pos = torch.arange(3, 10)[None]
    cos, sin = LlamaRotaryEmbedding(hf_cfg)(x, pos)
    mask = torch.full((7, 7), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    expected = hf_layer(x, attention_mask=mask, position_embeddings=(cos, sin), position_ids=pos)
    expected = expected[0] if isinstance(expected, tuple) else expected
    ours_cos, ours_sin = draft.rotary(pos, torch.float64)
    ours = draft.layers[1](None, x, ours_cos, ours_sin, KVCache(2), "decode")
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-5)  # both norm and RoPE run in fp32 inside


def test_rope_scaling_from_target_config():
    cfg = _spec(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    )
    draft = Eagle3Draft(cfg)
    plain = Eagle3Draft(_spec(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}))
    assert draft.rotary.inv_freq.shape == plain.rotary.inv_freq.shape
    assert not torch.allclose(draft.rotary.inv_freq, plain.rotary.inv_freq)


def test_wrong_vocab_size_is_refused():
    draft = Eagle3Draft(_spec())
    with pytest.raises(ValueError):
        draft.set_draft_vocab(torch.arange(5))
