"""Conversations read without loss into one structure: HF chat messages and the declared tools.

Plain chat, and agentic traffic (OpenAI `messages` with `tools`, assistant `tool_calls` whose `content` is null, `tool`
results, `reasoning_content` / `reasoning`, a `<think>` block inline; ShareGPT's `function_call` / `observation` turns;
Hermes-style `<tool_call>` text) become `Chat`: HF chat messages (`role`, `content`, `reasoning_content`,
`tool_calls`, `tool_call_id`, `name`) and the declared `tools`; a record that cannot be one is a `Skip` naming why.
The chat template renders them (chat.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "function_call": "assistant",  # ShareGPT (LLaMA-Factory): an assistant turn that calls tools, its value the call
    "system": "system",
    "developer": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",  # a tool's result: context, never trained on
}
TURN_KEYS = ("conversations", "conversation", "messages")  # where a record holds its turns
_ROLE_KEYS = ("from", "role")
_TEXT_KEYS = ("value", "content", "text")
_TOOLS_KEYS = ("tools", "functions")
_REASONING_KEYS = ("reasoning_content", "reasoning")
SURROGATE = re.compile("[\ud800-\udfff]")
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class Skip(Exception):
    """A conversation that cannot be used: `reason` is the counted category, `detail` says what exactly."""

    def __init__(self, reason: str, detail: str = "", needed: int = 0):
        super().__init__(reason)
        self.reason = reason
        self.detail = detail or reason
        self.needed = needed  # the shortest max_length that keeps it, where that is why it is skipped


Message = dict[str, Any]


@dataclass
class Chat:
    """A normalised conversation: HF chat messages and the tools its requests declared (OpenAI function tools)."""

    messages: list[Message]
    tools: list[dict] | None = None
    # per message: its content as written where a `<think>` block was split out of it (a template that does not read
    # `reasoning_content` is given the text as written), else None
    written: list[str | None] | None = None
    leading_dropped: int = 0  # assistant turns dropped before the first user turn (leading_assistant="drop")
    template_kwargs: dict | None = None  # the request's own chat template options (a recorded request's)

    @property
    def agentic(self) -> bool:
        """Declares tools or calls one (a tool result after a call in plain text is chat)."""
        return bool(self.tools) or any(m.get("tool_calls") for m in self.messages)


def _text_of(content: object) -> str | None:
    """A turn's text: a string, or the text parts of an OpenAI-style list of content blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) for b in content):
        parts = [b.get("text") for b in content if b.get("type", "text") == "text"]
        if parts and len(parts) == len(content) and all(isinstance(p, str) for p in parts):
            return "".join(parts)
    return None


