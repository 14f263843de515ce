"""`draftsmith evaluate` with the reference decoder: prompt sets, the report and charts, refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import random_eagle3_export

from draftsmith import evaluate
from draftsmith.config import EvaluateConfig
from draftsmith.core import targets
from draftsmith.core.errors import DraftsmithError
from draftsmith.evaluate.prompts import load_prompts
from draftsmith.evaluate.report import ACCEPTANCE_PNG, REPORT_JSON, REPORT_MD, TAU_PNG, read_report
from draftsmith.evaluate.segments import SEGMENTS, Segmenter
from draftsmith.methods.artefact import load_draft

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def exported(tiny_target_dir, tmp_path_factory):
    return random_eagle3_export(tiny_target_dir, tmp_path_factory.mktemp("eval") / "export", dtype="fp32")


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello! How are you?"},
                {"role": "assistant", "content": "Fine."},
            ]
        },
        {"conversations": [{"from": "human", "value": "What is the capital of France?"}]},
        {"turns": ["Explain speculative decoding.", "Shorter, please."]},
        {"not a": "conversation"},
        {"prompt": "def add(a, b):"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_prompts_from_a_file_are_chat_rendered_up_to_the_first_answer(tiny_target_dir, prompt_file):
    tokenizer = targets.load_tokenizer(tiny_target_dir)
    prompts = load_prompts(str(prompt_file), tokenizer)
    assert len(prompts) == 4  # the record without a conversation is skipped
    texts = [tokenizer.decode(p.token_ids) for p in prompts]
    assert texts[0] == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello! How are you?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert "Fine." not in texts[0]
    assert all(t.endswith("<|im_start|>assistant\n") for t in texts)
    assert "Shorter" not in texts[2]  # MT-bench style: the first turn
    assert len(load_prompts(str(prompt_file), tokenizer, num_prompts=2)) == 2


def test_mtbench_prompts(tiny_target_dir, mtbench_file):
    prompts = load_prompts("mt-bench", targets.load_tokenizer(tiny_target_dir))
    assert len(prompts) == 80 and prompts[0].id == "81"


def test_the_suite_names_its_domains_and_refuses_an_unknown_one_in_one_line():
    from draftsmith.evaluate.prompts import suite_domains

    assert suite_domains("suite") == ["chat", "code", "math", "agentic"]
    assert suite_domains("suite:math,humaneval") == ["code", "math"]  # set names too, in the suite's order
    assert suite_domains("mt-bench") is None and suite_domains("suites.jsonl") is None
    with pytest.raises(DraftsmithError, match=r"no domain 'poetry' \(its domains: chat \(mt-bench\), code"):
        suite_domains("suite:chat,poetry")


def test_each_domain_of_the_suite_is_read_from_its_pinned_asset(tiny_target_dir):
    from draftsmith.evaluate.prompts import load_domains

    tokenizer = targets.load_tokenizer(tiny_target_dir)
    domains = load_domains("suite", tokenizer, num_prompts=2)
    assert [(d.name, d.source, len(d.prompts)) for d in domains] == [
        ("chat", "mt-bench", 2),
        ("code", "humaneval", 2),
        ("math", "jee-math", 2),
        ("agentic", "bfcl-multi-turn", 2),
    ]
    assert [d.prompts[0].id for d in domains] == ["81", "HumanEval/0", "jee-0", "multi_turn_base_0"]
    code, math = (tokenizer.decode(d.prompts[0].token_ids) for d in domains[1:3])
    assert "Complete the following Python function" in code and "def has_close_elements(numbers" in code
    assert "You are MathGPT" in math and "f : {1, 2, 3, 4}" in math  # its system prompt, then the question
    assert [len(load_prompts(n, tokenizer)) for n in ("humaneval", "jee-math")] == [164, 434]


def test_prompts_from_a_prepared_sets_held_out_split(tiny_target_dir, tmp_path):
    from draftsmith.prepare.dataset import split_indices, write_prepared

    rng = np.random.default_rng(0)
    samples = []
    for i in range(20):
        ids = rng.integers(4, 300, size=30)
        mask = np.zeros(30, dtype=np.int64)
        mask[10 + i % 5 :] = 1
        samples.append({"input_ids": ids, "loss_mask": mask})
    identity = targets.target_identity(tiny_target_dir)
    write_prepared(tmp_path / "prep", samples, identity, chat_template_hash="t", max_length=64)
    tokenizer = targets.load_tokenizer(tiny_target_dir)
    prompts = load_prompts(str(tmp_path / "prep"), tokenizer, target=identity, eval_fraction=0.2, split_seed=3)
    _, held_out = split_indices(20, 0.2, 3)
    assert [p.id for p in prompts] == [f"sample-{i}" for i in held_out]
    for p, i in zip(prompts, held_out, strict=False):
        assert p.token_ids == samples[i]["input_ids"][: 10 + i % 5].tolist()  # cut before the first answer token
    other = identity.model_copy(update={"config_hash": "other"})
    with pytest.raises(DraftsmithError, match="prepared for another target"):
        load_prompts(str(tmp_path / "prep"), tokenizer, target=other)


def test_evaluate_hf_writes_report_and_charts(exported, prompt_file, tmp_path):
    out = tmp_path / "eval"
    result = evaluate.run(
        EvaluateConfig(
            draft=exported,
            prompts=str(prompt_file),
            num_prompts=3,
            max_new_tokens=12,
            k=[1, 3],
            output=out,
            device="cpu",
        )
    )
    report = read_report(out / REPORT_JSON)
    assert result.result == report  # report.json reads back as the stage returned it
    assert report.engine == "hf" and report.num_prompts == 3
    assert [r.k for r in report.runs] == [1, 3]
    for run in report.runs:
        assert run.tau >= 1.0 and len(run.acceptance_per_pos) == run.k
        assert report.baseline is not None
        assert run.num_new_tokens == 36 or run.num_new_tokens == report.baseline.num_new_tokens
        assert run.speedup is not None and run.speedup > 0
    assert report.lossless == {"k=1": "3/3 prompts", "k=3": "3/3 prompts"}
    for png in (ACCEPTANCE_PNG, TAU_PNG):
        assert (out / png).read_bytes()[:8] == PNG_MAGIC
    md = (out / REPORT_MD).read_text()
    assert "| k | τ |" in md and ACCEPTANCE_PNG in md
    assert result.summary["k=3 τ"] == round(report.runs[1].tau, 3)  # the CLI's table shows the report's numbers
    for run in report.runs:  # τ per prompt, and its interval over them around the whole run's τ
        assert len(run.per_prompt) == 3 and sum(r for r, _ in run.per_prompt) == run.num_rounds
        assert sum(a for _, a in run.per_prompt) == run.num_accepted
        assert run.tau_95 is not None
        low, high = run.tau_95
        assert 1.0 <= low <= run.tau <= high <= 1 + run.k
    assert "τ 95 % interval" in md
    assert (out / "config.yaml").is_file()


def test_evaluate_refuses_a_draft_for_another_target(exported, prompt_file, tmp_path):
    from conftest import build_tiny_target

    wide = build_tiny_target(tmp_path / "wide", hidden_size=128)
    with pytest.raises(DraftsmithError, match=r"another target \(hidden size 64 != 128"):
        evaluate.run(EvaluateConfig(draft=exported, target=str(wide), prompts=str(prompt_file), output=tmp_path / "e"))
    deeper = build_tiny_target(tmp_path / "deeper", num_layers=5)  # same shapes, another model
    with pytest.raises(DraftsmithError, match=r"trained for target .*, not .*deeper \(config_hash"):
        evaluate.run(
            EvaluateConfig(draft=exported, target=str(deeper), prompts=str(prompt_file), output=tmp_path / "e")
        )


def test_evaluate_reads_a_training_checkpoint(tiny_target_dir, exported, prompt_file, tmp_path):
    from draftsmith.methods.artefact import CheckpointManifest
    from draftsmith.train.checkpoint import save_checkpoint

    source = load_draft(exported)
    model = targets.load_target(tiny_target_dir)
    draft = evaluate.build_draft_module(source, model, torch.device("cpu"), torch.float32)
    manifest = CheckpointManifest(target=source.target, draft=source.spec, step=3)
    save_checkpoint(tmp_path / "run", manifest, draft.state_dict(), None, best=True)
    from_ckpt = load_draft(tmp_path / "run")
    assert from_ckpt.spec == source.spec
    for name, t in source.tensors.items():
        assert torch.equal(from_ckpt.tensors[name], t), name
    result = evaluate.run(
        EvaluateConfig(
            draft=tmp_path / "run",
            prompts=str(prompt_file),
            num_prompts=1,
            max_new_tokens=6,
            k=[2],
            output=tmp_path / "e",
            baseline=False,
        )
    )
    report = read_report(tmp_path / "e" / REPORT_JSON)
    assert result.result == report and report.baseline is None and report.runs[0].speedup is None


def test_vllm_counters_become_decode_stats():
    """The worker sums vLLM's spec-decode counters and takes deltas over the timed call; τ as vLLM defines it."""
    from types import SimpleNamespace as NS

    from draftsmith.evaluate.vllm_runner import stats_from_vllm
    from draftsmith.evaluate.vllm_worker import GenerationResult, SpecCounts, read_spec_metrics

    class FakeLLM:
        def __init__(self, drafts, accepted, per_pos):
            self.metrics = [
                NS(name="vllm:spec_decode_num_drafts", value=drafts),
                NS(name="vllm:spec_decode_num_draft_tokens", value=3 * drafts),
                NS(name="vllm:spec_decode_num_accepted_tokens", value=accepted),
                NS(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=per_pos),
                NS(name="vllm:num_requests_running", value=1),
            ]

        def get_metrics(self):
            return self.metrics

    before = read_spec_metrics(FakeLLM(2, 1, [1, 0, 0]))
    after = read_spec_metrics(FakeLLM(12, 16, [9, 5, 2]))
    spec = after.minus(before)
    assert spec == SpecCounts(
        num_drafts=10,
        num_draft_tokens=30,
        num_accepted_tokens=15,
        num_accepted_tokens_per_pos=[8, 5, 2],
    )
    result = GenerationResult(spec=spec, outputs=[[1] * 20, [2] * 5], elapsed_s=5.0)
    assert GenerationResult.model_validate_json(result.model_dump_json()) == result  # as RESULT.json carries it
    stats = stats_from_vllm(result, 3)
    assert stats.tau == 2.5 and stats.acceptance_per_pos == [0.8, 0.5, 0.2]
    assert stats.num_new_tokens == 25 and stats.tokens_per_s == 5.0


