"""prepare on agentic traffic: tool-calling, reasoning conversations read without loss and each assistant generation
supervised exactly as the target's template renders it when it is generated.

The conversations come from tests/agentic.py (OpenAI messages as a server returns them: `content: null` tool-call
turns, arguments as JSON strings, `tools` as a list or a JSON string, reasoning in three spellings); the expected
supervised text of every generation is written by that module by hand, not by the template.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from agentic import (
    QWEN3_MARKERS,
    QWEN3_SHAPED_TEMPLATE,
    SHORT_TOOLS,
    TOOLS,
    agentic_conversations,
    expected_generations,
    write_jsonl,
)
from conftest import build_tiny_target, build_tiny_tokenizer

from draftsmith.config import PrepareConfig
from draftsmith.core.errors import DraftsmithError
from draftsmith.prepare import run as prepare_run
from draftsmith.prepare.chat import ChatEncoder, masked_spans
from draftsmith.prepare.dataset import open_prepared
from draftsmith.prepare.messages import Chat, Skip, normalize_conversation


def _qwen_tokenizer():
    return build_tiny_tokenizer(QWEN3_SHAPED_TEMPLATE.read_text(), added_tokens=QWEN3_MARKERS)


def _decode(tok, ids) -> str:
    return tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _runs(tok, sample) -> list[str]:
    return [_decode(tok, run) for run in masked_spans(sample["input_ids"].numpy(), sample["loss_mask"].numpy())]


def test_sixty_tool_use_conversations_are_all_kept_and_supervised_as_generated(tmp_path, qwen3_shaped_target):
    records = agentic_conversations(60)
    assert sum(m["content"] is None for r in records for m in r["messages"]) >= 60  # content: null call turns
    data = write_jsonl(tmp_path / "chats.jsonl", records)
    result = prepare_run(
        PrepareConfig(
            data=[str(data)], target=str(qwen3_shaped_target), output=tmp_path / "out", num_workers=1, max_length=4096
        )
    )
    ds = open_prepared(tmp_path / "out")
    tok = _qwen_tokenizer()
    assert result.summary["skipped"] == 0 and result.summary["conversations"] == 60
    assert result.summary["agentic conversations"] == 60

    # every generation, in order, exactly once, as the template renders it at the moment it is generated
    runs = [run for i in range(len(ds)) for run in _runs(tok, ds[i])]
    expected = [g for r in records for g in expected_generations(r)]
    assert len(expected) > 3 * 60
    assert runs == expected
    # what is never supervised: tool results, tool declarations, user and system text
    results = [m["content"] for r in records for m in r["messages"] if m["role"] == "tool"]
    users = [m["content"] for r in records for m in r["messages"] if m["role"] in ("user", "system")]
    assert not any(x in run for run in runs for x in results + users + ["<tools>", "<tool_response>"])
    # every sample declares the tools
    for i in range(len(ds)):
        text = _decode(tok, ds[i]["input_ids"])
        assert "<tools>" in text and all(t["function"]["name"] in text for t in TOOLS), i

    # the two-request conversations (every third) drop the first loop's reasoning once the second request comes:
    # the first loop is trained where it was generated, the second in its own sample (one sample per loop)
    two_requests = sum(1 for r in records if sum(m["role"] == "user" for m in r["messages"]) == 2)
    assert two_requests == 20 and len(ds) == 60 + two_requests
    stats = ds.manifest.stats
    assert stats["samples"] == 80 and stats["generations"] == len(expected) and stats["agentic_conversations"] == 60
    # the layout's cost against one sample per conversation: the first loop's context is written twice
    one = stats["one_sample_per_conversation_tokens"]
    assert one < stats["layout_tokens"] < 2 * one
    assert "1." in result.summary["samples"] and "80" in result.summary["samples"]


def test_a_tool_loop_after_one_request_is_one_sample_and_costs_no_more_tokens(tmp_path):
    tok = _qwen_tokenizer()
    record = next(r for r in agentic_conversations(6) if sum(m["role"] == "user" for m in r["messages"]) == 1)
    encoded = ChatEncoder(tok).encode(normalize_conversation(record))
    assert len(encoded.samples) == 1 and encoded.generations == len(expected_generations(record)) >= 2
    assert encoded.one_sample_tokens == len(encoded.samples[0].input_ids)


def test_enable_thinking_false_keeps_the_prefilled_think_out_of_the_loss(tmp_path, qwen3_shaped_target):
    """Qwen3 served with enable_thinking=false pre-fills an empty <think> block in the prompt: context, not
    generation."""
    record = {"messages": [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": "Cold."}]}
    data = write_jsonl(tmp_path / "chats.jsonl", [record])
    prepare_run(
        PrepareConfig(
            data=[str(data)],
            target=str(qwen3_shaped_target),
            output=tmp_path / "off",
            num_workers=1,
            chat_template_kwargs='{"enable_thinking": false}',
        )
    )
    prepare_run(PrepareConfig(data=[str(data)], target=str(qwen3_shaped_target), output=tmp_path / "on", num_workers=1))
    tok = _qwen_tokenizer()
    off, on = open_prepared(tmp_path / "off")[0], open_prepared(tmp_path / "on")[0]
    assert _runs(tok, off) == ["Cold.<|im_end|>"]
    assert _decode(tok, off["input_ids"]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nCold.<|im_end|>\n")
    assert _runs(tok, on) == ["<think>\n\n</think>\n\nCold.<|im_end|>"]  # the model writes its (empty) reasoning
    assert open_prepared(tmp_path / "off").manifest.stats["chat_template_kwargs"] == {"enable_thinking": False}


# ------------------------------------------------------------------ the same structure from every spelling


def _without_ids(chat: Chat) -> list[dict]:
    return [
        {k: v for k, v in m.items() if k != "tool_call_id"}
        | (
            {"tool_calls": [{k: v for k, v in c.items() if k != "id"} for c in m["tool_calls"]]}
            if "tool_calls" in m
            else {}
        )
        for m in chat.messages
    ]


def test_sharegpt_function_calls_and_hermes_text_read_as_openai_tool_calls():
    arguments = {"city": "Lima", "unit": "C"}
    openai = {
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "Weather in Lima?"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "Use the tool.",
                "tool_calls": [
                    {
                        "id": "c0",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": json.dumps(arguments)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c0", "name": "get_weather", "content": '{"temperature": 19}'},
            {"role": "assistant", "content": "19 degrees."},
        ],
    }
    sharegpt = {
        "tools": json.dumps([t["function"] for t in TOOLS]),
        "conversations": [
            {"from": "human", "value": "Weather in Lima?"},
            {
                "from": "function_call",
                "value": json.dumps({"name": "get_weather", "arguments": arguments}),
                "reasoning_content": "Use the tool.",
            },
            {"from": "observation", "value": '{"temperature": 19}'},
            {"from": "gpt", "value": "19 degrees."},
        ],
    }
    hermes = {
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "Weather in Lima?"},
            {
                "role": "assistant",
                "content": "<think>\nUse the tool.\n</think>\n\n<tool_call>\n"
                + json.dumps({"name": "get_weather", "arguments": arguments})
                + "\n</tool_call>",
            },
            {"role": "tool", "content": '{"temperature": 19}'},
            {"role": "assistant", "content": "19 degrees."},
        ],
    }
    chats = [normalize_conversation(r) for r in (openai, sharegpt, hermes)]
    # a chat that only quotes the format (no tools declared, no tool results) keeps it as text
    quoted = {
        "messages": [
            {"role": "user", "content": "What does a Hermes call look like?"},
            {"role": "assistant", "content": "Like <tool_call>{name: x}</tool_call>."},
        ]
    }
    assert normalize_conversation(quoted).messages[1] == quoted["messages"][1]
    assert all(c.tools == TOOLS for c in chats)
    assert _without_ids(chats[0]) == _without_ids(chats[1]) == _without_ids(chats[2])
    call = chats[0].messages[1]
    assert call == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Use the tool.",
        "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}],
    }
    assert chats[0].messages[2] == {
        "role": "tool",
        "content": '{"temperature": 19}',
        "tool_call_id": "c0",
        "name": "get_weather",
    }
    assert chats[1].messages[2]["name"] == "get_weather"  # the observation answers the call before it


def test_vllms_reasoning_field_and_inline_think_are_split_the_same_way():
    base = [{"role": "user", "content": "2 + 2?"}]
    spelled = [
        {"role": "assistant", "content": "4", "reasoning_content": "Add."},
        {"role": "assistant", "content": "4", "reasoning": "Add."},
        {"role": "assistant", "content": "<think>\nAdd.\n</think>\n\n4"},
        {"role": "assistant", "content": "Add.</think>4"},
    ]  # DeepSeek-R1 style: the <think> was pre-filled
    assert {json.dumps(normalize_conversation({"messages": base + [m]}).messages) for m in spelled} == {
        json.dumps(base + [{"role": "assistant", "content": "4", "reasoning_content": "Add."}])
    }


def test_a_template_without_reasoning_sees_it_inline_and_one_without_tools_is_a_counted_skip():
    from conftest import CHATML_TEMPLATE

    tok = build_tiny_tokenizer(CHATML_TEMPLATE)
    encoder = ChatEncoder(tok)
    assert (encoder.features.tools, encoder.features.tool_calls, encoder.features.reasoning) == (False, False, False)
    chat = normalize_conversation(
        {
            "messages": [
                {"role": "user", "content": "2 + 2?"},
                {"role": "assistant", "content": "4", "reasoning": "Add."},
            ]
        }
    )
    [sample] = encoder.encode(chat).samples
    assert [_decode(tok, run) for run in masked_spans(sample.input_ids, sample.loss_mask)] == [
        "<think>\nAdd.\n</think>\n\n4<|im_end|>"
    ]
    # reasoning that came inline stays as it was written
    written = normalize_conversation(
        {"messages": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "<think>Add.</think>4"}]}
    )
    [sample] = encoder.encode(written).samples
    assert [_decode(tok, run) for run in masked_spans(sample.input_ids, sample.loss_mask)] == [
        "<think>Add.</think>4<|im_end|>"
    ]
    with pytest.raises(Skip) as info:
        encoder.encode(normalize_conversation(agentic_conversations(1)[0]))
    assert info.value.reason == "chat template without tools" and "--chat-template" in info.value.detail
    qwen = ChatEncoder(_qwen_tokenizer())
    assert (qwen.features.tools, qwen.features.tool_calls, qwen.features.reasoning) == (True, True, True)


# ------------------------------------------------------------------ bad agentic input: counted skips naming the turn


def _bad(kind: str) -> dict:
    record = agentic_conversations(1)[0]
    messages = record["messages"]
    call_turn = next(i for i, m in enumerate(messages) if m.get("tool_calls"))
    if kind == "arguments not JSON":
        messages[call_turn]["tool_calls"][0]["function"]["arguments"] = "{city: Paris"
    elif kind == "a result for no call":
        messages[call_turn + 1]["tool_call_id"] = "call_nobody_made"
    elif kind == "arguments a list":
        messages[call_turn]["tool_calls"][0]["function"]["arguments"] = "[1, 2]"
    elif kind == "tools not a list":
        record["tools"] = json.dumps({"name": "get_weather"})
    elif kind == "a role nobody knows":
        messages[call_turn]["role"] = "planner"
    elif kind == "a call without a name":
        messages[call_turn]["tool_calls"][0]["function"]["name"] = ""
    return record


@pytest.mark.parametrize(
    "kind, reason, detail",
    [
        ("arguments not JSON", "malformed tool call", "the arguments of call"),
        ("a result for no call", "tool result without its call", "'call_nobody_made' matches no earlier call"),
        ("arguments a list", "malformed tool call", "arguments that are a JSON array"),
        ("tools not a list", "malformed tools", "not a list of tools"),
        ("a role nobody knows", "unknown role", "role 'planner'"),
        ("a call without a name", "malformed tool call", "without a function name"),
    ],
)
def test_bad_agentic_records_are_counted_skips_naming_file_record_and_turn(
    tmp_path, qwen3_shaped_target, kind, reason, detail
):
    records = agentic_conversations(3)
    records[1] = _bad(kind)
    data = write_jsonl(tmp_path / "chats.jsonl", records)
    result = prepare_run(
        PrepareConfig(
            data=[str(data)], target=str(qwen3_shaped_target), output=tmp_path / "out", num_workers=1, max_length=4096
        )
    )
    assert result.summary["conversations"] == 2 and result.summary[f"skipped: {reason}"] == 1
    example = open_prepared(tmp_path / "out").manifest.skip_examples[reason]
    assert example.startswith(f"{data} record 1: ") and detail in example, example
    if kind not in ("tools not a list",):
        assert "turn " in example  # the turn is named


def test_regenerate_leaves_agentic_conversations_out_in_one_counted_line(tmp_path):
    """Until regenerate answers with tools, a conversation that declares or calls tools is a counted skip there
    (never answered as plain chat)."""
    from draftsmith.prepare.readers import expand_sources
    from draftsmith.prepare.regenerate_conversations import read_records

    data = write_jsonl(
        tmp_path / "chats.jsonl",
        agentic_conversations(2)
        + [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}],
    )
    items = list(read_records(expand_sources([str(data)]), 0, "skip"))
    assert [i[0] for i in items] == ["skip", "skip", "conversation"]
    assert items[0][1] == "agentic conversation" and "tools" in items[0][3]


def test_evaluate_renders_agentic_prompts_with_their_tools_as_served(tmp_path):
    """`evaluate --prompts FILE` on agentic records: the context of each record's first answer, the record's tools
    declared and the server's template options applied (what the target is asked in serving)."""
    from draftsmith.evaluate.prompts import load_prompts

    tok = _qwen_tokenizer()
    records = agentic_conversations(4)
    data = write_jsonl(tmp_path / "agent.jsonl", records)
    prompts = load_prompts(str(data), tok, num_prompts=3)
    assert [p.id for p in prompts] == ["agentic-0", "agentic-1", "agentic-2"]
    for prompt, record in zip(prompts, records, strict=False):
        text = _decode(tok, prompt.token_ids)
        assert "<tools>" in text and all(t["function"]["name"] in text for t in TOOLS)
        assert text.endswith(record["messages"][1]["content"] + "<|im_end|>\n<|im_start|>assistant\n")
    [off] = load_prompts(str(data), tok, num_prompts=1, template_kwargs={"enable_thinking": False})
    assert _decode(tok, off.token_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


# ------------------------------------------------------------------ evaluate: acceptance by what the target writes


def test_the_segment_of_each_token_follows_the_markers_the_target_writes():
    from draftsmith.evaluate.segments import Segmenter, split_rounds

    tok = _qwen_tokenizer()
    prompt = tok("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    pieces = [
        ("reasoning", "<think>\nplan it\n</think>"),
        ("content", "\n\nSure.\n"),
        ("tool call", '<tool_call>\n{"name": "read_file", "arguments": {}}\n</tool_call>'),
        ("content", "<|im_end|>"),
    ]
    ids, expected = [], []
    for segment, text in pieces:  # tokenised apart, so every token lies in one piece
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids += piece
        expected += [segment] * len(piece)
    labels = Segmenter(tok).labels(prompt, ids)
    assert labels == expected and set(labels) == {"reasoning", "content", "tool call"}
    # a prompt that pre-fills <think> starts the answer in reasoning
    assert (
        Segmenter(tok).labels(
            prompt + tok("<think>\n", add_special_tokens=False)["input_ids"],
            tok("x</think>y", add_special_tokens=False)["input_ids"],
        )[0]
        == "reasoning"
    )
    first_tool = expected.index("tool call")
    counts = split_rounds(labels, [(0, 2), (3, 0), (first_tool, 1), (len(ids) - 1, 0)], k=2)
    assert {n: (c.num_rounds, c.num_accepted, c.accepted_per_pos) for n, c in counts.items()} == {
        "reasoning": (2, 2, [1, 1]),
        "tool call": (1, 1, [1, 0]),
        "content": (1, 0, [0, 0]),
    }


@pytest.fixture(scope="module")
def tiny_agent(tmp_path_factory):
    """A Qwen3-shaped tiny target (head_dim 32, the smallest vLLM's CPU attention takes) trained briefly on agentic
    conversations that declare the tools by name: it writes reasoning and calls."""
    from agentic import train_tiny_agent

    root = tmp_path_factory.mktemp("tiny-agent")
    target = build_tiny_target(
        root / "random", hidden_size=128, chat_template=QWEN3_SHAPED_TEMPLATE.read_text(), added_tokens=QWEN3_MARKERS
    )
    data = write_jsonl(root / "chats.jsonl", agentic_conversations(60, tools=SHORT_TOOLS))
    prepare_run(
        PrepareConfig(data=[str(data)], target=str(target), output=root / "prepared", num_workers=1, max_length=640)
    )  # each loop's first answers: what the prompts ask
    return train_tiny_agent(target, root / "prepared", root / "agent")


def _agent_draft(agent: Path, out: Path) -> Path:
    """An EAGLE-3 draft of the tiny agent (random weights), exported for vLLM in float32."""
    import torch

    from draftsmith import export
    from draftsmith.core import targets
    from draftsmith.methods.eagle3.modeling import Eagle3Draft
    from draftsmith.methods.layers import draft_tensors
    from draftsmith.methods.spec import DraftSpec

    config = json.loads((agent / "config.json").read_text())
    spec = DraftSpec.from_target_config(config, 128, 1, [1, 2, 3])
    draft = Eagle3Draft.from_target(spec, targets.load_target(agent), torch.arange(0, 256, 2))
    export.write_export(
        out,
        draft_tensors(draft.state_dict()),
        spec,
        "vllm",
        target=targets.target_identity(agent),
        verifier_architectures=["LlamaForCausalLM"],
        dtype="fp32",
    )
    return out


def test_evaluate_splits_acceptance_by_reasoning_content_and_tool_call(tiny_agent, tmp_path):
    from draftsmith import evaluate
    from draftsmith.config import EvaluateConfig
    from draftsmith.evaluate.report import REPORT_JSON, REPORT_MD

    _agent_draft(tiny_agent, tmp_path / "draft")
    prompts = write_jsonl(tmp_path / "agent.jsonl", agentic_conversations(8, seed=1, tools=SHORT_TOOLS))
    result = evaluate.run(
        EvaluateConfig(
            draft=tmp_path / "draft",
            prompts=str(prompts),
            max_new_tokens=64,
            k=[2],
            output=tmp_path / "eval",
            device="cpu",
            baseline=False,
        )
    )
    [run] = json.loads((tmp_path / "eval" / REPORT_JSON).read_text())["runs"]
    segments = run["by_segment"]
    # the target thinks, then calls a tool: both segments hold rounds, and every round is in exactly one segment
    assert segments["reasoning"]["rounds"] > 0 and segments["tool call"]["rounds"] > 0, segments
    assert sum(c["rounds"] for c in segments.values()) == run["num_rounds"]
    assert sum((c["tau"] - 1) * c["rounds"] for c in segments.values() if c["rounds"]) == pytest.approx(
        run["num_accepted"]
    )
    assert "τ by segment" in " ".join(result.summary)
    assert "| 2 | tool call |" in (tmp_path / "eval" / REPORT_MD).read_text()


def _memorised_agent_draft(agent: Path, prompts: list, root: Path) -> Path:
    """An EAGLE-3 draft that memorised the tiny agent's own greedy answers to `prompts` (its reasoning, calls and
    content), trained offline from their hf store in float32 and exported for vLLM: accepted deep in every segment."""
    import numpy as np
    import torch
    from conftest import memorise

    from draftsmith.config import ExtractConfig
    from draftsmith.core import targets
    from draftsmith.evaluate.specdec import TargetRunner, plain_generate
    from draftsmith.extract import stage as extract
    from draftsmith.prepare.dataset import write_prepared

    runner, samples = TargetRunner(targets.load_target(agent, dtype=torch.float32), []), []
    for prompt in prompts:
        ids = np.asarray(prompt.token_ids, dtype=np.int64)
        answer = plain_generate(runner, torch.from_numpy(ids), 64).tokens
        mask = np.r_[np.zeros(len(ids), dtype=np.int64), np.ones(len(answer), dtype=np.int64)]
        samples.extend([{"input_ids": np.r_[ids, answer], "loss_mask": mask}] * 4)
    write_prepared(
        root / "prepared", samples, targets.target_identity(agent), chat_template_hash="agent", max_length=1024
    )
    extract.run(
        ExtractConfig(
            prepared=root / "prepared", output=root / "store", backend="hf", compute_dtype="float32", device="cpu"
        )
    )
    return memorise(root / "store", root, method="eagle3", ttt_steps=2, max_steps=80, token_budget=2048)


@pytest.mark.vllm
def test_vllms_split_by_segment_equals_the_reference_decoders_along_vllms_output(tiny_agent, tmp_path):
    """Real vLLM (its per-request verify steps) splits the rounds of a draft that memorised the agent's answers by
    reasoning / content / tool call as the reference decoder does along vLLM's own greedy output: the same rounds in
    each segment, the same acceptance within the gate's tolerance."""
    import torch

    from draftsmith import evaluate
    from draftsmith.config import EvaluateConfig
    from draftsmith.core import targets
    from draftsmith.evaluate.prompts import load_prompts
    from draftsmith.evaluate.report import read_report
    from draftsmith.evaluate.segments import Segmenter
    from draftsmith.evaluate.vllm_worker import GenerationResult
    from draftsmith.extract.vllm.probe import probe
    from draftsmith.methods.artefact import load_draft

    tokenizer = targets.load_tokenizer(tiny_agent)
    prompts_file = write_jsonl(tmp_path / "agent.jsonl", agentic_conversations(6, seed=1, tools=SHORT_TOOLS))
    prompts = load_prompts(str(prompts_file), tokenizer)
    draft = _memorised_agent_draft(tiny_agent, prompts, tmp_path / "memorised")
    # k=4 past the 2 depths it memorised: rounds accept different lengths, so they start at uneven tokens
    settings = dict(draft=draft, prompts=str(prompts_file), max_new_tokens=64, k=[4], baseline=False)
    evaluate.run(EvaluateConfig(**settings, engine="vllm", dtype="float32", vllm_kv_cache_gb=1, output=tmp_path / "v"))
    [served] = read_report(tmp_path / "v").runs
    if not probe().facts.per_request_spec_steps:
        assert (
            served.by_segment is None and "keeps no per-request verify steps" in (tmp_path / "v/report.md").read_text()
        )
        return
    outputs = GenerationResult.model_validate_json((tmp_path / "v/vllm/k4.result.json").read_text()).outputs
    model = targets.load_target(tiny_agent, dtype=torch.float32)
    source = load_draft(draft)
    reference = evaluate.evaluate_reference(
        model,
        evaluate.build_draft_module(source, model, torch.device("cpu"), torch.float32),
        source.spec.aux_layer_ids,
        prompts,
        [4],
        max_new_tokens=64,
        temperature=0.0,
        seed=0,
        eos_ids=targets.eos_ids(tokenizer, tiny_agent),
        baseline=False,
        segmenter=Segmenter(tokenizer),
        paths={4: outputs},
    ).by_segment[4]
    assert served.by_segment is not None
    split = {name: c for name, c in served.by_segment.items() if c.rounds}
    assert {"reasoning", "tool call"} <= set(split), split  # the agent thinks, then calls
    assert 2.0 < served.tau < 4.9, served.tau  # accepted deep, not always whole
    assert set(split) == {name for name, c in reference.items() if c.num_rounds}
    for name, c in split.items():
        assert c.tau > 1.5, (name, c)  # memorised: accepted deep in every segment
        assert abs(c.rounds - reference[name].num_rounds) <= 1 + 0.03 * c.rounds, (name, c, reference[name])
        assert c.tau == pytest.approx(reference[name].tau, abs=0.05), name
    assert sum(c.rounds for c in split.values()) == served.num_rounds


@pytest.mark.vllm
def test_regenerate_with_vllm_writes_the_targets_calls_and_reasoning_that_prepare_reads(tiny_agent, tmp_path):
    """Real vLLM and its parsers (hermes, qwen3): the tiny agent answers recorded tool loops; its calls come back
    as tool_calls with the recorded results after them where the names match, and the loops it leaves end there,
    counted."""
    from draftsmith.config import RegenerateConfig
    from draftsmith.prepare import regenerate, regenerated_set

    data = write_jsonl(tmp_path / "loops.jsonl", agentic_conversations(12, seed=2, tools=SHORT_TOOLS))
    result = regenerate.run(
        RegenerateConfig(
            data=[str(data)],
            target=str(tiny_agent),
            output=tmp_path / "out",
            engine="vllm",
            tool_call_parser="hermes",
            reasoning_parser="qwen3",
            max_new_tokens=96,
            max_length=1536,
            dtype="float32",
        )
    )
    records = list(regenerated_set.read_conversations(tmp_path / "out"))
    summary = result.summary
    assert summary["engine"].startswith("vllm ") and summary["conversations"] == len(records) > 0, summary
    assert summary["conversations"] + summary["skipped"] == 12  # a first answer with a broken call: skipped, counted
    calls = [m for r in records for m in r["messages"] if m["role"] == "assistant" and m.get("tool_calls")]
    assert sum(len(m["tool_calls"]) for m in calls) == summary["tool calls written"] > 0
    assert all(isinstance(json.loads(c["function"]["arguments"]), dict) for m in calls for c in m["tool_calls"])
    assert all(m.get("reasoning_content") for r in records for m in r["messages"] if m["role"] == "assistant")
    # every spliced result answers a call the target made, by its id; the loops the target left are counted
    for r in records:
        ids: set = set()
        for m in r["messages"]:
            if m["role"] == "assistant":
                ids = {c["id"] for c in m.get("tool_calls") or []}
            elif m["role"] == "tool":
                assert m["tool_call_id"] in ids, r
    spliced = sum(m["role"] == "tool" for r in records for m in r["messages"])
    left = sum("diverged" in r["regenerated"] for r in records)
    assert spliced == summary["recorded tool results spliced"] and left == summary["tool loops ended early"]
    assert spliced + left > 0
    manifest = regenerated_set.open_regenerated(tmp_path / "out")
    assert manifest.generator.tool_call_parser == "hermes" and manifest.generator.parsers_from

    prepared = prepare_run(
        PrepareConfig(
            data=[str(tmp_path / "out")],
            target=str(tiny_agent),
            output=tmp_path / "prepared",
            num_workers=1,
            max_length=4096,
        )
    )
    assert prepared.summary["skipped"] == 0 and prepared.summary["conversations"] == len(records)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the cross-check renders with vLLM's own code")
def test_check_with_vllm_compares_every_prompt_with_vllms_own_rendering(tmp_path, qwen3_shaped_target):
    data = write_jsonl(tmp_path / "chats.jsonl", agentic_conversations(6))
    result = prepare_run(
        PrepareConfig(
            data=[str(data)],
            target=str(qwen3_shaped_target),
            output=tmp_path / "out",
            num_workers=1,
            max_length=4096,
            check_with_vllm=4,
        )
    )
    generations = sum(len(expected_generations(r)) for r in agentic_conversations(6)[:4])
    assert result.summary["rendering checked against"].endswith(
        f": 4 conversations, {generations} prompts token for token the same"
    )
    # Served with thinking off, the template pre-fills an empty <think> block, where these records hold reasoning:
    # the contexts draftsmith trains in are not what the server's prompts would be, and the check says where.
    with pytest.raises(
        DraftsmithError,
        match=r"^chats.jsonl record 0: the prompt of turn 2 differs from vLLM "
        r"\S+'s rendering at token \d+ of \d+: draftsmith nothing \(the prompt ends there\), vLLM ",
    ):
        prepare_run(
            PrepareConfig(
                data=[str(data)],
                target=str(qwen3_shaped_target),
                output=tmp_path / "off",
                num_workers=1,
                max_length=4096,
                check_with_vllm=4,
                chat_template_kwargs={"enable_thinking": False},
            )
        )
    assert not (tmp_path / "off").exists()
