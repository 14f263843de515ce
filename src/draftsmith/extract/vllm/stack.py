"""What draftsmith's layer taps rely on in one vLLM decoder stack, read from its source with `ast`.

architectures.py follows a target architecture to its decoder stack; `read_taps` then reads, each with the file and
line it was read at (`StackTaps`): the stack's loop over `self.layers`, how a layer is called and what it returns
(`hidden, residual = layer(...)`: the stream is their sum; `x = layer(...)`: the one tensor), where the stream
enters the call (position or keyword: id 0's hook), how the layers are made (`make_layers` / `start_layer` /
`end_layer`), the decoder layer classes (through lambdas, parameters with defaults, a subclass's
`super().__init__(..., layer_type=...)`, class attributes, local builder functions), any rescaling of the residual
inside them (DeepSeek's float16 overflow guard) and whether the stack all-gathers a token-sharded stream. The first
thing not found ends the reading with `missing` naming what was looked for, where: the taps are then not offered.
`cpu_bfloat16_only` reads a CPU kernel's bfloat16 assert the architecture reaches (vLLM's own words).
The shared AST helpers here (`where`, `callee`, ...) serve architectures.py too. Nothing here imports vLLM.
"""

from __future__ import annotations

import ast
import contextlib
import re
from typing import Literal

from pydantic import BaseModel, Field

from draftsmith.extract.vllm.source import Found, SourceTree


class StackTaps(BaseModel):
    """What draftsmith's layer taps need from one decoder stack, each with where it was read (`file:line text`)."""

    loop: str | None = Field(None, description="the stack's loop over self.layers")
    layers: str | None = Field(None, description="where the stack makes self.layers (make_layers / ModuleList)")
    layer_returns: Literal["pair", "tensor"] | None = Field(
        None, description="pair: `hidden, residual = layer(...)` (the stream is their sum); tensor: `x = layer(...)`"
    )
    stream_arg: int | str | None = Field(
        None, description="where the stream enters a layer call: a position or a keyword (the embeddings, id 0)"
    )
    layer_classes: list[str] = Field(default_factory=list, description="the decoder layer classes make_layers builds")
    float16_rescale: str | None = Field(
        None, description="where a layer rescales the stream under float16 (then taps refuse float16)"
    )
    gathers_rows: bool = Field(False, description="the stack all-gathers a token-sharded stream (sequence parallel)")
    missing: str | None = Field(None, description="why the taps cannot be placed: what was looked for, where")

    @property
    def placeable(self) -> bool:
        return self.missing is None


def where(found: Found, node: ast.AST | None = None) -> str:
    """`models/llama.py:454 <that line>` for a node (default: the definition itself), as doctor and the docs cite."""
    node = node if node is not None else found.node
    line = getattr(node, "lineno", 1)
    text = found.module.text.splitlines()[line - 1].strip() if found.module.text else ""
    return f"{short(found)}:{line} {text}"


def short(found: Found) -> str:
    rel = found.module.name.replace(".", "/") + ("/__init__.py" if found.module.is_package else ".py")
    return rel.removeprefix("vllm/model_executor/").removeprefix("vllm/")


def is_self(expr: ast.expr) -> bool:
    return isinstance(expr, ast.Name) and expr.id == "self"


def callee(tree: SourceTree, fn: Found, func: ast.expr, *, owner: Found) -> Found | None:
    """What a call's function expression names inside method `fn` of class `owner`: `Name` (module level),
    `self.attr` (a member of owner), or a parameter of `fn` with a default (`layer_type: type = LlamaDecoderLayer`)."""
    if isinstance(func, ast.Attribute) and is_self(func.value):
        return tree.member(owner, func.attr)
    if isinstance(func, ast.Name):
        default = _param_default(fn, func.id)
        if default is not None:
            return tree.resolve(fn.module, default)
        local = local_def(fn, func.id)
        if local is not None:
            return Found(fn.module, local)
        return tree.lookup(fn.module.name, func.id)
    return None


def _param_default(fn: Found, name: str) -> ast.expr | None:
    args = fn.function.args
    positional = args.posonlyargs + args.args
    for arg, default in zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=False):
        if arg.arg == name:
            return default
    for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults, strict=False):
        if arg.arg == name and kw_default is not None:
            return kw_default
    return None


def local_def(fn: Found, name: str) -> ast.FunctionDef | None:
    return next(
        (n for n in ast.walk(fn.node) if isinstance(n, ast.FunctionDef) and n.name == name and n is not fn.node), None
    )


# ------------------------------------------------------------------------------------------- CPU kernels


