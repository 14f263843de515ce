"""Conversations -> chat-template text -> token ids and an assistant loss mask, for any chat template.

Conversations come in read without loss, agentic traffic included, as messages.py's `Chat`: HF chat messages and
the declared `tools`.

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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jinja2 import TemplateError
from numpy.typing import ArrayLike

from draftsmith.prepare.messages import Chat, Message, Skip

# A conversation far longer than max_length is tokenised only up to max_length * _PREFIX_CHARS_PER_TOKEN
# characters; when that prefix yields max_length + _PREFIX_MARGIN tokens or more, its first max_length tokens
# are those of the whole text (pre-tokenisation is local, so only tokens near the cut can differ).
_PREFIX_CHARS_PER_TOKEN = 8
_PREFIX_MARGIN = 128
# Names the template probes render (what a template shows of tools, calls and reasoning).
_PROBE = "draftsmith_probe"


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
        self,
        messages: list[Message],
        add_generation_prompt: bool = False,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
    ) -> str:
        """The template's text; `template_kwargs`: a conversation's own options, over the encoder's."""
        options = {**self.template_kwargs, **(template_kwargs or {}), **({"tools": tools} if tools else {})}
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
            options = chat.template_kwargs
            context = self.render(messages[:k], True, chat.tools, options) if k else ""
            full = self.render(messages[: k + 1], tools=chat.tools, template_kwargs=options)
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
            for j, (k, start) in enumerate(zip(sample.turns, sample.starts, strict=False)):
                yield k, self._tokenize(sample.text[:start], [], sample.starts[:j])[0]

    # ------------------------------------------------------------------ tokenising
    def _tokenize(
        self, text: str, spans: list[tuple[int, int]], cuts: Sequence[int] = ()
    ) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of `text` (tokenised separately on each side of every cut) and the mask of tokens inside
        `spans`."""
        bounds = [0, *sorted(c for c in set(cuts) if 0 < c < len(text)), len(text)]
        ids_parts, mask_parts = [], []
        for a, b in zip(bounds, bounds[1:], strict=False):
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
        for a, b in zip(cuts, cuts[1:], strict=False):
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
                first = encoded[1] if encoded[1].any() else self._tokenize(text, spans, starts)[1]
                needed = int(np.argmax(first)) + 1
                raise Skip(
                    "no assistant tokens within max_length",
                    f"the first assistant token is token {needed:,}, after max_length {self.max_length:,}",
                    needed,
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


def masked_spans(input_ids: ArrayLike, loss_mask: ArrayLike) -> list[list[int]]:
    """The runs of consecutive loss-masked token ids (for display and for tests)."""
    pairs = zip(np.asarray(input_ids).tolist(), np.asarray(loss_mask).astype(bool).tolist(), strict=False)
    return [[token for token, _ in run] for masked, run in itertools.groupby(pairs, key=lambda p: p[1]) if masked]
