"""The extract stage: run the target over a prepared set and fill a hidden-state store.

`run(cfg)` is in stage.py; backends hf.py and vllm/; the store (the stage's artefact) is the store/ package.
`run` is loaded from stage.py on first use (PEP 562): importing a module of this package does not load the
stage and its torch.
"""

from __future__ import annotations

import importlib

__all__ = ["run"]


def __getattr__(name: str):
    """`run`, from stage.py on first use; a submodule is imported as usual."""
    if name == "run":
        return importlib.import_module("draftsmith.extract.stage").run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
