"""The export stage: a trained draft -> a vLLM, SGLang or speculators model directory (stage.py runs it,
formats.py writes the formats; drafts are read back by draftsmith.methods.artefact.load_draft)."""

from draftsmith.export.formats import (
    FORMATS,
    ExportManifest,
    read_export_manifest,
    serve_commands,
    vllm_loadable,
    write_export,
)
from draftsmith.export.stage import run

__all__ = [
    "FORMATS",
    "ExportManifest",
    "read_export_manifest",
    "run",
    "serve_commands",
    "vllm_loadable",
    "write_export",
]
