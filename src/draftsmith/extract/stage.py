"""The extract stage: run the target over a prepared set and fill a hidden-state store (draftsmith.extract.store).

Backends: "hf" (transformers, extract/hf.py) and "vllm" (extract/vllm/). Both share extract/common.py: input
checks, this worker's sample slice (`--shard i/n`), length-bucketed batches, resume, the background writer.
"""

from __future__ import annotations

from draftsmith.config import ExtractConfig, StageResult
from draftsmith.extract import hf
from draftsmith.extract.vllm import backend as vllm_backend


def run(cfg: ExtractConfig, **kwargs) -> StageResult:
    """Extract with the backend cfg.backend names; returns where the store is and a summary."""
    if cfg.backend == "hf":
        return hf.run(cfg, **kwargs)
    return vllm_backend.run(cfg, **kwargs)  # the config allows no other backend
