"""The vLLM extraction backend: probe the installed vLLM, pick a strategy, fill the store from inside vLLM.

    backend.run(cfg)               the extract stage with --backend vllm (called by extract/stage.py)
    probe.probe(), tables.render_probe_table(report)      what `draftsmith doctor` shows
    backend.benchmark(prepared, n) every offered strategy's throughput vs plain prefill of the same vLLM, same prompts

Strategies (see docs/vllm-compat.md): "connector" = vLLM's own extract_hidden_states method + draftsmith's KV
connector (connector.py); "direct" = a worker extension reading vLLM's own EAGLE-3 aux states in the model runner;
"taps" = draftsmith's own hooks on the target's decoder layers, needing nothing of vLLM's EAGLE-3 support (both
taps.py). All hand each finished request to the store sink (sink.py) inside vLLM's worker; the driver (driver.py)
only feeds prompts.
Nothing here imports vLLM at module import time, so the package loads (and the probe reports) without vLLM.
This package imports nothing itself: `draftsmith doctor` reads the probe without torch or the store.
"""
