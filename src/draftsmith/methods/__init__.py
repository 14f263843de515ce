"""The drafting methods, one package each, and the one registry every stage asks: `method(name)` for --method,
`method_of(spec)` for a draft, `method_of_config(config)` for a draft directory's config.json as vLLM reads it.

    eagle3   EAGLE-3: one token per forward, each step reading its own output (methods/eagle3/)
    eagle3.1 Eagle 3.1: EAGLE-3 with a norm per captured layer and the normed output fed back (methods/eagle31/)
    peagle   P-EAGLE: EAGLE-3 with parallel drafting, a round in one forward (methods/peagle/)
    dflash   DFlash: a block drafter, the anchor and block_size - 1 masks in one forward (methods/dflash/)
    dspark   DSpark: DFlash's block with the anchor predicting too, then a Markov head left to right (methods/dspark/)

A method is a package: its `__init__` light (no torch: its options `Options`, the vLLM facts it needs `NEEDS`, and
`load()`), its `method.py` the `DraftMethod` (methods/base.py), its `modeling.py` where it has a module of its own.
Everything the stages know of the methods is derived from PACKAGES: the names, the options union and OPTIONS, the
probe facts they need. A new method is its package and one line in PACKAGES (and its name in MethodName, which a
test holds to PACKAGES); nothing else branches on a method's name.

Below the stages and below config/ (core < methods < config < prepare < ...): it imports core/ only.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Annotated, Literal, Union

from pydantic import Field

from draftsmith.core.errors import DraftsmithError
from draftsmith.methods import dflash, dspark, eagle3, eagle31, peagle
from draftsmith.methods.options import MethodOptions, VllmNeed

if TYPE_CHECKING:
    from draftsmith.methods.base import DraftMethod
    from draftsmith.methods.spec import DraftSpec

# Every method, in the order a draft directory's config.json is read: the most specific first (DSpark before DFlash:
# its config names a block and a mask token too), EAGLE-3 (which claims every EAGLE-style config) last.
PACKAGES: tuple[ModuleType, ...] = (dspark, dflash, peagle, eagle31, eagle3)

# --method's choices, as the packages' options name them (tests/test_method_options.py holds the two equal)
MethodName = Literal["eagle3", "eagle3.1", "peagle", "dflash", "dspark"]
DEFAULT_METHOD: MethodName = "eagle3"

_BY_NAME: dict[str, ModuleType] = {p.Options.model_fields["name"].default: p for p in PACKAGES}
NAMES: tuple[str, ...] = tuple(_BY_NAME)  # the registry's order
# Each method's options model, in the order flags and help list them (the plainest first)
OPTIONS: dict[str, type[MethodOptions]] = {name: _BY_NAME[name].Options for name in reversed(NAMES)}
NEEDS: dict[str, tuple[VllmNeed, ...]] = {name: p.NEEDS for name, p in _BY_NAME.items()}

if TYPE_CHECKING:  # a type checker reads the base; pydantic the union told apart by `name`
    AnyMethodOptions = MethodOptions
else:
    AnyMethodOptions = Annotated[Union[tuple(OPTIONS.values())], Field(discriminator="name")]  # noqa: UP007 - a union of a tuple


def method(name: str) -> DraftMethod:
    """The method called `name` (--method, a recorded DraftSpec.method); its implementation imported on first use."""
    try:
        package = _BY_NAME[name]
    except KeyError:
        raise DraftsmithError(
            f"drafting method {name!r} is not one draftsmith has; choose one of {', '.join(sorted(NAMES))}"
        ) from None
    return package.load()


def all_methods() -> tuple[DraftMethod, ...]:
    """Every method, in the registry's order (the most specific first)."""
    return tuple(p.load() for p in PACKAGES)


def method_of(spec: DraftSpec) -> DraftMethod:
    """The method of a draft."""
    return method(spec.method)


def method_of_config(config: Mapping[str, object], where: str = "config.json") -> DraftMethod:
    """The method vLLM serves a draft directory's config.json as (each method's `claims`, the most specific first);
    `where` names the file in a refusal."""
    return next(m for m in all_methods() if m.claims(config, where))


def recorded_spec(draft: dict[str, object]) -> dict[str, object]:
    """A DraftSpec an older draftsmith recorded (manifest format 2), as the methods record it now: P-EAGLE was
    EAGLE-3's method with `parallel_drafting: true`, an EAGLE-3 draft had the flag false."""
    if draft.pop("parallel_drafting", False):
        draft["method"] = "peagle"
    return draft


def same_family(a: DraftMethod, b: DraftMethod) -> bool:
    """Whether drafts of methods `a` and `b` are one module, so one's weights are read whole as the other's (an
    export's config.json naming another method than its manifest). Which drafts can start a run is the method's
    own question (`DraftMethod.starts_from`)."""
    return a.module is b.module
