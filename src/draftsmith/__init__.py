"""draftsmith: train EAGLE-3 draft models for Hugging Face causal LMs and ship them to vLLM."""

__version__ = "0.1.0"
