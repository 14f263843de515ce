"""What a vLLM does for one target architecture, read from its source with `ast`, never from a version number.

The probe (probe.py) calls `inspect_architecture` for its target; it follows the registry's class to the decoder stack
whose forward pass it reads: the class `self.model = ...` builds (Qwen3ForCausalLM -> Qwen3Model, whose forward is
Qwen2Model's), or, for a multimodal wrapper, the language model it builds with
`init_vllm_registered_model(..., architectures=[...])` (Kimi-K2.5 -> DeepseekV2ForCausalLM). Two things are read there:

- the **layer convention** of vLLM's own EAGLE-3 aux states (which ids they reach), for the connector and direct
  strategies;
- what **draftsmith's own layer taps** rely on (`StackTaps`): the stack's loop over `self.layers`, how a layer is
  called and what it returns (`hidden, residual = layer(...)`: the stream is their sum; `x = layer(...)`: the one
  tensor), how the layers are made (`make_layers` / `start_layer` / `end_layer`), the decoder layer classes, any
  rescaling of the stream inside them (DeepSeek's float16 handling of `routed_scaling_factor`) and whether the stack
  gathers a token-sharded stream (sequence-parallel MoE).

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


class StackTaps(BaseModel):
    """What draftsmith's layer taps need from one decoder stack, each with where it was read (`file:line text`)."""

    loop: str | None = Field(None, description="the stack's loop over self.layers")
    layers: str | None = Field(None, description="where the stack makes self.layers (make_layers / ModuleList)")
    layer_returns: Literal["pair", "tensor"] | None = Field(
        None, description="pair: `hidden, residual = layer(...)` (the stream is their sum); tensor: `x = layer(...)`")
    stream_arg: int | str | None = Field(
        None, description="where the stream enters a layer call: a position or a keyword (the embeddings, id 0)")
    layer_classes: list[str] = Field(default_factory=list, description="the decoder layer classes make_layers builds")
    float16_rescale: str | None = Field(
        None, description="where a layer rescales the stream under float16 (then taps refuse float16)")
    gathers_rows: bool = Field(False, description="the stack all-gathers a token-sharded stream (sequence parallel)")
    missing: str | None = Field(None, description="why the taps cannot be placed: what was looked for, where")

    @property
    def placeable(self) -> bool:
        return self.missing is None


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


def model_class(tree: SourceTree, architecture: str,
                registry: dict[str, tuple[str, str]] | None = None) -> Found | None:
    """The class the registry maps `architecture` to, found in its module (or what that module imports it from)."""
    entry = (registry if registry is not None else registered_models(tree)).get(architecture)
    if entry is None:
        return None
    return tree.find_class(entry[1], [f"{MODELS_PACKAGE}.{entry[0]}"])


def where(found: Found, node: ast.AST | None = None) -> str:
    """`models/llama.py:454 <that line>` for a node (default: the definition itself), as doctor and the docs cite."""
    node = node if node is not None else found.node
    line = getattr(node, "lineno", 1)
    text = found.module.text.splitlines()[line - 1].strip() if found.module.text else ""
    return f"{_short(found)}:{line} {text}"


def _short(found: Found) -> str:
    rel = found.module.name.replace(".", "/") + ("/__init__.py" if found.module.is_package else ".py")
    return rel.removeprefix("vllm/model_executor/").removeprefix("vllm/")


# ------------------------------------------------------------------------------------------- per architecture


