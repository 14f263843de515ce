"""`draftsmith improve` on a tiny target with the reference decoder: the split, the decision, the versions and the
`current` link, resuming; the same in real vLLM on the default target is tests/test_improve_vllm.py."""

from __future__ import annotations

import json
import os
import stat

import pytest
from conftest import random_eagle3_export

from draftsmith import improve
from draftsmith.config import ImproveConfig
from draftsmith.core import recording
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.targets import target_identity
from draftsmith.evaluate.report import EvaluationReport, RunReport

ANSWERS = ["Paris is the capital of France.", "The quick brown fox jumps over the lazy dog.", "1 2 3 4 5 6 7 8 9 10"]


def _record(i: int, target: str, acceptance: float | None = None) -> dict:
    return {
        "messages": [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": ANSWERS[i % 3]}],
        "recorded": {
            "time": 1000.0 + i,
            "endpoint": "chat",
            "target": target,
            "acceptance": None if acceptance is None else {"mean_acceptance_length": acceptance},
        },
    }


def _recording(where, target: str, n: int, acceptance=lambda i: None):
    writer = recording.RecordingWriter(where, recording.ServerInfo(target=target, target_path="t"))
    for i in range(n):
        writer.append(_record(i, target, acceptance(i)))
    writer.close()
    return where


def _fingerprint(target_dir) -> str:
    identity = target_identity(target_dir)
    return recording.fingerprint(identity.config_hash, identity.tokenizer_hash)


def _run(k: int, tau: float, interval: tuple[float, float] | None, prompts: int = 8) -> EvaluationReport:
    run = RunReport(k=k, tau=tau, acceptance_per_pos=[0.5] * k, tokens_per_s=1.0, tau_95=interval, num_prompts=prompts)
    return EvaluationReport(
        engine="vllm",
        target="t",
        draft="d",
        prompts="p",
        num_prompts=prompts,
        max_new_tokens=8,
        temperature=0.0,
        runs=[run],
    )


def test_only_a_candidate_above_the_current_drafts_interval_that_passed_its_gate_is_promoted():
    now = _run(3, 1.5, (1.4, 1.6))
    promote, why = improve.decide(now, _run(3, 1.9, (1.7, 2.1)), 3, {})
    assert promote and "better beyond the intervals" in why and "1.900 [1.700, 2.100]" in why
    promote, why = improve.decide(now, _run(3, 1.7, (1.55, 1.85)), 3, {})  # higher, the intervals overlap
    assert not promote and "not better beyond the intervals" in why
    promote, why = improve.decide(now, _run(3, 1.9, (1.7, 2.1)), 3, {"prove candidate": "vLLM differs at position 2"})
    assert not promote and "failed the gate (vLLM differs at position 2)" in why
    promote, why = improve.decide(now, _run(3, 1.9, (1.7, 2.1)), 3, {"prove current": "a config key differs"})
    assert promote and why.endswith("; the current draft failed its gate (a config key differs)")  # said, not hidden
    promote, why = improve.decide(now, _run(3, 1.9, None), 3, {})
    assert not promote and "no per-request interval" in why


def test_the_split_holds_out_the_newest_and_worst_selects_the_lowest_acceptance(tmp_path):
    where = _recording(tmp_path / "rec", "t", 10, acceptance=lambda i: float(10 - i) if i != 3 else None)
    writer = recording.RecordingWriter(where, recording.ServerInfo(target="u", target_path="u"))
    writer.append(_record(99, "another"))
    writer.close()
    cfg = ImproveConfig(recording=where, held_out=0.2, select="worst:0.5")
    done = improve.split(cfg, "t", tmp_path / "data")
    assert (done["train"], done["held out"], done["left out"]) == (4, 2, {"recorded for another target": 1})
    read = [
        [json.loads(line) for line in (tmp_path / "data" / name).read_text().splitlines()] for name in improve.SPLIT
    ]
    assert [r["recorded"]["time"] for r in read[1]] == [1008.0, 1009.0]  # the newest, never trained on
    # the worst half of the 8 older requests that carry acceptance (10 - i: the latest are worst; #3 has none)
    assert [r["recorded"]["time"] for r in read[0]] == [1007.0, 1006.0, 1005.0, 1004.0]
    assert all(stat.S_IMODE(os.stat(tmp_path / "data" / n).st_mode) == 0o600 for n in improve.SPLIT)
    bare = _recording(tmp_path / "bare", "t", 6)
    with pytest.raises(DraftsmithError, match="carries its acceptance"):
        improve.split(ImproveConfig(recording=bare, select="worst:0.5"), "t", tmp_path / "d2")
    with pytest.raises(DraftsmithError, match="too few to hold out"):
        improve.split(ImproveConfig(recording=_recording(tmp_path / "one", "t", 1)), "t", tmp_path / "d3")


def test_a_round_on_a_tiny_target_resumes_proves_both_drafts_and_promotes_the_better(
    tmp_path, tiny_target_dir, monkeypatch
):
    draft = random_eagle3_export(tiny_target_dir, tmp_path / "draft", (1, 2, 3), speculative_tokens=2)
    where = _recording(tmp_path / "rec", _fingerprint(tiny_target_dir), 20)
    out = tmp_path / "improve"
    cfg = ImproveConfig(
        draft=draft,
        recording=where,
        output=out,
        engine="hf",
        max_steps=30,
        lr=3e-3,
        token_budget=256,
        max_new_tokens=12,
        device="cpu",
    )
    proven = improve._prove

    def interrupted(config):
        if "candidate" in str(config.draft):
            raise KeyboardInterrupt
        return proven(config)

    monkeypatch.setattr(improve, "_prove", interrupted)
    with pytest.raises(KeyboardInterrupt):
        improve.run(cfg)
    state_path = out / "rounds" / "001" / improve.STATE
    trained = json.loads(state_path.read_text())["finished"]["train"]
    assert os.readlink(out / improve.CURRENT) == "v1" and not (out / "v2").exists()
    with pytest.raises(DraftsmithError, match=r"unfinished round started with other options \(max_steps\)"):
        improve.run(cfg.model_copy(update={"max_steps": 31}))
    monkeypatch.setattr(improve, "_prove", proven)
    result = improve.run(cfg)  # the same command: on from where it stopped
    state = json.loads(state_path.read_text())
    assert state["finished"]["train"] == trained  # not trained again
    assert list(state["finished"]) == [
        "split",
        "prepare",
        "extract",
        "train",
        "export",
        "prove current",
        "prove candidate",
        "decide",
    ]
    # the held-out requests ask for the answers the training ones teach: the candidate is better, beyond doubt
    decided = state["finished"]["decide"]
    assert decided["promoted"] == "v2" and "better beyond the intervals" in decided["why"], decided
    assert os.readlink(out / improve.CURRENT) == "v2" and result.summary["decision"].startswith("promoted v2")
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    assert (out / "v1" / "manifest.json").read_bytes() == (draft / "manifest.json").read_bytes()
    # the first round's draft given again (the same command, the next day) is the draft served now, not a new copy
    assert improve._adopt(draft, out) == out / "v2" and not (out / "v3").exists()
    assert improve._adopt(out / "v1", out) == out / "v1"  # a version given itself: that one
    assert os.readlink(out / improve.CURRENT) == "v2"
    # a next round starts from current
    monkeypatch.setattr(improve, "_prove", lambda config: {"gate failed": "vLLM differs"})
    monkeypatch.setattr(improve, "read_report", lambda path: _run(2, 1.0, (1.0, 1.0)))
    again = improve.run(cfg.model_copy(update={"draft": out / improve.CURRENT, "max_steps": 2}))
    assert again.summary["round"].endswith("002") and "failed the gate (vLLM differs)" in again.summary["decision"]
    assert os.readlink(out / improve.CURRENT) == "v2"
