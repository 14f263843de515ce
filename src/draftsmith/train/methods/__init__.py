"""The drafting methods, one module each, and the one registry every stage asks: `method(name)` for --method,
`method_of(spec)` for a draft, `method_of_config(config)` for a draft directory's config.json as vLLM reads it.

    eagle3   EAGLE-3: one token per forward, each step reading its own output (methods/eagle3.py)
    eagle3.1 Eagle 3.1: EAGLE-3 with a norm per captured layer and the normed output fed back (methods/eagle31.py)
    peagle   P-EAGLE: EAGLE-3 with parallel drafting, a round in one forward (methods/peagle.py)
    dflash   DFlash: a block drafter, the anchor and block_size - 1 masks in one forward (methods/dflash.py)
    dspark   DSpark: DFlash's block with the anchor predicting too, then a Markov head left to right (methods/dspark.py)

A new method is a module with a `DraftMethod` (methods/base.py) and one line in METHODS; nothing else branches on a
method's name.
"""

from __future__ import annotations

from collections.abc import Mapping

from draftsmith.core.errors import DraftsmithError
from draftsmith.train.methods.base import DraftMethod
from draftsmith.train.methods.dflash import DFLASH
from draftsmith.train.methods.dspark import DSPARK
from draftsmith.train.methods.eagle3 import EAGLE3
from draftsmith.train.methods.eagle31 import EAGLE31
from draftsmith.train.methods.peagle import PEAGLE
from draftsmith.train.model import DraftSpec

# Every method, in the order a draft directory's config.json is read: the most specific first (DSpark before DFlash:
# its config names a block and a mask token too), EAGLE-3 (which claims every EAGLE-style config) last.
METHODS: dict[str, DraftMethod] = {m.name: m for m in (DSPARK, DFLASH, PEAGLE, EAGLE31, EAGLE3)}


def method(name: str) -> DraftMethod:
    """The method called `name` (--method, a recorded DraftSpec.method)."""
    try:
        return METHODS[name]
    except KeyError:
        raise DraftsmithError(
            f"drafting method {name!r} is not one draftsmith has; choose one of {', '.join(sorted(METHODS))}"
        ) from None


def method_of(spec: DraftSpec) -> DraftMethod:
    """The method of a draft."""
    return method(spec.method)


def method_of_config(config: Mapping[str, object], where: str = "config.json") -> DraftMethod:
    """The method vLLM serves a draft directory's config.json as (each method's `claims`, the most specific first);
    `where` names the file in a refusal."""
    return next(m for m in METHODS.values() if m.claims(config, where))


def recorded_spec(draft: dict[str, object]) -> dict[str, object]:
    """A DraftSpec an older draftsmith recorded (manifest format 2), as the methods record it now: P-EAGLE was
    EAGLE-3's method with `parallel_drafting: true`, an EAGLE-3 draft had the flag false."""
    if draft.pop("parallel_drafting", False):
        draft["method"] = PEAGLE.name
    return draft


def same_family(a: DraftMethod, b: DraftMethod) -> bool:
    """Whether drafts of methods `a` and `b` are one module, so one's weights are read whole as the other's (an
    export's config.json naming another method than its manifest). Which drafts can start a run is the method's
    own question (`DraftMethod.starts_from`)."""
    return a.module is b.module


__all__ = ["DraftMethod", "METHODS", "method", "method_of", "method_of_config", "recorded_spec", "same_family"]
