"""Conversations -> chat-template text -> token ids and an assistant loss mask, for any chat template.

Conversations are read without loss: plain chat, and agentic traffic (OpenAI `messages` with `tools`, assistant
`tool_calls` whose `content` is null, `tool` results, `reasoning_content` / `reasoning`, a `<think>` block inline;
ShareGPT's `function_call` / `observation` turns; Hermes-style `<tool_call>` text) become one structure: HF chat
messages (`role`, `content`, `reasoning_content`, `tool_calls`, `tool_call_id`, `name`) and the declared `tools`.

No token offsets are hard-coded. What the model is trained on is each assistant generation as the target's own
template renders it *at the moment it is generated*:

- the context of assistant turn k is the conversation before it, rendered with the generation prompt (and the
  declared tools and the template options the server passes); the generation is what the template adds to that
  when turn k is the last message: its reasoning, content, tool-call section and end-of-turn marker (trailing
  whitespace aside). A `<think>` the generation prompt pre-fills is context, not generation;
- templates that rewrite past turns (Qwen3 and Kimi-K2.5 drop the reasoning of turns before the last user turn)
  make a later context differ from what an earlier turn was generated after; each generation is then trained in
  the text it saw. Generations share one sample as long as each one's context extends the previous sample's text
  (a tool loop after one user turn is one sample), so a long loop does not cost O(turns^2) tokens;
- a sample is tokenised once, in pieces cut where each generation starts (what the server tokenised as the
  prompt), and tokens inside a generation get loss_mask 1; tool results, tool declarations, system and user
  turns and role headers never do.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jinja2 import TemplateError

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
_TURN_KEYS = ("conversations", "conversation", "messages")
_ROLE_KEYS = ("from", "role")
_TEXT_KEYS = ("value", "content", "text")
_TOOLS_KEYS = ("tools", "functions")
_REASONING_KEYS = ("reasoning_content", "reasoning")
_SURROGATE = re.compile("[\ud800-\udfff]")
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
# A conversation far longer than max_length is tokenised only up to max_length * _PREFIX_CHARS_PER_TOKEN
# characters; when that prefix yields max_length + _PREFIX_MARGIN tokens or more, its first max_length tokens
# are those of the whole text (pre-tokenisation is local, so only tokens near the cut can differ).
_PREFIX_CHARS_PER_TOKEN = 8
_PREFIX_MARGIN = 128
# Names the template probes render (what a template shows of tools, calls and reasoning).
_PROBE = "draftsmith_probe"


class Skip(Exception):
    """A conversation that cannot be used: `reason` is the counted category, `detail` says what exactly."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason = reason
        self.detail = detail or reason


Message = dict[str, Any]


@dataclass
class Chat:
    """A normalised conversation: HF chat messages and the tools its requests declared (OpenAI function tools)."""

    messages: list[Message]
    tools: list[dict] | None = None
    # per message: its content as written where a `<think>` block was split out of it (a template that does not read
    # `reasoning_content` is given the text as written), else None
    written: list[str | None] | None = None

    @property
    def agentic(self) -> bool:
        """Declares tools or calls one (a tool result after a call in plain text is chat)."""
        return bool(self.tools) or any(m.get("tool_calls") for m in self.messages)


def _text_of(content: Any) -> str | None:
    """A turn's text: a string, or the text parts of an OpenAI-style list of content blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) for b in content):
        parts = [b.get("text") for b in content if b.get("type", "text") == "text"]
        if parts and len(parts) == len(content) and all(isinstance(p, str) for p in parts):
            return "".join(parts)
    return None


def _json_kind(value: Any) -> str:
    return {
        str: "string",
        bool: "boolean",
        int: "number",
        float: "number",
        list: "array",
        dict: "object",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def raw_role(turn: Any) -> str | None:
    """A turn's role as written (`from` or `role`), lower-cased; None where there is no role string."""
    role = next((turn[k] for k in _ROLE_KEYS if k in turn), None) if isinstance(turn, dict) else None
    return role.strip().lower() if isinstance(role, str) else None


def role_of(turn: Any) -> str | None:
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


def _parse_json(value: Any, reason: str, what: str) -> Any:
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
        raise Skip("malformed tools", f"{key} is a JSON {_json_kind(tools)}, not a list of tools")
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
            f"{where}: call {function['name']!r} has arguments that are a JSON {_json_kind(arguments)}, not an object",
        )
    call = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(raw.get("id"), str) and raw["id"]:
        call = {"id": raw["id"], **call}
    return call


