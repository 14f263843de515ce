"""The conversations `draftsmith regenerate` answers, and the bookkeeping that keeps them in order.

    records (readers) -> normalised messages (messages.normalize_conversation, trailing turns kept) in file order
      -> a window of conversations in flight: each renders its history up to its next assistant turn with the
         target's chat template (the answers regenerated so far; system, user and tool turns as they are) and
         asks the engine for that answer; when it is back, the conversation asks for the next one
      -> finished shards of conversations, in input order, with a tally of what they hold and were made from

Every assistant turn is regenerated, and a conversation that ends with a user (or tool) turn gets an answer
appended, so a set of prompts alone works too. The prompts are rendered and tokenised here, which is what vLLM's
`LLM.chat` does inside, so both engines (regenerate_engines.py) see exactly the same tokens.

Agentic conversations (with vLLM's parsers named, vllm_chat.py): each prompt declares the record's tools, and each
answer is read back as the server returns it (reasoning_content, content, tool_calls). Tools are not run: where the
target calls the tools the recording called (the same names, in order), the recorded results follow its calls
(their tool_call_id renamed to the target's calls); where it does not, the conversation ends with that answer and
is counted by how it diverged.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from draftsmith.config import RegenerateConfig
from draftsmith.prepare.chat import ChatEncoder
from draftsmith.prepare.messages import Chat, Message, Skip, normalize_conversation
from draftsmith.prepare.readers import Skips, Source, chats_after
from draftsmith.prepare.vllm_chat import AnswerParser, openai_message

if TYPE_CHECKING:
    from draftsmith.prepare.regenerate_engines import Engine

# how a regenerated tool loop left the recorded one (the conversation ends with the target's answer)
ANSWERED_INSTEAD = "answered where the recording calls tools"
CALLED_INSTEAD = "called tools where the recording answers"
CALLED_OTHERS = "called other tools than the recording"
WROTE_MALFORMED = "wrote a malformed tool call"

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_THINK_BLOCK = re.compile(re.escape(THINK_OPEN) + ".*?" + re.escape(THINK_CLOSE), re.DOTALL)
_OPEN_THINK_AT_END = re.compile(re.escape(THINK_OPEN) + r"\s*$")


def answer_text(generated: str, prompt: str, think: str) -> str | None:
    """The assistant turn to store for `generated` (the decoded answer tokens) after `prompt` (the rendered prompt).

    A generation prompt that ends by opening a `<think>` block (some reasoning templates do) contributes that
    opening, so the stored turn holds the whole block. With `think="drop"` every `<think>...</think>` block is
    removed and what follows is kept; None when the answer was cut off inside a block (nothing but reasoning).
    """
    opened = _OPEN_THINK_AT_END.search(prompt)
    text = (opened.group(0) if opened else "") + generated
    if think == "keep":
        return text
    text = _THINK_BLOCK.sub("", text)
    if THINK_OPEN in text:
        return None
    return text.lstrip()


def _seed(seed: int, conversation: int, turn: int) -> int:
    """Each answer's own sampling seed: the same however the answers are batched or the run is resumed."""
    return int(hashlib.sha256(f"{seed}:{conversation}:{turn}".encode()).hexdigest()[:15], 16)


@dataclass
class Conversation:
    where: str  # "file.json record 3"
    index: int  # conversations taken in before this one: its place in the output, its seeds
    turns: list[dict]  # normalised source turns; every assistant turn is regenerated (content None: appended)
    before: list[tuple[str, str, str]]  # records skipped since the previous conversation: (reason, where, detail)
    leading_dropped: bool = False  # lost its assistant turns before the first user turn (leading_assistant drop)
    tools: list[dict] | None = None  # the tools its requests declare
    out: list[Message] = field(default_factory=list)
    pos: int = 0
    truncated_turns: list[int] = field(default_factory=list)
    new_tokens: list[int] = field(default_factory=list)
    cut: bool = False
    diverged: str | None = None  # how the target's tool loop left the recorded one (it ends there)
    call_ids: dict[str, str] = field(default_factory=dict)  # recorded call id -> the target's call's id
    tool_calls: int = 0  # calls the target made
    spliced: int = 0  # recorded tool results placed after the target's calls
    skip: Skip | None = None

    def record(self) -> dict:
        """The conversation as written to the set: messages in OpenAI form (a call's arguments a JSON string, the
        content of a turn that only calls tools null), with the record's tools."""
        return {
            **({"tools": self.tools} if self.tools else {}),
            "messages": [openai_message(m) for m in self.out],
            "regenerated": {
                "source": self.where,
                "truncated_turns": self.truncated_turns,
                "new_tokens": self.new_tokens,
                "cut_at_max_length": self.cut,
                **({"diverged": self.diverged} if self.diverged else {}),
            },
        }


