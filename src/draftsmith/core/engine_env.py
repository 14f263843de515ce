"""The environment a vLLM engine that draftsmith starts runs in: what vLLM reads from it, decided in one place.

Every engine -- extraction's and the online feed's (in this process), evaluation's and regeneration's (a worker
process), `draftsmith serve` (vLLM's server) -- takes its KV-cache size from here, so one option means the same
everywhere: `--kv-cache-gb` / `--vllm-kv-cache-gb` when given, else what the environment already says, else 2 GiB.
vLLM reads `VLLM_CPU_KVCACHE_SPACE` on its CPU platform only; without it vLLM on a CPU reserves most of the
machine's memory for its cache and refuses to start when that much is not free.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

KV_CACHE_VAR = "VLLM_CPU_KVCACHE_SPACE"
DEFAULT_KV_CACHE_GIB = 2


def kv_cache(kv_cache_gib: int | None, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The KV-cache variable an engine needs on top of `environ`: the option when given, else nothing where
    `environ` sets it, else the default. vLLM parses an integer."""
    if kv_cache_gib is None and environ.get(KV_CACHE_VAR):
        return {}
    return {KV_CACHE_VAR: str(int(kv_cache_gib or DEFAULT_KV_CACHE_GIB))}


def worker_environment(kv_cache_gib: int | None, **extra: str) -> dict[str, str]:
    """The whole environment of a child process that starts vLLM (an evaluation or regeneration worker, vLLM's
    server): this process's, the KV cache as `kv_cache` decides, vLLM's log level at WARNING unless set, `extra`."""
    env = dict(os.environ, **kv_cache(kv_cache_gib))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.update(extra)
    return env
