"""Conversations -> chat-template text -> token ids and an assistant loss mask, for any chat template.

No token offsets are hard-coded. The conversation is rendered once with the target's own template and
tokenised once (so the ids are exactly what the target sees), and every assistant turn is located in that text
by rendering probes of the same conversation:

- where the turn starts: the text the template renders for "everything before turn k + the generation
  prompt" is a prefix of the full text, so the turn starts right after it (so a `<think>` block the model
  writes itself is inside the turn);
- where the turn's content ends: render the conversation again with turn k's content replaced by a sentinel;
  the two texts share everything after the turn, so the common suffix marks the end. This holds even for
  templates that rewrite earlier turns (a Qwen3-style template drops the reasoning of past turns);
- the end-of-turn marker (`<|im_end|>`, `<|eot_id|>`, ...) is what the template writes after the final
  assistant turn, up to trailing whitespace; it is masked too, because the draft must learn to stop.

Tokens whose character span overlaps an assistant span get loss_mask 1, everything else 0.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
from jinja2 import TemplateError

# A string no chat template or conversation contains (private-use code points around a name).
SENTINEL = "\ue000draftsmith-turn\ue001"

ROLE_ALIASES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool", "function": "tool", "observation": "tool",  # a tool's result: context, never trained on
}
_TURN_KEYS = ("conversations", "conversation", "messages")
_ROLE_KEYS = ("from", "role")
_TEXT_KEYS = ("value", "content", "text")
_SURROGATE = re.compile("[\ud800-\udfff]")
# A conversation far longer than max_length is tokenised only up to max_length * _PREFIX_CHARS_PER_TOKEN
# characters; when that prefix yields max_length + _PREFIX_MARGIN tokens or more, its first max_length tokens
# are those of the whole text (pre-tokenisation is local, so only tokens near the cut can differ).
_PREFIX_CHARS_PER_TOKEN = 8
_PREFIX_MARGIN = 128


class Skip(Exception):
    """A conversation that cannot be used: `reason` is the counted category, `detail` says what exactly."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason = reason
        self.detail = detail or reason


Message = dict[str, str]


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
    return {str: "string", bool: "boolean", int: "number", float: "number", list: "array", dict: "object",
            type(None): "null"}.get(type(value), type(value).__name__)


def leading_assistant_turns(messages: list[Message]) -> int:
    """How many assistant turns come before the first user turn (system turns aside)."""
    n = 0
    for m in messages:
        if m["role"] == "user":
            break
        n += m["role"] == "assistant"
    return n


def normalize_conversation(record: Any, leading_assistant: str = "skip", keep_trailing: bool = False) -> list[Message]:
    """A record (ShareGPT `conversations: [{from, value}]` or `messages: [{role, content}]`) -> chat messages.

    Roles become user / assistant / system / tool; turns after the last assistant turn are dropped (they carry
    no loss) unless `keep_trailing` (`draftsmith regenerate` answers them). A conversation that starts with the
    assistant is skipped, or with `leading_assistant="drop"` loses its assistant turns before the first user turn
    (the caller counts them with `leading_assistant_turns`), or with "keep" is left as it is.
    Raises Skip with a counted reason for anything that is not a usable conversation.
    """
    if not isinstance(record, dict):
        raise Skip("not a JSON object", f"record is a JSON {_json_kind(record)}, not an object")
    key = next((k for k in _TURN_KEYS if k in record), None)
    if key is None:
        raise Skip("no conversations", f"no {' / '.join(_TURN_KEYS)} field (keys: {', '.join(map(str, record))})")
    turns = record[key]
    if not isinstance(turns, list) or not turns:
        raise Skip("no conversations", f"{key} is an empty list" if isinstance(turns, list)
                   else f"{key} is a JSON {_json_kind(turns)}, not a list of turns")
    messages: list[Message] = []
    for t, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise Skip("malformed turn", f"turn {t} is not an object")
        role = next((turn[k] for k in _ROLE_KEYS if k in turn), None)
        canonical = ROLE_ALIASES.get(str(role).strip().lower()) if isinstance(role, str) else None
        if canonical is None:
            raise Skip("unknown role", f"turn {t} has role {role!r}")
        text_key = next((k for k in _TEXT_KEYS if k in turn), None)
        text = _text_of(turn[text_key]) if text_key else None
        if text is None:
            raise Skip("turn without text", f"turn {t} ({canonical}) has no {' / '.join(_TEXT_KEYS)} field"
                       if text_key is None else f"turn {t} ({canonical}): {text_key} is a JSON "
                       f"{_json_kind(turn[text_key])}, not text")
        if _SURROGATE.search(text):
            raise Skip("not valid UTF-8", f"turn {t} ({canonical}) holds bytes that are not valid UTF-8")
        if not text.strip():
            raise Skip("empty turn", f"turn {t} ({canonical}) is empty or whitespace only")
        messages.append({"role": canonical, "content": text})
    if leading_assistant != "keep" and leading_assistant_turns(messages):
        if leading_assistant == "skip":
            raise Skip("starts with the assistant", "the first non-system turn is the assistant's")
        first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
        messages = [m for m in messages[:first_user] if m["role"] == "system"] + messages[first_user:]
    while messages and messages[-1]["role"] != "assistant" and not keep_trailing:
        messages.pop()
    if not messages:
        raise Skip("no assistant turn", "no turn is from the assistant")
    return messages


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