def _turns_to_answer(messages: list[Message]) -> list[dict]:
    """The turns of a normalised conversation (trailing turns kept), with an answer slot after a final user or
    tool turn; Skip when there is nothing to answer."""
    turns: list[dict] = list(messages)
    while turns and turns[-1]["role"] == "system":
        turns.pop()
    if not any(t["role"] == "user" for t in turns):
        raise Skip("no user turn", "no turn is from the user")
    if turns[-1]["role"] != "assistant":
        turns.append({"role": "assistant", "content": None})
    return turns


def _last_assistant(messages: list[Message]) -> Message:
    return next((m for m in reversed(messages) if m["role"] == "assistant"), {})


@dataclass
class Tally(Skips):
    """What the complete shards hold and what was read to make them: saved with each shard, so a resumed run
    starts from exactly this."""

    records: int = 0
    attempted: int = 0  # conversations taken in (written or skipped after that)
    dropped: int = 0  # of those, skipped (chat template, prompt too long, empty answer ...)
    conversations: int = 0  # written
    assistant_turns: int = 0
    new_tokens: int = 0
    truncated_turns: int = 0
    truncated_conversations: int = 0
    cut_conversations: int = 0
    leading_assistant_dropped: int = 0
    tool_calls: int = 0
    spliced_results: int = 0
    diverged: dict[str, int] = field(default_factory=dict)  # conversations whose tool loop ended early, by how

    def add(self, conv: Conversation) -> bool:
        """Count one finished conversation and the records read before it; True when it is written."""
        for skipped in conv.before:
            self.skip(*skipped)
        self.records += len(conv.before) + 1
        self.attempted += 1
        self.leading_assistant_dropped += conv.leading_dropped
        if conv.skip is not None:
            self.dropped += 1
            self.skip(conv.skip.reason, conv.where, conv.skip.detail)
            return False
        self.conversations += 1
        self.assistant_turns += len(conv.new_tokens)
        self.new_tokens += sum(conv.new_tokens)
        self.truncated_turns += len(conv.truncated_turns)
        self.truncated_conversations += bool(conv.truncated_turns)
        self.cut_conversations += conv.cut
        self.tool_calls += conv.tool_calls
        self.spliced_results += conv.spliced
        if conv.diverged:
            self.diverged[conv.diverged] = self.diverged.get(conv.diverged, 0) + 1
        return True


def read_records(
    sources: list[Source], skip_records: int, leading_assistant: str, agentic: bool = False
) -> Iterator[tuple]:
    """Every record of every source, in order, as ("skip", reason, where, detail) or ("conversation", turns,
    tools, where, leading assistant turns dropped); the first `skip_records` (already in the shards of an
    interrupted run) are read past. Conversations with tools are skipped unless `agentic` (a tool-call parser is
    named)."""
    for source, record, chat in chats_after(sources, skip_records, leading_assistant, keep_trailing=True):
        where = f"{source.path.name} record {record.index}"
        try:
            if isinstance(chat, Skip):
                raise chat
            if chat.agentic and not agentic:
                raise Skip(
                    "agentic conversation",
                    "it declares or calls tools; name the target's tool-call format "
                    "with --tool-call-parser (vLLM's names: hermes for Qwen3, kimi_k2 for Kimi-K2.5)",
                )
            yield "conversation", _turns_to_answer(chat.messages), chat.tools, where, chat.leading_dropped > 0
        except Skip as skip:
            yield "skip", skip.reason, where, skip.detail


