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
from draftsmith.methods.artefact import load_draft
from draftsmith.methods.eagle3.modeling import Eagle3Draft
from draftsmith.methods.layers import draft_tensors
from draftsmith.methods.spec import DraftSpec

AUX = [1, 2, 4]


pytestmark = pytest.mark.usefixtures("one_thread")


def make_draft(target_dir, draft_vocab_size=96, seed=0):
    config = json.loads((target_dir / "config.json").read_text())
    model = targets.load_target(target_dir)
    spec = DraftSpec.from_target_config(config, draft_vocab_size, 1, AUX)
    ids = torch.linspace(0, config["vocab_size"] - 1, draft_vocab_size).round().long()
    return Eagle3Draft.from_target(spec, model, ids, seed=seed), spec


@pytest.fixture(scope="module")
def tiny_draft(tiny_target_dir):
    draft, spec = make_draft(tiny_target_dir)
    return draft, spec, draft_tensors(draft.state_dict()), targets.target_identity(tiny_target_dir)


def write(tmp_path, tiny_draft, fmt, **kw):
    _, spec, tensors, identity = tiny_draft
    out = tmp_path / fmt
    export.write_export(out, tensors, spec, fmt, target=identity, verifier_architectures=["LlamaForCausalLM"], **kw)
    return out


