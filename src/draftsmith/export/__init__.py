"""The export stage: a trained draft -> a vLLM, SGLang or speculators model directory (formats.py)."""

from draftsmith.export.formats import (
                                       FORMATS,
                                       DraftArch,
                                       DraftSource,
                                       canonical_tensors,
                                       draft_module,
                                       is_export,
                                       load_draft,
                                       read_export,
                                       require_draft_for_target,
                                       run,
                                       write_export,
)

__all__ = ["FORMATS", "DraftArch", "DraftSource", "canonical_tensors", "draft_module", "is_export", "load_draft",
           "read_export", "require_draft_for_target", "run", "write_export"]
