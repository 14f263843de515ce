"""P-EAGLE: EAGLE-3 with parallel drafting, all k tokens of a round from one draft forward.

Light (no torch): its options, the vLLM facts it needs and `load()` (methods/__init__.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from draftsmith.methods.eagle3 import Eagle3Options
from draftsmith.methods.options import VllmNeed

if TYPE_CHECKING:
    from draftsmith.methods.peagle.method import PEagle

ROW = "parallel drafting (P-EAGLE)"  # doctor's row of the probe fact (extract/vllm/readers.py)
NEEDS = (
    VllmNeed(
        lambda facts: facts.parallel_drafting,
        ROW,
        "has no parallel drafting",
        "has parallel drafting",
        " (vLLM >= 0.16 has SpeculativeConfig.parallel_drafting)",
    ),
)


class PEagleOptions(Eagle3Options):
    """P-EAGLE: every depth of a round in one forward, trained with COD sampling."""

    name: Literal["peagle"] = "peagle"  # type: ignore[assignment]
    ttt_steps: int = Field(
        7, ge=1, description="the parallel depths trained: the most tokens a round is meant to propose."
    )
    cod_ratio: float = Field(
        0.8, gt=0, le=1, description="COD sampling: depth k >= 1 scores about ratio**k of its positions (1: every one)."
    )
    cod_floor: float = Field(0.2, ge=0, le=1, description="COD sampling keeps at least this fraction of each depth.")


Options = PEagleOptions


def load() -> PEagle:
    from draftsmith.methods.peagle.method import PEAGLE

    return PEAGLE
