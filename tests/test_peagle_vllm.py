"""P-EAGLE drafts in real vLLM (CPU): trained with `--method peagle`, exported, served with parallel drafting.

For each target below a P-EAGLE draft is trained a few steps, exported in the vllm format (float32 weights), and
decoded by vLLM with `"parallel_drafting": true` (all k proposals of a round from one draft forward) at
temperature 0 in float32:

- lossless: vLLM's output token ids with the draft equal the same engine's without it;
- the draft ran: vLLM's spec-decode counters > 0, k draft tokens per round, some accepted;
- the same proposals as draftsmith's reference decoder (evaluate/specdec.py, drafting in parallel for a P-EAGLE
  draft): vLLM's accepted counts per draft position equal the reference decoder's on the same prompts, so vLLM's
  parallel slots read what training trained (mask token, fc(mask_hidden), positions, attention).

(a) the default target through `draftsmith evaluate --engine vllm`: a P-EAGLE draft that memorised the target's
    answers to the evaluated prompts (tests/conftest.py's `memorised_prepared`), so its parallel slots are accepted
    past position 1 and the per-position comparison can fail on a wrong slot layout; the tolerance is
    tests/test_parity.py's (float32 kernels of vLLM and transformers may part at a near-tie).
(b) the MoE family qwen3_moe (tests/families.py, its head sharpened so greedy tokens are decisive): exact equality,
    as tests/test_families.py's EAGLE-3 decoding test. (DeepSeek-V3's MLA does not run with an EAGLE-3 draft in
    vLLM 0.32 on CPU in float32: see MLA_ON_CPU there.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import MEMORISED_PROMPTS, memorise
from test_families import (
    SPEC_K,
    Matrix,
    needs_vllm,
    vllm_decodes_as_the_reference,
    write_chats,
)
from test_parity import evaluate_in_both_engines

from draftsmith.methods.artefact import load_draft

pytestmark = [pytest.mark.slow, pytest.mark.vllm, needs_vllm]

K = 4  # (a): draft tokens per round
PEAGLE_STEPS = 60  # (a): steps of a fresh draft on the memorised answers
MOE_STEPS = 20  # (b): steps of a fresh draft on the tiny target (what tests/test_families.py gives its drafts)
MOE = "qwen3_moe"


def _spec_config(export_dir: Path) -> dict:
    from draftsmith.evaluate import vllm_worker

    return vllm_worker.engine_launch(
        vllm_worker.GenerationJob(
            target=str(load_draft(export_dir).target.path),
            dtype="float32",
            max_model_len=64,
            seed=0,
            k=3,
            draft=str(export_dir),
        )
    )[0]["speculative_config"]


def test_the_probe_finds_the_parallel_drafting_these_tests_decode_with():
    """evaluate and serve refuse a P-EAGLE draft unless the probe finds parallel drafting (vLLM >= 0.16); the
    installed vLLM decodes below, so the probe must say so."""
    from draftsmith.extract.vllm.probe import probe
    from draftsmith.methods.peagle import ROW as PARALLEL_DRAFTING_ROW

    report = probe(architecture="LlamaForCausalLM")
    assert report.facts.parallel_drafting is True, report.capability(PARALLEL_DRAFTING_ROW).found


# ---------------------------------------------------------------------------------------- (a) default target


@pytest.fixture(scope="module")
def peagle_export(memorised_store, tmp_path_factory) -> Path:
    """A P-EAGLE draft that memorised the target's answers to the evaluated prompts (conftest's memorised_prepared),
    trained PEAGLE_STEPS steps offline from their store (the features online training computes, extract's default
    layers), so its parallel slots are accepted past position 1; exported vllm, float32."""
    from draftsmith.core.layers import resolve_layer_ids
    from draftsmith.extract import store

    layers = store.open(memorised_store).manifest.target.num_layers
    return memorise(
        memorised_store,
        tmp_path_factory.mktemp("peagle-default"),
        speculative_tokens=K,
        aux_layer_ids=resolve_layer_ids(None, layers)[:-1],
        method="peagle",
        ttt_steps=K,
        max_steps=PEAGLE_STEPS,
        draft_vocab_size=2048,
        cod_ratio=1.0,
    )


def test_vllm_drafts_in_parallel_losslessly_with_the_reference_acceptance(peagle_export, tmp_path, monkeypatch):
    spec = load_draft(peagle_export).spec
    assert spec.method == "peagle" and spec.mask_token_id is not None
    config = json.loads((peagle_export / "config.json").read_text())
    assert config["ptd_token_id"] == spec.mask_token_id
    assert _spec_config(peagle_export)["parallel_drafting"] is True
    # the parallel slots accepted (position 2 on), then the same acceptance per position in both engines
    evaluate_in_both_engines(peagle_export, tmp_path, monkeypatch, K, deep=1, num_prompts=MEMORISED_PROMPTS)


# ---------------------------------------------------------------------------------------- (b) an MoE family


class PeagleMatrix(Matrix):
    """tests/test_families.py's prepared sets, stores, exports and reference decodes, with P-EAGLE drafts."""

    draft_options = dict(method="peagle", ttt_steps=SPEC_K, draft_vocab_size=256, max_steps=MOE_STEPS)


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> PeagleMatrix:
    root = tmp_path_factory.mktemp("peagle-moe")
    return PeagleMatrix(root, write_chats(root / "chats.jsonl"))


def test_vllm_parallel_drafting_on_an_moe_target_is_lossless_with_the_reference_acceptance(moe, one_thread):
    draft = moe.export(MOE, "vllm")
    assert load_draft(draft).spec.method == "peagle" and _spec_config(draft)["parallel_drafting"] is True
    ref = moe.reference(MOE)
    assert ref["spec"] == ref["plain"]  # the reference decoder, drafting in parallel, is lossless too
    vllm_decodes_as_the_reference(moe, MOE, draft)  # test_families.ENGINE_LEN: room for its slots