class Regenerator:
    """Keeps a window of conversations in flight, each asking for its next answer as soon as the previous one is
    back, and hands over finished shards in input order.

    Shard k holds conversations k * shard_samples .. (k + 1) * shard_samples - 1 in the order they were taken in
    (less those skipped). It is complete once all of them are finished and no more can join it; at most
    OPEN_SHARDS shards are open at once, so a long conversation holds back the writing of its shard, not the
    generation of the others.
    """

    OPEN_SHARDS = 4

    def __init__(
        self,
        cfg: RegenerateConfig,
        encoder: ChatEncoder,
        max_length: int,
        start_engine: Callable[[], Engine],
        records: Iterator[tuple],
        tally: Tally,
        parser: AnswerParser | None = None,
    ):
        self.cfg = cfg
        self.encoder = encoder
        self.parser = parser
        self.max_length = max_length
        self._start_engine = start_engine
        self.engine: Engine | None = None
        self.records = records
        self.size = cfg.shard_samples
        self.window = 2 * cfg.shard_samples
        self.taken = tally.attempted  # conversations taken in so far (committed ones included)
        self.live = tally.conversations  # taken in and not skipped (so far)
        self.next_shard = -(-tally.attempted // cfg.shard_samples)  # the first shard not written yet
        self.asked: dict[int, tuple[Conversation, str]] = {}  # key -> (conversation, rendered prompt)
        self.finished: dict[int, Conversation] = {}
        self.exhausted = False
        self.tail: list[tuple[str, str, str]] = []  # records skipped after the last conversation
        self.generate_s = 0.0
        self.generated_tokens = 0

    # ---- intake
    def _may_take(self) -> bool:
        return (
            not self.exhausted
            and len(self.asked) < self.window
            and self.taken < (self.next_shard + self.OPEN_SHARDS) * self.size
            and (not self.cfg.max_samples or self.live < self.cfg.max_samples)
        )

    def _take(self) -> None:
        before: list[tuple[str, str, str]] = []
        for item in self.records:
            if item[0] == "skip":
                before.append(item[1:])
                continue
            _, turns, tools, where, dropped = item
            conv = Conversation(
                where=where, index=self.taken, turns=turns, before=before, leading_dropped=dropped, tools=tools
            )
            self.taken += 1
            self.live += 1
            try:
                self.encoder.check_shows(Chat(turns, tools))
            except Skip as skip:
                conv.skip = skip
                self._finish(conv)
                return
            self._ask(conv)
            return
        self.exhausted, self.tail = True, before

    def _ask(self, conv: Conversation) -> None:
        """Ask the engine for `conv`'s next answer, or finish it."""
        request = self._prompt(conv)
        if request is None:
            self._finish(conv)
            return
        ids, text, limit = request
        if self.engine is None:
            self.engine = self._start_engine()
        self.engine.submit(conv.index, ids, limit, _seed(self.cfg.seed, conv.index, conv.pos))
        self.asked[conv.index] = (conv, text)

    def _finish(self, conv: Conversation) -> None:
        self.live -= conv.skip is not None
        self.finished[conv.index] = conv

    def _prompt(self, conv: Conversation) -> tuple[list[int], str, int] | None:
        """Advance `conv` to its next assistant turn: (prompt ids, prompt text, answer limit), or None when done."""
        while conv.pos < len(conv.turns) and conv.turns[conv.pos]["role"] != "assistant":
            turn = dict(conv.turns[conv.pos])
            if turn["role"] == "tool" and _last_assistant(conv.out).get("tool_calls"):  # a result of the target's call
                conv.spliced += 1
                if turn.get("tool_call_id") in conv.call_ids:
                    turn["tool_call_id"] = conv.call_ids[turn["tool_call_id"]]
            conv.out.append(turn)
            conv.pos += 1
        if conv.pos == len(conv.turns):
            return None
        try:
            text = self.encoder.render(conv.out, add_generation_prompt=True, tools=conv.tools)
        except Skip as skip:
            conv.skip = skip
            return None
        ids = self.encoder.tokenizer.encode(text, add_special_tokens=False)
        limit = min(self.cfg.max_new_tokens, self.max_length - len(ids))
        if limit >= 1:
            return ids, text, limit
        answered = max((k for k, m in enumerate(conv.out) if m["role"] == "assistant"), default=None)
        if answered is None:
            conv.skip = Skip(
                "prompt longer than max_length",
                f"the prompt of the first answer has {len(ids)} tokens, max_length is {self.max_length}",
            )
        else:
            conv.out, conv.cut = conv.out[: answered + 1], True
        return None

    def _message(self, conv: Conversation, tokens: list[int], prompt: str) -> Message:
        """The answer `tokens` as an assistant message (Skip where there is none to keep)."""
        if self.parser is None:
            content = answer_text(
                self.encoder.tokenizer.decode(tokens, skip_special_tokens=False), prompt, self.cfg.think
            )
            if content is None:
                raise Skip(
                    "cut off inside <think>",
                    f"turn {conv.pos}: the answer hit its limit of {len(tokens)} "
                    "tokens before its reasoning ended (--think drop)",
                )
            if not content.strip():
                raise Skip("empty answer", f"turn {conv.pos}: the target answered with nothing")
            return {"role": "assistant", "content": content}
        message = self.parser.read(tokens, conv.tools)
        if self.cfg.think == "drop":
            message.pop("reasoning_content", None)
        if not (message["content"].strip() or message.get("tool_calls") or message.get("reasoning_content")):
            raise Skip("empty answer", f"turn {conv.pos}: the target answered with nothing")
        # read back as prepare will read the set (arguments objects, as vLLM hands them to the template later); a
        # call the parser could not read stays `<tool_call>` text in the content, which fails here too
        try:
            return normalize_conversation(
                {"tools": conv.tools, "messages": [{"role": "user", "content": "-"}, message]}
            ).messages[-1]
        except Skip as skip:
            raise Skip("malformed tool call", f"turn {conv.pos}: {skip.detail}") from None

    def _follow(self, conv: Conversation, message: Message) -> None:
        """Compare the target's calls in `message` with the recorded turn's: the same names in order -> its calls
        take the recorded ids where the model wrote none, and the recorded results will follow them; otherwise the
        conversation ends here, counted by how it diverged."""
        recorded = conv.turns[conv.pos]
        calls = message.get("tool_calls", [])
        conv.tool_calls += len(calls)
        want = [c["function"]["name"] for c in recorded.get("tool_calls") or []]
        got = [c["function"]["name"] for c in calls]
        matched = got == want
        for k, call in enumerate(calls):
            old = recorded["tool_calls"][k].get("id") if matched else None
            if "id" not in call:  # id first, as OpenAI writes a call
                calls[k] = call = {"id": old or f"call_{conv.index}_{conv.pos}_{k}", **call}
            if old and old != call["id"]:
                conv.call_ids[old] = call["id"]
        answer_slot = recorded.get("content") is None and not want  # appended after a final user or tool turn
        if not matched and not answer_slot:
            conv.diverged = ANSWERED_INSTEAD if not got else CALLED_INSTEAD if not want else CALLED_OTHERS

    def _answer(self, key: int, tokens: list[int], hit_limit: bool) -> None:
        conv, prompt = self.asked.pop(key)
        self.generated_tokens += len(tokens)
        try:
            message = self._message(conv, tokens, prompt)
        except Skip as skip:
            if skip.reason == "malformed tool call" and any(m["role"] == "assistant" for m in conv.out):
                conv.diverged = WROTE_MALFORMED  # the conversation ends before this answer
            elif skip.reason == "malformed tool call":
                conv.skip = Skip("target wrote a malformed tool call", skip.detail)
            else:
                conv.skip = skip
            self._finish(conv)
            return
        if hit_limit:
            conv.truncated_turns.append(len(conv.out))
        conv.new_tokens.append(len(tokens))
        if self.parser is not None:
            self._follow(conv, message)
        conv.out.append(message)
        conv.pos = len(conv.turns) if conv.diverged else conv.pos + 1
        self._ask(conv)

    # ---- output
    def _intake_over(self) -> bool:
        """No conversation will be taken in any more: the input is read, or max_samples are written or being
        written (nothing in flight could still be skipped and make room)."""
        return self.exhausted or bool(self.cfg.max_samples and self.live >= self.cfg.max_samples and not self.asked)

    def _complete_shard(self) -> list[Conversation] | None:
        """The oldest open shard's conversations once it is complete, else None."""
        first, end = self.next_shard * self.size, (self.next_shard + 1) * self.size
        if self.taken < end and not self._intake_over():
            return None  # more conversations may still join it
        last = min(end, self.taken)
        if first >= last or any(i not in self.finished for i in range(first, last)):
            return None
        self.next_shard += 1
        return [self.finished.pop(i) for i in range(first, last)]

    def shards(self) -> Iterator[list[Conversation]]:
        """The finished shards' conversations, in input order, as they complete."""
        while True:
            while self._may_take():
                self._take()
            while (shard := self._complete_shard()) is not None:
                yield shard
            if not self.asked:
                if self._may_take():
                    continue
                return
            assert self.engine is not None  # started by the first request asked
            t0 = time.perf_counter()
            answers = self.engine.results()
            self.generate_s += time.perf_counter() - t0
            for key, tokens, hit_limit in answers:
                self._answer(key, tokens, hit_limit)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
