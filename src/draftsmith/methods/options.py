"""The drafting methods' typed options: one pydantic model per method, `TrainConfig.method` their union told apart by
`name` (the --method choice). Each method's own model is in its package; this module holds what they extend.

Each method has the options it reads and no other: an EAGLE-3 run its training-time-test steps, P-EAGLE also COD
sampling, a block method (DFlash, DSpark) its block, anchors and loss decay; the draft vocabulary is EAGLE's (default
32000) and DFlash's (default: the target's whole one), DSpark having none of its own. What every method has, whatever it calls
it, is what the trainer reads: `depths`, the positions a round trains (TTT steps, parallel depths, a block's
proposals) and `depth_weight`, the loss weight of depth d being depth_weight**d.

Flags and YAML stay flat (`--method dflash --block-size 8`, or `method: dflash` beside `block_size: 8`); the resolved
config nests them (`method: {name: dflash, block_size: 8, ...}`); both read back. An option of another method is
refused in one line that says which options the chosen method takes.
"""

from __future__ import annotations

import math
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
