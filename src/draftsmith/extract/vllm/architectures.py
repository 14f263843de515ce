"""What a vLLM does for one target architecture, read from its source with `ast`, never from a version number.

The probe (probe.py) calls `inspect_architecture` for its target; it follows the registry's class to the decoder stack
whose forward pass it reads: the class `self.model = ...` builds (Qwen3ForCausalLM -> Qwen3Model, whose forward is
Qwen2Model's), or, for a multimodal wrapper, the language model it builds with
`init_vllm_registered_model(..., architectures=[...])` (Kimi-K2.5 -> DeepseekV2ForCausalLM). Two things are read there:

- the **layer convention** of vLLM's own EAGLE-3 aux states (which ids they reach), for the connector and direct
  strategies;
- what **draftsmith's own layer taps** rely on (`StackTaps`, read by stack.py's `read_taps`).

Where the evidence is not there in a form these readers know, the answer is "unknown" with what was looked for and
where, never a guess: `support.unknown[fact]`, `taps.missing`. The registry (`registered_models`) is shared with
probe.py. Nothing here imports vLLM: every class and method is found in its .py files by source.SourceTree.
"""

from __future__ import annotations

import ast
import re
from typing import Literal

from pydantic import BaseModel, Field

from draftsmith.extract.vllm.source import Found, SourceTree
from draftsmith.extract.vllm.stack import StackTaps, callee, cpu_bfloat16_only, is_self, read_taps, short

# Layer-index conventions a vLLM can have (what aux id k captures on a decoder-only model).
#   "output": 0 = embeddings, k = output of decoder layer k-1, N = last layer's output (draftsmith's own)
#   "input":  k = input of decoder layer k (= output of layer k-1 for 1 <= k < N); 0 is never captured (the
#             stream has no residual yet), N only where the stack also appends its last output
#             (`if self.end_layer in self.aux_hidden_state_layers`, as vLLM's DeepSeek-V2/V3 model does)
#   "unknown": the stack's forward was not found, or it captures no aux states in a form read here
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
    decoder_stack: str | None = None  # the class whose forward pass was read (convention, taps)
    supports_eagle3: bool | None = False
    aux_setter: str | None = None
    aux_default_getter: str | None = None
    layer_convention: LayerConvention = "unknown"
    reaches_embeddings: bool = False
    reaches_last: bool = False
    taps: StackTaps = Field(default_factory=StackTaps)
    cpu_bfloat16_only: str | None = Field(
        None, description="vLLM's own words where a CPU kernel the architecture reaches asserts bfloat16, and where"
    )
    unknown: dict[str, str] = Field(default_factory=dict, description="fact -> what was looked for, where")
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
    registry's dict literals (`"LlamaForCausalLM": ("llama", "LlamaForCausalLM")`). Empty: no registry found."""
    out: dict[str, tuple[str, str]] = {}
    for module in REGISTRY_MODULES:
        for arch, entry in tree.string_pairs(module).items():
            out.setdefault(arch, entry)
    return out


def model_class(
    tree: SourceTree, architecture: str, registry: dict[str, tuple[str, str]] | None = None
) -> Found | None:
    """The class the registry maps `architecture` to, found in its module (or what that module imports it from)."""
    entry = (registry if registry is not None else registered_models(tree)).get(architecture)
    if entry is None:
        return None
    return tree.find_class(entry[1], [f"{MODELS_PACKAGE}.{entry[0]}"])


# ------------------------------------------------------------------------------------------- per architecture


