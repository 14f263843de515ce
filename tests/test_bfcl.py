"""`--data bfcl-multi-turn`: the Berkeley Function Calling Leaderboard's 200 multi-turn tool-use tasks (the pinned
bfcl-eval wheel) as conversations, their ground-truth calls executed by BFCL's own offline backends.

Checked against BFCL's files read here directly: every call of every turn, in order, with its arguments; results
that are what the backend's state gives (a grep finds the text the task's initial file holds); and prepare on them
with a Qwen3-shaped tool template supervises each call exactly as the template writes it."""

from __future__ import annotations

import json

import pytest
from agentic import QWEN3_MARKERS, QWEN3_SHAPED_TEMPLATE
from conftest import build_tiny_target, build_tiny_tokenizer

from draftsmith.config import PrepareConfig
from draftsmith.core import assets
from draftsmith.prepare import run as prepare_run
from draftsmith.prepare.bfcl import _ANSWERS, _QUESTIONS, conversations_path, parse_call
from draftsmith.prepare.chat import masked_spans
from draftsmith.prepare.dataset import open_prepared

pytestmark = pytest.mark.slow  # fetches the pinned bfcl-eval wheel (1.9 MB) once per machine


def _as_json(value):
    return json.loads(json.dumps(value))  # tuples as lists


@pytest.fixture(scope="module")
def bfcl():
    tree = assets.fetch_tree(assets.BFCL)
    tasks = [json.loads(line) for line in (tree / _QUESTIONS.format(split="base")).read_text().splitlines()]
    answers = {a["id"]: a for a in map(json.loads, (tree / _ANSWERS.format(split="base")).read_text().splitlines())}
    records = [json.loads(line) for line in conversations_path().read_text().splitlines()]
    return tasks, answers, records


def test_every_task_becomes_a_conversation_of_its_ground_truth_calls_and_their_results(bfcl):
    tasks, answers, records = bfcl
    assert len(records) == len(tasks) == 200
    for task, record in zip(tasks, records, strict=False):
        assert record["id"] == task["id"]
        names = {t["function"]["name"] for t in record["tools"]}
        assert names and not names & set(task.get("excluded_function", []))
        calls = [m["tool_calls"][0]["function"] for m in record["messages"] if m["role"] == "assistant"]
        expected = [parse_call(c) for turn in answers[task["id"]]["ground_truth"] for c in turn]
        assert [c["name"] for c in calls] == [name for name, _, _ in expected]
        for call, (_, args, kwargs) in zip(calls, expected, strict=False):
            assert call["name"] in names
            arguments = json.loads(call["arguments"])  # a JSON string, as an OpenAI server returns it
            # keyword arguments by their names; positional ones named by the function, in its order
            assert len(arguments) == len(args) + len(kwargs)
            assert {k: arguments[k] for k in kwargs} == _as_json(kwargs)
            assert [v for k, v in arguments.items() if k not in kwargs] == _as_json(args)
        users = [m["content"] for m in record["messages"] if m["role"] == "user"]
        assert users == [m["content"] for turn in task["question"] for m in turn]
        # each call is answered by its result, in order
        for i, m in enumerate(record["messages"]):
            if m["role"] == "assistant":
                result = record["messages"][i + 1]
                assert result["role"] == "tool" and result["tool_call_id"] == m["tool_calls"][0]["id"]
    # the backends really ran from each task's state: task 0's grep finds what its initial file says
    first = records[0]["messages"]
    grep = next(
        i for i, m in enumerate(first) if m["role"] == "assistant" and m["tool_calls"][0]["function"]["name"] == "grep"
    )
    assert "budget analysis" in first[grep + 1]["content"]
    assert sum(m["role"] == "tool" for r in records for m in r["messages"]) > 1000


def test_the_unpacked_wheel_is_verified_and_repaired(bfcl):
    tree = assets.fetch_tree(assets.BFCL)
    doc = tree / "bfcl_eval/data/multi_turn_func_doc/math_api.json"
    original = doc.read_bytes()
    doc.write_bytes(original.replace(b"absolute", b"ABSOLUTE"))
    assert not assets._tree_is_intact(tree, assets.BFCL)
    assert assets.fetch_tree(assets.BFCL) == tree and doc.read_bytes() == original
    # a tree unpacked before a member was pinned (the long-context split) is unpacked again, with it
    marker = json.loads((tree / "draftsmith-tree.json").read_text())
    split = "bfcl_eval/data/BFCL_v4_multi_turn_long_context.json"
    del marker["members"][split]
    (tree / "draftsmith-tree.json").write_text(json.dumps(marker))
    assert not assets._tree_is_intact(tree, assets.BFCL)
    assert (
        assets.fetch_tree(assets.BFCL) == tree
        and split in json.loads((tree / "draftsmith-tree.json").read_text())["members"]
    )
    rows = [json.loads(line) for line in conversations_path("bfcl-multi-turn-long-context").open()]
    assert len(rows) == 200 and all(r["tools"] and r["messages"] for r in rows)


def test_prepare_supervises_every_bfcl_call_as_the_template_writes_it(bfcl, tmp_path):
    _, _, records = bfcl
    target = build_tiny_target(
        tmp_path / "target", chat_template=QWEN3_SHAPED_TEMPLATE.read_text(), added_tokens=QWEN3_MARKERS
    )
    result = prepare_run(
        PrepareConfig(
            data=["bfcl-multi-turn"], target=str(target), output=tmp_path / "out", num_workers=1, max_length=65536
        )
    )
    assert result.summary["conversations"] == 200 and result.summary["skipped"] == 0
    tok = build_tiny_tokenizer(QWEN3_SHAPED_TEMPLATE.read_text(), added_tokens=QWEN3_MARKERS)
    ds = open_prepared(tmp_path / "out")
    runs = [
        tok.decode(run, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        for i in range(len(ds))
        for run in masked_spans(ds[i]["input_ids"].numpy(), ds[i]["loss_mask"].numpy())
    ]
    expected = []
    for record in records:
        for m in record["messages"]:
            if m["role"] == "assistant":
                call = m["tool_calls"][0]["function"]
                arguments = json.dumps(json.loads(call["arguments"]), ensure_ascii=False)
                # no reasoning recorded: the model writes an empty <think> block, then the call
                expected.append(
                    f'<think>\n\n</think>\n\n<tool_call>\n{{"name": "{call["name"]}", "arguments": '
                    f"{arguments}}}\n</tool_call><|im_end|>"
                )
    assert runs == expected and len(runs) == 1142
    # that empty block is dropped from later contexts, so every call saw a context of its own: one sample each
    stats = ds.manifest.stats
    assert len(ds) == 1142 and stats["layout_tokens"] > stats["one_sample_per_conversation_tokens"]
