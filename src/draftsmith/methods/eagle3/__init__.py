"""EAGLE-3: the draft proposes one token per forward, each step reading its own previous output.

Light (no torch): its options, the vLLM facts it needs and `load()` (methods/__init__.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from draftsmith.methods.options import MethodOptions, VllmNeed

if TYPE_CHECKING:
    from draftsmith.methods.eagle3.method import Eagle3

NEEDS: tuple[VllmNeed, ...] = ()  # EAGLE-style speculative decoding on the platform: every method's


class Eagle3Options(MethodOptions):
    """EAGLE-3: one token a forward, each step reading its own previous output (training-time test)."""

    name: Literal["eagle3"] = "eagle3"
    draft_vocab_size: int = Field(
        32000,
        ge=2,
        description=(
            "the draft vocabulary: the most frequent loss-masked target ids (clipped to the target's vocabulary), "
            "with the draft's own lm_head."
        ),
    )
    ttt_steps: int = Field(7, ge=1, description="training-time-test steps unrolled per position.")
    step_weight: float = Field(0.8, gt=0, description="loss weight of TTT step k is step_weight**k.")

    @property
    def depths(self) -> int:
        return self.ttt_steps

    @property
    def depth_weight(self) -> float:
        return self.step_weight


Options = Eagle3Options


def load() -> Eagle3:
    from draftsmith.methods.eagle3.method import EAGLE3

    return EAGLE3
