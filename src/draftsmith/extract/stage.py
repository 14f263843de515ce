"""The extract stage: run the target over a prepared set and fill a hidden-state store (draftsmith.extract.store).

Backends: "hf" (transformers, extract/hf.py) and "vllm" (extract/vllm/). Both share extract/common.py: input
checks, this worker's sample slice (`--shard i/n`), length-bucketed batches, resume, the background writer.
"""

from __future__ import annotations

import importlib

from draftsmith.config import ExtractConfig, StageResult
from draftsmith.core.errors import DraftsmithError
from draftsmith.extract import hf


def run(cfg: ExtractConfig, **kwargs) -> StageResult:
    """Extract with the backend cfg.backend names; returns where the store is and a summary."""
    if cfg.backend == "hf":
        return hf.run(cfg, **kwargs)
    if cfg.backend == "vllm":
        try:
            vllm_backend = importlib.import_module("draftsmith.extract.vllm")
        except ModuleNotFoundError as err:
            if err.name and err.name.startswith("draftsmith"):
                raise DraftsmithError(
                    "--backend vllm: this draftsmith has no vLLM backend installed "
                    "(draftsmith.extract.vllm is missing); use --backend hf"
                ) from None
            raise
        backend_run = getattr(vllm_backend, "run", None)
        if backend_run is None:
            raise DraftsmithError("--backend vllm: draftsmith.extract.vllm has no run(cfg); use --backend hf")
        return backend_run(cfg, **kwargs)
    raise DraftsmithError(f"--backend {cfg.backend!r}: unknown; use hf or vllm")