def test_a_suite_reports_each_domain_as_evaluated_alone_and_their_whole(exported, tmp_path):
    """Each domain's row is what that prompt set gives evaluated alone; the whole is their sum."""
    settings = dict(draft=exported, num_prompts=2, max_new_tokens=10, k=[2], device="cpu")
    result = evaluate.run(EvaluateConfig(**settings, prompts="suite:chat,code", output=tmp_path / "suite"))
    report = read_report(tmp_path / "suite")
    assert [(d.name, d.num_prompts) for d in report.domains] == [("chat", 2), ("code", 2)] and report.num_prompts == 4
    [whole] = report.runs
    parts = [d.runs[0] for d in report.domains]
    assert all(p.num_rounds > 0 for p in parts)
    assert whole.num_rounds == sum(p.num_rounds for p in parts)
    assert whole.num_accepted == sum(p.num_accepted for p in parts)
    assert whole.per_prompt == parts[0].per_prompt + parts[1].per_prompt
    assert report.baseline.num_new_tokens == sum(d.baseline.num_new_tokens for d in report.domains)
    alone = evaluate.run(EvaluateConfig(**settings, prompts="humaneval", output=tmp_path / "code")).result
    assert alone.domains == [] and alone.runs[0].per_prompt == parts[1].per_prompt
    assert alone.runs[0].accepted_per_pos == parts[1].accepted_per_pos
    md = (tmp_path / "suite" / REPORT_MD).read_text()
    assert "By domain:" in md and f"| code | humaneval (2) | 2 | {parts[1].tau:.3f} |" in md
    assert (tmp_path / "suite" / "tau_by_domain.png").read_bytes()[:8] == PNG_MAGIC
    assert result.summary["k=2 τ by domain"].startswith(f"chat {parts[0].tau:.3f}")


