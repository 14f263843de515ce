"""Artefacts made by draftsmith 0.1.0 before the stage packages (commit db7d796, tests/data/legacy-0.1.0/make.py)
still load with today's code: prepared set, bf16 and fp8 stores, a checkpoint (resumable) and the three exports."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.config import EvaluateConfig, ExportConfig, TrainConfig
from draftsmith.core.targets import target_identity

LEGACY = Path(__file__).parent / "data" / "legacy-0.1.0"


@pytest.fixture(scope="module")
def legacy(tmp_path_factory) -> Path:
    """A writable copy (resume and verify may add files)."""
    root = tmp_path_factory.mktemp("legacy") / "legacy"
    shutil.copytree(LEGACY, root, ignore=shutil.ignore_patterns("target"))
    return root


@pytest.fixture(scope="module")
def legacy_target(tmp_path_factory, tiny_target_dir) -> Path:
    """The target the artefacts were made for: the tests' tiny target as transformers 5 saved it (its config and
    tokenizer files are kept in legacy-0.1.0/target/; the weights, deterministic, are the tiny target's). Under
    transformers 4.x, whose save_pretrained writes other tokenizer bytes (another target by identity), this is a
    transformers-5 directory read by 4.x, as a user's target may be."""
    path = tmp_path_factory.mktemp("legacy-target") / "target"
    shutil.copytree(LEGACY / "target", path)
    shutil.copy(tiny_target_dir / "model.safetensors", path / "model.safetensors")
    return path


def test_prepared_set_and_stores_load(legacy, legacy_target):
    from draftsmith.extract import store
    from draftsmith.prepare.dataset import open_prepared

    prepared = open_prepared(legacy / "prepared", verify=True)
    assert prepared.manifest.target.mismatch(target_identity(legacy_target)) is None
    assert len(prepared) == 12 and prepared[0]["loss_mask"].any()
    for dtype in ("bf16", "fp8"):
        s = store.open(legacy / f"store-{dtype}")
        assert len(s) == 12 and s.layer_ids == [1, 2, 4]
        item = s[3]
        assert torch.equal(item["input_ids"], prepared[item["sample_id"]]["input_ids"])
        assert item["hidden_states"].shape == (len(item["input_ids"]), 3, 64)
        assert torch.isfinite(item["hidden_states"]).all()
        assert store.verify_store(legacy / f"store-{dtype}").ok


def test_checkpoint_and_exports_load_and_agree(legacy):
    """The old manifests (a checkpoint's DraftConfig beside its aux_layer_ids, an export's DraftArch) read as one
    DraftSpec; the checkpoint's embedding (the target's) is left out; the tensors agree bit for bit."""
    from draftsmith.methods.artefact import load_draft

    source = load_draft(legacy / "train")
    assert source.spec.aux_layer_ids == [1, 2] and source.spec.num_hidden_layers == 1
    assert "embed_tokens.weight" not in source.tensors and source.training["step"] == 2
    for fmt in ("vllm", "sglang", "speculators"):
        exported = load_draft(legacy / f"export-{fmt}")
        assert exported.spec == source.spec
        assert exported.training["step"] == 2
        assert exported.tensors.keys() == source.tensors.keys()
        for name, tensor in source.tensors.items():
            assert torch.equal(exported.tensors[name], tensor), (fmt, name)


@pytest.mark.parametrize(
    "artefact, change, stage",
    [
        ("train/best", {"draft": {"attention_bias": True}}, "train"),
        ("export-vllm", {"arch": {"norm_before_residual": True}}, "export"),
    ],
)
def test_what_cannot_load_is_refused_with_the_stage_to_rerun(legacy, tmp_path, artefact, change, stage):
    import json

    from draftsmith.core.errors import DraftsmithError
    from draftsmith.methods.artefact import load_draft

    copy = tmp_path / "old"
    shutil.copytree(legacy / artefact, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    for key, fields in change.items():
        manifest[key].update(fields)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DraftsmithError, match=rf"made by an older draftsmith .*; re-run `draftsmith {stage}`"):
        load_draft(copy)


def test_legacy_checkpoint_exports_and_resumes(legacy, legacy_target, tmp_path):
    from draftsmith import export
    from draftsmith.methods.artefact import latest_checkpoint
    from draftsmith.train.stage import run as train

    export.run(ExportConfig(checkpoint=legacy / "train", target=str(legacy_target), output=tmp_path / "export"))
    assert export.read_export_manifest(tmp_path / "export").draft.draft_vocab_size == 64
    result = train(
        TrainConfig(
            data=legacy / "store-bf16",
            target=str(legacy_target),
            output=legacy / "train",
            max_steps=2,
            token_budget=256,
            ttt_steps=2,
            draft_vocab_size=64,
            warmup_steps=1,
            save_every=2,
            keep_checkpoints=1,
            eval_fraction=0.2,
        )
    )
    assert result.summary["steps"] == 2 and "resumed from" in result.summary
    assert "embed_tokens.weight" not in load_file(str(latest_checkpoint(legacy / "train") / "model.safetensors"))


def test_legacy_export_evaluates(legacy, legacy_target, tmp_path):
    from draftsmith import evaluate

    result = evaluate.run(
        EvaluateConfig(
            draft=legacy / "export-speculators",
            target=str(legacy_target),
            engine="hf",
            prompts=str(legacy / "prepared"),
            eval_fraction=0.2,
            max_new_tokens=6,
            k=[2],
            output=tmp_path / "eval",
        )
    )
    assert result.result is not None and [run.k for run in result.result.runs] == [2]
    assert result.result.runs[0].tau >= 1.0