def _hermes_calls(text: str, where: str) -> tuple[str, list[dict]]:
    """Hermes-style `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks in an assistant's text ->
    (the text without them, the calls)."""
    calls = []
    for i, block in enumerate(_HERMES_CALL.findall(text)):
        calls.append(
            normalize_call(
                _parse_json(block.strip(), "malformed tool call", f"{where}: <tool_call> {i}"),
                f"{where}, <tool_call> {i}",
            )
        )
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
        raise Skip("malformed tool call", f"{where}: tool_calls is a JSON {_json_kind(raw_calls)}, not a list")
    calls = [normalize_call(c, f"{where}, call {i}") for i, c in enumerate(raw_calls or [])]
    text = text or ""
    if not calls and hermes:
        text, calls = _hermes_calls(text, where)
    reasoning = next((turn[k] for k in _REASONING_KEYS if turn.get(k) not in (None, "")), None)
    if reasoning is not None and not isinstance(reasoning, str):
        raise Skip("turn without text", f"{where}: reasoning_content is a JSON {_json_kind(reasoning)}, not text")
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
        if call_id not in (None, ""):
            call = self.ids.get(str(call_id))
            if call is None:
                raise Skip("tool result without its call", f"{where}: tool_call_id {call_id!r} matches no earlier call")
        elif self.pending:
            call = self.pending[0]
        else:  # a result of a call the assistant wrote as text (ReAct's "Action: ..."): context as it is
            message: Message = {"role": "tool", "content": text}
            return message | ({"name": turn["name"]} if isinstance(turn.get("name"), str) and turn["name"] else {})
        if call in self.pending:
            self.pending.remove(call)
        message = {"role": "tool", "content": text}
        if "id" in call:
            message["tool_call_id"] = call["id"]
        name = turn.get("name") if isinstance(turn.get("name"), str) and turn["name"] else call["function"]["name"]
        message["name"] = name
        return message


def normalize_conversation(record: Any, leading_assistant: str = "skip", keep_trailing: bool = False) -> Chat:
    """A record (ShareGPT `conversations: [{from, value}]` or `messages: [{role, content}]`, agentic or not) -> a Chat.

    Roles become user / assistant / system / tool; turns after the last assistant turn are dropped (they carry
    no loss) unless `keep_trailing` (`draftsmith regenerate` answers them). A conversation that starts with the
    assistant is skipped, or with `leading_assistant="drop"` loses its assistant turns before the first user turn
    (the caller counts them with `leading_assistant_turns`), or with "keep" is left as it is.
    Raises Skip with a counted reason (and the turn in its detail) for anything that is not a usable conversation.
    """
    if not isinstance(record, dict):
        raise Skip("not a JSON object", f"record is a JSON {_json_kind(record)}, not an object")
    key = next((k for k in _TURN_KEYS if k in record), None)
    if key is None:
        raise Skip("no conversations", f"no {' / '.join(_TURN_KEYS)} field (keys: {', '.join(map(str, record))})")
    turns = record[key]
    if not isinstance(turns, list) or not turns:
        raise Skip(
            "no conversations",
            f"{key} is an empty list"
            if isinstance(turns, list)
            else f"{key} is a JSON {_json_kind(turns)}, not a list of turns",
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
                else f"{where}: {text_key} is a JSON {_json_kind(value)}, not text",
            )
        if text is not None and _SURROGATE.search(text):
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
    if leading_assistant != "keep" and leading_assistant_turns(messages):
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
    return Chat(messages, tools, written if any(w is not None for w in written) else None)


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class Encoded:
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    truncated: bool


@dataclass
class EncodedChat:
    """A conversation's samples (one per run of generations that share a context) and what the layout cost."""

    samples: list[Encoded]
    generations: int  # assistant generations trained on
    one_sample_tokens: int  # tokens of the whole conversation as one sample (the final render)
    dropped: dict[str, int] = field(default_factory=dict)  # samples left out, by reason (max_length)
    agentic: bool = False  # declares tools or calls one


@dataclass(frozen=True)
class TemplateFeatures:
    """What a chat template renders of the agentic parts of a conversation."""

    tools: bool  # the declared tools (`tools=`)
    tool_calls: bool  # an assistant turn's `tool_calls`
    reasoning: bool  # an assistant turn's `reasoning_content`


@dataclass
class _Sample:
    text: str
    starts: list[int]  # where each generation starts (its context ends)
    spans: list[tuple[int, int]]  # each generation, end-of-turn marker included
    turns: list[int]  # each generation's message index