def test_vllms_verify_steps_are_rounds_from_the_token_after_the_prefills():
    from draftsmith.evaluate.segments import step_rounds

    assert step_rounds([2, 0, 3]) == [(1, 2), (4, 0), (5, 3)]
    assert step_rounds([]) == []


def test_tau_interval_over_prompts():
    """The bootstrap interval: none for one prompt, tight for prompts that agree, wide for prompts that differ."""
    from draftsmith.evaluate.specdec import DecodeStats

    one = DecodeStats(k=3, num_prompts=1, num_rounds=10, num_accepted=5)
    assert one.tau_interval() is None
    alike, mixed = DecodeStats(k=3), DecodeStats(k=3)
    for i in range(20):
        alike.add(DecodeStats(k=3, num_prompts=1, num_rounds=10, num_accepted=5))
        mixed.add(DecodeStats(k=3, num_prompts=1, num_rounds=10, num_accepted=0 if i % 2 else 10))
    assert alike.tau == mixed.tau == 1.5 and len(alike.per_prompt) == 20
    assert alike.tau_interval() == (1.5, 1.5)
    low, high = mixed.tau_interval()
    assert 1.2 < low < 1.5 < high < 1.8


def test_vllm_context_fits_the_targets_own_context():
    """vLLM's max_model_len for an evaluation: the longest prompt + new tokens + k (+8), cut at the target's declared
    context (generation then stops there, as the target alone would); a prompt leaving no room for one new token is
    refused in one line naming the prompt file and the prompt."""
    from draftsmith.evaluate.prompts import Prompt
    from draftsmith.evaluate.stage import _engine_context

    cfg = EvaluateConfig(draft="d", prompts="prompts.jsonl", max_new_tokens=64, k=[3, 5])
    prompts = [Prompt("a", [1] * 100), Prompt("b", [1] * 2000)]
    assert _engine_context(prompts, cfg, None) == 2000 + 64 + 5 + 8
    assert _engine_context(prompts, cfg, 4096) == 2000 + 64 + 5 + 8
    assert _engine_context(prompts, cfg, 2048) == 2048  # the target's whole context, no more
    with pytest.raises(DraftsmithError, match=r"prompts.jsonl: prompt 1 has 2000 tokens, no room .* context of 2000"):
        _engine_context(prompts, cfg, 2000)