def cpu_bfloat16_only(tree: SourceTree, model_module: str) -> str | None:
    """Where a CPU kernel the architecture's model module reaches asserts that its input is bfloat16:
    `"<vLLM's message>" (<file>:<line>)`, else None. The kernels are the modules of a `cpu` package under
    vllm/model_executor/layers with such an assert (vLLM 0.32's gated delta-net for Qwen3-Next / Qwen3.5: "CPU GDN
    attention requires BF16."); the model module reaches one when it names it, or names a layers module that does
    (vLLM imports its CPU kernels inside the function that calls them)."""
    kernels = _cpu_bfloat16_kernels(tree)
    module = tree.module(model_module)
    if not kernels or module is None:
        return None
    for kernel, said in kernels.items():
        importers = [name for name, text in _layer_texts(tree).items() if kernel in text]
        if any(name in module.text for name in [kernel, *importers]):
            return said
    return None


def _layer_texts(tree: SourceTree) -> dict[str, str]:
    """Module name -> text of the modules under vllm/model_executor/layers (packages' __init__ left out)."""
    cached = getattr(tree, "_draftsmith_layer_texts", None)
    if cached is None:
        cached = {}
        root = tree.package / "model_executor" / "layers"
        for path in sorted(root.rglob("*.py")) if root.is_dir() else []:
            name = "vllm." + ".".join(path.relative_to(tree.package).with_suffix("").parts)
            if path.name != "__init__.py":
                with contextlib.suppress(OSError):
                    cached[name] = path.read_text(encoding="utf-8", errors="replace")
        tree._draftsmith_layer_texts = cached  # type: ignore[attr-defined]  # a cache kept on the tree it was read from
    return cached


def _cpu_bfloat16_kernels(tree: SourceTree) -> dict[str, str]:
    """CPU kernel module -> its bfloat16 assert's message and place (only these few files are parsed)."""
    found: dict[str, str] = {}
    for name, text in _layer_texts(tree).items():
        if ".cpu." not in name or "bfloat16" not in text:
            continue
        module = tree.module(name)
        if module is None:
            continue
        for node in ast.walk(module.tree):
            if (
                isinstance(node, ast.Assert)
                and "torch.bfloat16" in ast.unparse(node.test)
                and isinstance(node.msg, ast.Constant)
                and isinstance(node.msg.value, str)
            ):
                found[name] = f"{node.msg.value!r} ({where(Found(module, node), node).split(' ', 1)[0]})"
                break
    return found


# ------------------------------------------------------------------------------------------- the layer taps

GATHER = "tensor_model_parallel_all_gather"


def read_taps(tree: SourceTree, stack: Found, forward: Found) -> StackTaps:
    """What draftsmith's layer taps rely on in `stack`, read from its forward and __init__ and its layers' forward.
    The first thing not found ends the reading with `missing` naming it (the taps are then not offered)."""
    taps = StackTaps()
    loop = _layer_loop(forward)
    if loop is None:
        return _missing(taps, f"no `for ... in ...self.layers...` loop in {stack.name}.forward ({short(forward)})")
    taps.loop = where(forward, loop)
    call = _layer_call(loop)
    if call is None:
        return _missing(
            taps, f"no `<stream> = layer(...)` call inside the loop of {stack.name}.forward ({where(forward, loop)})"
        )
    assign, targets = call
    taps.layer_returns = "pair" if len(targets) == 2 else "tensor"
    stream = targets[0]
    assert isinstance(assign.value, ast.Call)  # what _layer_call finds
    taps.stream_arg = _argument_of(assign.value, stream)
    if taps.stream_arg is None:
        return _missing(taps, f"the stream `{stream}` is not an argument of the layer call ({where(forward, assign)})")
    taps.gathers_rows = GATHER in tree.segment(forward)
    rescaled = _reassigned_in_loop(loop, assign, targets, taps.gathers_rows)
    if rescaled is not None:
        return _missing(taps, f"the loop changes the stream besides the layer call ({where(forward, rescaled)})")
    made = _layers_made(tree, stack)
    if made is None:
        return _missing(
            taps,
            f"no `self.layers = ...` (make_layers or nn.ModuleList) in the __init__ of {stack.name} "
            f"({short(stack)}) or its bases",
        )
    init, statement, builder = made
    taps.layers = where(init, statement)
    classes = _layer_classes(tree, stack, init, builder)
    if not classes:
        return _missing(
            taps,
            f"the decoder layer class that {where(init, statement)} builds could not be resolved, "
            "so its rescaling of the stream could not be read",
        )
    taps.layer_classes = [c.name for c in classes]
    for layer_cls in classes:
        layer_forward = tree.method(layer_cls, "forward")
        if layer_forward is None:
            return _missing(taps, f"no forward() on {layer_cls.name} ({short(layer_cls)})")
        kind, node = _stream_rescale(layer_forward)
        if kind == "other":
            return _missing(
                taps,
                f"{layer_cls.name}.forward rescales the stream outside a float16 branch "
                f"({where(layer_forward, node)}), which the taps cannot undo",
            )
        if kind == "float16" and taps.float16_rescale is None:
            taps.float16_rescale = where(layer_forward, node)
    return taps


