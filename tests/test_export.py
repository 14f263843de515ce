"""Export writers: every format's names, config and round trip; validation and refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith import export
from draftsmith.config import ExportConfig
from draftsmith.core import targets
from draftsmith.core.errors import DraftsmithError
from draftsmith.train.model import DraftConfig, Eagle3Draft

AUX = [1, 2, 4]


pytestmark = pytest.mark.usefixtures("one_thread")


def make_draft(target_dir, draft_vocab_size=96, seed=0):
    config = json.loads((target_dir / "config.json").read_text())
    model = targets.load_target(target_dir)
    dc = DraftConfig.from_target_config(config, draft_vocab_size=draft_vocab_size)
    ids = torch.linspace(0, config["vocab_size"] - 1, draft_vocab_size).round().long()
    return Eagle3Draft.from_target(dc, model, ids, seed=seed), dc


@pytest.fixture(scope="module")
def tiny_draft(tiny_target_dir):
    draft, dc = make_draft(tiny_target_dir)
    arch = export.DraftArch.from_draft_config(dc, AUX)
    return draft, arch, export.canonical_tensors(draft), targets.target_identity(tiny_target_dir)


def write(tmp_path, tiny_draft, fmt, **kw):
    _, arch, tensors, identity = tiny_draft
    out = tmp_path / fmt
    export.write_export(out, tensors, arch, fmt, target=identity, verifier_architectures=["LlamaForCausalLM"], **kw)
    return out


def test_canonical_names_are_vllms(tiny_draft):
    _, arch, tensors, _ = tiny_draft
    assert "embed_tokens.weight" not in tensors  # servers share the target's embedding
    assert set(tensors) == set(arch.expected_shapes())
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
            "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight"} <= set(tensors)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * arch.hidden_size
    assert tensors["fc.weight"].shape == (arch.hidden_size, 3 * arch.target_hidden_size)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool


def test_vllm_format(tmp_path, tiny_draft):
    out = write(tmp_path, tiny_draft, "vllm")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 96 and config["target_hidden_size"] == 64 and config["vocab_size"] == 320
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX
    assert config["norm_before_residual"] is False and config["num_hidden_layers"] == 1
    weights = load_file(str(out / "model.safetensors"))
    assert "midlayer.self_attn.q_proj.weight" in weights and not any("embed" in k for k in weights)
    assert weights["fc.weight"].dtype == torch.bfloat16
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    readme = (out / "README.md").read_text()
    assert "LLM(" in readme and "eagle3" in readme and str(AUX) in readme


def test_sglang_format_shifts_layer_ids(tmp_path, tiny_draft):
    out = write(tmp_path, tiny_draft, "sglang")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    # SGLang captures "layer id + 1" as the input of that layer, i.e. vLLM id = SGLang id + 1
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in AUX]
    assert "eagle_aux_hidden_state_layer_ids" not in config


def test_speculators_format(tmp_path, tiny_draft, tiny_target_dir):
    out = write(tmp_path, tiny_draft, "speculators", speculative_tokens=4)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["norm_before_residual"] is False  # explicit: vLLM's reader defaults it to True
    layer = config["transformer_layer_config"]
    assert layer["hidden_size"] == 64 and layer["vocab_size"] == 320 and layer["num_hidden_layers"] == 1
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3"
    assert spec["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 4}]
    assert spec["default_proposal_method"] == "greedy"
    assert spec["verifier"] == {"name_or_path": str(tiny_target_dir.resolve()), "architectures": ["LlamaForCausalLM"]}
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX and config["draft_vocab_size"] == 96
    weights = load_file(str(out / "model.safetensors"))
    assert "layers.0.self_attn.q_proj.weight" in weights and not any(k.startswith("midlayer.") for k in weights)


@pytest.mark.parametrize("fmt", export.FORMATS)
def test_round_trip(tmp_path, tiny_draft, fmt):
    _, arch, tensors, identity = tiny_draft
    out = write(tmp_path, tiny_draft, fmt, dtype="fp32")
    back = export.read_export(out)
    assert back.manifest.format == fmt and back.arch == arch and back.manifest.target == identity
    assert set(back.tensors) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(back.tensors[name], t), name


def test_speculators_reader_in_vllm_accepts_the_config(tmp_path, tiny_draft):
    """vLLM's own speculators-config parser turns our config into an Eagle-3 Llama draft config."""
    pytest.importorskip("vllm")
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    out = write(tmp_path, tiny_draft, "speculators", speculative_tokens=3)
    config = json.loads((out / "config.json").read_text())
    pre = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(config)))
    assert pre["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert pre["norm_before_residual"] is False and pre["draft_vocab_size"] == 96
    assert pre["eagle_aux_hidden_state_layer_ids"] == AUX
    spec = SpeculatorsConfig.extract_vllm_speculative_config(config)
    assert spec == {"method": "eagle3", "num_speculative_tokens": 3}


# ---------------------------------------------------------------------------------------------- refusals


def _assert_refused(tmp_path, tiny_draft, tensors, match):
    _, arch, _, identity = tiny_draft
    with pytest.raises(DraftsmithError, match=match):
        export.write_export(tmp_path / "bad", tensors, arch, "vllm", target=identity, verifier_architectures=[])
    assert not (tmp_path / "bad").exists()  # nothing half-written


def test_refuses_wrong_shape(tmp_path, tiny_draft):
    tensors = dict(tiny_draft[2])
    tensors["fc.weight"] = torch.zeros(64, 3 * 128)
    _assert_refused(tmp_path, tiny_draft, tensors, r"fc\.weight has shape \(64, 384\).*\(64, 192\)")


def test_refuses_missing_and_unexpected_tensors(tmp_path, tiny_draft):
    tensors = dict(tiny_draft[2])
    del tensors["midlayer.hidden_norm.weight"]
    _assert_refused(tmp_path, tiny_draft, tensors, r"missing tensor.*hidden_norm")
    tensors = dict(tiny_draft[2], **{"midlayer.self_attn.q_norm.weight": torch.ones(16)})
    _assert_refused(tmp_path, tiny_draft, tensors, r"unexpected tensor.*q_norm")


def test_refuses_bad_dtype_nan_and_vocab_maps(tmp_path, tiny_draft):
    base = tiny_draft[2]
    _assert_refused(tmp_path, tiny_draft, dict(base, d2t=base["d2t"].int()), r"d2t is torch.int32")
    nan = base["norm.weight"].clone()
    nan[0] = float("nan")
    _assert_refused(tmp_path, tiny_draft, dict(base, **{"norm.weight": nan}), r"NaN")
    _assert_refused(tmp_path, tiny_draft, dict(base, d2t=base["d2t"] + 10_000), r"outside the target vocabulary")
    t2d = base["t2d"].clone()
    t2d[~t2d.clone()] = True
    _assert_refused(tmp_path, tiny_draft, dict(base, t2d=t2d), r"t2d does not mark")


def test_refuses_draft_for_another_target(tmp_path, tiny_draft):
    from conftest import build_tiny_target

    _, arch, tensors, _ = tiny_draft
    other = targets.target_identity(build_tiny_target(tmp_path / "wide", hidden_size=128))
    with pytest.raises(DraftsmithError, match=r"another target.*hidden size 64 != 128"):
        export.write_export(tmp_path / "x", tensors, arch, "vllm", target=other, verifier_architectures=[])
    small_vocab = other.model_copy(update={"hidden_size": 64, "vocab_size": 300})
    with pytest.raises(DraftsmithError, match=r"vocab 320 != 300"):
        export.write_export(tmp_path / "x", tensors, arch, "vllm", target=small_vocab, verifier_architectures=[])


def test_sglang_refuses_embedding_layer_id(tmp_path, tiny_draft):
    _, arch, tensors, identity = tiny_draft
    arch0 = arch.model_copy(update={"aux_layer_ids": [0, 2, 4]})
    with pytest.raises(DraftsmithError, match="layer id 0"):
        export.write_export(tmp_path / "s", tensors, arch0, "sglang", target=identity, verifier_architectures=[])


def test_read_export_detects_damage(tmp_path, tiny_draft):
    out = write(tmp_path, tiny_draft, "vllm")
    with open(out / "model.safetensors", "r+b") as f:
        f.seek(-8, 2)
        f.write(b"\x00" * 8)
    with pytest.raises(DraftsmithError, match="sha256"):
        export.read_export(out)


# ---------------------------------------------------------------------------------------------- the stage


def save_checkpoint_for(run_dir, target_dir, draft, dc, aux=AUX):
    from draftsmith.train.checkpoint import CheckpointManifest, save_checkpoint

    manifest = CheckpointManifest(target=targets.target_identity(target_dir), aux_layer_ids=aux, draft=dc, step=7,
                                  data="unit-test", best_acceptance_length=1.5)
    return save_checkpoint(run_dir, manifest, draft.state_dict(), None, best=True)


def test_run_exports_a_checkpoint(tmp_path, tiny_target_dir, tiny_draft):
    draft, arch, tensors, _ = tiny_draft
    save_checkpoint_for(tmp_path / "run", tiny_target_dir, draft, arch.to_draft_config())
    result = export.run(ExportConfig(checkpoint=tmp_path / "run", format="vllm", output=tmp_path / "out"))
    assert result.summary["format"] == "vllm" and result.summary["aux layers"] == AUX
    back = export.read_export(tmp_path / "out")
    assert back.manifest.training["step"] == 7 and back.manifest.source_checkpoint == str(tmp_path / "run")
    assert (tmp_path / "out" / "config.yaml").is_file()
    for name, t in tensors.items():
        expected = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert torch.equal(back.tensors[name], expected), name
    assert "best_acceptance_length" in (tmp_path / "out" / "README.md").read_text()


def test_run_refuses_checkpoint_for_another_target(tmp_path, tiny_target_dir, tiny_draft):
    from conftest import build_tiny_target

    draft, arch, _, _ = tiny_draft
    save_checkpoint_for(tmp_path / "run", tiny_target_dir, draft, arch.to_draft_config())
    other = build_tiny_target(tmp_path / "wide", hidden_size=128)
    with pytest.raises(DraftsmithError, match=r"another target \(hidden size 64 != 128\)"):
        export.run(ExportConfig(checkpoint=tmp_path / "run", output=tmp_path / "out", target=str(other)))
    assert not (tmp_path / "out").exists()
