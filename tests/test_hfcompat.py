"""HF directories draftsmith writes read the same in transformers 4.56/4.57 and 5.x (core/hfcompat.py).

These run in whichever transformers the venv holds: CI runs them in the main venv (transformers 5) and in
.venv-tf4 (transformers 4.57), where a transformers-5 directory that was not made portable fails to load.
"""

from __future__ import annotations

import json
import shutil

from transformers import AutoConfig, AutoTokenizer, LlamaConfig

from draftsmith.core import assets, hfcompat, targets

YARN = {
    "rope_type": "yarn",
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "rope_theta": 50000.0,
}


def _as_transformers5_wrote_it(path) -> None:
    """Rewrite a directory's config/tokenizer_config in transformers 5's names only (as draftsmith 0.1.0 left it)."""
    config = json.loads((path / "config.json").read_text())
    rope = hfcompat.rope_parameters_of(config)
    for key in ("rope_theta", "rope_scaling"):
        config.pop(key, None)
    config["rope_parameters"] = rope
    (path / "config.json").write_text(json.dumps(config))
    tok = json.loads((path / "tokenizer_config.json").read_text())
    tok["tokenizer_class"] = "TokenizersBackend"
    (path / "tokenizer_config.json").write_text(json.dumps(tok))


def _loaded_rope(config) -> tuple[float, dict | None]:
    """(theta, scaling or None) as this transformers reads them from a config object."""
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and rope:  # transformers 5
        scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "type")}
        return float(rope["rope_theta"]), (scaling if scaling.get("rope_type", "default") != "default" else None)
    scaling = dict(config.rope_scaling) if config.rope_scaling else None
    if scaling:
        scaling.pop("type", None)
    return float(config.rope_theta), scaling


def test_legacy_rope_keys_and_back():
    assert hfcompat.legacy_rope_keys({"rope_theta": 1e6, "rope_type": "default"}) == {"rope_theta": 1e6}
    legacy = hfcompat.legacy_rope_keys(YARN)
    assert legacy["rope_theta"] == 50000.0 and legacy["rope_scaling"]["rope_type"] == "yarn"
    assert "rope_theta" not in legacy["rope_scaling"]
    assert hfcompat.rope_parameters_of(legacy) == YARN  # a transformers-4 config reads back as the same RoPE
    assert hfcompat.legacy_rope_keys({"full_attention": {"rope_theta": 1e6}}) == {}  # no flat 4.x form: untouched


def test_portable_and_canonical_configs_mean_the_same():
    five = {"model_type": "deepseek_v3", "hidden_size": 8, "rope_parameters": dict(YARN)}
    portable = hfcompat.portable_config(five)
    assert portable["rope_parameters"] == YARN and portable["rope_theta"] == 50000.0
    assert portable["rope_scaling"]["factor"] == 40.0
    assert hfcompat.canonical_config(portable) == hfcompat.canonical_config(five) == five  # 5.x form is canonical
    four = {"model_type": "llama", "rope_theta": 1e6, "rope_scaling": None}
    assert hfcompat.canonical_config(four) == {
        "model_type": "llama",
        "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
    }
    wrapper = {"model_type": "kimi_k25", "text_config": dict(five)}
    assert hfcompat.portable_config(wrapper)["text_config"]["rope_theta"] == 50000.0  # nested text config too
    assert hfcompat.portable_config(portable) == portable  # idempotent


def test_a_transformers5_directory_made_portable_loads_here_as_the_same_model(tmp_path, tiny_target_dir):
    path = tmp_path / "t"
    shutil.copytree(tiny_target_dir, path)
    config = json.loads((path / "config.json").read_text())
    config.update(
        rope_parameters=dict(YARN),
        rope_theta=YARN["rope_theta"],
        rope_scaling={k: v for k, v in YARN.items() if k != "rope_theta"},
    )
    (path / "config.json").write_text(json.dumps(config))
    reference_ids = AutoTokenizer.from_pretrained(tiny_target_dir)("Hello <|im_start|>user\nhi<|im_end|>")["input_ids"]
    identity = targets.target_identity(path)
    _as_transformers5_wrote_it(path)
    assert targets.target_identity(path) == identity  # the identity does not depend on the names used
    assert not hfcompat.is_portable(path)
    assert hfcompat.make_portable(path) and hfcompat.is_portable(path)
    assert not hfcompat.make_portable(path)  # nothing left to change
    assert targets.target_identity(path) == identity
    assert json.loads((path / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    loaded = AutoConfig.from_pretrained(path)
    theta, scaling = _loaded_rope(loaded)
    assert theta == 50000.0 and scaling == {k: v for k, v in YARN.items() if k != "rope_theta"}
    assert AutoTokenizer.from_pretrained(path)("Hello <|im_start|>user\nhi<|im_end|>")["input_ids"] == reference_ids


def test_rope_config_kwargs_give_this_transformers_the_rope():
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, **hfcompat.rope_config_kwargs(LlamaConfig, YARN))
    assert _loaded_rope(config) == (50000.0, {k: v for k, v in YARN.items() if k != "rope_theta"})


def test_a_default_target_an_older_draftsmith_converted_is_made_portable_on_use(tmp_path, monkeypatch, tiny_target_dir):
    """A cache entry without the format field (draftsmith 0.1.0, transformers-5 names) is upgraded in place, not
    converted again (the GGUF file is not even read), and stays the same target."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    sha = "ab" * 32
    gguf = tmp_path / "Model.Q4_1.gguf"  # never opened: the entry is complete
    out = assets.cache_dir() / "targets" / f"Model.Q4_1-{sha[:12]}"
    shutil.copytree(tiny_target_dir, out)
    _as_transformers5_wrote_it(out)
    (out / "draftsmith-asset.json").write_text(json.dumps({"source": str(gguf), "source_sha256": sha}))
    identity = targets.target_identity(out)

    def no_conversion(*_args, **_kwargs):
        raise AssertionError("a complete entry must not be converted again")

    monkeypatch.setattr(assets, "convert_gguf", no_conversion)
    assert assets.converted_gguf_dir(gguf, sha) == out
    assert json.loads((out / "draftsmith-asset.json").read_text())["format"] == 2
    assert hfcompat.is_portable(out) and targets.target_identity(out) == identity
    AutoTokenizer.from_pretrained(out)  # loads in this transformers (4.57 refused TokenizersBackend)
    assert assets.converted_gguf_dir(gguf, sha) == out  # a second use finds it ready


def test_an_exported_draft_config_carries_the_rope_for_transformers_4():
    from draftsmith.export.formats import format_config
    from draftsmith.methods.spec import DraftSpec

    spec = DraftSpec(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=1,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        max_position_embeddings=2048,
        rope_parameters=dict(YARN),
        vocab_size=320,
        draft_vocab_size=64,
        target_hidden_size=64,
        aux_layer_ids=[1, 2, 3],
    )
    config = format_config(
        spec,
        "vllm",
        verifier="t",
        verifier_architectures=["LlamaForCausalLM"],
        speculative_tokens=3,
        dtype="bf16",
        special_tokens={},
    )
    assert config["rope_parameters"] == YARN and config["rope_theta"] == 50000.0
    assert config["rope_scaling"]["rope_type"] == "yarn"
    loaded = LlamaConfig.from_dict({k: v for k, v in config.items() if k != "architectures"})
    assert _loaded_rope(loaded)[0] == 50000.0 and _loaded_rope(loaded)[1]["factor"] == 40.0