class ChatEncoder:
    """Renders conversations with one tokenizer's chat template and builds the assistant loss mask.

    `template_kwargs` are the options the server passes to the template (vLLM's `--chat-template-kwargs`, e.g.
    {"thinking": true} for Kimi-K2.5, {"enable_thinking": false} for Qwen3).
    """

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None = None,
        max_length: int | None = None,
        overflow: str = "truncate",
        template_kwargs: dict | None = None,
    ):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.max_length = max_length
        self.overflow = overflow
        self.template_kwargs = dict(template_kwargs or {})
        self._features: TemplateFeatures | None = None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend if backend is not None and getattr(tokenizer, "is_fast", False) else None

    # ------------------------------------------------------------------ rendering
    def render(
        self, messages: list[Message], add_generation_prompt: bool = False, tools: list[dict] | None = None
    ) -> str:
        options = dict(self.template_kwargs, **({"tools": tools} if tools else {}))
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt,
                **options,
            )
        except (TemplateError, TypeError) as err:
            raise Skip("chat template error", f"the chat template refused this conversation: {err}") from None

    @property
    def features(self) -> TemplateFeatures:
        """Probed once: does the template render declared tools, tool calls, reasoning_content?"""
        if self._features is None:
            user = {"role": "user", "content": "q"}

            def shows(messages: list[Message], needle: str, **options: Any) -> bool:
                try:
                    return needle in self.render(messages, **options)
                except Skip:
                    return False

            tool = {
                "type": "function",
                "function": {
                    "name": _PROBE + "_tool",
                    "description": "",
                    "parameters": {"type": "object", "properties": {}},
                },
            }
            call = {"id": "call_0", "type": "function", "function": {"name": _PROBE + "_call", "arguments": {}}}
            self._features = TemplateFeatures(
                tools=shows([user], _PROBE + "_tool", add_generation_prompt=True, tools=[tool]),
                tool_calls=shows([user, {"role": "assistant", "content": "", "tool_calls": [call]}], _PROBE + "_call"),
                reasoning=shows([user, {"role": "assistant", "content": "a", "reasoning_content": _PROBE}], _PROBE),
            )
        return self._features

    def check_shows(self, chat: Chat) -> TemplateFeatures:
        """This template's features; Skip where it cannot show the conversation's declared tools or its calls."""
        features = self.features
        if chat.tools and not features.tools:
            raise Skip(
                "chat template without tools",
                "the chat template does not render the declared tools; pass "
                "a tool-aware template with --chat-template FILE",
            )
        if any(m.get("tool_calls") for m in chat.messages) and not features.tool_calls:
            raise Skip(
                "chat template without tool calls",
                "the chat template does not render tool calls; pass a tool-aware template with --chat-template FILE",
            )
        return features

    def as_rendered(self, chat: Chat) -> list[Message]:
        """The messages as this template is given them: where the template does not read `reasoning_content`, the
        reasoning inline as `<think>` (as written where it came inline; what a reasoning model writes without a
        reasoning parser). Raises Skip where the template cannot show the conversation's tools or calls."""
        if self.check_shows(chat).reasoning:
            return chat.messages
        out = []
        for i, m in enumerate(chat.messages):
            if m.get("reasoning_content") is not None:
                reasoning = m["reasoning_content"]
                written = chat.written[i] if chat.written else None
                m = {k: v for k, v in m.items() if k != "reasoning_content"}
                m["content"] = written if written is not None else f"<think>\n{reasoning}\n</think>\n\n{m['content']}"
            out.append(m)
        return out

    def generations(self, chat: Chat) -> list[_Sample]:
        """Each assistant generation located in the text it was generated after, grouped into samples."""
        messages = self.as_rendered(chat)
        samples: list[_Sample] = []
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            context = self.render(messages[:k], add_generation_prompt=True, tools=chat.tools) if k else ""
            full = self.render(messages[: k + 1], tools=chat.tools)
            start = len(context) if full.startswith(context) else _common_prefix_len(full, context)
            end = len(full.rstrip())
            if end <= start:
                continue  # the template writes nothing of this turn: nothing of it to learn
            last = samples[-1] if samples else None
            if last is not None and context.startswith(last.text[: last.spans[-1][1]]) and start == len(context):
                last.text = full
                last.starts.append(start)
                last.spans.append((start, end))
                last.turns.append(k)
            else:
                samples.append(_Sample(full, [start], [(start, end)], [k]))
        return samples

    def prompts(self, chat: Chat) -> Iterator[tuple[int, np.ndarray]]:
        """Each generation's context as its sample holds it: (its message index, the token ids before it)."""
        for sample in self.generations(chat):
            for j, (k, start) in enumerate(zip(sample.turns, sample.starts)):
                yield k, self._tokenize(sample.text[:start], [], sample.starts[:j])[0]

    # ------------------------------------------------------------------ tokenising
    def _tokenize(
        self, text: str, spans: list[tuple[int, int]], cuts: Sequence[int] = ()
    ) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of `text` (tokenised separately on each side of every cut) and the mask of tokens inside
        `spans`."""
        bounds = [0, *sorted(c for c in set(cuts) if 0 < c < len(text)), len(text)]
        ids_parts, mask_parts = [], []
        for a, b in zip(bounds, bounds[1:]):
            ids, mask = self._tokenize_piece(text[a:b], [(s - a, e - a) for s, e in spans if e > a and s < b])
            ids_parts.append(ids)
            mask_parts.append(mask)
        return np.concatenate(ids_parts), np.concatenate(mask_parts)

    def _tokenize_piece(self, text: str, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        if self._backend is not None:
            enc = self._backend.encode(text, add_special_tokens=False)
            ids = np.asarray(enc.ids, dtype=np.int64)
            offsets = np.fromiter(itertools.chain.from_iterable(enc.offsets), dtype=np.int64, count=2 * len(ids))
            starts, ends = offsets[0::2], offsets[1::2]
            mask = np.zeros(len(ids), dtype=bool)
            for a, b in spans:
                mask |= np.where(ends > starts, (ends > a) & (starts < b), (starts >= a) & (starts < b))
            return ids, mask.astype(np.uint8)
        # A tokenizer without offsets: tokenise the pieces between span boundaries separately.
        cuts = sorted({0, len(text), *(min(max(p, 0), len(text)) for span in spans for p in span)})
        ids_parts, mask_parts = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.uint8)]
        for a, b in zip(cuts, cuts[1:]):
            piece = self.tokenizer.encode(text[a:b], add_special_tokens=False)
            inside = any(s <= a and b <= e for s, e in spans)
            ids_parts.append(np.asarray(piece, dtype=np.int64))
            mask_parts.append(np.full(len(piece), inside, dtype=np.uint8))
        return np.concatenate(ids_parts), np.concatenate(mask_parts)

    def _encode_sample(self, sample: _Sample) -> Encoded:
        text, spans, starts = sample.text, sample.spans, sample.starts
        encoded = None
        if self.max_length is not None and len(text) > (limit := self.max_length * _PREFIX_CHARS_PER_TOKEN):
            encoded = self._tokenize(
                text[:limit], [(s, min(e, limit)) for s, e in spans if s < limit], [c for c in starts if c < limit]
            )
            if len(encoded[0]) < self.max_length + _PREFIX_MARGIN:
                encoded = None  # unusually many characters per token: tokenise the whole text
        if encoded is None:
            encoded = self._tokenize(text, spans, starts)
            if not encoded[1].any():
                raise Skip("no assistant tokens", "the chat template rendered no assistant text")
        ids, mask = encoded
        truncated = False
        if self.max_length is not None and len(ids) > self.max_length:
            if self.overflow == "drop":
                raise Skip("longer than max_length", f"more than max_length {self.max_length} tokens")
            ids, mask = ids[: self.max_length], mask[: self.max_length]
            truncated = True
            if not mask.any():
                raise Skip(
                    "no assistant tokens within max_length",
                    f"the first assistant token comes after max_length {self.max_length}",
                )
        return Encoded(ids.astype(np.int32), mask, truncated)

    def encode(self, chat: Chat | list[Message]) -> EncodedChat:
        """The samples of one normalised conversation; raises Skip (counted) when none is usable."""
        chat = chat if isinstance(chat, Chat) else Chat(list(chat))
        groups = self.generations(chat)
        if not groups:
            raise Skip("no assistant tokens", "the chat template rendered no assistant text")
        samples: list[Encoded] = []
        dropped: dict[str, int] = {}
        first: Skip | None = None
        one = None  # the whole conversation as one sample: the last group's text, the final render
        for group in groups:
            try:
                samples.append(self._encode_sample(group))
                one = len(samples[-1].input_ids) if group is groups[-1] else None
            except Skip as skip:
                dropped[skip.reason] = dropped.get(skip.reason, 0) + 1
                first = first or skip
        if not samples:
            assert first is not None  # every group raised Skip
            raise first
        if one is None:  # the final render was left out: longer than max_length, or no assistant text in it
            one = len(self._tokenize(groups[-1].text, [])[0])
            one = min(one, self.max_length) if self.max_length is not None else one
        return EncodedChat(samples, sum(len(g.spans) for g in groups), one, dropped, chat.agentic)


def masked_spans(input_ids: Any, loss_mask: Any) -> list[list[int]]:
    """The runs of consecutive loss-masked token ids (for display and for tests)."""
    ids = np.asarray(input_ids).tolist()
    mask = np.asarray(loss_mask).astype(bool).tolist()
    runs: list[list[int]] = []
    previous = False
    for token, m in zip(ids, mask):
        if m:
            if not previous:
                runs.append([])
            runs[-1].append(token)
        previous = m
    return runs