def test_engine_auto_is_vllm_where_it_decodes_the_draft_here_else_the_reference_decoder(exported, monkeypatch, capfd):
    from pathlib import Path

    from draftsmith.evaluate import stage, vllm_runner

    source, cfg = load_draft(exported), EvaluateConfig(draft=exported, engine="auto")
    monkeypatch.setattr(vllm_runner, "vllm_verdict", lambda *a, **k: vllm_runner.VllmVerdict("0.32.0", None, None))
    assert stage._engine(cfg, source, Path("target")).engine == "vllm"
    why = "vLLM 0.16.0 cannot run EAGLE-3 speculative decoding here: its CPU runner asserts"
    monkeypatch.setattr(vllm_runner, "vllm_verdict", lambda *a, **k: vllm_runner.VllmVerdict("0.16.0", why, "no"))
    assert stage._engine(cfg, source, Path("target")).engine == "hf"
    assert f"evaluate --engine auto: reference decoder ({why})" in capfd.readouterr().err
    assert stage._engine(cfg.model_copy(update={"engine": "vllm"}), source, Path("target")).engine == "vllm"


def test_vllms_domains_and_their_split_are_read_from_one_engines_result(tiny_target_dir):
    """A worker result holding two domains (each its own `generate`): each domain's counters, outputs and per-prompt
    counts; its rounds by segment from the verify steps where vLLM kept them, else the one line that says it did not."""
    from draftsmith.evaluate import vllm_runner
    from draftsmith.evaluate.prompts import Prompt
    from draftsmith.evaluate.vllm_worker import GenerationResult, GroupResult, SpecCounts

    tokenizer = targets.load_tokenizer(tiny_target_dir)
    think = tokenizer("<think>a b</think> c d e f", add_special_tokens=False)["input_ids"]
    prompts = [Prompt("a", [5, 6]), Prompt("b", [7]), Prompt("c", [8, 9])]
    groups = [
        GroupResult(size=1, elapsed_s=2.0, spec=SpecCounts(num_drafts=3, num_accepted_tokens=2)),
        GroupResult(size=2, elapsed_s=4.0, spec=SpecCounts(num_drafts=5, num_accepted_tokens=4)),
    ]
    outputs = [think, [11, 12, 13], [14, 15]]
    result = GenerationResult(
        elapsed_s=6.0,
        outputs=outputs,
        spec=SpecCounts(num_drafts=8, num_accepted_tokens=6),
        per_prompt=[(3, 2), (3, 3), (2, 1)],
        per_step=[[1, 0, 1], [1, 1, 1], [1, 0]],
        groups=groups,
    )
    first, second = (
        vllm_runner.served_domain({2: result}, i, p, tokenizer, "float32")
        for i, p in enumerate([prompts[:1], prompts[1:]])
    )
    assert (second.stats[2].num_rounds, second.stats[2].num_accepted, second.stats[2].elapsed_s) == (5, 4, 4.0)
    assert second.outputs[2] == outputs[1:] and second.stats[2].per_prompt == [(3, 3), (2, 1)]
    assert second.stats[2].num_new_tokens == 5 and first.stats[2].num_new_tokens == len(think)
    labels = Segmenter(tokenizer).labels(prompts[0].token_ids, think)
    expected = {name: sum(1 for start, _ in [(1, 1), (3, 0), (4, 1)] if labels[start] == name) for name in SEGMENTS}
    assert {n: c.num_rounds for n, c in first.by_segment[2].items()} == expected and expected["reasoning"] > 0
    none = result.model_copy(update={"per_step": None})
    alone = vllm_runner.served_domain({2: none}, 0, prompts[:1], tokenizer, "float32")
    assert alone.by_segment == {} and "keeps no per-request verify steps" in (alone.segments_note or "")
