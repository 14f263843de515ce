"""The vLLM extraction backend: probe the installed vLLM, pick a strategy, fill the store from inside vLLM.

    run(cfg)                       the extract stage with --backend vllm (called by draftsmith.extract.run)
    probe.probe(), probe.render_probe_table(report)       what `draftsmith doctor` shows
    benchmark(prepared, n)         every offered strategy's throughput vs plain prefill of the same vLLM, same prompts

Strategies (see docs/vllm-compat.md): "connector" = vLLM's own extract_hidden_states method + draftsmith's KV
connector (connector.py); "direct" = a worker extension reading vLLM's own EAGLE-3 aux states in the model runner;
"taps" = draftsmith's own hooks on the target's decoder layers, needing nothing of vLLM's EAGLE-3 support (both
taps.py). All hand each finished request to the store sink (sink.py) inside vLLM's worker; the driver (driver.py)
only feeds prompts.
Nothing here imports vLLM at module import time, so the package loads (and the probe reports) without vLLM.
The stage itself is backend.py; its names are loaded on first use (PEP 562), so importing the package, or the
probe in it, loads neither torch nor the store: `draftsmith doctor` reads the probe without them.
"""

from __future__ import annotations

import importlib

_BACKEND = "draftsmith.extract.vllm.backend"
__all__ = ["benchmark", "choose_strategy", "compute_dtype", "offered_strategies", "run", "say_dtype"]


def __getattr__(name: str):
    """The backend's public names, from backend.py on first use (a submodule such as `probe` is imported as usual)."""
    if name in __all__:
        return getattr(importlib.import_module(_BACKEND), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