def inspect_architecture(
    tree: SourceTree,
    architecture: str,
    *,
    config: dict | None = None,
    registry: dict[str, tuple[str, str]] | None = None,
    _depth: int = 0,
) -> ArchitectureSupport:
    """Registry class, SupportsEagle3, the aux-state convention and the taps' needs for one architecture."""
    support = ArchitectureSupport(architecture=architecture)
    registry = registry if registry is not None else registered_models(tree)
    if not registry:
        support.unknown["registered"] = "no model registry dict in vllm/model_executor/models/registry.py"
        support.supports_eagle3 = None
        support.taps = StackTaps(missing=support.unknown["registered"])
        return support
    cls = model_class(tree, architecture, registry)
    if cls is None:
        support.taps = StackTaps(missing=f"{architecture} is not in this vLLM's model registry")
        return support
    support.registered = True
    support.vllm_class = f"{cls.module.name.rsplit('.', 1)[-1]}.{cls.name}"
    support.cpu_bfloat16_only = cpu_bfloat16_only(tree, cls.module.name)
    support.supports_eagle3 = supports_eagle3(tree, cls)
    support.aux_setter = AUX_SETTER if tree.method(cls, AUX_SETTER) is not None else None
    support.aux_default_getter = next((g for g in AUX_DEFAULT_GETTERS if tree.method(cls, g) is not None), None)
    wrapped = _language_model(tree, cls, config) if _depth < 3 else None
    if wrapped is not None:  # a multimodal wrapper: its language model's stack decides
        inner_cls, inner_arch = wrapped
        inner = (
            inspect_architecture(tree, inner_arch, registry=registry, _depth=_depth + 1)
            if inner_cls is None
            else _inspect_class(tree, inner_cls, ArchitectureSupport(architecture=inner_arch, registered=True))
        )
        support.language_model = inner_arch
        support.cpu_bfloat16_only = support.cpu_bfloat16_only or (
            inner.cpu_bfloat16_only if inner_cls is None else cpu_bfloat16_only(tree, inner_cls.module.name)
        )
        for name in ("decoder_stack", "layer_convention", "reaches_embeddings", "reaches_last", "taps"):
            setattr(support, name, getattr(inner, name))
        support.unknown.update({k: v for k, v in inner.unknown.items() if k != "registered"})
        if not inner.registered:
            support.unknown["decoder_stack"] = (
                f"{cls.name} builds {inner_arch}, which is not in this vLLM's model registry"
            )
            support.taps = StackTaps(missing=support.unknown["decoder_stack"])
        return support
    return _inspect_class(tree, cls, support)


def _inspect_class(tree: SourceTree, cls: Found, support: ArchitectureSupport) -> ArchitectureSupport:
    """The decoder stack a (language model) class builds, and what its forward tells."""
    stack = _decoder_stack(tree, cls)
    if isinstance(stack, str):  # what was looked for
        support.unknown["decoder_stack"] = stack
        support.unknown["layer_convention"] = stack
        support.taps = StackTaps(missing=stack)
        return support
    support.decoder_stack = stack.name
    forward = tree.method(stack, "forward")
    if forward is None:
        why = f"no forward() on {stack.name} ({short(stack)}) or its bases"
        support.unknown["layer_convention"] = why
        support.taps = StackTaps(missing=why)
        return support
    text = tree.segment(forward)
    support.layer_convention, support.reaches_embeddings, support.reaches_last = _layer_convention(text)
    if support.layer_convention == "unknown":
        support.unknown["layer_convention"] = (
            f"{stack.name}.forward ({short(forward)}) captures no aux states "
            "(`_maybe_add_hidden_state(..., idx + 1, ...)` or `if idx in "
            "self.aux_hidden_state_layers`)"
        )
    support.taps = read_taps(tree, stack, forward)
    return support


def supports_eagle3(tree: SourceTree, cls: Found) -> bool:
    """The class has SupportsEagle3 among its bases (transitively, across modules), or sets `supports_eagle3 = True`
    itself or in a base (what vLLM's `supports_eagle3()` checks at run time)."""
    if INTERFACE in tree.lineage(cls):
        return True
    flag = tree.member(cls, "supports_eagle3")
    return flag is not None and getattr(flag.node, "value", None) is True


def _language_model(tree: SourceTree, cls: Found, config: dict | None) -> tuple[Found | None, str] | None:
    """A multimodal wrapper's language model: (None, architecture) where its __init__ builds a registered one with
    `init_vllm_registered_model(..., architectures=["X"])` (else its config's text_config architecture), or (class,
    class name) where it builds `self.language_model = SomeForCausalLM(...)` itself. None: not a wrapper."""
    init = _init_assigning(tree, cls, "language_model")
    if init is None:
        return None
    value = _self_assignment(init, "language_model")
    func = getattr(value, "func", None)
    if isinstance(value, ast.Call) and isinstance(func, ast.Name) and func.id == "init_vllm_registered_model":
        named = next((kw.value for kw in value.keywords if kw.arg == "architectures"), None)
        if isinstance(named, ast.List) and named.elts and isinstance(named.elts[0], ast.Constant):
            return None, str(named.elts[0].value)
        text = (config or {}).get("text_config") or {}
        archs = text.get("architectures") if isinstance(text, dict) else None
        return (None, archs[0]) if archs else None
    inner = callee(tree, init, func, owner=cls) if func is not None else None
    return (inner, inner.name) if inner is not None and inner.is_class and inner.node is not cls.node else None


