"""The evaluate stage: acceptance length and speed-up by real speculative decoding (stage.py), with the reference
decoder (specdec.py) or vLLM (vllm_runner.py); the report is written by report.py."""

from draftsmith.evaluate.stage import build_draft_module, evaluate_reference, run

__all__ = ["run", "build_draft_module", "evaluate_reference"]
