"""Parity of the draft across the three places it runs.

- Training-time test == decoding: TTT step k at position t is exactly the k-th step the reference decoder
  (evaluate/specdec.py's DraftRunner, the path where the draft feeds on its own hidden state) takes from the prefix
  0..t, when it is fed the same tokens: logits and hidden states, float64, k = 0..3.
- The same for P-EAGLE: depth d at anchor t of training (mask-token slots) is exactly the d-th proposal of the
  reference decoder's one parallel forward from the prefix 0..t (its method's round, `PEagle.propose`), d = 0..3.
- draftsmith == vLLM: the exported draft proposes in vLLM what draftsmith's module proposes on the same features:
  vLLM's per-position accepted counts at temperature 0 equal the reference decoder's on the same prompts (float32),
  within ACCEPTED_TOLERANCE: the EAGLE-3 draft of the default target in tests/test_evaluate_real.py (one vLLM start
  for its τ and this), P-EAGLE and DFlash drafts through `evaluate_in_both_engines` in their own modules.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import parallel_round

from draftsmith.evaluate.report import RunReport, read_report
from draftsmith.evaluate.specdec import DraftRunner
from draftsmith.evaluate.vllm_worker import GenerationResult
from draftsmith.methods.eagle3.modeling import Eagle3Draft
from draftsmith.methods.spec import DraftSpec
from draftsmith.train.unrolled import ttt_hidden_states

TTT_STEPS = 4


def _tiny_draft(layers: int, parallel: bool = False, eagle31: bool = False) -> Eagle3Draft:
    spec = DraftSpec(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=layers,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        target_hidden_size=32,
        vocab_size=50,
        draft_vocab_size=20,
        aux_layer_ids=[1, 2, 3],
        method="peagle" if parallel else "eagle3.1" if eagle31 else "eagle3",
        mask_token_id=47 if parallel else None,
        fc_norm=eagle31,
        norm_output=eagle31,
    )
    draft = Eagle3Draft(spec)
    draft.init_weights(3)  # mask_hidden too (a parameter): random and non-zero
    with torch.no_grad():
        draft.embed_tokens.weight.normal_(generator=torch.Generator().manual_seed(4))
        for p in draft.parameters():  # larger weights than the init's: the steps differ clearly from each other
            p.mul_(8.0 if p.ndim == 2 else 1.0)
        if eagle31:  # each layer's norm its own weights: a chunk normed by another layer's norm shows
            for i, norm in enumerate(draft.fc_norm):
                norm.weight.copy_(torch.linspace(0.5, 2.0, 32) * (i + 1))
    draft.set_draft_vocab(torch.arange(0, 40, 2))
    return draft.double().eval()


def _inputs(seed: int, t_len: int = 14) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids [T] and aux features [T, 3 x 32] (float64) for _tiny_draft."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (t_len,), generator=gen)
    return ids, torch.randn(t_len, 96, dtype=torch.float64, generator=gen)


@pytest.mark.parametrize("eagle31", [False, True], ids=["eagle3", "eagle3.1"])
@pytest.mark.parametrize("layers", [1, 2])
def test_ttt_step_k_is_the_kth_decode_step_from_the_same_prefix(layers, eagle31):
    """Eagle 3.1 (fc_norm, norm_output): the decoder's step reads the normed output back, as training's next step."""
    draft = _tiny_draft(layers, eagle31=eagle31)
    ids, aux = _inputs(seed=5)
    t_len = len(ids)
    with torch.no_grad():
        steps = [h[0] for h in ttt_hidden_states(draft, ids[None], aux[None], TTT_STEPS)]  # k x [T, H]
    assert not torch.allclose(steps[1], steps[2])
    runner = DraftRunner(draft)
    fused = runner.fuse(aux)
    for t in range(t_len - TTT_STEPS - 1):  # step k at t reads x_{t+k+1}
        runner.reset()
        logits, hidden = runner.step(ids[1 : t + 2], fused[: t + 1])  # the prefix 0..t, with the target's features
        for k in range(TTT_STEPS):
            if k:  # the draft's own hidden state and the next token, at position t + k
                logits, hidden = runner.step(ids[t + k + 1 : t + k + 2], hidden[None])
            with torch.no_grad():
                fed_back, expected = draft.feedback(steps[k][t]), draft.logits(steps[k][t])
            torch.testing.assert_close(hidden, fed_back, rtol=1e-12, atol=1e-12, msg=f"hidden t={t} k={k}")
            # the runner hands its logits out in float32: equal up to that rounding
            torch.testing.assert_close(logits, expected.float(), rtol=1e-6, atol=1e-6, msg=f"logits t={t} k={k}")


@pytest.mark.parametrize("layers", [1, 2])
def test_peagle_depth_d_is_the_dth_parallel_proposal_from_the_same_prefix(layers):
    draft = _tiny_draft(layers, parallel=True)
    assert draft.mask_hidden.abs().min() > 0
    ids, aux = _inputs(seed=6)
    t_len = len(ids)
    with torch.no_grad():
        depths = [h[0] for h in ttt_hidden_states(draft, ids[None], aux[None], TTT_STEPS)]  # d x [T, H]
    for a in range(TTT_STEPS):  # a real test: every depth is its own prediction (the mask slots are not inert)
        for b in range(a + 1, TTT_STEPS):
            assert not torch.allclose(depths[a], depths[b], rtol=1e-3, atol=1e-3), (a, b)
    runner = DraftRunner(draft)
    fused = runner.fuse(aux)
    for t in range(t_len - 1):  # the prefix 0..t reads x_1..x_{t+1}; the parallel slots read no token of the data
        runner.reset()
        logits, hidden = parallel_round(runner, ids[1 : t + 2], fused[: t + 1], TTT_STEPS)
        assert runner.length == t + TTT_STEPS
        for d in range(TTT_STEPS):
            torch.testing.assert_close(hidden[d], depths[d][t], rtol=1e-12, atol=1e-12, msg=f"hidden t={t} d={d}")
            with torch.no_grad():
                expected = draft.logits(depths[d][t])
            torch.testing.assert_close(logits[d], expected.float(), rtol=1e-6, atol=1e-6, msg=f"logits t={t} d={d}")


@pytest.mark.parametrize("layers", [1, 2])
def test_dflash_block_at_anchor_t_is_the_reference_decoders_round_from_prefix_t(layers):
    import numpy as np

    from draftsmith.methods.dflash.modeling import DFlashDraft
    from draftsmith.methods.objective import Anchors
    from draftsmith.train.blocks import block_index, dflash_hidden_states

    size = 4
    spec = _tiny_draft(layers).spec.model_copy(
        update=dict(method="dflash", block_size=size, mask_token_id=47, draft_vocab_size=50)
    )
    draft = DFlashDraft(spec)
    draft.init_weights(3)
    gen = torch.Generator().manual_seed(4)
    draft.set_target(torch.randn(50, 32, generator=gen), torch.randn(50, 32, generator=gen))
    with torch.no_grad():
        for p in draft.parameters():
            p.mul_(8.0 if p.ndim == 2 else 1.0)
    draft = draft.double().eval()
    ids, aux = _inputs(seed=7, t_len=16)
    index = block_index(np.ones((1, 16), dtype=bool), Anchors(size, 100), [0])  # every anchor 1..14
    anchors = index.anchors[0].tolist()
    assert anchors == list(range(1, 15))
    with torch.no_grad():
        hidden = next(dflash_hidden_states(draft, ids[None], aux[None], index))[0].view(len(anchors), size, -1)
        trained = draft.logits(hidden[:, 1:])  # [A, S-1, V]: block position j proposes x_{a+j}
    assert not torch.allclose(trained[:, 0], trained[:, 1], rtol=1e-3, atol=1e-3)  # positions differ
    runner = DraftRunner(draft)
    fused = runner.fuse(aux)
    for n, t in enumerate(anchors):
        runner.reset()
        if t >= 2:  # an earlier round: its context stays, its block leaves nothing behind
            u = t // 2
            runner.method.block_round(runner, fused[:u], int(ids[u]), size - 1)
            runner.crop(u)
            logits = runner.method.block_round(runner, fused[u:t], int(ids[t]), size - 1)
        else:
            logits = runner.method.block_round(runner, fused[:t], int(ids[t]), size - 1)
        assert runner.length == t
        torch.testing.assert_close(logits, trained[n].float(), rtol=1e-6, atol=1e-6, msg=f"anchor {t}")


# ---------------------------------------------------------------------------------------------- vLLM


# Tolerance: vLLM's CPU kernels and transformers' round differently in float32, so now and then the target's greedy
# token flips at a near-tie and the two decodes part ways for the rest of that prompt; per position, the accepted
# counts may then differ by a few (at most ACCEPTED_TOLERANCE of the rounds), never more.
ACCEPTED_TOLERANCE = 0.05


# The engine's length in evaluate_in_both_engines: room for the longest of the first 4 MT-bench prompts (87 tokens),
# 32 new tokens, k up to 9 and evaluate's spare 8 -- one length whatever k a draft decodes with (evaluate would size
# it by k), so that the target alone on these prompts is one and the same vLLM job for every draft compared here.
ENGINE_LEN = 160

# vLLM's target-alone runs, by their job (GenerationJob without its result path): the run a draft's is compared with
# does not depend on the draft, so the drafts of tests/test_dflash_vllm.py and tests/test_peagle_vllm.py compare
# theirs with one run of the session (one vLLM start and 128 target-alone tokens less for the second).
_TARGET_ALONE: dict[str, GenerationResult] = {}


def _target_alone(spec_request: Path, kv_cache_gb: int, timeout_s: int) -> GenerationResult:
    """vLLM's run of the target alone by the job a draft's run decoded with (`spec_request`, its REQUEST.json), the
    draft taken out: what `evaluate --baseline` runs beside it (the same worker, settings and prompts), run once per
    session for every draft that decodes with the same job."""
    from draftsmith.evaluate import vllm_runner
    from draftsmith.evaluate.vllm_worker import GenerationJob

    spec = GenerationJob.model_validate_json(spec_request.read_text())
    assert spec.draft is not None and spec.k > 0, spec
    alone = spec.model_copy(update={"draft": None, "k": 0, "result": None})
    key = alone.model_dump_json()
    if key not in _TARGET_ALONE:
        workdir = spec_request.parent
        result = vllm_runner.run_vllm(
            target=Path(spec.target),
            draft=None,
            prompts=spec.prompts,
            k=0,
            max_new_tokens=spec.max_new_tokens,
            temperature=spec.temperature,
            seed=spec.seed,
            dtype=spec.dtype,
            max_model_len=spec.max_model_len,
            kv_cache_gb=kv_cache_gb,
            timeout_s=timeout_s,
            workdir=workdir,
            trust_remote_code=spec.trust_remote_code,
            name="baseline",
            max_num_seqs=spec.max_num_seqs,
            tensor_parallel_size=spec.tensor_parallel_size,
            groups=spec.groups,
        )
        ran = GenerationJob.model_validate_json((workdir / "baseline.request.json").read_text())
        assert ran.model_copy(update={"result": None}) == alone, (ran, alone)  # the draft's job, less the draft
        _TARGET_ALONE[key] = result
    return _TARGET_ALONE[key]


def evaluate_in_both_engines(
    draft, tmp_path, monkeypatch, k: int, deep: int, num_prompts: int = 4, max_new_tokens: int = 32
) -> tuple[RunReport, RunReport]:
    """`draftsmith evaluate` of `draft` on the default target's first MT-bench prompts, temperature 0, float32, with
    the reference decoder and with vLLM (in its worker process, without an engine-core process of its own: most of
    a start on a CPU): vLLM lossless against itself without the draft (the same job less the draft: _target_alone,
    shared by the drafts that decode with the same job), k tokens a round, the reference decoder's rounds and
    per-position acceptance within ACCEPTED_TOLERANCE -- after both accepted proposals at position `deep` + 1 (a
    comparison of acceptance that is zero past position 1 passes with a wrong slot or mask layout). Returns both
    reports' runs."""
    from draftsmith import evaluate
    from draftsmith.config import EvaluateConfig

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    common = dict(
        draft=draft,
        prompts="mt-bench",
        num_prompts=num_prompts,
        max_new_tokens=max_new_tokens,
        k=[k],
        dtype="float32",
        temperature=0.0,
        vllm_kv_cache_gb=1,
        vllm_timeout_s=1200,
    )
    evaluate.run(EvaluateConfig(engine="hf", output=tmp_path / "hf", baseline=False, **common))
    evaluate.run(
        EvaluateConfig(engine="vllm", output=tmp_path / "vllm", baseline=False, max_model_len=ENGINE_LEN, **common)
    )
    hf, vl = (read_report(tmp_path / e / "report.json").runs[0] for e in ("hf", "vllm"))
    k = vl.k  # a DFlash draft's block decides
    workdir = tmp_path / "vllm" / "vllm"
    results = {
        "baseline": _target_alone(workdir / f"k{k}.request.json", common["vllm_kv_cache_gb"], common["vllm_timeout_s"]),
        f"k{k}": GenerationResult.model_validate_json((workdir / f"k{k}.result.json").read_text()),
    }
    assert results[f"k{k}"].outputs == results["baseline"].outputs  # lossless
    assert all(len(o) > 0 for o in results["baseline"].outputs)
    assert results["baseline"].spec.num_drafts == 0  # the target alone
    assert vl.num_rounds > 0 and vl.num_draft_tokens == k * vl.num_rounds, vl
    assert len(vl.accepted_per_pos) == k, vl
    assert hf.accepted_per_pos[deep] > 0 and vl.accepted_per_pos[deep] > 0, (hf, vl)  # deep into a round
    rounds = max(hf.num_rounds, vl.num_rounds)
    assert abs(hf.num_rounds - vl.num_rounds) <= ACCEPTED_TOLERANCE * rounds, (hf, vl)
    for pos, (a, b) in enumerate(zip(hf.accepted_per_pos, vl.accepted_per_pos, strict=False)):
        assert abs(a - b) <= ACCEPTED_TOLERANCE * rounds, (pos, hf.accepted_per_pos, vl.accepted_per_pos)
    return hf, vl
