"""Agentic conversations for the tests, as an OpenAI-compatible server returns them and as agent frameworks log them:
multi-turn tool use in OpenAI `messages` with the request's `tools`, assistant turns that only call tools
(`content: null`, arguments a JSON string), `tool` results with `tool_call_id` and `name`, and the model's reasoning
in `reasoning_content` (or vLLM's newer `reasoning`, or inline `<think>`).

`expected_generations(record)` writes, independently of any chat template code, what a Qwen3-shaped template
(tests/data/qwen3_shaped_tools.jinja) renders for each assistant generation at the moment it is generated: its
reasoning block, content, `<tool_call>` section and end-of-turn marker.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

QWEN3_SHAPED_TEMPLATE = Path(__file__).parent / "data" / "qwen3_shaped_tools.jinja"
# the markers Qwen3's tokenizer holds as whole tokens
QWEN3_MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_flights",
            "description": "Flights between two airports on a date.",
            "parameters": {
                "type": "object",
                "properties": {
                    "origin": {"type": "string"},
                    "destination": {"type": "string"},
                    "date": {"type": "string"},
                },
                "required": ["origin", "destination", "date"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a text file from the workspace.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the test suite and report failures.",
            "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}}},
        },
    },
]
# the same tools by name only: a short declaration, for the tiny targets that learn to call them
SHORT_TOOLS = [{"type": "function", "function": {"name": t["function"]["name"]}} for t in TOOLS]
CITIES = ["Paris", "Lyon", "Oslo", "Lima", "Kyoto", "Accra", "Quito", "Perth"]
AIRPORTS = ["CDG", "LYS", "OSL", "LIM", "KIX", "ACC", "UIO", "PER"]
FILES = ["src/app.py", "README.md", "setup.cfg", "tests/test_app.py"]


def _call(rng: random.Random, n: int, turn: int, index: int) -> dict:
    name = rng.choice(["get_weather", "search_flights", "read_file", "run_tests"])
    args = {
        "get_weather": lambda: {"city": rng.choice(CITIES), "unit": rng.choice("CF")},
        "search_flights": lambda: {
            "origin": rng.choice(AIRPORTS),
            "destination": rng.choice(AIRPORTS),
            "date": f"2026-0{rng.randint(1, 9)}-1{rng.randint(0, 9)}",
        },
        "read_file": lambda: {"path": rng.choice(FILES)},
        "run_tests": lambda: {"pattern": rng.choice(["test_app", "test_io", ""])},
    }[name]()
    return {
        "id": f"call_{n}_{turn}_{index}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)},
    }


def _result(call: dict, rng: random.Random) -> str:
    args = json.loads(call["function"]["arguments"])
    return {
        "get_weather": lambda: json.dumps(
            {"city": args["city"], "temperature": rng.randint(-5, 35), "sky": rng.choice(["clear", "rain", "fog"])}
        ),
        "search_flights": lambda: json.dumps(
            [{"flight": f"XD{rng.randint(100, 999)}", "price": rng.randint(80, 900)} for _ in range(rng.randint(1, 3))]
        ),
        "read_file": lambda: f"# {args['path']}\nimport os\nprint(os.getcwd())\n",
        "run_tests": lambda: f"{rng.randint(3, 40)} passed, {rng.randint(0, 2)} failed",
    }[call["function"]["name"]]()


def agentic_conversations(n: int = 60, seed: int = 0, declare_tools: bool = True, tools: list = TOOLS) -> list[dict]:
    """`n` multi-turn tool-use conversations: one or two user requests, each answered by a loop of 1-3 tool-calling
    assistant turns (content null or a short preface; one or two calls each) and a final answer, every assistant
    turn with its reasoning. `tools` is a list in even records and a JSON string in odd ones (none without
    `declare_tools`; `tools` are the declared ones); the reasoning field rotates between `reasoning_content`, `reasoning` and an inline `<think>`
    block."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        messages: list[dict] = [{"role": "system", "content": "You are an agent. Use the tools when they help."}]
        for q in range(1 + (i % 3 == 0)):
            messages.append(
                {
                    "role": "user",
                    "content": f"Request {q} of conversation {i}: please check "
                    f"{rng.choice(CITIES)} and {rng.choice(FILES)}.",
                }
            )
            for turn in range(rng.randint(1, 3)):
                calls = [_call(rng, i, 10 * q + turn, k) for k in range(rng.randint(1, 2))]
                preface = None if rng.random() < 0.7 else f"Checking step {turn}."
                messages.append(
                    _with_reasoning(
                        {"role": "assistant", "content": preface, "tool_calls": calls},
                        f"Step {turn}: I need {calls[0]['function']['name']}.",
                        i,
                    )
                )
                for call in calls:
                    messages.append(
                        {
                            "role": "tool",
                            "tool_call_id": call["id"],
                            "name": call["function"]["name"],
                            "content": _result(call, rng),
                        }
                    )
            messages.append(
                _with_reasoning(
                    {"role": "assistant", "content": f"Done with request {q}: all good."},
                    "I have everything; summarise.",
                    i,
                )
            )
        record = {"id": f"agentic-{i}", "messages": messages}
        if declare_tools:
            record["tools"] = tools if i % 2 == 0 else json.dumps(tools)
        records.append(record)
    return records


