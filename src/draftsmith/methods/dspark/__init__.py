"""DSpark: DFlash's block with the anchor predicting too, then a Markov head left to right.

Light (no torch): its options, the vLLM facts it needs and `load()` (methods/__init__.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from draftsmith.methods.options import BlockOptions, VllmNeed

if TYPE_CHECKING:
    from draftsmith.methods.dspark.method import DSpark

ROW = "DSpark drafts"  # doctor's row of the probe fact (extract/vllm/readers.py)
ARCHITECTURE = "Qwen3DSparkModel"  # the architecture of an exported DSpark draft (vLLM's qwen3_dspark)
NEEDS = (
    VllmNeed(
        lambda facts: facts.dspark,
        ROW,
        "cannot draft with the dspark method here",
        "drafts with the dspark method here",
        " (vLLM >= 0.32 on a GPU: its model runner V2 drafts DSpark)",
    ),
)


class DSparkOptions(BlockOptions):
    """DSpark: DFlash's block whose anchor row proposes too, with a Markov and a confidence head, over the target's
    whole vocabulary (its Markov head and confidence target read every token)."""

    name: Literal["dspark"] = "dspark"
    silent_rows: ClassVar[int] = 0


Options = DSparkOptions


def load() -> DSpark:
    from draftsmith.methods.dspark.method import DSPARK

    return DSPARK
