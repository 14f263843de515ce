"""The real default target (SmolLM2-135M-Instruct) with a trained draft: lossless greedy speculative decoding in the
reference decoder, and real vLLM (CPU) serving the exported draft with the same acceptance length.

The draft is the small one benchmarks/specdec.py trains once per machine (120 ShareGPT conversations, 30 online
steps, cached under $DRAFTSMITH_CACHE/bench/): a few minutes the first time, then free.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_parity import ACCEPTED_TOLERANCE

from draftsmith import evaluate, export
from draftsmith.config import EvaluateConfig, ExportConfig
from draftsmith.core import targets
from draftsmith.evaluate.prompts import load_prompts
from draftsmith.evaluate.specdec import (
    DraftRunner,
    TargetRunner,
    plain_generate,
    speculative_generate,
)
from draftsmith.extract.vllm.probe import probe
from draftsmith.train.drafts import load_draft

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


@pytest.mark.vllm
def test_vllm_serves_the_exported_draft_with_the_reference_acceptance(real, trained_run, tmp_path):
    """Export (float32) -> real vLLM (CPU) loads draft + target and runs EAGLE-3: τ within 5% of the reference
    decoder's, and the same accepted counts per draft position within tests/test_parity.py's tolerance (draftsmith
    == vLLM: the exported draft proposes in vLLM what draftsmith's module proposes)."""
    pytest.importorskip("vllm")
    facts = probe().facts
    if not facts.eagle3_on_platform:
        pytest.skip(
            f"EAGLE-3 does not run on vLLM {facts.version} here (tests/test_vllm_release_engines.py tests the refusal)"
        )
    out = tmp_path / "export"
    export.run(ExportConfig(checkpoint=trained_run, format="vllm", output=out, dtype="fp32"))
    common = dict(
        draft=out,
        prompts="mt-bench",
        num_prompts=4,
        max_new_tokens=48,
        k=[3],
        dtype="float32",
        vllm_kv_cache_gb=1,
        vllm_timeout_s=1200,
    )
    hf = evaluate.run(EvaluateConfig(engine="hf", output=tmp_path / "hf", baseline=False, **common))
    vl = evaluate.run(EvaluateConfig(engine="vllm", output=tmp_path / "vllm", baseline=True, **common))
    hf_report = json.loads((tmp_path / "hf" / "report.json").read_text())
    vl_report = json.loads((tmp_path / "vllm" / "report.json").read_text())
    assert vl_report["vllm_version"].startswith("0.")
    run = vl_report["runs"][0]
    assert run["num_rounds"] > 0 and len(run["acceptance_per_pos"]) == 3
    assert run["num_draft_tokens"] == 3 * run["num_rounds"]
    assert run["speedup"] is not None and vl_report["baseline"]["num_new_tokens"] > 0
    tau_hf, tau_vllm = hf_report["runs"][0]["tau"], run["tau"]
    assert hf_report["runs"][0]["num_accepted"] > 0 and run["num_accepted"] > 0  # both engines accept tokens
    assert abs(tau_vllm - tau_hf) / tau_hf <= 0.05, (tau_hf, tau_vllm)
    hf_run, rounds = hf_report["runs"][0], max(hf_report["runs"][0]["num_rounds"], run["num_rounds"])
    assert abs(hf_run["num_rounds"] - run["num_rounds"]) <= ACCEPTED_TOLERANCE * rounds, (hf_run, run)
    for pos, (a, b) in enumerate(zip(hf_run["accepted_per_pos"], run["accepted_per_pos"])):
        assert abs(a - b) <= ACCEPTED_TOLERANCE * rounds, (pos, hf_run["accepted_per_pos"], run["accepted_per_pos"])
    assert hf.summary["k=3 τ"] and vl.summary["k=3 τ"]
    if facts.per_request_spec_metrics:  # vLLM's per-request counters (0.32 has them, 0.28 not)
        # add up to its engine counters, and give τ an interval over the 4 prompts
        assert [sum(c) for c in zip(*run["per_prompt"])] == [run["num_rounds"], run["num_accepted"]]
        assert run["tau_95"][0] <= run["tau"] <= run["tau_95"][1]