def test_draft_tensors_are_the_modules_names(tiny_draft):
    _, spec, tensors, _ = tiny_draft
    assert "embed_tokens.weight" not in tensors  # servers share the target's embedding
    assert {
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
        "layers.0.hidden_norm.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.mlp.down_proj.weight",
    } <= set(tensors)
    assert tensors["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * spec.hidden_size
    assert tensors["fc.weight"].shape == (spec.hidden_size, 3 * spec.target_hidden_size)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool


def test_vllm_loads_the_vllm_files_names_into_the_modules_names(tmp_path, tiny_draft):
    """vLLM's own Eagle-3 loader renames the vllm format's weights to exactly the module's names (before it stacks
    q/k/v and gate/up into its fused layers): the module's names are vLLM's."""
    pytest.importorskip("vllm")
    from vllm.model_executor.models.llama_eagle3 import LlamaModel
    from vllm.model_executor.models.utils import WeightsMapper

    rename = WeightsMapper(orig_to_new_substr=LlamaModel.hf_to_vllm_mapper.orig_to_new_substr)
    in_file = load_file(str(write(tmp_path, tiny_draft, "vllm") / "model.safetensors"))
    assert {rename.map_name(name) for name in in_file} == set(tiny_draft[2])


def test_a_draft_over_the_whole_target_vocabulary_carries_no_vocabulary_maps(tmp_path, tiny_target_dir):
    """With the target's whole vocabulary d2t and t2d are the identity: not saved (vLLM's Eagle-3 model then has no
    draft_id_to_target_id and refuses a d2t in the weights), read back as the identity; an older draft that saved them
    reads back the same."""
    from safetensors.torch import save_file

    vocab = json.loads((tiny_target_dir / "config.json").read_text())["vocab_size"]
    draft, spec = make_draft(tiny_target_dir, draft_vocab_size=vocab)
    assert spec.draft_vocab_size == spec.vocab_size and torch.equal(draft.draft_to_target, torch.arange(vocab))
    tensors = draft_tensors(draft.state_dict())
    assert "d2t" not in tensors and "t2d" not in tensors and bool(draft.t2d.all())
    identity = targets.target_identity(tiny_target_dir)
    out = tmp_path / "whole"
    export.write_export(out, tensors, spec, "vllm", target=identity, verifier_architectures=["LlamaForCausalLM"])
    assert not {"d2t", "t2d"} & set(load_file(str(out / "model.safetensors")))
    source = load_draft(out)
    assert torch.equal(source.tensors["lm_head.weight"], tensors["lm_head.weight"].to(torch.bfloat16))
    older = {**load_file(str(out / "model.safetensors")), "d2t": torch.zeros(vocab, dtype=torch.int64)}
    older["t2d"] = torch.ones(vocab, dtype=torch.bool)
    save_file(older, str(out / "model.safetensors"), metadata={"format": "pt"})
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"] = {}  # as hand-copied: no checksum to hold it to
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert set(load_draft(out).tensors) == set(source.tensors)


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
    _, spec, tensors, identity = tiny_draft
    out = write(tmp_path, tiny_draft, fmt, dtype="fp32")
    back = load_draft(out)
    assert export.read_export_manifest(out).format == fmt
    assert back.spec == spec and back.target == identity and back.origin == out
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
    _, spec, _, identity = tiny_draft
    with pytest.raises(DraftsmithError, match=match):
        export.write_export(tmp_path / "bad", tensors, spec, "vllm", target=identity, verifier_architectures=[])
    assert not (tmp_path / "bad").exists()  # nothing half-written


def test_refuses_wrong_shape(tmp_path, tiny_draft):
    tensors = dict(tiny_draft[2])
    tensors["fc.weight"] = torch.zeros(64, 3 * 128)
    _assert_refused(tmp_path, tiny_draft, tensors, r"fc\.weight has shape \(64, 384\).*\(64, 192\)")


def test_refuses_missing_and_unexpected_tensors(tmp_path, tiny_draft):
    tensors = dict(tiny_draft[2])
    del tensors["layers.0.hidden_norm.weight"]
    _assert_refused(tmp_path, tiny_draft, tensors, r"missing tensor.*hidden_norm")
    tensors = dict(tiny_draft[2], **{"layers.0.self_attn.q_norm.weight": torch.ones(16)})
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

    _, spec, tensors, _ = tiny_draft
    other = targets.target_identity(build_tiny_target(tmp_path / "wide", hidden_size=128))
    with pytest.raises(DraftsmithError, match=r"another target.*hidden size 64 != 128"):
        export.write_export(tmp_path / "x", tensors, spec, "vllm", target=other, verifier_architectures=[])
    small_vocab = other.model_copy(update={"hidden_size": 64, "vocab_size": 300})
    with pytest.raises(DraftsmithError, match=r"vocab 320 != 300"):
        export.write_export(tmp_path / "x", tensors, spec, "vllm", target=small_vocab, verifier_architectures=[])


def test_sglang_refuses_embedding_layer_id(tmp_path, tiny_draft):
    _, spec, tensors, identity = tiny_draft
    spec0 = spec.model_copy(update={"aux_layer_ids": [0, 2, 4]})
    with pytest.raises(DraftsmithError, match="layer id 0"):
        export.write_export(tmp_path / "s", tensors, spec0, "sglang", target=identity, verifier_architectures=[])


def test_read_export_detects_damage(tmp_path, tiny_draft):
    out = write(tmp_path, tiny_draft, "vllm")
    with open(out / "model.safetensors", "r+b") as f:
        f.seek(-8, 2)
        f.write(b"\x00" * 8)
    with pytest.raises(DraftsmithError, match="sha256 does not match .*manifest.json; the export is damaged"):
        load_draft(out)


# ---------------------------------------------------------------------------------------------- the stage


def save_checkpoint_for(run_dir, target_dir, draft, spec):
    from draftsmith.methods.artefact import CheckpointManifest
    from draftsmith.train.checkpoint import save_checkpoint

    manifest = CheckpointManifest(
        target=targets.target_identity(target_dir), draft=spec, step=7, data="unit-test", best_acceptance_length=1.5
    )
    return save_checkpoint(run_dir, manifest, draft.state_dict(), None, best=True)


def test_checkpoint_holds_the_draft_but_not_the_targets_embedding(tmp_path, tiny_target_dir, tiny_draft):
    from draftsmith.methods.artefact import load_checkpoint

    draft, spec, tensors, _ = tiny_draft
    best = save_checkpoint_for(tmp_path / "run", tiny_target_dir, draft, spec)
    assert set(load_file(str(best / "model.safetensors"))) == set(tensors)  # no embed_tokens.weight
    manifest = json.loads((best / "manifest.json").read_text())
    assert manifest["draft"] == spec.model_dump() and "aux_layer_ids" not in manifest  # one DraftSpec, no copies
    assert "training" not in manifest  # derived from the checkpoint's own fields on read
    back, read = load_checkpoint(tmp_path / "run")
    assert read.draft == spec and read.training == {
        "data": "unit-test",
        "step": 7,
        "best_acceptance_length": 1.5,
        "eval_fraction": 0.0,
        "split_seed": 0,
    }
    assert all(torch.equal(back[name], t) for name, t in tensors.items())


def test_run_exports_a_checkpoint(tmp_path, tiny_target_dir, tiny_draft):
    draft, spec, tensors, _ = tiny_draft
    save_checkpoint_for(tmp_path / "run", tiny_target_dir, draft, spec)
    result = export.run(ExportConfig(checkpoint=tmp_path / "run", format="vllm", output=tmp_path / "out"))
    assert result.summary["format"] == "vllm" and result.summary["aux layers"] == AUX
    back, manifest = load_draft(tmp_path / "out"), export.read_export_manifest(tmp_path / "out")
    assert manifest.training["step"] == 7 and manifest.source_checkpoint == str(tmp_path / "run")
    assert back.training == manifest.training and manifest.draft == spec
    assert (tmp_path / "out" / "config.yaml").is_file()
    for name, t in tensors.items():
        expected = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert torch.equal(back.tensors[name], expected), name
    assert "best_acceptance_length" in (tmp_path / "out" / "README.md").read_text()


def test_run_exports_an_export_in_another_format(tmp_path, tiny_draft):
    out = write(tmp_path, tiny_draft, "sglang", dtype="fp32", training={"step": 3})
    export.run(ExportConfig(checkpoint=out, format="speculators", output=tmp_path / "again", dtype="fp32"))
    again = load_draft(tmp_path / "again")
    assert again.training == {"step": 3} and again.spec == tiny_draft[1]
    assert all(torch.equal(again.tensors[name], t) for name, t in tiny_draft[2].items())


def test_run_refuses_checkpoint_for_another_target(tmp_path, tiny_target_dir, tiny_draft):
    from conftest import build_tiny_target

    draft, spec, _, _ = tiny_draft
    save_checkpoint_for(tmp_path / "run", tiny_target_dir, draft, spec)
    other = build_tiny_target(tmp_path / "wide", hidden_size=128)
    with pytest.raises(DraftsmithError, match=r"another target \(hidden size 64 != 128\)"):
        export.run(ExportConfig(checkpoint=tmp_path / "run", output=tmp_path / "out", target=str(other)))
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------- P-EAGLE

MASK_TOKEN = 3


@pytest.fixture(scope="module")
def tiny_peagle(tiny_target_dir, tiny_draft):
    """The tiny draft as a P-EAGLE draft: its spec with parallel drafting and a mask token, plus mask_hidden."""
    _, spec, tensors, identity = tiny_draft
    spec = spec.model_copy(update={"method": "peagle", "mask_token_id": MASK_TOKEN})
    mask = torch.randn(1, len(AUX) * spec.target_hidden_size, generator=torch.Generator().manual_seed(1))
    return None, spec, {**tensors, "mask_hidden": mask}, identity


def test_peagle_vllm_export_holds_mask_hidden_and_names_the_mask_token(tmp_path, tiny_peagle):
    from draftsmith.export.formats import vllm_speculative_config

    tensors = tiny_peagle[2]
    out = write(tmp_path, tiny_peagle, "vllm", speculative_tokens=4)
    config = json.loads((out / "config.json").read_text())
    assert config["ptd_token_id"] == MASK_TOKEN and config["architectures"] == ["LlamaForCausalLMEagle3"]
    weights = load_file(str(out / "model.safetensors"))
    assert weights["mask_hidden"].shape == (1, 3 * 64) and weights["mask_hidden"].dtype == torch.bfloat16
    assert torch.equal(weights["mask_hidden"], tensors["mask_hidden"].to(torch.bfloat16))
    readme = (out / "README.md").read_text()
    assert "P-EAGLE" in readme and '"parallel_drafting": true' in readme and "'parallel_drafting': True" in readme
    assert vllm_speculative_config(out, 4) == {
        "method": "eagle3",
        "model": str(out),
        "num_speculative_tokens": 4,
        "parallel_drafting": True,
    }
    plain = write(tmp_path / "eagle3", _eagle3(tiny_peagle), "vllm")
    assert "ptd_token_id" not in json.loads((plain / "config.json").read_text())
    assert vllm_speculative_config(plain, 4) == {"method": "eagle3", "model": str(plain), "num_speculative_tokens": 4}
    assert "parallel_drafting" not in (plain / "README.md").read_text()


def _eagle3(peagle):
    """The P-EAGLE fixture's draft without parallel drafting (the EAGLE-3 draft it was made from)."""
    _, spec, tensors, identity = peagle
    return (
        None,
        spec.model_copy(update={"method": "eagle3", "mask_token_id": None}),
        {k: v for k, v in tensors.items() if k != "mask_hidden"},
        identity,
    )


def test_vllm_loads_a_peagle_exports_names(tmp_path, tiny_peagle):
    """vLLM's Eagle-3 loader: every name of the file maps to the module's, mask_hidden (its own buffer) included."""
    pytest.importorskip("vllm")
    from vllm.model_executor.models.llama_eagle3 import LlamaModel
    from vllm.model_executor.models.utils import WeightsMapper

    rename = WeightsMapper(orig_to_new_substr=LlamaModel.hf_to_vllm_mapper.orig_to_new_substr)
    in_file = load_file(str(write(tmp_path, tiny_peagle, "vllm") / "model.safetensors"))
    assert {rename.map_name(name) for name in in_file} == set(tiny_peagle[2])


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_peagle_round_trip(tmp_path, tiny_peagle, fmt):
    _, spec, tensors, identity = tiny_peagle
    out = write(tmp_path, tiny_peagle, fmt, dtype="fp32")
    back = load_draft(out)
    assert back.spec == spec and back.spec.method == "peagle" and back.spec.mask_token_id == MASK_TOKEN
    assert set(back.tensors) == set(tensors) and back.target == identity
    assert all(torch.equal(back.tensors[name], t) for name, t in tensors.items())
    again = tmp_path / "again"  # and once more through the stage, from the export
    export.run(ExportConfig(checkpoint=out, format="vllm", output=again, dtype="fp32"))
    assert load_draft(again).spec == spec


def test_peagle_checkpoint_round_trips_through_export(tmp_path, tiny_target_dir, tiny_peagle):
    from draftsmith.methods.artefact import CheckpointManifest
    from draftsmith.train.checkpoint import save_checkpoint

    _, spec, tensors, identity = tiny_peagle
    manifest = CheckpointManifest(target=identity, draft=spec, step=2, data="unit-test")
    save_checkpoint(tmp_path / "run", manifest, tensors, None, best=True)
    assert load_draft(tmp_path / "run").spec == spec
    result = export.run(
        ExportConfig(checkpoint=tmp_path / "run", format="vllm", output=tmp_path / "out", speculative_tokens=5)
    )
    assert result.summary["parallel drafting"] == f"P-EAGLE, mask token {MASK_TOKEN}"
    assert all('"parallel_drafting": true' in c for c in result.commands.values() if c.startswith("vllm serve"))
    assert export.read_export_manifest(tmp_path / "out").draft == spec


def test_an_export_read_as_its_config_serves_it(tmp_path, tiny_peagle):
    """A P-EAGLE export whose manifest's spec does not say so (written before DraftSpec knew parallel drafting):
    config.json's mask token and mask_hidden in the weights make it the P-EAGLE draft vLLM serves. And one an older
    draftsmith wrote (manifest format 2: method eagle3 with `parallel_drafting: true`) reads as P-EAGLE's method."""
    _, spec, tensors, _ = tiny_peagle
    out = write(tmp_path, tiny_peagle, "vllm", dtype="fp32")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format_version"] == 3 and manifest["draft"]["method"] == "peagle"
    for key in ("method", "mask_token_id"):
        manifest["draft"].pop(key)
    (out / "manifest.json").write_text(json.dumps(manifest))
    back = load_draft(out)
    assert back.spec == spec and set(back.tensors) == set(tensors)
    (out / "config.json").unlink()  # the manifest alone says what the draft is
    older = {**manifest, "format_version": 2}
    older["draft"] = {**manifest["draft"], "method": "eagle3", "parallel_drafting": True, "mask_token_id": MASK_TOKEN}
    (out / "manifest.json").write_text(json.dumps(older))
    assert load_draft(out).spec == spec


def test_peagle_refusals_are_one_line(tmp_path, tiny_peagle):
    _, spec, tensors, identity = tiny_peagle
    with pytest.raises(DraftsmithError) as err:
        export.write_export(tmp_path / "s", tensors, spec, "sglang", target=identity, verifier_architectures=[])
    assert str(err.value) == (
        "format sglang: SGLang has no parallel drafting, so it cannot serve this P-EAGLE draft; export as vllm"
    )
    no_token = spec.model_copy(update={"mask_token_id": None})
    with pytest.raises(DraftsmithError, match=r"mask_token_id None is not a target token id \(0\.\.319\)"):
        export.write_export(tmp_path / "v", tensors, no_token, "vllm", target=identity, verifier_architectures=[])
    with pytest.raises(DraftsmithError, match=r"missing tensor\(s\) \['mask_hidden'\] for a 1-layer P-EAGLE draft"):
        export.write_export(
            tmp_path / "v", _eagle3(tiny_peagle)[2], spec, "vllm", target=identity, verifier_architectures=[]
        )
    assert not any((tmp_path / d).exists() for d in ("s", "v"))


def test_peagle_speculators_format_is_speculators_peagle(tmp_path, tiny_peagle):
    """speculators has a P-EAGLE type of its own (speculators_model_type and algorithm "peagle", mask_token_id),
    which vLLM's reader turns into its Eagle-3 Llama draft with the mask token as pard_token and parallel drafting
    on."""
    out = write(tmp_path, tiny_peagle, "speculators", speculative_tokens=4)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["speculators_config"]["algorithm"] == "peagle"
    assert config["architectures"] == ["PEagleSpeculator"] and config["mask_token_id"] == MASK_TOKEN
    assert "layers.0.self_attn.q_proj.weight" in load_file(str(out / "model.safetensors"))
    pytest.importorskip("vllm")
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    pre = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(config)))
    assert pre["architectures"] == ["PeagleLlamaForCausalLM"] and pre["pard_token"] == MASK_TOKEN
    assert pre["norm_before_residual"] is False and pre["eagle_aux_hidden_state_layer_ids"] == AUX
    assert SpeculatorsConfig.extract_vllm_speculative_config(config) == {
        "method": "eagle3",
        "num_speculative_tokens": 4,
        "parallel_drafting": True,
    }