class ChatEncoder:
    """Renders conversations with one tokenizer's chat template and builds the assistant loss mask."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None, max_length: int | None = None,
                 overflow: str = "truncate"):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.max_length = max_length
        self.overflow = overflow
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend if backend is not None and getattr(tokenizer, "is_fast", False) else None

    # ------------------------------------------------------------------ rendering
    def render(self, messages: list[Message], add_generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, chat_template=self.chat_template,
                                                      add_generation_prompt=add_generation_prompt)
        except TemplateError as err:
            raise Skip("chat template error", f"the chat template refused this conversation: {err}") from None

    def _locate_turn(self, messages: list[Message], k: int, text: str) -> tuple[int, int] | None:
        """(start, content_end) of assistant turn k in `text`, or None when the template does not render it."""
        probe = self.render(messages[:k] + [{"role": "assistant", "content": SENTINEL}] + messages[k + 1:])
        at = probe.find(SENTINEL)
        if at < 0:
            return None  # the template leaves this turn out: nothing of it to learn
        after = len(probe) - (at + len(SENTINEL))
        content_end = len(text) - after
        if content_end < 0 or text[content_end:] != probe[at + len(SENTINEL):]:
            raise Skip("assistant turn not found", f"turn {k}: the chat template renders the rest of the "
                       "conversation differently when this turn changes")
        prompt = self.render(messages[:k], add_generation_prompt=True) if k else ""
        start = len(prompt) if prompt and text.startswith(prompt) else _common_prefix_len(text, probe[:at])
        if start > content_end:
            raise Skip("assistant turn not found", f"turn {k}: the generation prompt overlaps the turn")
        return start, content_end

    def assistant_spans(self, messages: list[Message], text: str, limit: int | None = None) -> list[tuple[int, int]]:
        """Character spans [start, end) of each assistant turn in `text` (the full render), end-of-turn included.

        With `limit`, turns after the first one that starts at or beyond character `limit` are not located.
        """
        turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        # What the template writes after the final assistant turn (the conversation ends there) is the
        # end-of-turn marker plus trailing whitespace; the marker is part of what the model generates.
        last = self._locate_turn(messages, turns[-1], text) if turns else None
        end_of_turn = text[last[1]:].rstrip() if last else ""
        spans = []
        for k in turns:
            located = last if k == turns[-1] else self._locate_turn(messages, k, text)
            if located is None:
                continue
            start, content_end = located
            end = content_end + len(end_of_turn) if text.startswith(end_of_turn, content_end) else content_end
            spans.append((start, end))
            if limit is not None and start >= limit:
                break
        return spans

    # ------------------------------------------------------------------ tokenising
    def _tokenize(self, text: str, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
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
        cuts = sorted({0, len(text), *(p for span in spans for p in span)})
        ids_parts, mask_parts = [], []
        for a, b in zip(cuts, cuts[1:]):
            piece = self.tokenizer.encode(text[a:b], add_special_tokens=False)
            inside = any(s <= a and b <= e for s, e in spans)
            ids_parts.append(np.asarray(piece, dtype=np.int64))
            mask_parts.append(np.full(len(piece), inside, dtype=np.uint8))
        return np.concatenate(ids_parts), np.concatenate(mask_parts)

    def encode(self, messages: list[Message]) -> Encoded:
        """Token ids and loss mask of one normalised conversation; raises Skip for a counted skip."""
        text = self.render(messages)
        ids = mask = None
        limit = self.max_length * _PREFIX_CHARS_PER_TOKEN if self.max_length is not None else None
        if limit is not None and len(text) > limit:
            ids, mask = self._tokenize(text[:limit], self.assistant_spans(messages, text, limit))
            if len(ids) < self.max_length + _PREFIX_MARGIN:
                ids = mask = None  # unusually many characters per token: tokenise the whole text
        if ids is None:
            ids, mask = self._tokenize(text, self.assistant_spans(messages, text))
            if not mask.any():
                raise Skip("no assistant tokens", "the chat template rendered no assistant text")
        truncated = False
        if self.max_length is not None and len(ids) > self.max_length:
            if self.overflow == "drop":
                raise Skip("longer than max_length", f"more than max_length {self.max_length} tokens")
            ids, mask = ids[: self.max_length], mask[: self.max_length]
            truncated = True
            if not mask.any():
                raise Skip("no assistant tokens within max_length",
                           f"the first assistant token comes after max_length {self.max_length}")
        return Encoded(ids.astype(np.int32), mask, truncated)


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