def inspect_architecture(tree: SourceTree, architecture: str, *, config: dict | None = None,
                         registry: dict[str, tuple[str, str]] | None = None, _depth: int = 0) -> ArchitectureSupport:
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
    support.supports_eagle3 = supports_eagle3(tree, cls)
    support.aux_setter = AUX_SETTER if tree.method(cls, AUX_SETTER) is not None else None
    support.aux_default_getter = next((g for g in AUX_DEFAULT_GETTERS if tree.method(cls, g) is not None), None)
    wrapped = _language_model(tree, cls, config) if _depth < 3 else None
    if wrapped is not None:  # a multimodal wrapper: its language model's stack decides
        inner_cls, inner_arch = wrapped
        inner = (inspect_architecture(tree, inner_arch, registry=registry, _depth=_depth + 1) if inner_cls is None
                 else _inspect_class(tree, inner_cls, ArchitectureSupport(architecture=inner_arch, registered=True)))
        support.language_model = inner_arch
        for name in ("decoder_stack", "layer_convention", "reaches_embeddings", "reaches_last", "taps"):
            setattr(support, name, getattr(inner, name))
        support.unknown.update({k: v for k, v in inner.unknown.items() if k != "registered"})
        if not inner.registered:
            support.unknown["decoder_stack"] = (f"{cls.name} builds {inner_arch}, which is not in this vLLM's model "
                                                "registry")
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
        why = f"no forward() on {stack.name} ({_short(stack)}) or its bases"
        support.unknown["layer_convention"] = why
        support.taps = StackTaps(missing=why)
        return support
    text = tree.segment(forward)
    support.layer_convention, support.reaches_embeddings, support.reaches_last = _layer_convention(text)
    if support.layer_convention == "unknown":
        support.unknown["layer_convention"] = (f"{stack.name}.forward ({_short(forward)}) captures no aux states "
                                               "(`_maybe_add_hidden_state(..., idx + 1, ...)` or `if idx in "
                                               "self.aux_hidden_state_layers`)")
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
    callee = getattr(value, "func", None)
    if isinstance(callee, ast.Name) and callee.id == "init_vllm_registered_model":
        named = next((kw.value for kw in value.keywords if kw.arg == "architectures"), None)  # type: ignore[union-attr]
        if isinstance(named, ast.List) and named.elts and isinstance(named.elts[0], ast.Constant):
            return None, str(named.elts[0].value)
        text = (config or {}).get("text_config") or {}
        archs = text.get("architectures") if isinstance(text, dict) else None
        return (None, archs[0]) if archs else None
    inner = _callee(tree, init, callee, owner=cls) if callee is not None else None
    return (inner, inner.name) if inner is not None and inner.is_class and inner.node is not cls.node else None


