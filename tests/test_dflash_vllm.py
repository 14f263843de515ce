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
from conftest import MEMORISED_PROMPTS
from test_families import (
    MAX_LENGTH,
    NEW_TOKENS,
    NUM_PROMPTS,
    SPEC_K,
    Matrix,
    in_process_vllm,
    needs_vllm,
    write_chats,
)
from test_parity import ACCEPTED_TOLERANCE

from draftsmith import evaluate, export, train
from draftsmith.config import EvaluateConfig, ExportConfig, TrainConfig
from draftsmith.train.drafts import load_draft

pytestmark = [pytest.mark.slow, pytest.mark.vllm, needs_vllm]

BLOCK = 4  # the anchor and 3 masks: vLLM drafts 3 tokens a round
PROMPTS, DEFAULT_NEW_TOKENS = MEMORISED_PROMPTS, 32  # the default target's decode


@pytest.fixture(scope="module")
def dflash_export(memorised_prepared, tmp_path_factory) -> Path:
    """A DFlash draft that memorised the target's answers to the evaluated prompts (conftest's memorised_prepared),
    trained online (the target in the trainer), exported vllm in float32."""
    root = tmp_path_factory.mktemp("dflash-default")
    train.run(TrainConfig(data=memorised_prepared, output=root / "run", method="dflash", block_size=BLOCK, num_layers=1,
                          anchors_per_sample=64, max_steps=60, token_budget=1024, lr=3e-3, warmup_steps=5,
                          schedule="constant", eval_fraction=0.0, save_every=10 ** 6, device="cpu",
                          precision="fp32", seed=0))
    out = root / "export"
    export.run(ExportConfig(checkpoint=root / "run", format="vllm", output=out, dtype="fp32"))
    return out


def test_vllm_decodes_a_dflash_draft_losslessly_with_the_reference_acceptance(dflash_export, tmp_path,
                                                                               monkeypatch):
    spec = load_draft(dflash_export).spec
    config = json.loads((dflash_export / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and spec.block_size == BLOCK
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    common = dict(draft=dflash_export, prompts="mt-bench", num_prompts=PROMPTS, max_new_tokens=DEFAULT_NEW_TOKENS,
                  k=[9], dtype="float32", temperature=0.0, vllm_kv_cache_gb=1, vllm_timeout_s=1200)
    evaluate.run(EvaluateConfig(engine="hf", output=tmp_path / "hf", baseline=False, **common))
    evaluate.run(EvaluateConfig(engine="vllm", output=tmp_path / "vllm", baseline=True, **common))
    k = BLOCK - 1  # whatever k was asked: a round is one block
    hf, vl = (json.loads((tmp_path / e / "report.json").read_text())["runs"][0] for e in ("hf", "vllm"))
    assert hf["k"] == vl["k"] == k
    results = {name: json.loads((tmp_path / "vllm" / "vllm" / f"{name}.result.json").read_text())
               for name in ("baseline", f"k{k}")}
    assert results[f"k{k}"]["outputs"] == results["baseline"]["outputs"]  # lossless
    assert vl["num_rounds"] > 0 and vl["num_draft_tokens"] == k * vl["num_rounds"], vl
    assert len(vl["accepted_per_pos"]) == k and hf["accepted_per_pos"][2] > 0 and vl["accepted_per_pos"][2] > 0, \
        (hf, vl)  # accepted deep into the block: the comparison below can fail on a wrong layout
    rounds = max(hf["num_rounds"], vl["num_rounds"])
    assert abs(hf["num_rounds"] - vl["num_rounds"]) <= ACCEPTED_TOLERANCE * rounds, (hf, vl)
    for pos, (a, b) in enumerate(zip(hf["accepted_per_pos"], vl["accepted_per_pos"])):
        assert abs(a - b) <= ACCEPTED_TOLERANCE * rounds, (pos, hf["accepted_per_pos"], vl["accepted_per_pos"])


# ---------------------------------------------------------------------------------------- an MoE family


MOE = "qwen3_moe"
MOE_STEPS = 30  # a fresh DFlash draft on the tiny MoE target's store (tests/families.py, its head sharpened)


class DFlashMatrix(Matrix):
    """tests/test_families.py's prepared sets, stores, exports and reference decodes, with DFlash drafts: blocks of
    SPEC_K + 1 (vLLM drafts SPEC_K tokens a round), reading the store's layers."""

    def draft(self, name: str, data: str) -> Path:
        key = ("draft", name, data)
        if key not in self._made:
            assert data == "store"
            out = self.root / name / "dflash-draft"
            result = train.run(TrainConfig(
                data=self.hf(name), output=out, method="dflash", block_size=SPEC_K + 1, num_layers=1,
                anchors_per_sample=64, max_steps=MOE_STEPS, lr=3e-3, warmup_steps=0, schedule="constant",
                token_budget=2048, eval_fraction=0.0, save_every=10 ** 6, device="cpu", precision="fp32", seed=0))
            self.summaries[key] = result.summary
            self._made[key] = out
        return self._made[key]


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> DFlashMatrix:
    root = tmp_path_factory.mktemp("dflash-moe")
    return DFlashMatrix(root, write_chats(root / "chats.jsonl"))


def test_vllm_decodes_dflash_on_an_moe_target_losslessly_with_the_reference_acceptance(moe, one_thread):
    from draftsmith.evaluate import vllm_worker
    from draftsmith.export.formats import vllm_speculative_config

    draft = moe.export(MOE, "vllm")
    assert load_draft(draft).spec.method == "dflash"
    assert vllm_speculative_config(draft, 7) == {"method": "dflash", "model": str(draft),
                                                 "num_speculative_tokens": SPEC_K}
    ref = moe.reference(MOE)
    assert ref["spec"] == ref["plain"]  # the reference decoder's DFlash rounds are lossless too
    request = dict(target=str(load_draft(draft).target.path), prompts=moe.prompts(MOE), k=SPEC_K,
                   max_new_tokens=NEW_TOKENS, temperature=0.0, seed=0, dtype="float32",
                   max_model_len=MAX_LENGTH + NEW_TOKENS + 2 * SPEC_K + 8, max_num_seqs=NUM_PROMPTS, ignore_eos=True)
    with in_process_vllm():
        plain = vllm_worker.run({**request, "draft": None})
        spec = vllm_worker.run({**request, "draft": str(draft)})
    assert spec["outputs"] == plain["outputs"]  # lossless
    assert plain["outputs"] == ref["plain"]  # the reference decoder's target alone
    counters = spec["spec"]
    assert counters["num_drafts"] > 0 and counters["num_draft_tokens"] == SPEC_K * counters["num_drafts"], counters
    assert counters["num_accepted_tokens"] > 0 and plain["spec"]["num_drafts"] == 0, counters
    assert (counters["num_drafts"], counters["num_accepted_tokens_per_pos"]) == (
        ref["rounds"], ref["accepted_per_pos"]), (counters, ref)