def _missing(taps: StackTaps, why: str) -> StackTaps:
    taps.missing = why
    return taps


def _mentions_layers(expr: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "layers" and is_self(n.value) for n in ast.walk(expr))


def _layer_loop(forward: Found) -> ast.For | None:
    """The loop over the layers: `for layer in islice(self.layers, ...)`, `for idx, layer in enumerate(...)`, or
    `for i in range(self.start_layer, self.end_layer): layer = self.layers[i]` (gpt-oss)."""
    loops = (n for n in ast.walk(forward.node) if isinstance(n, ast.For))
    return next((n for n in loops if _mentions_layers(n.iter) or _indexed_layer(n) is not None), None)


def _indexed_layer(loop: ast.For) -> str | None:
    """`layer` in a loop body's `layer = self.layers[i]`."""
    for stmt in loop.body:
        if (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
            and isinstance(stmt.value, ast.Subscript)
            and _mentions_layers(stmt.value.value)
        ):
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
    if isinstance(target, ast.Tuple) and len(target.elts) == 2:
        names = [e.id for e in target.elts if isinstance(e, ast.Name)]
        return names if len(names) == 2 else None
    return None


def _layer_call(loop: ast.For) -> tuple[ast.Assign, list[str]] | None:
    """`hidden, residual = layer(...)` / `x = layer(...)` / `... = self.layers[i](...)` in the loop body."""
    layer = _loop_layer(loop)
    for node in ast.walk(loop):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.value, ast.Call)):
            continue
        func = node.value.func
        if (isinstance(func, ast.Name) and func.id == layer) or (
            isinstance(func, ast.Subscript) and _mentions_layers(func.value)
        ):
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
        own = next((s for s in klass.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None)
        if own is None:
            continue
        for node in ast.walk(own):
            if not isinstance(node, ast.Assign):
                continue
            for target in node.targets:
                elts = target.elts if isinstance(target, ast.Tuple) else [target]
                if any(isinstance(e, ast.Attribute) and e.attr == "layers" and is_self(e.value) for e in elts):
                    value, init = node.value, Found(klass.module, own)
                    callee = getattr(value, "func", None)
                    if (
                        isinstance(value, ast.Call)
                        and getattr(callee, "id", getattr(callee, "attr", "")) == "make_layers"
                        and len(value.args) >= 2
                    ):
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
        local = local_def(init, builder.id)
        if local is not None:
            calls = [
                n.value.func for n in ast.walk(local) if isinstance(n, ast.Return) and isinstance(n.value, ast.Call)
            ]
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
    cls = callee(tree, init, func, owner=stack)
    return [cls] if cls is not None else []


def _passed_by_subclass(tree: SourceTree, stack: Found, init: Found, param: str) -> list[Found]:
    """Where `init` belongs to a base of `stack`: what the subclasses between pass for `param` to super().__init__
    (Qwen3Model passes `decoder_layer_type=self.decoder_layer_type` to Qwen2Model)."""
    for klass in tree.mro(stack):
        own = next((s for s in klass.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None)
        if own is None or own is init.node:
            continue
        for node in ast.walk(own):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "__init__"
                and isinstance(node.func.value, ast.Call)
                and getattr(node.func.value.func, "id", None) == "super"
            ):
                for kw in node.keywords:
                    if kw.arg == param:
                        named = callee(tree, Found(klass.module, own), kw.value, owner=stack)
                        return [named] if named is not None else []
    return []


def _stream_rescale(forward: Found) -> tuple[Literal["none", "float16", "other"], ast.AST | None]:  # noqa: C901 - one branch per rescale layout vLLM's releases use
    """How a decoder layer's forward rescales the residual it carries on (the second name of `return hidden, residual`:
    `residual *= ...` / `residual = residual * ...`), which vLLM's stream then holds scaled where the model's own does
    not. Scaling the layer's new output is its computation, not a rescale. "float16" where every such statement sits
    under a branch testing float16 (DeepSeek's overflow guard)."""
    returned: set[str] = set()
    parents: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(forward.node):
        parents.update(dict.fromkeys(ast.iter_child_nodes(node), node))
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple) and len(node.value.elts) == 2:
            carried = node.value.elts[1]
            if isinstance(carried, ast.Name):
                returned.add(carried.id)
    kind: Literal["none", "float16", "other"] = "none"
    first = None
    for node in ast.walk(forward.node):
        scaled = None
        if isinstance(node, ast.AugAssign) and isinstance(node.op, (ast.Mult, ast.Div)):
            scaled = node.target
        elif (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.BinOp)
            and isinstance(node.value.op, (ast.Mult, ast.Div))
            and len(node.targets) == 1
        ):
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


__all__ = ["StackTaps", "callee", "cpu_bfloat16_only", "is_self", "local_def", "read_taps", "short", "where"]
