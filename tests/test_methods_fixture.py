"""Drafts of every method written at commit 40a257f (tests/data/methods-40a257f/make.py) still load with today's
code: each training checkpoint and each export reads back to the spec 40a257f read (spec.json, field by field) and,
built as evaluate builds it, gives the logits 40a257f computed on the stored input (logits.safetensors)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from draftsmith.evaluate.stage import build_draft_module
from draftsmith.methods.artefact import load_draft
from draftsmith.methods.attention import KVCache
from draftsmith.methods.spec import DraftSpec

FIXTURE = Path(__file__).parent / "data" / "methods-40a257f"
# Each method's draft directories at 40a257f: its training run, then an export in each format it is written in.
ARTEFACTS = {
    "eagle3": ("train", "export-vllm", "export-sglang", "export-speculators"),
    "eagle3.1": ("train", "export-vllm", "export-speculators"),
    "peagle": ("train", "export-vllm", "export-speculators"),
    "dflash": ("train", "export-vllm", "export-speculators"),
    "dspark": ("train", "export-vllm", "export-speculators"),
}
CASES = [(method, artefact) for method, artefacts in ARTEFACTS.items() for artefact in artefacts]


def draft_outputs(draft: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the draft module computes on a fixed input, covering every weight it holds: `inputs` are the pending
    positions' ids [1, T], aux target features [1, T, n * H_target] (fused by the draft's fc) and positions [1, T].
    "proposals": the target id each row picks greedily from its logits (DSpark: Markov-corrected), through the draft
    vocabulary's d2t."""
    spec: DraftSpec = draft.spec  # type: ignore[assignment]
    with torch.no_grad():
        fused = draft.fuse(inputs["aux"])
        if spec.block_size is None:
            out = _eagle_outputs(draft, spec, inputs["ids"], fused, inputs["positions"])
        else:
            out = _block_outputs(draft, spec, inputs["ids"], fused, inputs["positions"])
    out["proposals"] = draft.draft_to_target[out.get("markov_logits", out["logits"]).argmax(-1)]
    return out


def _eagle_outputs(
    draft: torch.nn.Module, spec: DraftSpec, ids: torch.Tensor, fused: torch.Tensor, positions: torch.Tensor
) -> dict[str, torch.Tensor]:
    """A step over the pending positions, then a step reading its own output (Eagle 3.1: the normed one); P-EAGLE
    also two parallel slots (its mask token, fc(mask_hidden)) behind the pending positions."""
    logits, hidden = draft(ids, fused, positions)
    out = {"logits": logits, "next_logits": draft(ids, hidden, positions + 1)[0]}
    if spec.mask_token_id is not None:
        slots = torch.full((1, 2), spec.mask_token_id, dtype=ids.dtype)
        mask = draft.mask_features().expand(1, 2, -1)
        slot_positions = torch.arange(ids.shape[1] + 2)[None]
        out["parallel_logits"] = draft(
            torch.cat((ids, slots), 1), torch.cat((fused, mask), 1), slot_positions, logits_to_keep=3
        )[0]
    return out


def _block_outputs(
    draft: torch.nn.Module, spec: DraftSpec, ids: torch.Tensor, fused: torch.Tensor, positions: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The round vLLM runs: the features join the cache, then the block [last id, masks] after them; DSpark also
    its Markov-corrected logits and its confidence, each row after a given previous token (row 0: the anchor)."""
    assert spec.block_size is not None and spec.mask_token_id is not None
    block = torch.full((1, spec.block_size), spec.mask_token_id, dtype=ids.dtype)
    block[0, 0] = ids[0, -1]
    block_positions = torch.arange(ids.shape[1], ids.shape[1] + spec.block_size)[None]
    logits, hidden = draft(block, block_positions, fused, positions, KVCache(spec.num_hidden_layers))
    out = {"logits": logits}
    if spec.markov_rank is not None:
        prev = torch.cat((ids[:, -1:], ids[:, : spec.block_size - 1]), 1)
        out["markov_logits"] = draft.block_logits(hidden, prev)
        out["confidence"] = draft.confidence(draft.norm(hidden), prev)
    return out


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(FIXTURE / "target", dtype=torch.float32).eval()


def test_the_fixture_holds_every_method_and_format():
    assert sorted(p.name for p in FIXTURE.iterdir() if p.is_dir()) == sorted([*ARTEFACTS, "target"])
    for method, artefacts in ARTEFACTS.items():
        assert sorted(p.name for p in (FIXTURE / method).iterdir() if p.is_dir()) == sorted(artefacts), method


@pytest.mark.parametrize("method, artefact", CASES)
def test_a_40a257f_draft_reads_back_to_its_spec_and_logits(method, artefact, target):
    recorded = json.loads((FIXTURE / method / "spec.json").read_text())
    assert recorded["method"] == method
    source = load_draft(FIXTURE / method / artefact)
    read = source.spec.model_dump(mode="json")
    assert sorted(read) == sorted(recorded), "DraftSpec's fields changed"
    for field, value in recorded.items():
        assert read[field] == value, (field, read[field], value)
    assert source.spec == DraftSpec.model_validate(recorded)

    reference = load_file(str(FIXTURE / method / "logits.safetensors"))
    inputs = {k.removeprefix("input."): v for k, v in reference.items() if k.startswith("input.")}
    expected = {k.removeprefix("output."): v for k, v in reference.items() if k.startswith("output.")}
    proposals = expected.pop("proposals")
    assert expected and all(t.is_floating_point() for t in expected.values())
    for name, t in expected.items():  # a reference that could not catch a wrong weight would prove nothing
        assert t.abs().max() > 0 and t.std() > 1e-3 and t.unique().numel() > t.numel() // 2, name
    assert proposals.unique().numel() > 1

    draft = build_draft_module(source, target, torch.device("cpu"), torch.float32)
    got = draft_outputs(draft, inputs)
    assert torch.equal(got.pop("proposals"), proposals)
    assert sorted(got) == sorted(expected)
    for name, t in expected.items():
        torch.testing.assert_close(got[name], t, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
