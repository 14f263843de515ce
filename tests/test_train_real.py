"""The real default target (SmolLM2-135M-Instruct) on real ShareGPT conversations: online training raises the
simulated acceptance length, and the checkpoint loads back. The run is conftest's `trained_run` (benchmarks/specdec.py's
small draft: 120 conversations, 30 online steps, evaluated every 10, trained once per machine), the draft the
real-engine tests decode."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_online_training_on_the_default_target_raises_acceptance_length(trained_run):
    from draftsmith.methods import artefact

    evals = [json.loads(x) for x in (trained_run / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in evals if e["type"] == "eval"]
    assert len(evals) >= 3
    assert evals[-1]["acceptance_length"] > evals[0]["acceptance_length"] > 1.0, evals
    tensors, manifest = artefact.load_checkpoint(trained_run)
    assert manifest.target.num_layers == 30 and manifest.draft.aux_layer_ids == [2, 15, 27]
    assert tensors["lm_head.weight"].shape == (8000, 576)
    assert manifest.step == 30 and manifest.data_kind == "prepared"  # online: the target ran in the trainer
