"""What every method's typed options extend (`MethodOptions`, `BlockOptions`; each method's own model is in its
package, the union in the registry) and what a vLLM must have to serve a method (`VllmNeed`, `MethodFacts`). No torch.

What the trainer reads of every method's options: `depths`, the positions a round trains (TTT steps, parallel depths,
a block's proposals) and `depth_weight`, the loss weight of depth d being depth_weight**d.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field


class MethodOptions(BaseModel):
    """What every method's options have: its name, the depths a round trains and their loss weight."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    default_num_layers: ClassVar[int] = 1  # the draft's decoder layers when --num-layers is not given

    @property
    def depths(self) -> int:
        """The positions a round trains (the trainer's unrolled steps)."""
        raise NotImplementedError

    @property
    def depth_weight(self) -> float:
        """Depth d (0 = the first) weighs depth_weight**d in the loss."""
        raise NotImplementedError


class BlockOptions(MethodOptions):
    """A block method's: the block, its anchors and the loss decay over its proposals."""

    default_num_layers: ClassVar[int] = 5
    silent_rows: ClassVar[int]  # the block rows that propose nothing
    block_size: int = Field(
        16,
        ge=2,
        le=64,
        description=(
            "positions per block, the anchor and block-size - 1 mask tokens; vLLM proposes block-size - 1 tokens a "
            "round (dspark: block-size)."
        ),
    )
    anchors_per_sample: int = Field(
        512,
        ge=1,
        description=(
            "blocks trained per sample, their anchors drawn at random among the answer's tokens (fewer on a CPU: each "
            "costs block-size queries over the sample's context)."
        ),
    )
    loss_decay: float = Field(
        7.0, gt=0, description="a block's proposal d (0 = the first) weighs exp(-d / loss-decay) in the loss."
    )

    @property
    def depths(self) -> int:
        return self.block_size - self.silent_rows

    @property
    def depth_weight(self) -> float:
        return math.exp(-1.0 / self.loss_decay)


class MethodFacts(BaseModel):
    """What the probe reads of a vLLM for the methods beyond EAGLE-3 (`ProbeFacts` extends it). None: unknown."""

    parallel_drafting: bool | None = None  # P-EAGLE: SpeculativeConfig.parallel_drafting and a proposer using it
    dflash: bool | None = None  # DFlash: DFlashDraftModel registered, a DFlashProposer, the "dflash" method
    eagle31: bool | None = None  # Eagle 3.1: vLLM's Eagle-3 draft reads fc_norm and norm_output from its config
    dspark: bool | None = None  # DSpark: Qwen3DSparkModel registered, the "dspark" method, a GPU model runner V2


@dataclass(frozen=True)
class VllmNeed:
    """A probe fact a vLLM must have to serve a method beside EAGLE-style decoding (each package's `NEEDS`), and the
    words of a refusal: the doctor row that shows it, what is missing when the fact is false, which vLLM has it."""

    fact: Callable[[MethodFacts], bool | None]
    row: str
    lacks: str  # "has no parallel drafting"
    has: str  # "has parallel drafting" (for "could not tell whether vLLM X has ...")
    hint: str  # " (vLLM >= 0.16 has SpeculativeConfig.parallel_drafting)"
    hint_with_platform: str = ""  # the hint when EAGLE-style decoding is missing too (default: `hint`)
