"""The real default target (SmolLM2-135M-Instruct) with a trained draft: lossless greedy speculative decoding in the
reference decoder. Real vLLM (CPU) decoding an exported draft with the reference decoder's acceptance per position
is `evaluate --gate` (tests/test_gate.py, on a draft accepted deep into its rounds).

The draft is the small one benchmarks/specdec.py trains once per machine (120 ShareGPT conversations, 30 online
steps, cached under $DRAFTSMITH_CACHE/bench/): a few minutes the first time, then free.
"""

from __future__ import annotations

import pytest
import torch

from draftsmith import evaluate
from draftsmith.core import targets
from draftsmith.evaluate.prompts import load_prompts
from draftsmith.evaluate.specdec import (
    DraftRunner,
    TargetRunner,
    plain_generate,
    speculative_generate,
)
from draftsmith.methods.artefact import load_draft

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real(default_target_dir, trained_run):
    model = targets.load_target(default_target_dir)
    tokenizer = targets.load_tokenizer(default_target_dir)
    source = load_draft(trained_run)
    draft = evaluate.build_draft_module(source, model, torch.device("cpu"), torch.float32)
    return model, tokenizer, source, draft


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_lossless_on_default_target_with_trained_draft(real, k):
    model, tokenizer, source, draft = real
    runner = TargetRunner(model, source.spec.aux_layer_ids)
    drafter = DraftRunner(draft)
    accepted = 0
    for prompt in load_prompts("mt-bench", tokenizer, num_prompts=2):
        ids = torch.tensor(prompt.token_ids)
        base = plain_generate(runner, ids, 32)
        spec = speculative_generate(runner, drafter, ids, k, 32)
        assert spec.tokens == base.tokens
        accepted += spec.stats.num_accepted
    assert accepted > 0  # the trained draft really gets tokens accepted


def test_vllms_verify_steps_map_onto_the_reference_decoders_rounds(real):
    """segments.step_rounds turns a request's verify steps (vLLM's per-step accepted counts) into the rounds the
    reference decoder records, where each round starts, with the trained draft accepting tokens."""
    from draftsmith.evaluate.segments import step_rounds

    model, tokenizer, source, draft = real
    runner, drafter = TargetRunner(model, source.spec.aux_layer_ids), DraftRunner(draft)
    for prompt in load_prompts("mt-bench", tokenizer, num_prompts=2):
        spec = speculative_generate(runner, drafter, torch.tensor(prompt.token_ids), 3, 32)
        assert any(a for _, a in spec.rounds) and len(spec.rounds) > 3
        assert step_rounds([a for _, a in spec.rounds]) == spec.rounds