def _init_assigning(tree: SourceTree, cls: Found, attr: str) -> Found | None:
    """The first __init__ along the MRO that assigns `self.<attr>` (a subclass may only call super().__init__)."""
    for klass in tree.mro(cls):
        own = next((s for s in klass.node.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None)
        if own is not None and _self_assignment(Found(klass.module, own), attr) is not None:
            return Found(klass.module, own)
    return None


def _self_assignment(fn: Found, attr: str) -> ast.expr | None:
    """The value of the first `self.<attr> = ...` in a function's body (any depth)."""
    for node in ast.walk(fn.node):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and target.attr == attr and _is_self(target.value):
                    return node.value
    return None


def _is_self(expr: ast.expr) -> bool:
    return isinstance(expr, ast.Name) and expr.id == "self"


def _decoder_stack(tree: SourceTree, cls: Found) -> Found | str:
    """The decoder stack class the target builds as `self.model = ...` (in its __init__ or a base's): a class by
    name (`Qwen3Model(...)`), a class attribute (`self.model_cls(...)`), or a builder method (`self._init_model(...)`,
    which returns `LlamaModel(...)`). Else what was looked for, in words."""
    init = _init_assigning(tree, cls, "model")
    value = _self_assignment(init, "model") if init is not None else None
    if init is None or not isinstance(value, ast.Call):
        return f"no `self.model = <class>(...)` in the __init__ of {cls.name} ({_short(cls)}) or its bases"
    stack = _callee(tree, init, value.func, owner=cls)
    if stack is not None and stack.is_function:  # a builder method: the class it returns
        built = next((n.value for n in ast.walk(stack.node) if isinstance(n, ast.Return)
                      and isinstance(n.value, ast.Call)), None)
        stack = _callee(tree, stack, built.func, owner=cls) if built is not None else None
    if stack is None or not stack.is_class:
        return (f"`self.model = {ast.unparse(value.func)}(...)` in {cls.name}.__init__ ({_short(init)}) names no class "
                "found in this tree")
    return stack


def _callee(tree: SourceTree, fn: Found, func: ast.expr, *, owner: Found) -> Found | None:
    """What a call's function expression names inside method `fn` of class `owner`: `Name` (module level),
    `self.attr` (a member of owner), or a parameter of `fn` with a default (`layer_type: type = LlamaDecoderLayer`)."""
    if isinstance(func, ast.Attribute) and _is_self(func.value):
        return tree.member(owner, func.attr)
    if isinstance(func, ast.Name):
        default = _param_default(fn, func.id)
        if default is not None:
            return tree.resolve(fn.module, default)
        local = _local_def(fn, func.id)
        if local is not None:
            return Found(fn.module, local)
        return tree.lookup(fn.module.name, func.id)
    return None


def _param_default(fn: Found, name: str) -> ast.expr | None:
    args = fn.node.args
    positional = args.posonlyargs + args.args
    for arg, default in zip(positional[len(positional) - len(args.defaults):], args.defaults):
        if arg.arg == name:
            return default
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        if arg.arg == name and default is not None:
            return default
    return None


def _local_def(fn: Found, name: str) -> ast.FunctionDef | None:
    return next((n for n in ast.walk(fn.node) if isinstance(n, ast.FunctionDef) and n.name == name
                 and n is not fn.node), None)


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


# ------------------------------------------------------------------------------------------- the layer taps

GATHER = "tensor_model_parallel_all_gather"


def read_taps(tree: SourceTree, stack: Found, forward: Found) -> StackTaps:
    """What draftsmith's layer taps rely on in `stack`, read from its forward and __init__ and its layers' forward.
    The first thing not found ends the reading with `missing` naming it (the taps are then not offered)."""
    taps = StackTaps()
    loop = _layer_loop(forward)
    if loop is None:
        return _missing(taps, f"no `for ... in ...self.layers...` loop in {stack.name}.forward ({_short(forward)})")
    taps.loop = where(forward, loop)
    call = _layer_call(loop)
    if call is None:
        return _missing(taps, f"no `<stream> = layer(...)` call inside the loop of {stack.name}.forward "
                              f"({where(forward, loop)})")
    assign, targets = call
    taps.layer_returns = "pair" if len(targets) == 2 else "tensor"
    stream = targets[0]
    taps.stream_arg = _argument_of(assign.value, stream)
    if taps.stream_arg is None:
        return _missing(taps, f"the stream `{stream}` is not an argument of the layer call ({where(forward, assign)})")
    taps.gathers_rows = GATHER in tree.segment(forward)
    rescaled = _reassigned_in_loop(loop, assign, targets, taps.gathers_rows)
    if rescaled is not None:
        return _missing(taps, f"the loop changes the stream besides the layer call ({where(forward, rescaled)})")
    made = _layers_made(tree, stack)
    if made is None:
        return _missing(taps, f"no `self.layers = ...` (make_layers or nn.ModuleList) in the __init__ of {stack.name} "
                              f"({_short(stack)}) or its bases")
    init, statement, builder = made
    taps.layers = where(init, statement)
    classes = _layer_classes(tree, stack, init, builder)
    if not classes:
        return _missing(taps, f"the decoder layer class that {where(init, statement)} builds could not be resolved, "
                              "so its rescaling of the stream could not be read")
    taps.layer_classes = [c.name for c in classes]
    for layer_cls in classes:
        layer_forward = tree.method(layer_cls, "forward")
        if layer_forward is None:
            return _missing(taps, f"no forward() on {layer_cls.name} ({_short(layer_cls)})")
        kind, node = _stream_rescale(layer_forward)
        if kind == "other":
            return _missing(taps, f"{layer_cls.name}.forward rescales the stream outside a float16 branch "
                                  f"({where(layer_forward, node)}), which the taps cannot undo")
        if kind == "float16" and taps.float16_rescale is None:
            taps.float16_rescale = where(layer_forward, node)
    return taps


def _missing(taps: StackTaps, why: str) -> StackTaps:
    taps.missing = why
    return taps


def _mentions_layers(expr: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "layers" and _is_self(n.value) for n in ast.walk(expr))


def _layer_loop(forward: Found) -> ast.For | None:
    """The loop over the layers: `for layer in islice(self.layers, ...)`, `for idx, layer in enumerate(...)`, or
    `for i in range(self.start_layer, self.end_layer): layer = self.layers[i]` (gpt-oss)."""
    return next((n for n in ast.walk(forward.node) if isinstance(n, ast.For)
                 and (_mentions_layers(n.iter) or _indexed_layer(n) is not None)), None)


def _indexed_layer(loop: ast.For) -> str | None:
    """`layer` in a loop body's `layer = self.layers[i]`."""
    for stmt in loop.body:
        if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                and isinstance(stmt.value, ast.Subscript) and _mentions_layers(stmt.value.value)):
            return stmt.targets[0].id
    return None