def _with_reasoning(message: dict, reasoning: str, i: int) -> dict:
    style = i % 3
    if style == 0:
        return {**message, "reasoning_content": reasoning}
    if style == 1:
        return {**message, "reasoning": reasoning}
    return {**message, "content": f"<think>\n{reasoning}\n</think>\n\n{message['content'] or ''}"}


def _reasoning_and_content(message: dict) -> tuple[str, str]:
    if "reasoning_content" in message or "reasoning" in message:
        return message.get("reasoning_content", message.get("reasoning")), message["content"] or ""
    before, _, after = message["content"].partition("</think>")
    return before.replace("<think>", "").strip("\n"), after.lstrip("\n")


def expected_generations(record: dict) -> list[str]:
    """Each assistant generation of `record` as the Qwen3-shaped template writes it when the model generates it."""
    out = []
    for message in record["messages"]:
        if message["role"] != "assistant":
            continue
        reasoning, content = _reasoning_and_content(message)
        text = f"<think>\n{reasoning}\n</think>\n\n{content}"
        for k, call in enumerate(message.get("tool_calls") or []):
            arguments = json.dumps(json.loads(call["function"]["arguments"]), ensure_ascii=False)
            text += (
                "\n" if k or content else ""
            ) + f'<tool_call>\n{{"name": "{call["function"]["name"]}", "arguments": {arguments}}}\n</tool_call>'
        out.append(text + "<|im_end|>")
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def train_tiny_agent(target_dir: Path, prepared_dir: Path, out_dir: Path, steps: int = 400, seed: int = 0) -> Path:
    """The tiny random target at `target_dir` trained briefly on a prepared agentic set (its loss-masked tokens:
    reasoning, tool calls, answers), so that greedy decoding writes `<think>` blocks and `<tool_call>` sections; saved
    with its tokenizer at `out_dir`."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from draftsmith.prepare.dataset import open_prepared

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(target_dir).float().train()
    data = open_prepared(prepared_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed)).tolist()
    # one thread: a model this small spends two threads' time at OpenMP barriers, and more so beside other work
    # (measured: 0.08 s a step on one thread, 0.31 s on two beside the suite; 400 steps took 175 s in CI)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step in range(steps):
            sample = data[order[step % len(order)]]
            ids, mask = sample["input_ids"][None], sample["loss_mask"][None]
            labels = ids.masked_fill(~mask, -100)
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(threads)
    model.eval().save_pretrained(out_dir)
    for name in Path(target_dir).iterdir():  # tokenizer files
        if name.is_file() and not name.name.startswith(("model", "config", "generation_config")):
            shutil.copy(name, out_dir / name.name)
    return out_dir
