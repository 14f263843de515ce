"""What a vLLM does for one target architecture, read from its source with `ast`, never from a version number.

The probe (probe.py) calls `inspect_architecture` for its target; it follows the registry's class to the decoder stack
whose forward pass it reads: the class `self.model = ...` builds (Qwen3ForCausalLM -> Qwen3Model, whose forward is
Qwen2Model's), or, for a multimodal wrapper, the language model it builds with
`init_vllm_registered_model(..., architectures=[...])` (Kimi-K2.5 -> DeepseekV2ForCausalLM). Which layer ids vLLM's aux
states reach there decides what each strategy can do. The registry (`registered_models`) is shared with probe.py.
Nothing here imports vLLM: every class and method is found in its .py files by source.SourceTree.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, Field

from draftsmith.extract.vllm.source import Found, SourceTree

# Layer-index conventions a vLLM can have (what aux id k captures on a decoder-only model).
#   "output": 0 = embeddings, k = output of decoder layer k-1, N = last layer's output (draftsmith's own)
#   "input":  k = input of decoder layer k (= output of layer k-1 for 1 <= k < N); 0 is never captured (the
#             stream has no residual yet), N only where the stack also appends its last output
#             (`if self.end_layer in self.aux_hidden_state_layers`, as vLLM's DeepSeek-V2/V3 model does)
LayerConvention = Literal["output", "input", "unknown"]

REGISTRY_MODULES = ["vllm.model_executor.models.registry"]
MODELS_PACKAGE = "vllm.model_executor.models"
INTERFACE = "SupportsEagle3"
AUX_SETTER = "set_aux_hidden_state_layers"
AUX_DEFAULT_GETTERS = ("get_eagle3_default_aux_hidden_state_layers", "get_eagle3_aux_hidden_state_layers")


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


def registered_models(tree: SourceTree) -> dict[str, tuple[str, str]]:
    """vLLM's model registry: architecture -> (module under vllm.model_executor.models, class name), read from the
    registry's dict literals (`"LlamaForCausalLM": ("llama", "LlamaForCausalLM")`)."""
    out: dict[str, tuple[str, str]] = {}
    for module in REGISTRY_MODULES:
        for arch, entry in tree.string_pairs(module).items():
            out.setdefault(arch, entry)
    return out


def model_class(tree: SourceTree, architecture: str,
                registry: dict[str, tuple[str, str]] | None = None) -> Found | None:
    """The class the registry maps `architecture` to, found in its module (or what that module imports it from)."""
    entry = (registry if registry is not None else registered_models(tree)).get(architecture)
    if entry is None:
        return None
    return tree.find_class(entry[1], [f"{MODELS_PACKAGE}.{entry[0]}"])


# ------------------------------------------------------------------------------------------- per architecture


def inspect_architecture(tree: SourceTree, architecture: str, *, config: dict | None = None,
                         registry: dict[str, tuple[str, str]] | None = None, _depth: int = 0) -> ArchitectureSupport:
    """Registry class, SupportsEagle3, and which layer ids vLLM's aux states reach for one architecture."""
    support = ArchitectureSupport(architecture=architecture)
    registry = registry if registry is not None else registered_models(tree)
    cls = model_class(tree, architecture, registry)
    if cls is None:
        return support
    support.registered = True
    support.vllm_class = f"{cls.module.name.rsplit('.', 1)[-1]}.{cls.name}"
    support.supports_eagle3 = supports_eagle3(tree, cls)
    support.aux_setter = AUX_SETTER if tree.method(cls, AUX_SETTER) is not None else None
    support.aux_default_getter = next((g for g in AUX_DEFAULT_GETTERS if tree.method(cls, g) is not None), None)
    init = tree.method(cls, "__init__")
    init_text = tree.segment(init)
    inner_arch = _wrapped_architecture(init_text, config)
    if inner_arch and inner_arch != architecture and _depth < 3:  # a wrapper: the language model's stack decides
        inner = inspect_architecture(tree, inner_arch, registry=registry, _depth=_depth + 1)
        support.language_model = inner_arch
        support.decoder_stack = inner.decoder_stack
        support.layer_convention = inner.layer_convention
        support.reaches_embeddings, support.reaches_last = inner.reaches_embeddings, inner.reaches_last
        return support
    stack, text = _decoder_stack(tree, cls, init)
    support.decoder_stack = stack
    if not text:  # no stack class found: the whole module's source
        text = cls.module.text
    support.layer_convention, support.reaches_embeddings, support.reaches_last = _layer_convention(text)
    return support


def supports_eagle3(tree: SourceTree, cls: Found) -> bool:
    """The class has SupportsEagle3 among its bases (transitively, across modules), or sets `supports_eagle3 = True`
    itself or in a base (what vLLM's `supports_eagle3()` checks at run time)."""
    if INTERFACE in tree.lineage(cls):
        return True
    flag = tree.member(cls, "supports_eagle3")
    return flag is not None and getattr(flag.node, "value", None) is True


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


def _decoder_stack(tree: SourceTree, cls: Found, init: Found | None) -> tuple[str | None, str]:
    """(name, forward source) of the decoder stack the target builds as `self.model = ...`: a class by name
    (`Qwen3Model(...)`), a class attribute (`self.model_cls(...)`), or a builder method (`self._init_model(...)`,
    which returns `LlamaModel(...)`)."""
    found = re.search(r"self\.model\s*=\s*(self\.)?(\w+)\s*\(", tree.segment(init))
    if found is None or init is None:
        return None, ""
    stack = tree.member(cls, found.group(2)) if found.group(1) else tree.lookup(init.module.name, found.group(2))
    if stack is not None and stack.is_function:  # a builder method: the class it returns
        built = re.search(r"return\s+(\w+)\s*\(", tree.segment(stack))
        stack = tree.lookup(stack.module.name, built.group(1)) if built else None
    if stack is None or not stack.is_class:
        return None, ""
    forward = tree.method(stack, "forward")
    return (stack.name, tree.segment(forward)) if forward is not None else (None, "")


def _layer_convention(text: str) -> tuple[LayerConvention, bool, bool]:
    """(convention, reaches id 0, reaches id N) from the decoder stack's forward source. Under "input", id 0 is the
    embeddings only where the capture guards the missing residual (`hidden_states + residual if residual is not None
    else hidden_states`); a bare `hidden_states + residual` cannot run before layer 0."""
    if re.search(r"_maybe_add_hidden_state\([^)]*idx\s*\+\s*1", text, re.DOTALL):
        return "output", True, True
    if re.search(r"if\s+\w*idx\s+in\s+self\.aux_hidden_state_layers", text):
        first = re.search(r"residual\s+if\s+residual\s+is\s+not\s+None\s+else\s+hidden_states", text)
        last = re.search(r"if\s+(self\.end_layer|len\(self\.layers\))\s+in\s+self\.aux_hidden_state_layers", text)
        return "input", first is not None, last is not None
    return "unknown", False, False


def _convention_words(support: ArchitectureSupport) -> str:
    if support.layer_convention == "output":
        return "0 = embeddings, k = output of layer k-1, N reachable"
    if support.layer_convention == "input":
        first = " (0 = embeddings)" if support.reaches_embeddings else ""
        if support.reaches_last:
            return f"k = input of layer k{first}, N = last layer's output" + ("" if first else "; 0 not reachable")
        return f"k = input of layer k{first}; " + ("N not reachable" if first else "0 and N not reachable")
    return "could not tell from the source"


__all__ = ["ArchitectureSupport", "LayerConvention", "inspect_architecture", "model_class", "registered_models",
           "supports_eagle3"]
