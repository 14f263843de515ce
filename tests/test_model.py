"""The EAGLE-3 draft: shapes, names, initialisation from the target, RoPE/layers against transformers' Llama."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.core import targets
from draftsmith.train.model import DraftConfig, Eagle3Draft, KVCache


def _config(**kw) -> DraftConfig:
    base = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, target_hidden_size=32,
                vocab_size=50, draft_vocab_size=20)
    base.update(kw)
    return DraftConfig(**base)


def test_config_from_target_config(tiny_target_dir):
    cfg = DraftConfig.from_target_config(json.loads((tiny_target_dir / "config.json").read_text()),
                                         draft_vocab_size=100000)
    assert cfg.hidden_size == 64 and cfg.num_attention_heads == 4 and cfg.num_key_value_heads == 2
    assert cfg.head_dim == 16 and cfg.intermediate_size == 128
    assert cfg.draft_vocab_size == cfg.vocab_size  # clipped to the target vocabulary
    assert cfg.rope_parameters["rope_theta"] > 0


def test_state_dict_names_are_the_vllm_names():
    draft = Eagle3Draft(_config(num_layers=2))
    names = set(draft.state_dict())
    assert {"embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    assert "layers.0.hidden_norm.weight" in names and "layers.1.hidden_norm.weight" not in names
    assert draft.state_dict()["layers.0.self_attn.q_proj.weight"].shape == (32, 64)  # reads 2H
    assert draft.state_dict()["layers.1.self_attn.q_proj.weight"].shape == (32, 32)
    assert draft.fc.weight.shape == (32, 96)
    assert not draft.embed_tokens.weight.requires_grad
    assert all(not n.startswith("rotary") for n in names)


def test_from_target_copies_embedding_and_lm_head_rows(tiny_target_dir):
    target = targets.load_target(tiny_target_dir)
    cfg = DraftConfig.from_target_config(json.loads((tiny_target_dir / "config.json").read_text()), 32)
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
    draft = Eagle3Draft(_config(num_layers=2)).double()
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
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = _config(num_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    draft = Eagle3Draft(cfg).double()
    draft.init_weights(3)
    hf_cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 500.0}, vocab_size=50)
    hf_cfg._attn_implementation = "sdpa"
    hf_layer = LlamaDecoderLayer(hf_cfg, layer_idx=1).double().eval()
    hf_layer.load_state_dict({k[len("layers.1."):]: v for k, v in draft.state_dict().items()
                              if k.startswith("layers.1.")})
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
    cfg = _config(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64})
    draft = Eagle3Draft(cfg)
    plain = Eagle3Draft(_config(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}))
    assert draft.rotary.inv_freq.shape == plain.rotary.inv_freq.shape
    assert not torch.allclose(draft.rotary.inv_freq, plain.rotary.inv_freq)


def test_wrong_vocab_size_is_refused():
    draft = Eagle3Draft(_config())
    with pytest.raises(ValueError):
        draft.set_draft_vocab(torch.arange(5))