def json_kind(value: object) -> str:
    return {
        str: "string",
        bool: "boolean",
        int: "number",
        float: "number",
        list: "array",
        dict: "object",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def raw_role(turn: object) -> str | None:
    """A turn's role as written (`from` or `role`), lower-cased; None where there is no role string."""
    role = next((turn[k] for k in _ROLE_KEYS if k in turn), None) if isinstance(turn, dict) else None
    return role.strip().lower() if isinstance(role, str) else None


def role_of(turn: object) -> str | None:
    """A turn's canonical role (user / assistant / system / tool), or None for an unknown or missing one."""
    written = raw_role(turn)
    return ROLE_ALIASES.get(written) if written else None


def leading_assistant_turns(messages: list[Message]) -> int:
    """How many assistant turns come before the first user turn (system turns aside)."""
    n = 0
    for m in messages:
        if m["role"] == "user":
            break
        n += m["role"] == "assistant"
    return n


# ------------------------------------------------------------------ agentic pieces: tools, calls, reasoning


def _parse_json(value: object, reason: str, what: str) -> object:
    """A JSON string's value (an object or list given as such passes through); Skip(reason) naming `what`."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        raise Skip(reason, f"{what} is not valid JSON ({err.msg} at character {err.pos})") from None


def _tools(record: dict) -> list[dict] | None:
    """The record's declared tools (a list or a JSON string), each as {"type": "function", "function": {...}}."""
    key = next((k for k in _TOOLS_KEYS if record.get(k) not in (None, "", [])), None)
    if key is None:
        return None
    tools = _parse_json(record[key], "malformed tools", key)
    if not isinstance(tools, list):
        raise Skip("malformed tools", f"{key} is a JSON {json_kind(tools)}, not a list of tools")
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise Skip("malformed tools", f"{key}[{i}] is not a function tool with a name")
        out.append({"type": "function", "function": function})
    return out


def normalize_call(raw: Any, where: str) -> dict:
    """One tool call (OpenAI {id, type, function: {name, arguments}}, or a bare {name, arguments}) with its
    arguments an object, as vLLM hands them to the chat template."""
    function = raw.get("function", raw) if isinstance(raw, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"].strip():
        raise Skip("malformed tool call", f"{where}: a call without a function name")
    arguments = function.get("arguments", function.get("parameters"))
    what = f"{where}: the arguments of call {function['name']!r}"
    arguments = _parse_json(arguments, "malformed tool call", what) if arguments not in (None, "") else {}
    if not isinstance(arguments, dict):
        raise Skip(
            "malformed tool call",
            f"{where}: call {function['name']!r} has arguments that are a JSON {json_kind(arguments)}, not an object",
        )
    call = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(raw.get("id"), str) and raw["id"]:
        call = {"id": raw["id"], **call}
    return call


def _hermes_calls(text: str, where: str) -> tuple[str, list[dict]]:
    """Hermes-style `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks in an assistant's text ->
    (the text without them, the calls)."""
    calls = [
        normalize_call(
            _parse_json(block.strip(), "malformed tool call", f"{where}: <tool_call> {i}"), f"{where}, <tool_call> {i}"
        )
        for i, block in enumerate(_HERMES_CALL.findall(text))
    ]
    return (_HERMES_CALL.sub("", text).strip() if calls else text), calls


def _split_think(text: str) -> tuple[str | None, str]:
    """An inline `<think>reasoning</think>content` -> (reasoning, content), as reasoning templates split it."""
    if "</think>" not in text:
        return None, text
    before, _, after = text.partition("</think>")
    return before.split("<think>")[-1].strip("\n"), after.lstrip("\n")


def _assistant(turn: dict, role: str | None, text: str | None, where: str, hermes: bool) -> tuple[Message, str | None]:
    """An assistant turn: content, reasoning and tool calls, whatever form each came in (`<tool_call>` text only
    with `hermes`: in a conversation that declares tools or holds tool results); and the content as written where
    an inline `<think>` block was split out of it."""
    raw_calls = turn.get("tool_calls")
    if raw_calls is None and turn.get("function_call") is not None:
        raw_calls = [turn["function_call"]]  # OpenAI's legacy single call
    if role == "function_call":  # ShareGPT: the turn's value is the call (or a list of calls)
        value = _parse_json(text or "", "malformed tool call", f"{where}: the call")
        raw_calls, text = (value if isinstance(value, list) else [value]), ""
    if raw_calls is not None and not isinstance(raw_calls, list):
        raise Skip("malformed tool call", f"{where}: tool_calls is a JSON {json_kind(raw_calls)}, not a list")
    calls = [normalize_call(c, f"{where}, call {i}") for i, c in enumerate(raw_calls or [])]
    text = text or ""
    if not calls and hermes:
        text, calls = _hermes_calls(text, where)
    reasoning = next((turn[k] for k in _REASONING_KEYS if turn.get(k) not in (None, "")), None)
    if reasoning is not None and not isinstance(reasoning, str):
        raise Skip("turn without text", f"{where}: reasoning_content is a JSON {json_kind(reasoning)}, not text")
    written = None
    if reasoning is None:
        written = text
        reasoning, text = _split_think(text)
        written = written if reasoning is not None else None
    if not text.strip() and not calls and not (reasoning or "").strip():
        raise Skip("empty turn", f"{where} is empty or whitespace only")
    message: Message = {"role": "assistant", "content": text}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message, written


class _Results:
    """Pairs each tool result with the call it answers: by `tool_call_id`, else the next unanswered call of the
    latest assistant turn that called tools (a result no structured call comes before stays as it is)."""

    def __init__(self) -> None:
        self.pending: list[dict] = []
        self.ids: dict[str, dict] = {}

    def called(self, calls: list[dict]) -> None:
        self.pending = list(calls)
        self.ids.update({c["id"]: c for c in calls if "id" in c})

    def result(self, turn: dict, text: str, where: str) -> Message:
        call_id = turn.get("tool_call_id")
        name = turn["name"] if isinstance(turn.get("name"), str) and turn["name"] else None  # as the record names it
        message: Message = {"role": "tool", "content": text}
        if call_id not in (None, ""):
            call = self.ids.get(str(call_id))
            if call is None:
                raise Skip("tool result without its call", f"{where}: tool_call_id {call_id!r} matches no earlier call")
        elif self.pending:
            call = self.pending[0]
        else:  # a result of a call the assistant wrote as text (ReAct's "Action: ..."): context as it is
            return message | ({"name": name} if name else {})
        if call in self.pending:
            self.pending.remove(call)
        if "id" in call:
            message["tool_call_id"] = call["id"]
        message["name"] = name or call["function"]["name"]
        return message


def normalize_conversation(record: object, leading_assistant: str = "skip", keep_trailing: bool = False) -> Chat:  # noqa: C901 - one branch per message shape the readers accept
    """A record (ShareGPT `conversations: [{from, value}]` or `messages: [{role, content}]`, agentic or not) -> a Chat.

    Roles become user / assistant / system / tool; turns after the last assistant turn are dropped (they carry
    no loss) unless `keep_trailing` (`draftsmith regenerate` answers them). A conversation that starts with the
    assistant is skipped, or with `leading_assistant="drop"` loses its assistant turns before the first user turn
    (counted in `Chat.leading_dropped`), or with "keep" is left as it is.
    Raises Skip with a counted reason (and the turn in its detail) for anything that is not a usable conversation.
    """
    if not isinstance(record, dict):
        raise Skip("not a JSON object", f"record is a JSON {json_kind(record)}, not an object")
    key = next((k for k in TURN_KEYS if k in record), None)
    if key is None:
        raise Skip("no conversations", f"no {' / '.join(TURN_KEYS)} field (keys: {', '.join(map(str, record))})")
    turns = record[key]
    if not isinstance(turns, list) or not turns:
        raise Skip(
            "no conversations",
            f"{key} is an empty list"
            if isinstance(turns, list)
            else f"{key} is a JSON {json_kind(turns)}, not a list of turns",
        )
    tools = _tools(record)
    # `<tool_call>` text is a call only where the conversation is about tools (a chat may quote the format)
    hermes = bool(tools) or any(role_of(t) == "tool" for t in turns)
    results = _Results()
    messages: list[Message] = []
    written: list[str | None] = []
    for t, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise Skip("malformed turn", f"turn {t} is not an object")
        canonical = role_of(turn)
        if canonical is None:
            role = next((turn[k] for k in _ROLE_KEYS if k in turn), None)
            raise Skip("unknown role", f"turn {t} has role {role!r}")
        where = f"turn {t} ({canonical})"
        text_key = next((k for k in _TEXT_KEYS if k in turn), None)
        value = turn[text_key] if text_key else None
        text = _text_of(value)
        may_be_empty = canonical == "tool" or (
            canonical == "assistant"
            and (turn.get("tool_calls") or turn.get("function_call") or any(turn.get(k) for k in _REASONING_KEYS))
        )
        if text is None and not (may_be_empty and value is None):
            raise Skip(
                "turn without text",
                f"{where} has no {' / '.join(_TEXT_KEYS)} field"
                if text_key is None
                else f"{where}: {text_key} is a JSON {json_kind(value)}, not text",
            )
        if text is not None and SURROGATE.search(text):
            raise Skip("not valid UTF-8", f"{where} holds bytes that are not valid UTF-8")
        as_written = None
        if canonical == "assistant":
            message, as_written = _assistant(turn, raw_role(turn), text, where, hermes)
            if message.get("tool_calls"):
                results.called(message["tool_calls"])
        elif canonical == "tool":
            message = results.result(turn, text or "", where)
        else:
            if not (text or "").strip():
                raise Skip("empty turn", f"{where} is empty or whitespace only")
            message = {"role": canonical, "content": text}
        messages.append(message)
        written.append(as_written)
    leading_dropped = leading_assistant_turns(messages) if leading_assistant != "keep" else 0
    if leading_dropped:
        if leading_assistant == "skip":
            raise Skip("starts with the assistant", "the first non-system turn is the assistant's")
        first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
        kept = [i for i in range(len(messages)) if i >= first_user or messages[i]["role"] == "system"]
        messages, written = [messages[i] for i in kept], [written[i] for i in kept]
    while messages and messages[-1]["role"] != "assistant" and not keep_trailing:
        messages.pop()
        written.pop()
    if not messages:
        raise Skip("no assistant turn", "no turn is from the assistant")
    options = record.get("chat_template_kwargs")
    texts = written if any(w is not None for w in written) else None
    return Chat(messages, tools, texts, leading_dropped, options if isinstance(options, dict) and options else None)