def _init_assigning(tree: SourceTree, cls: Found, attr: str) -> Found | None:
    """The first __init__ along the MRO that assigns `self.<attr>` (a subclass may only call super().__init__)."""
    for klass in tree.mro(cls):
        own = next((s for s in klass.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None)
        if own is not None and _self_assignment(Found(klass.module, own), attr) is not None:
            return Found(klass.module, own)
    return None


def _self_assignment(fn: Found, attr: str) -> ast.expr | None:
    """The value of the first `self.<attr> = ...` in a function's body (any depth)."""
    for node in ast.walk(fn.node):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and target.attr == attr and is_self(target.value):
                    return node.value
    return None


def _decoder_stack(tree: SourceTree, cls: Found) -> Found | str:
    """The decoder stack class the target builds as `self.model = ...` (in its __init__ or a base's): a class by
    name (`Qwen3Model(...)`), a class attribute (`self.model_cls(...)`), or a builder method (`self._init_model(...)`,
    which returns `LlamaModel(...)`). Else what was looked for, in words."""
    init = _init_assigning(tree, cls, "model")
    value = _self_assignment(init, "model") if init is not None else None
    if init is None or not isinstance(value, ast.Call):
        return f"no `self.model = <class>(...)` in the __init__ of {cls.name} ({short(cls)}) or its bases"
    stack = callee(tree, init, value.func, owner=cls)
    if stack is not None and stack.is_function:  # a builder method: the class it returns
        built = next(
            (n.value for n in ast.walk(stack.node) if isinstance(n, ast.Return) and isinstance(n.value, ast.Call)), None
        )
        stack = callee(tree, stack, built.func, owner=cls) if built is not None else None
    if stack is None or not stack.is_class:
        return (
            f"`self.model = {ast.unparse(value.func)}(...)` in {cls.name}.__init__ ({short(init)}) names no class "
            "found in this tree"
        )
    return stack


def _layer_convention(text: str) -> tuple[LayerConvention, bool, bool]:
    """(convention, reaches id 0, reaches id N) from the decoder stack's forward source. Under "input", id 0 is the
    embeddings only where the capture guards the missing residual (`hidden_states + residual if residual is not None
    else hidden_states`, `x if residual is None else x + residual`); a bare `hidden_states + residual` cannot run
    before layer 0."""
    if re.search(r"_maybe_add_hidden_state\([^)]*\b\w+\s*\+\s*1\b", text, re.DOTALL):
        return "output", True, True
    if re.search(r"if\s+\w+\s+in\s+self\.aux_hidden_state_layers", text):
        first = re.search(r"\bif\s+residual\s+is\s+(not\s+)?None\s+else\b", text)
        last = re.search(r"if\s+(self\.end_layer|len\(self\.layers\))\s+in\s+self\.aux_hidden_state_layers", text)
        return "input", first is not None, last is not None
    return "unknown", False, False


def convention_words(support: ArchitectureSupport) -> str:
    if support.layer_convention == "output":
        return "0 = embeddings, k = output of layer k-1, N reachable"
    if support.layer_convention == "input":
        first = " (0 = embeddings)" if support.reaches_embeddings else ""
        if support.reaches_last:
            return f"k = input of layer k{first}, N = last layer's output" + ("" if first else "; 0 not reachable")
        return f"k = input of layer k{first}; " + ("N not reachable" if first else "0 and N not reachable")
    why = support.unknown.get("layer_convention")
    return "unknown" + (f": {why}" if why else "")


__all__ = [
    "ArchitectureSupport",
    "LayerConvention",
    "convention_words",
    "inspect_architecture",
    "model_class",
    "registered_models",
    "supports_eagle3",
]