# ---------------------------------------------------------------------------------------------- the P-EAGLE rule

SPECULATORS_PEAGLE = {"speculators_model_type": "peagle", "transformer_layer_config": {"model_type": "llama"}}
READINGS = [  # config.json -> the mask token vLLM's parallel drafting reads (None: an EAGLE-3 draft)
    ({"ptd_token_id": 5}, 5),  # what draftsmith's vllm format writes
    ({"pard_token": 6}, 6),
    ({"mask_token_id": 7}, 7),
    ({"mask_token_id": 7, "ptd_token_id": 5}, 7),  # vLLM reads mask_token_id first
    ({"pard_token": 6, "ptd_token_id": 5}, 6),  # then pard_token
    ({"mask_token_id": None, "ptd_token_id": 5}, 5),  # a null mask_token_id is passed over
    ({"pad_token_id": 2}, None),
    ({**SPECULATORS_PEAGLE, "mask_token_id": 4}, 4),  # speculators' own P-EAGLE type, read as pard_token
    (
        {
            **SPECULATORS_PEAGLE,
            "mask_token_id": 4,  # its layer config is what vLLM's proposer reads first
            "transformer_layer_config": {"model_type": "llama", "mask_token_id": 9},
        },
        9,
    ),
    ({"speculators_model_type": "eagle3", "mask_token_id": 4, "transformer_layer_config": {}}, None),
]


