"""DFlash drafts in real vLLM 0.32 (CPU): trained with `--method dflash`, exported in vLLM's reference layout and
decoded by vLLM's `dflash` method at temperature 0 in float32.

The draft memorises what the target writes for the evaluated prompts (conftest's memorised_prepared: their greedy
continuations are its training set, every anchor of them a block), so it is accepted deep into a block; only then does comparing per-position
acceptance say anything about the layout (a draft that is accepted nowhere past position 1 passes with a wrong
mask or slot layout). Then:

- lossless: vLLM's output token ids with the draft equal the same engine's without it;
- the draft ran: spec-decode counters > 0, block_size - 1 draft tokens a round, acceptance at positions >= 2;
- the same proposals as draftsmith's reference decoder (evaluate/specdec.py's DFlash round): vLLM's accepted
  counts per position equal the reference decoder's on the same prompts, within tests/test_parity.py's tolerance.

The same on the MoE family qwen3_moe (tests/families.py): a fresh DFlash draft from its store, decoded with exact
equality of the per-position counters, as tests/test_peagle_vllm.py's P-EAGLE MoE test.
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

from draftsmith import export
from draftsmith.methods.artefact import load_draft

pytestmark = [pytest.mark.slow, pytest.mark.vllm, needs_vllm]

BLOCK = 4  # the anchor and 3 masks: vLLM drafts 3 tokens a round


@pytest.fixture(scope="module")
def dflash_export(memorised_store, tmp_path_factory) -> Path:
    """A DFlash draft that memorised the target's answers to the evaluated prompts (conftest's memorised_prepared),
    trained offline from their store (the features online training computes: a one-layer DFlash's layer), exported
    vllm in float32."""
    from draftsmith.core.layers import dflash_aux_layer_ids
    from draftsmith.extract import store

    layers = store.open(memorised_store).manifest.target.num_layers
    return memorise(
        memorised_store,
        tmp_path_factory.mktemp("dflash-default"),
        aux_layer_ids=dflash_aux_layer_ids(layers, 1),
        method="dflash",
        block_size=BLOCK,
        num_layers=1,
        anchors_per_sample=64,
    )


def test_vllm_decodes_a_dflash_draft_losslessly_with_the_reference_acceptance(dflash_export, tmp_path, monkeypatch):
    spec = load_draft(dflash_export).spec
    config = json.loads((dflash_export / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and spec.block_size == BLOCK
    hf, vl = evaluate_in_both_engines(
        dflash_export, tmp_path, monkeypatch, 9, deep=2, num_prompts=MEMORISED_PROMPTS
    )  # 3rd position of a block
    assert hf.k == vl.k == BLOCK - 1  # whatever k was asked: a round is one block
    # the command printed after the export (and the quickstart) serves it as a block of BLOCK - 1 drafted tokens
    _, gpu_only = export.serve_commands(tmp_path / "target", dflash_export, k=9).values()
    assert '"method": "dflash"' in gpu_only and f'"num_speculative_tokens": {BLOCK - 1}' in gpu_only, gpu_only


# ---------------------------------------------------------------------------------------- an MoE family


MOE = "qwen3_moe"
MOE_STEPS = 30  # a fresh DFlash draft on the tiny MoE target's store (tests/families.py, its head sharpened)


class DFlashMatrix(Matrix):
    """tests/test_families.py's prepared sets, stores, exports and reference decodes, with DFlash drafts: blocks of
    SPEC_K + 1 (vLLM drafts SPEC_K tokens a round), reading the store's layers."""

    draft_options = dict(
        method="dflash", block_size=SPEC_K + 1, num_layers=1, anchors_per_sample=64, max_steps=MOE_STEPS
    )


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> DFlashMatrix:
    root = tmp_path_factory.mktemp("dflash-moe")
    return DFlashMatrix(root, write_chats(root / "chats.jsonl"))


def test_vllm_decodes_dflash_on_an_moe_target_losslessly_with_the_reference_acceptance(moe, one_thread):
    from draftsmith.export.formats import vllm_speculative_config

    draft = moe.export(MOE, "vllm")
    assert load_draft(draft).spec.method == "dflash"
    assert vllm_speculative_config(draft, 7) == {
        "method": "dflash",
        "model": str(draft),
        "num_speculative_tokens": SPEC_K,
    }
    ref = moe.reference(MOE)
    assert ref["spec"] == ref["plain"]  # the reference decoder's DFlash rounds are lossless too
    vllm_decodes_as_the_reference(moe, MOE, draft)  # test_families.ENGINE_LEN: room for its slots
