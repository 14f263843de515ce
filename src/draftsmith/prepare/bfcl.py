"""`--data bfcl-multi-turn`: real multi-turn tool-use conversations, from the Berkeley Function Calling Leaderboard.

BFCL (Apache-2.0, the `bfcl-eval` wheel, pinned in core/assets.py) ships 200 multi-turn tasks ("multi_turn_base"):
each has the functions of the APIs it involves (a file system, a trading bot, travel booking, a vehicle, ...), a
list of user turns, the ground-truth calls that answer each turn, and the initial state of each API; the same wheel
ships the offline Python backends that execute those calls. A conversation here is one task as an agent serving it
would log it, in OpenAI messages:

    tools        the task's functions (its APIs' docs, less those the task excludes), as OpenAI function tools
    per turn     the user message, then one assistant turn per ground-truth call (`content: null`, the call with
                 its arguments as a JSON string, as an OpenAI-compatible server returns it) and the call's result
                 (a `tool` turn: what the backend returned, executed in order from the task's initial state)

BFCL holds no assistant text, so the last assistant turn of a conversation is a call; prepare trains on the calls,
and regenerate (or a target's own traces) adds answers. Built once per machine into the cache, atomically.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import importlib
import inspect
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from draftsmith.core import assets
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import atomic_write_text, file_lock

NAME = "bfcl-multi-turn"  # readers.NAMED_BFCL
# the named sets: BFCL's splits of the same tasks' kind; "long_context" (another 200, with long tool results) is the
# agentic set no test reads (benchmarks/agentic_extract.py --data)
SPLITS = {NAME: "base", f"{NAME}-long-context": "long_context"}
_BUILD = 1  # bump when the conversations built from the same wheel change
_QUESTIONS = "bfcl_eval/data/BFCL_v4_multi_turn_{split}.json"
_ANSWERS = "bfcl_eval/data/possible_answer/BFCL_v4_multi_turn_{split}.json"
_DOCS = "bfcl_eval/data/multi_turn_func_doc"
_BACKENDS = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
# each API class: the module of its backend, which also names its function docs
_MODULES = {
    "GorillaFileSystem": "gorilla_file_system",
    "MathAPI": "math_api",
    "MessageAPI": "message_api",
    "TwitterAPI": "posting_api",
    "TicketAPI": "ticket_api",
    "TradingBot": "trading_bot",
    "TravelAPI": "travel_booking",
    "VehicleControlAPI": "vehicle_control",
}
_STATELESS = {"MathAPI"}
# BFCL's parameter types (Python-flavoured) as JSON Schema's
_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": "string"}


def conversations_path(name: str = NAME) -> Path:
    """The JSONL file of the named set's BFCL conversations (`SPLITS`; built on first use from the pinned wheel;
    written atomically, so once it exists the wheel's tree need not be verified again)."""
    split = SPLITS[name]
    files = assets.cache_dir() / "files" / f"{assets.BFCL.name}-conversations"
    out = files / f"multi_turn_{split}-{assets.BFCL.version}-b{_BUILD}.jsonl"
    if out.is_file():
        return out
    with file_lock(assets.cache_dir() / "locks" / f"{name}.lock"):
        if not out.is_file():
            tree = assets.fetch_tree(assets.BFCL)
            lines = (json.dumps(c, ensure_ascii=False) + "\n" for c in conversations(tree, split))
            atomic_write_text(out, "".join(lines))
    return out


def _schema(value: object) -> object:
    """BFCL's function doc -> JSON Schema (its `dict` / `float` / `tuple` types renamed)."""
    if isinstance(value, dict):
        return {k: (_TYPES.get(v, v) if k == "type" and isinstance(v, str) else _schema(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [_schema(v) for v in value]
    return value


def _tools(tree: Path, classes: list[str], excluded: list[str]) -> list[dict]:
    tools = []
    for name in classes:
        for line in (tree / _DOCS / f"{_MODULES[name]}.json").read_text(encoding="utf-8").splitlines():
            doc = json.loads(line)
            if doc["name"] in excluded:
                continue
            tools.append(
                {
                    "type": "function",
                    "function": {
                        "name": doc["name"],
                        "description": doc["description"],
                        "parameters": _schema(doc["parameters"]),
                    },
                }
            )
    return tools


def parse_call(text: str) -> tuple[str, list, dict]:
    """`mv(source='a.pdf', destination='temp')` -> ("mv", [], {"source": "a.pdf", "destination": "temp"})."""
    node = ast.parse(text.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a function call: {text!r}")
    return (
        node.func.id,
        [ast.literal_eval(a) for a in node.args],
        {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg},
    )


@contextlib.contextmanager
def _backends(tree: Path) -> Iterator[None]:
    """BFCL's backend modules importable from the unpacked wheel (and forgotten afterwards)."""
    sys.path.insert(0, str(tree))
    try:
        yield
    finally:
        sys.path.remove(str(tree))
        for module in [m for m in sys.modules if m == "bfcl_eval" or m.startswith("bfcl_eval.")]:
            del sys.modules[module]


def _result_text(result: object) -> str:
    """A call's result as BFCL's executor writes it: strings as they are, dicts as JSON, anything else as str()."""
    if isinstance(result, str):
        return result
    if isinstance(result, dict):
        with contextlib.suppress(TypeError, ValueError):
            return json.dumps(result)
    return str(result)


def _conversation(tree: Path, task: dict, answer: dict) -> dict:
    instances = {}
    for name in task["involved_classes"]:
        instance = getattr(importlib.import_module(f"{_BACKENDS}.{_MODULES[name]}"), name)()
        if name not in _STATELESS:
            instance._load_scenario(copy.deepcopy(task["initial_config"].get(name, {})), long_context=False)
        instances[name] = instance
    methods = {
        n: m
        for instance in instances.values()
        for n, m in inspect.getmembers(instance, predicate=inspect.ismethod)
        if not n.startswith("_")
    }
    messages: list[dict] = []
    for t, (user_turns, calls) in enumerate(zip(task["question"], answer["ground_truth"], strict=False)):
        messages.extend({"role": m["role"], "content": m["content"]} for m in user_turns)
        for c, text in enumerate(calls):
            name, args, kwargs = parse_call(text)
            method = methods.get(name)
            if method is None:
                raise DraftsmithError(
                    f"BFCL's possible answer of {task['id']}: turn {t} calls {name!r}, which none of "
                    f"{', '.join(task['involved_classes'])} has"
                )
            arguments = dict(inspect.signature(method).bind(*args, **kwargs).arguments)
            try:
                result = _result_text(method(*args, **kwargs))
            except Exception as err:  # noqa: BLE001 - a call that fails returns its error, as BFCL's executor does
                result = f"Error during execution: {err}"
            call_id = f"call_{t}_{c}"
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
                        }
                    ],
                }
            )
            messages.append({"role": "tool", "tool_call_id": call_id, "name": name, "content": result})
    return {
        "id": task["id"],
        "tools": _tools(tree, task["involved_classes"], task.get("excluded_function", [])),
        "messages": messages,
    }


def conversations(tree: Path, split: str = "base") -> Iterator[dict]:
    """Every multi_turn_{split} task of the unpacked wheel at `tree` as a conversation, in BFCL's order."""
    lines = (tree / _ANSWERS.format(split=split)).read_text(encoding="utf-8").splitlines()
    answers = {a["id"]: a for a in map(json.loads, lines)}
    with _backends(tree):
        for line in (tree / _QUESTIONS.format(split=split)).read_text(encoding="utf-8").splitlines():
            task = json.loads(line)
            yield _conversation(tree, task, answers[task["id"]])