@pytest.mark.parametrize(("config", "token"), READINGS)
def test_one_rule_reads_each_mask_token_spelling_in_vllms_order(config, token):
    from draftsmith.methods.peagle.method import parallel_drafting_token

    assert parallel_drafting_token(config) == token


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"pard_token": None, "ptd_token_id": 5}, r"^d/config.json: pard_token None is not a token id"),
        ({"ptd_token_id": "3"}, r"^d/config.json: ptd_token_id '3' is not a token id"),
        ({**SPECULATORS_PEAGLE}, r"^d/config.json: a speculators P-EAGLE config .* without mask_token_id"),
    ],
)
def test_a_mask_token_vllm_would_misread_is_refused_in_one_line(config, message):
    from draftsmith.methods.peagle.method import parallel_drafting_token

    with pytest.raises(DraftsmithError, match=message):
        parallel_drafting_token(config, "d/config.json")


@pytest.mark.vllm
@pytest.mark.parametrize(("config", "token"), READINGS)
def test_the_rules_order_is_the_installed_vllms(config, token):
    """vLLM's own proposer code, given the config as vLLM reads it (a speculators one through its converter), picks
    the same mask token, and finds none where the rule says EAGLE-3."""
    pytest.importorskip("vllm")
    import copy
    import types

    from transformers import PretrainedConfig
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    if "speculators_model_type" in config:
        config = SpeculatorsConfig.extract_transformers_pre_trained_config(copy.deepcopy(config))
    proposer = types.SimpleNamespace(
        draft_model_config=types.SimpleNamespace(hf_config=PretrainedConfig(**config)),
        pass_hidden_states_to_model=False,
    )
    if token is None:
        with pytest.raises(ValueError, match="For parallel drafting, the draft model config must have"):
            SpecDecodeBaseProposer._init_parallel_drafting_params(proposer)
        return
    SpecDecodeBaseProposer._init_parallel_drafting_params(proposer)
    assert proposer.parallel_drafting_token_id == token