def _loop_layer(loop: ast.For) -> str | None:
    """The name bound to a layer: `layer` in `for layer in ...` / `for idx, layer in enumerate(...)` / `layer =
    self.layers[i]`."""
    indexed = _indexed_layer(loop)
    if indexed is not None:
        return indexed
    target = loop.target
    if isinstance(target, ast.Tuple) and target.elts and isinstance(target.elts[-1], ast.Name):
        return target.elts[-1].id
    return target.id if isinstance(target, ast.Name) else None


def _names(target: ast.expr) -> list[str] | None:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Tuple) and len(target.elts) == 2 and all(isinstance(e, ast.Name) for e in target.elts):
        return [e.id for e in target.elts]  # type: ignore[attr-defined]
    return None


def _layer_call(loop: ast.For) -> tuple[ast.Assign, list[str]] | None:
    """`hidden, residual = layer(...)` / `x = layer(...)` / `... = self.layers[i](...)` in the loop body."""
    layer = _loop_layer(loop)
    for node in ast.walk(loop):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.value, ast.Call)):
            continue
        func = node.value.func
        if (isinstance(func, ast.Name) and func.id == layer) or (isinstance(func, ast.Subscript)
                                                                   and _mentions_layers(func.value)):
            names = _names(node.targets[0])
            if names is not None:
                return node, names
    return None


def _argument_of(call: ast.Call, name: str) -> int | str | None:
    for i, arg in enumerate(call.args):
        if isinstance(arg, ast.Name) and arg.id == name:
            return i
    return next((kw.arg for kw in call.keywords if isinstance(kw.value, ast.Name) and kw.value.id == name), None)


def _reassigned_in_loop(loop: ast.For, call: ast.Assign, targets: list[str], gathers: bool) -> ast.AST | None:
    """A statement in the loop, other than the layer call, that assigns the stream or the residual -- with anything
    but a tensor-parallel all-gather of them where the stack gathers (sequence parallelism moves rows; the values
    stay)."""
    for node in ast.walk(loop):
        if node is call or not isinstance(node, (ast.Assign, ast.AugAssign)):
            continue
        assigned = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = {n.id for t in assigned for n in ast.walk(t) if isinstance(n, ast.Name)}
        if names & set(targets) and not (gathers and _is_gather(node)):
            return node
    return None


def _is_gather(node: ast.AST) -> bool:
    """`h, r = combined.split(...)` after an all-gather, or `x = all_gather(x, 0)` / `x = x[:n]`."""
    text = ast.unparse(node)
    return GATHER in text or ".split(" in text or re.search(r"=\s*\w+\[:", text) is not None


