"""The extract stage: run the target over a prepared set and fill a hidden-state store.

`run(cfg)` is in stage.py; backends hf.py and vllm/; the store (the stage's artefact) is the store/ package.
"""

from draftsmith.extract.stage import run

__all__ = ["run"]
