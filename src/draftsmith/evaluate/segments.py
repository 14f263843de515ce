"""What the target was writing at each generated token: reasoning, content or a tool call; and τ split that way.

An agentic reasoning model's answer is a `<think>` block, then content or a tool-call section; a draft may be
accepted far more often inside one than another (a tool call's JSON is predictable, free reasoning less so), and one
τ over all of them hides it. The segment of a token follows the markers the target writes (and a reasoning block the
prompt leaves open, as templates that pre-fill `<think>` do):

    reasoning    from `<think>` to `</think>` (both included)
    tool call    from a tool-call section's opening marker to its closing one: Hermes / Qwen3 `<tool_call>`,
                 Kimi-K2 `<|tool_calls_section_begin|>`, DeepSeek-V3 `<｜tool▁calls▁begin｜>`
    content      everything else

A round of speculative decoding counts for the segment of the first token it adds (where the draft's proposals
start). The reference decoder sees every round (evaluate --engine hf); vLLM reports each request's verify steps in
order where the release keeps them (`per_request_spec_decode_metrics="detailed"`, vLLM 0.32 on), and `step_rounds`
maps them onto the generated tokens: the first token comes from the prefill, each step adds its accepted draft
tokens and one of the target's.
"""

from __future__ import annotations

from typing import Any

from draftsmith.evaluate.report import SegmentReport
from draftsmith.evaluate.specdec import DecodeStats

REASONING, CONTENT, TOOL_CALL = "reasoning", "content", "tool call"
SEGMENTS = (REASONING, CONTENT, TOOL_CALL)
# (opening marker, closing marker, segment)
MARKERS = (
    ("<think>", "</think>", REASONING),
    ("<tool_call>", "</tool_call>", TOOL_CALL),
    ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", TOOL_CALL),
    ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", TOOL_CALL),
)
_TAIL = max(len(m) for pair in MARKERS for m in pair[:2])


class Segmenter:
    """Labels generated tokens with the segment the target was writing, from the tokenizer's text of them."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def open_at_end(self, prompt_ids: list[int]) -> str:
        """The segment a prompt leaves open (a generation prompt that pre-fills `<think>`), else content."""
        text = self._text(prompt_ids[-64:])
        state, last = CONTENT, -1
        for opening, closing, segment in MARKERS:
            at_open, at_close = text.rfind(opening), text.rfind(closing)
            if at_open > at_close and at_open > last:
                state, last = segment, at_open
        return state

    def labels(self, prompt_ids: list[int], out_ids: list[int]) -> list[str]:
        """The segment of each generated token: a marker belongs to the segment it opens or closes, all of its
        tokens where the tokenizer spells it in several."""
        state = self.open_at_end(prompt_ids)
        text, labels, lengths = "", [], []
        for token in out_ids:
            piece = self._text([token])
            text = (text + piece)[-4 * _TAIL :]
            labels.append(state)
            lengths.append(len(piece))
            for opening, closing, segment in MARKERS:
                if state == CONTENT and text.endswith(opening):
                    state = segment
                    covered, i = 0, len(labels) - 1  # the marker's earlier tokens open the segment too
                    while i >= 0 and covered < len(opening):
                        labels[i] = segment
                        covered += lengths[i]
                        i -= 1
                    break
                if state == segment and text.endswith(closing):
                    state = CONTENT  # the closing marker itself is still the segment's
                    break
        return labels


def split_rounds(
    labels: list[str], rounds: list[tuple[int, int]], k: int, into: dict[str, DecodeStats] | None = None
) -> dict[str, DecodeStats]:
    """Count each round `(index of its first new token, accepted draft tokens)` for that token's segment."""
    into = into if into is not None else {s: DecodeStats(k=k) for s in SEGMENTS}
    for start, accepted in rounds:
        if start < len(labels):
            into[labels[start]].add_round(accepted)
    return into


def step_rounds(accepted: list[int]) -> list[tuple[int, int]]:
    """One request's verify steps (accepted draft tokens of each, in order) as rounds `(index of its first new token,
    accepted draft tokens)`, as the reference decoder records them."""
    rounds, start = [], 1  # token 0 is the prefill's
    for n in accepted:
        rounds.append((start, n))
        start += n + 1
    return rounds


def segment_report(stats: DecodeStats) -> SegmentReport:
    """One segment's rounds as the report shows them."""
    rounds = stats.num_rounds
    return SegmentReport(
        rounds=rounds,
        tau=stats.tau if rounds else None,
        acceptance_per_pos=stats.acceptance_per_pos if rounds else None,
    )
