"""Eagle 3.1: EAGLE-3 with a norm per captured layer and the normed output fed back.

Light (no torch): its options, the vLLM facts it needs and `load()` (methods/__init__.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from draftsmith.methods.eagle3 import Eagle3Options
from draftsmith.methods.options import VllmNeed

if TYPE_CHECKING:
    from draftsmith.methods.eagle31.method import Eagle31

ROW = "Eagle 3.1 drafts"  # doctor's row of the probe fact (extract/vllm/readers.py)
NEEDS = (
    VllmNeed(
        lambda facts: facts.eagle31,
        ROW,
        "builds no fc_norm / norm_output into its EAGLE-3 draft",
        "builds fc_norm and norm_output into its EAGLE-3 draft",
        " (vLLM >= 0.22 reads fc_norm and norm_output)",
    ),
)


class Eagle31Options(Eagle3Options):
    """Eagle 3.1: EAGLE-3's options (its norms are the draft's, not options)."""

    name: Literal["eagle3.1"] = "eagle3.1"  # type: ignore[assignment]  # the discriminator narrows per method


Options = Eagle31Options


def load() -> Eagle31:
    from draftsmith.methods.eagle31.method import EAGLE31

    return EAGLE31
