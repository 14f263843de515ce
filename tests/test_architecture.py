"""The layout docs/architecture.md describes is the layout of the code: every module it names exists, imports run
one way (core <- methods <- config <- prepare <- extract <- train <- export <- evaluate <- serve <- the shell),
imports inside functions included, and every one is a plain import (no module loaded by name, no module
`__getattr__`), there is no import cycle, no import inside a function but of optional heavy dependencies, of a stage
by the commands that run it or of a method's implementation by its package's `load()`, no
module over 600 lines and no function over 80 lines in ruff format's layout, and nothing in src/ or docs/ points at
a file outside the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "draftsmith"
RANK = {
    "core": 0,
    "methods": 1,
    "config": 2,
    "prepare": 3,
    "extract": 4,
    "train": 5,
    "export": 6,
    "evaluate": 7,
    "serve": 8,
}
SHELL = 9  # cli, quickstart, doctor, inspection, __main__: may use every stage
# vLLM, matplotlib and TensorBoard are extras; datasets takes ~0.7 s to import and only serves its own input format
OPTIONAL_HEAVY = ("vllm", "matplotlib", "torch.utils.tensorboard", "datasets", "mooncake")
# the commands that import a stage when it runs, so that `draftsmith --help` loads none
LAZY_SHELL = ("draftsmith.cli", "draftsmith.doctor")
MAX_MODULE_LINES = 600  # in ruff format's layout (CI checks it)
MAX_FUNCTION_LINES = 80  # a screen in the same layout, docstring included


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _rank(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:  # the package itself (__version__)
        return -1
    return RANK.get(parts[1], SHELL)


def _imports(path: Path) -> list[tuple[str, bool, int]]:
    """(imported module, inside a function?, line) for every import in a file; `from draftsmith.x import y` names
    the submodule draftsmith.x.y when y is one."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    inner = {
        id(n)
        for f in ast.walk(tree)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        for n in ast.walk(f)
        if isinstance(n, (ast.Import, ast.ImportFrom))
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in inner, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES]
            found += [(m, id(node) in inner, node.lineno) for m in (subs or [node.module])]
    return found


def test_every_module_the_architecture_names_exists():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`((?:core|methods|prepare|extract|train|export|evaluate|serve)/[\w/]*(?:\.py|/))`", text))
    named |= {
        f"{m.split('/')[0]}/{m.split('/')[1]}.py"
        for m in re.findall(r"`((?:core|methods|prepare|extract|train|export|evaluate|serve)/\w+): ", text)
    }
    assert len(named) > 15, "the architecture names its modules as `package/module.py`"
    missing = sorted(p for p in named if not (SRC / p).exists())
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"
    for package in RANK:
        if package != "config":
            assert f"`{package}/`" in text, f"docs/architecture.md does not describe {package}/"
    for test_file in re.findall(r"`(tests/[\w/]+\.py)`", text):
        assert (ROOT / test_file).is_file(), test_file


def test_imports_run_one_way():
    wrong = []
    for name, path in MODULES.items():
        for imported, _, line in _imports(path):
            if imported.startswith("draftsmith.") and _rank(imported) > _rank(name):
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {imported}")
    assert not wrong, "a stage imports a later one:\n" + "\n".join(wrong)


def test_no_import_cycle():
    graph = {name: {m for m, _, _ in _imports(path) if m in MODULES and m != name} for name, path in MODULES.items()}
    # a package's __init__ re-exporting its own modules is not a cycle with them: drop parent <- child edges
    for name, deps in graph.items():
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(dep) :] + [dep]))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def _loads_its_method(name: str, imported: str) -> bool:
    """A method package's `load()` importing its own implementation (draftsmith.methods.X -> X.method): the
    package stays light (no torch) for `draftsmith --help` and the probe."""
    return name.startswith("draftsmith.methods.") and imported == f"{name}.method"


def test_every_method_package_is_in_the_registry_and_light():
    from draftsmith import methods

    packages = sorted(p.parent.name for p in (SRC / "methods").glob("*/__init__.py"))
    assert sorted(p.__name__.rsplit(".", 1)[1] for p in methods.PACKAGES) == packages
    for package in packages:
        heavy = [m for m, inner, _ in _imports(SRC / "methods" / package / "__init__.py") if not inner]
        heavy = [m for m in heavy if m.startswith(("torch", "transformers", "numpy")) or m.endswith(".modeling")]
        assert not heavy, f"methods/{package}/__init__.py imports {heavy}: a package's own module is light"
    # (its `.method` is named at the top only for the type checker: `load()` imports it)


def test_imports_inside_functions_are_only_of_optional_heavy_dependencies_or_a_command_s_stage():
    inner = [
        f"{path.relative_to(ROOT)}:{line} imports {m}"
        for name, path in MODULES.items()
        for m, is_inner, line in _imports(path)
        if is_inner
        and not m.startswith(OPTIONAL_HEAVY)
        and not (name in LAZY_SHELL and m.startswith("draftsmith."))
        and not _loads_its_method(name, m)
    ]
    assert not inner, "move these imports to the top of their module:\n" + "\n".join(inner)


def _hidden_imports(path: Path) -> list[str]:
    """`importlib.import_module` of a draftsmith module (a string literal, or a module-level name bound to one) and
    module-level `__getattr__` in one file, as "line what"."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = {
        t.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    found = [f"{n.lineno} module __getattr__" for n in tree.body if getattr(n, "name", None) == "__getattr__"]
    for node in ast.walk(tree):
        called = getattr(node, "func", None)
        if isinstance(node, ast.Call) and getattr(called, "attr", getattr(called, "id", None)) == "import_module":
            texts = [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
            texts += [names.get(n.id, "") for n in ast.walk(node) if isinstance(n, ast.Name)]
            if any(t.startswith("draftsmith") for t in texts):
                found.append(f"{node.lineno} import_module({ast.unparse(node.args[0])})")
    return found


def test_the_stage_graph_is_in_plain_imports():
    hidden = [f"{p.relative_to(ROOT)}:{h}" for p in MODULES.values() for h in _hidden_imports(p)]
    assert not hidden, "import these with `import`/`from ... import` (inside the function if it must wait):\n" + (
        "\n".join(hidden)
    )


def test_no_module_is_a_god_module():
    big = {
        str(p.relative_to(ROOT)): n
        for p in MODULES.values()
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert not big, f"modules over {MAX_MODULE_LINES} lines: {big}"


def test_functions_fit_on_a_screen():
    long = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


@pytest.mark.parametrize("folder", ["src", "docs"])
def test_nothing_points_outside_the_repository(folder):
    cited = []
    for path in sorted((ROOT / folder).rglob("*")):
        if path.suffix in (".py", ".md") and re.search(r"\b(DESIGN|STYLE)\.md\b", path.read_text(encoding="utf-8")):
            cited.append(str(path.relative_to(ROOT)))
    assert not cited, f"these cite design documents a clone does not have: {cited}"