def _layers_made(tree: SourceTree, stack: Found) -> tuple[Found, ast.stmt, ast.expr | None] | None:
    """(the __init__, through the MRO, that makes self.layers; that statement; the expression building one layer:
    make_layers' second argument or a ModuleList comprehension's element, None when in neither form)."""
    for klass in tree.mro(stack):
        own = next((s for s in klass.node.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None)
        if own is None:
            continue
        for node in ast.walk(own):
            if not isinstance(node, ast.Assign):
                continue
            for target in node.targets:
                elts = target.elts if isinstance(target, ast.Tuple) else [target]
                if any(isinstance(e, ast.Attribute) and e.attr == "layers" and _is_self(e.value) for e in elts):
                    value, init = node.value, Found(klass.module, own)
                    callee = getattr(value, "func", None)
                    if isinstance(value, ast.Call) and getattr(callee, "id", getattr(callee, "attr", "")) == \
                            "make_layers" and len(value.args) >= 2:
                        return init, node, value.args[1]
                    comp = next((n for n in ast.walk(value) if isinstance(n, (ast.ListComp, ast.GeneratorExp))), None)
                    return init, node, comp.elt if comp is not None else None
    return None


def _layer_classes(tree: SourceTree, stack: Found, init: Found, builder: ast.expr | None) -> list[Found]:
    """The classes a layer builder makes: `lambda prefix: Cls(...)`, `lambda prefix: layer_type(...)` (a parameter
    with a default, or passed by a subclass's `super().__init__(..., layer_type=...)`), `self.block_cls(...)`, or a
    local function returning `Cls(...)`."""
    if builder is None:
        return []
    calls: list[ast.expr] = []
    if isinstance(builder, ast.Lambda) and isinstance(builder.body, ast.Call):
        calls = [builder.body.func]
    elif isinstance(builder, ast.Call):
        calls = [builder.func]
    elif isinstance(builder, ast.Name):
        local = _local_def(init, builder.id)
        if local is not None:
            calls = [n.value.func for n in ast.walk(local) if isinstance(n, ast.Return) and isinstance(n.value, ast.Call)]
    found: list[Found] = []
    for func in calls:
        for cls in _classes_named(tree, stack, init, func):
            if cls.is_class and all(cls.node is not f.node for f in found):
                found.append(cls)
    return found


def _classes_named(tree: SourceTree, stack: Found, init: Found, func: ast.expr) -> list[Found]:
    if isinstance(func, ast.Name):
        passed = _passed_by_subclass(tree, stack, init, func.id)
        if passed:
            return passed
    cls = _callee(tree, init, func, owner=stack)
    return [cls] if cls is not None else []


def _passed_by_subclass(tree: SourceTree, stack: Found, init: Found, param: str) -> list[Found]:
    """Where `init` belongs to a base of `stack`: what the subclasses between pass for `param` to super().__init__
    (Qwen3Model passes `decoder_layer_type=self.decoder_layer_type` to Qwen2Model)."""
    for klass in tree.mro(stack):
        own = next((s for s in klass.node.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None)
        if own is None or own is init.node:
            continue
        for node in ast.walk(own):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "__init__"
                    and isinstance(node.func.value, ast.Call)
                    and getattr(node.func.value.func, "id", None) == "super"):
                for kw in node.keywords:
                    if kw.arg == param:
                        named = _callee(tree, Found(klass.module, own), kw.value, owner=stack)
                        return [named] if named is not None else []
    return []


def _stream_rescale(forward: Found) -> tuple[Literal["none", "float16", "other"], ast.AST | None]:
    """How a decoder layer's forward rescales the residual it carries on (the second name of `return hidden, residual`:
    `residual *= ...` / `residual = residual * ...`), which vLLM's stream then holds scaled where the model's own does
    not. Scaling the layer's new output is its computation, not a rescale. "float16" where every such statement sits
    under a branch testing float16 (DeepSeek's overflow guard)."""
    returned: set[str] = set()
    for node in ast.walk(forward.node):
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple) and len(node.value.elts) == 2:
            carried = node.value.elts[1]
            if isinstance(carried, ast.Name):
                returned.add(carried.id)
    parents: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(forward.node):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    kind: Literal["none", "float16", "other"] = "none"
    first = None
    for node in ast.walk(forward.node):
        scaled = None
        if isinstance(node, ast.AugAssign) and isinstance(node.op, (ast.Mult, ast.Div)):
            scaled = node.target
        elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.BinOp)
              and isinstance(node.value.op, (ast.Mult, ast.Div)) and len(node.targets) == 1):
            operands = {n.id for n in (node.value.left, node.value.right) if isinstance(n, ast.Name)}
            target = node.targets[0]
            if isinstance(target, ast.Name) and target.id in operands:
                scaled = target
        if not (isinstance(scaled, ast.Name) and scaled.id in returned):
            continue
        guarded, up = False, parents.get(node)
        while up is not None and up is not forward.node:
            if isinstance(up, ast.If) and "float16" in ast.unparse(up.test):
                guarded = True
                break
            up = parents.get(up)
        if not guarded:
            return "other", node
        if first is None:
            kind, first = "float16", node
    return kind, first


__all__ = ["ArchitectureSupport", "LayerConvention", "StackTaps", "convention_words", "inspect_architecture",
           "model_class", "read_taps", "registered_models", "supports_eagle3", "where"]