def test_load_and_serve_follow_the_mask_token_vllm_reads(tmp_path, tiny_peagle):
    """A vllm export whose config.json names mask_token_id beside ptd_token_id is the P-EAGLE draft with vLLM's
    choice (mask_token_id); without either it is refused as EAGLE-3 holding mask_hidden, not misread."""
    from draftsmith.export.formats import vllm_speculative_config

    out = write(tmp_path, tiny_peagle, "vllm", dtype="fp32")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "mask_token_id": 9}))
    back = load_draft(out)
    assert back.spec.method == "peagle" and back.spec.mask_token_id == 9
    assert vllm_speculative_config(out, 3)["parallel_drafting"] is True
    del config["ptd_token_id"]
    (out / "config.json").write_text(json.dumps(config))
    assert "parallel_drafting" not in vllm_speculative_config(out, 3)
    with pytest.raises(
        DraftsmithError,
        match=r"names no mask token, so vLLM would serve the draft as EAGLE-3, but "
        r"its weights hold a P-EAGLE draft's mask_hidden",
    ):
        load_draft(out)


def test_a_config_naming_a_mask_token_without_mask_hidden_is_refused(tmp_path, tiny_draft):
    out = write(tmp_path, tiny_draft, "vllm")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "pard_token": 3}))
    with pytest.raises(DraftsmithError) as err:
        load_draft(out)
    assert str(err.value) == (
        f"{out / 'config.json'}: names mask token 3, so vLLM would serve the draft as P-EAGLE, "
        "but its weights have no mask_hidden; remove the mask token (mask_token_id, pard_token, "
        "ptd_token_id) or export the draft again from its training run"
    )


def test_a_mask_token_outside_the_targets_vocabulary_is_refused_on_load(tmp_path, tiny_peagle):
    out = write(tmp_path, tiny_peagle, "vllm")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "ptd_token_id": 320}))
    with pytest.raises(DraftsmithError, match=r"config.json: mask token 320 is not a target token id \(0\.\.319\)"):
        load_draft(out)
