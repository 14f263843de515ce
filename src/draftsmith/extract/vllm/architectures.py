"""What the installed vLLM does for one target architecture, read from its source, never from a version number.

The probe (probe.py) calls `inspect_architecture` for its target; it follows the registry's class to the decoder stack
whose forward pass it reads: the class `self.model = ...` builds (Qwen3ForCausalLM -> Qwen3Model, whose forward is
Qwen2Model's), or, for a multimodal wrapper, the language model it builds with
`init_vllm_registered_model(..., architectures=[...])` (Kimi-K2.5 -> DeepseekV2ForCausalLM). Which layer ids vLLM's aux
states reach there decides what each strategy can do. The helpers that read vLLM's modules (`_try`, `_source`, the
registry) live here and are shared with probe.py.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from pydantic import BaseModel, Field

Importer = Callable[[str], ModuleType]

# Layer-index conventions an installed vLLM can have (what aux id k captures on a decoder-only model).
#   "output": 0 = embeddings, k = output of decoder layer k-1, N = last layer's output (draftsmith's own)
#   "input":  k = input of decoder layer k (= output of layer k-1 for 1 <= k < N); 0 is never captured (the
#             stream has no residual yet), N only where the stack also appends its last output
#             (`if self.end_layer in self.aux_hidden_state_layers`, as vLLM's DeepSeek-V2/V3 model does)
LayerConvention = Literal["output", "input", "unknown"]


class ArchitectureSupport(BaseModel):
    """What this vLLM can do for one target architecture (a row of doctor's architecture table)."""

    architecture: str
    registered: bool = False
    vllm_class: str | None = None  # module.Class the registry maps the architecture to
    language_model: str | None = None  # a multimodal wrapper: the text architecture it builds inside
    decoder_stack: str | None = None  # the class whose forward pass was read for the layer convention
    supports_eagle3: bool = False
    aux_setter: str | None = None
    aux_default_getter: str | None = None
    layer_convention: LayerConvention = "unknown"
    reaches_embeddings: bool = False
    reaches_last: bool = False
    usable: dict[str, bool] = Field(default_factory=dict, description="strategy -> usable for the default layer ids")
    notes: list[str] = Field(default_factory=list, description="one line each: a limit and what draftsmith does")

    @property
    def reachable(self) -> str:
        """The aux ids vLLM itself can capture, in words."""
        if self.layer_convention == "unknown":
            return "unknown"
        first = "0" if self.reaches_embeddings else "1"
        last = "N" if self.reaches_last else "N-1"
        return f"{first}..{last}"


# --------------------------------------------------------------------------------------------------- helpers


def default_importer(name: str) -> ModuleType:
    return importlib.import_module(name)


def _try(importer: Importer, name: str) -> ModuleType | None:
    try:
        return importer(name)
    except ImportError:
        return None
    except Exception:  # noqa: BLE001 - a module that fails to import is a module we cannot use
        return None


def _source(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        path = getattr(obj, "__source_path__", None) or getattr(sys.modules.get(getattr(obj, "__module__", "")),
                                                                 "__file__", None)
        try:
            return Path(path).read_text(encoding="utf-8") if path else ""
        except OSError:
            return ""


def _registered_archs(importer: Importer) -> tuple[set[str], Callable[[str], tuple[Any, ModuleType | None]]]:
    """Architectures vLLM's model registry knows, and a loader name -> (class, its module) (None when it cannot)."""
    registry_mod = _try(importer, "vllm.model_executor.models.registry")
    registry = getattr(registry_mod, "ModelRegistry", None)
    if registry is None:
        return set(), lambda name: (None, None)
    try:
        archs = set(registry.get_supported_archs())
    except Exception:  # noqa: BLE001
        archs = set()

    def load(arch: str) -> Any:
        entry = getattr(registry, "models", {}).get(arch)
        if entry is None:
            return None, None
        module_name, class_name = getattr(entry, "module_name", None), getattr(entry, "class_name", None)
        if module_name and class_name:
            module = _try(importer, module_name)
            return getattr(module, class_name, None), module
        cls = getattr(entry, "model_cls", None)
        return cls, sys.modules.get(getattr(cls, "__module__", ""))

    return archs, load


# ------------------------------------------------------------------------------------------- per architecture


def inspect_architecture(importer: Importer | None, architecture: str, *, config: dict | None = None,
                         _depth: int = 0) -> ArchitectureSupport:
    """Registry class, SupportsEagle3, and which layer ids vLLM's aux states reach for one architecture."""
    importer = importer or default_importer
    support = ArchitectureSupport(architecture=architecture)
    iface = _try(importer, "vllm.model_executor.models.interfaces")
    supports_eagle3 = getattr(iface, "supports_eagle3", None)
    _, load_arch = _registered_archs(importer)
    cls, module = load_arch(architecture)
    if cls is None:
        return support
    support.registered = True
    support.vllm_class = f"{getattr(cls, '__module__', '?').rsplit('.', 1)[-1]}.{cls.__name__}"
    if supports_eagle3 is not None:
        try:
            support.supports_eagle3 = bool(supports_eagle3(cls))
        except Exception:  # noqa: BLE001
            support.supports_eagle3 = False
    support.aux_setter = "set_aux_hidden_state_layers" if hasattr(cls, "set_aux_hidden_state_layers") else None
    for getter in ("get_eagle3_default_aux_hidden_state_layers", "get_eagle3_aux_hidden_state_layers"):
        if hasattr(cls, getter):
            support.aux_default_getter = getter
            break
    init = _init_source(cls)
    inner_arch = _wrapped_architecture(init, config)
    if inner_arch and inner_arch != architecture and _depth < 3:  # a wrapper: the language model's stack decides
        inner = inspect_architecture(importer, inner_arch, config=None, _depth=_depth + 1)
        support.language_model = inner_arch
        support.decoder_stack = inner.decoder_stack
        support.layer_convention = inner.layer_convention
        support.reaches_embeddings, support.reaches_last = inner.reaches_embeddings, inner.reaches_last
        return support
    stack, text = _decoder_stack(cls, module, init)
    support.decoder_stack = stack
    if not text:  # no stack class found: the whole module's source, as before
        text = _source(module) if module is not None else ""
        if not text:
            text = _source(cls)
    support.layer_convention, support.reaches_embeddings, support.reaches_last = _layer_convention(text)
    return support


def _init_source(cls: Any) -> str:
    """Source of the first __init__ in the class's MRO that the class itself defines (not nn.Module's)."""
    for klass in getattr(cls, "__mro__", [cls]):
        init = klass.__dict__.get("__init__")
        if init is not None and getattr(klass, "__module__", "").split(".")[0] not in ("torch", "builtins"):
            return _source(init)
    return ""


def _wrapped_architecture(init: str, config: dict | None) -> str | None:
    """A multimodal wrapper's language model architecture: the literal it passes to init_vllm_registered_model,
    else its config's text_config architecture."""
    call = re.search(r"init_vllm_registered_model\(", init)
    if call is None:
        return None
    named = re.search(r"architectures\s*=\s*\[\s*[\"'](\w+)[\"']", init[call.end():call.end() + 600])
    if named:
        return named.group(1)
    text = (config or {}).get("text_config") or {}
    archs = text.get("architectures") if isinstance(text, dict) else None
    return archs[0] if archs else None


def _global(cls: Any, module: ModuleType | None, name: str) -> Any:
    found = getattr(module, name, None) if module is not None else None
    if found is None:
        init = next((k.__dict__["__init__"] for k in getattr(cls, "__mro__", []) if "__init__" in k.__dict__), None)
        found = getattr(init, "__globals__", {}).get(name)
    return found


def _decoder_stack(cls: Any, module: ModuleType | None, init: str) -> tuple[str | None, str]:
    """(name, forward source) of the decoder stack the target builds as `self.model = ...`: a class by name
    (`Qwen3Model(...)`), a class attribute (`self.model_cls(...)`), or a builder method (`self._init_model(...)`,
    which returns `LlamaModel(...)`)."""
    found = re.search(r"self\.model\s*=\s*(self\.)?(\w+)\s*\(", init)
    if found is None:
        return None, ""
    stack = getattr(cls, found.group(2), None) if found.group(1) else _global(cls, module, found.group(2))
    if stack is not None and not isinstance(stack, type):  # a builder method: the class it returns
        built = re.search(r"return\s+(\w+)\s*\(", _source(stack))
        stack = _global(cls, module, built.group(1)) if built else None
    forward = getattr(stack, "forward", None) if isinstance(stack, type) else None
    return (stack.__name__, _source(forward)) if forward is not None else (None, "")


def _layer_convention(text: str) -> tuple[LayerConvention, bool, bool]:
    """(convention, reaches id 0, reaches id N) from the decoder stack's forward source."""
    if re.search(r"_maybe_add_hidden_state\([^)]*idx\s*\+\s*1", text, re.DOTALL):
        return "output", True, True
    if re.search(r"if\s+idx\s+in\s+self\.aux_hidden_state_layers", text):
        last = re.search(r"if\s+(self\.end_layer|len\(self\.layers\))\s+in\s+self\.aux_hidden_state_layers", text)
        return "input", False, last is not None
    return "unknown", False, False


def _convention_words(support: ArchitectureSupport) -> str:
    if support.layer_convention == "output":
        return "0 = embeddings, k = output of layer k-1, N reachable"
    if support.layer_convention == "input":
        return ("k = input of layer k, N = last layer's output; 0 not reachable" if support.reaches_last else
                "k = input of layer k; 0 and N not reachable")
    return "could not tell from the source"


__all__ = ["ArchitectureSupport", "Importer", "LayerConvention", "default_importer", "inspect_architecture"]
