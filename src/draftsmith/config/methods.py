"""The drafting methods' typed options: one pydantic model per method, `TrainConfig.method` their union told apart by
`name` (the --method choice).

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
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

# The drafting methods --method chooses among (each has its module in draftsmith.train.methods, which the stages ask)
MethodName = Literal["eagle3", "eagle3.1", "peagle", "dflash", "dspark"]
DEFAULT_METHOD: MethodName = "eagle3"


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


class Eagle31Options(Eagle3Options):
    """Eagle 3.1: EAGLE-3's options (its norms are the draft's, not options)."""

    name: Literal["eagle3.1"] = "eagle3.1"  # type: ignore[assignment]  # the discriminator narrows per method


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


class DSparkOptions(BlockOptions):
    """DSpark: DFlash's block whose anchor row proposes too, with a Markov and a confidence head, over the target's
    whole vocabulary (its Markov head and confidence target read every token)."""

    name: Literal["dspark"] = "dspark"
    silent_rows: ClassVar[int] = 0


AnyMethodOptions = Annotated[
    Eagle3Options | Eagle31Options | PEagleOptions | DFlashOptions | DSparkOptions, Field(discriminator="name")
]
OPTIONS: dict[str, type[MethodOptions]] = {
    cls.model_fields["name"].default: cls
    for cls in (Eagle3Options, Eagle31Options, PEagleOptions, DFlashOptions, DSparkOptions)
}
# Every method's option names, each with the methods that take it (the CLI has one flag per name)
OPTION_NAMES: dict[str, list[str]] = {}
for _name, _cls in OPTIONS.items():
    for _field in _cls.model_fields:
        if _field != "name":
            OPTION_NAMES.setdefault(_field, []).append(_name)


def options_class(name: str) -> type[MethodOptions]:
    return OPTIONS[name]


def fold_options(data: dict[str, object]) -> dict[str, object]:
    """The config's input with `method` a mapping: its name (a string, a mapping's `name`, or the default) and the
    method's options given flat beside it (flags, a flat YAML file, an older checkpoint's flat record) moved in, a
    flat one overriding a nested one as a flag overrides a file. A flat option of another method is refused."""
    given = data.get("method", DEFAULT_METHOD)
    if isinstance(given, MethodOptions):
        given = given.model_dump()
    nested = dict(given) if isinstance(given, dict) else {"name": given}
    name = nested.setdefault("name", DEFAULT_METHOD)
    flat = {k: data[k] for k in OPTION_NAMES if k in data}
    if name not in OPTIONS:  # the union's own error names the choices
        return {**{k: v for k, v in data.items() if k not in flat}, "method": nested}
    takes = OPTIONS[name].model_fields
    for key in flat:
        if key not in takes:
            mine = ", ".join("--" + k.replace("_", "-") for k in takes if k != "name") or "no options"
            owners = " / ".join(OPTION_NAMES[key])
            raise ValueError(
                f"--{key.replace('_', '-')} is an option of --method {owners}; --method {name} takes {mine}"
            )
    return {**{k: v for k, v in data.items() if k not in flat}, "method": {**nested, **flat}}


def flat_options(dumped: dict[str, object]) -> dict[str, object]:
    """A dumped config with `method` back to its name and its options beside it (the flat form flags and older
    checkpoints use), for comparing two runs' hyper-parameters key by key."""
    method = dumped.get("method")
    if not isinstance(method, dict):
        return dict(dumped)
    options = {k: v for k, v in method.items() if k != "name"}
    return {**dumped, **options, "method": method.get("name")}


def option_default(key: str) -> object:
    """The default of an option every method that takes it agrees on; None where they differ (each says its own)."""
    defaults = {repr(OPTIONS[name].model_fields[key].default) for name in OPTION_NAMES[key]}
    return OPTIONS[OPTION_NAMES[key][0]].model_fields[key].default if len(defaults) == 1 else None


def option_help(key: str) -> str:
    """One flag's help for an option several methods may take: each distinct description, with its methods (and
    its default where the methods' defaults differ)."""
    texts: dict[str, list[str]] = {}
    for name in OPTION_NAMES[key]:
        field = OPTIONS[name].model_fields[key]
        shown = f" [default: {field.default}]" if option_default(key) is None and field.default is not None else ""
        texts.setdefault((field.description or "") + shown, []).append(name)
    return " ".join(f"{' / '.join(names)}: {text}" for text, names in texts.items())
