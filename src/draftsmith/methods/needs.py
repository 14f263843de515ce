"""What a vLLM must have to serve a method (`VllmNeed`), beside EAGLE-style speculative decoding on its platform:
each method's package lists its own (`NEEDS`); the registry joins them to the probe's facts by field, and a test
holds every need's fact to a `ProbeFacts` field (extract/vllm/probe.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VllmNeed:
    """A probe fact (`ProbeFacts` attribute) a vLLM must have to serve a method, with the words of a refusal: the
    doctor row that shows it, what is missing when the fact is false, and which vLLM has it."""

    fact: str
    row: str
    lacks: str  # "has no parallel drafting"
    has: str  # "has parallel drafting" (for "could not tell whether vLLM X has ...")
    hint: str  # " (vLLM >= 0.16 has SpeculativeConfig.parallel_drafting)"
    hint_with_platform: str = ""  # the hint when EAGLE-style decoding is missing too (default: `hint`)
