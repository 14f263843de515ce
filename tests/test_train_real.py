"""The real default target (SmolLM2-135M-Instruct) on real ShareGPT conversations: online training raises the
simulated acceptance length, and the checkpoint loads back. Slow (a few minutes on 2 CPU cores)."""

from __future__ import annotations

import json

import pytest

from draftsmith.config import PrepareConfig, TrainConfig


@pytest.mark.slow
def test_online_training_on_the_default_target_raises_acceptance_length(default_target_dir, sharegpt_file, tmp_path):
    from draftsmith.prepare.stage import run as prepare
    from draftsmith.train import checkpoint, run

    prepare(
        PrepareConfig(
            data=[str(sharegpt_file)],
            target=str(default_target_dir),
            output=tmp_path / "prepared",
            max_length=192,
            max_samples=60,
        )
    )
    result = run(
        TrainConfig(
            data=tmp_path / "prepared",
            output=tmp_path / "run",
            draft_vocab_size=8000,
            ttt_steps=3,
            lr=1e-3,
            warmup_steps=2,
            token_budget=768,
            max_steps=24,
            eval_every=8,
            eval_fraction=0.1,
            log_every=4,
            device="cpu",
        )
    )
    evals = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in evals if e["type"] == "eval"]
    assert len(evals) >= 3
    assert evals[-1]["acceptance_length"] > evals[0]["acceptance_length"], evals
    tensors, manifest = checkpoint.load_checkpoint(tmp_path / "run")
    assert manifest.target.num_layers == 30 and manifest.draft.aux_layer_ids == [2, 15, 27]
    assert tensors["lm_head.weight"].shape == (8000, 576)
    assert result.summary["steps"] == 24
