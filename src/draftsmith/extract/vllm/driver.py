"""Build the vLLM engine for a strategy and feed it the prepared prompts; the store is written inside vLLM.

The driver process never sees a hidden state: it submits each pending sample's token ids as a prompt with
`max_tokens=1` (the prefill computes every layer; one token is sampled and the request ends), keeps many requests
in flight, and tags each with its sample id in `SamplingParams.extra_args["kv_transfer_params"]`, which reaches
the connector (request.kv_transfer_params) and the direct taps (new request data) alike. When every request has
finished it waits until the worker-side sink has received them all, then has the writer flush and close.

vLLM must be started from a real script (its worker processes are spawned, not forked); the CLI, pytest and the
benchmark scripts all are.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from draftsmith.core.errors import DraftsmithError
from draftsmith.extract.vllm import worker as worker_module
from draftsmith.extract.vllm.connector import EXTRA_CONFIG_KEY
from draftsmith.extract.vllm.probe import ProbeFacts
from draftsmith.extract.vllm.sink import SAMPLE_ID_KEY

DEFAULT_CPU_KV_CACHE_GIB = "2"
IN_FLIGHT = 1024  # requests handed to vLLM ahead of what it is computing


@dataclass
class EngineSpec:
    """What the engine is built with: the target, the strategy and vLLM's own knobs."""

    target_dir: str
    strategy: str  # "connector", "direct" or "plain" (no capture: the prefill-only baseline)
    facts: ProbeFacts
    max_model_len: int
    max_num_batched_tokens: int
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    compile: bool = True
    dtype: str = "bfloat16"
    trust_remote_code: bool = False
    sink_config: dict[str, Any] = field(default_factory=dict)


def engine_kwargs(spec: EngineSpec) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM` (each engine knob guarded by what the probe found)."""
    kwargs: dict[str, Any] = {
        "model": spec.target_dir,
        "dtype": spec.dtype,
        "max_model_len": spec.max_model_len,
        "max_num_batched_tokens": max(spec.max_num_batched_tokens, spec.max_model_len),
        "tensor_parallel_size": spec.tensor_parallel_size,
        "data_parallel_size": spec.data_parallel_size,
        "enable_prefix_caching": False,  # a cached prefix would skip its forward pass, and with it its states
        "trust_remote_code": spec.trust_remote_code,
        "seed": 0,
        "worker_extension_cls": worker_module.EXTENSION,
    }
    if spec.strategy == "connector":
        layer_ids = spec.sink_config["spec"]["layer_ids"]
        kwargs["speculative_config"] = {
            "method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}
        kwargs["kv_transfer_config"] = {
            "kv_connector": "DraftsmithStoreConnector",
            "kv_connector_module_path": "draftsmith.extract.vllm.connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {EXTRA_CONFIG_KEY: spec.sink_config}}
        if not spec.compile:
            kwargs["enforce_eager"] = True
    elif spec.strategy == "direct":
        kwargs["enforce_eager"] = True  # taps are set after start-up; a compiled graph would not see them
        if spec.facts.async_scheduling_field:
            kwargs["async_scheduling"] = False  # read each step's states before the next step is scheduled
    elif not spec.compile:
        kwargs["enforce_eager"] = True
    return kwargs


def resolve_dtype(asked: str, platform: str | None) -> str:
    """`auto`: bfloat16 on accelerators and on CPUs with bf16 instructions; float32 on other CPUs (where vLLM's
    bf16 kernels are emulated and many times slower)."""
    if asked != "auto":
        return asked
    if platform == "cpu":
        import torch

        try:
            native_bf16 = bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
        except AttributeError:
            native_bf16 = False
        return "bfloat16" if native_bf16 else "float32"
    return "bfloat16"


def _prepare_environment(spec: EngineSpec) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_CPU_KV_CACHE_GIB)
    if spec.strategy == "direct" and spec.facts.runner_v2_switch:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"  # the taps know the V1 runner (GPUModelRunner)


class Engine:
    """A started vLLM with draftsmith's extension; `close()` shuts it down and frees its processes."""

    def __init__(self, spec: EngineSpec):
        _prepare_environment(spec)
        from vllm import LLM

        self.spec = spec
        start = time.perf_counter()
        try:
            self.llm = LLM(**engine_kwargs(spec))
        except DraftsmithError:
            raise
        except Exception as err:
            raise DraftsmithError(f"vLLM could not start the target {spec.target_dir} for the {spec.strategy} "
                                  f"strategy ({type(err).__name__}: {err}); see `draftsmith doctor`".replace("\n", " "))
        if spec.strategy == "direct":
            tap = {"layer_ids": spec.sink_config["spec"]["layer_ids"],
                   "num_layers": spec.sink_config["spec"]["target"]["num_layers"],
                   "convention": spec.facts.layer_convention, "two_phase": spec.facts.two_phase}
            self.llm.collective_rpc("draftsmith_install_direct", args=(spec.sink_config, tap))
        self.start_seconds = time.perf_counter() - start

    def generate(self, prompts: Sequence[tuple[int, Sequence[int]]], *, tag: bool = True,
                 on_finished: Callable[[int], None] | None = None) -> float:
        """Prefill every (sample_id, token_ids) with max_tokens=1, many in flight; returns the seconds it took."""
        from vllm import SamplingParams

        engine = self.llm.llm_engine
        start = time.perf_counter()
        pending = list(prompts)
        pending.reverse()
        in_flight: dict[str, int] = {}
        counter = 0
        while pending or in_flight:
            while pending and len(in_flight) < IN_FLIGHT:
                sample_id, ids = pending.pop()
                extra = {"kv_transfer_params": {SAMPLE_ID_KEY: int(sample_id)}} if tag else None
                params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, extra_args=extra)
                request_id = f"ds-{counter}"
                counter += 1
                engine.add_request(request_id, {"prompt_token_ids": list(map(int, ids))}, params)
                in_flight[request_id] = len(ids)
            for out in engine.step():
                if out.finished:
                    tokens = in_flight.pop(out.request_id, None)
                    if tokens is None:  # vLLM may suffix the id it was given
                        key = next((k for k in in_flight if out.request_id.startswith(k)), None)
                        tokens = in_flight.pop(key, 0) if key is not None else 0
                    if on_finished is not None:
                        on_finished(tokens)
        return time.perf_counter() - start

    def wait_for_sink(self, expected: int, timeout_s: float = 600.0) -> None:
        """Block until the worker-side sink has received `expected` requests (or raise its error)."""
        deadline = time.monotonic() + timeout_s
        while True:
            reports = self.llm.collective_rpc("draftsmith_progress")
            errors = [r["error"] for r in reports if r.get("error")]
            if errors:
                raise DraftsmithError(f"vLLM worker could not store hidden states: {errors[0]}")
            received = sum(r["received"] for r in reports if r.get("writes"))
            if received >= expected:
                return
            if time.monotonic() > deadline:
                raise DraftsmithError(f"vLLM worker stored {received} of {expected} samples before timing out; "
                                      "run extract again to resume")
            time.sleep(0.05)

    def close_sink(self) -> list[dict[str, Any]]:
        reports = self.llm.collective_rpc("draftsmith_close")
        errors = [r["error"] for r in reports if r.get("error")]
        if errors:
            raise DraftsmithError(f"vLLM worker could not finish the store: {errors[0]}")
        return reports

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            try:
                core.shutdown()
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass
        del llm
        gc.collect()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
