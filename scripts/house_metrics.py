"""The house's size and typing counts (issue 51), read from git, for any commit: `python scripts/house_metrics.py REV`.

lines                 src/draftsmith's .py files as `wc -l` counts them
any                   annotations naming Any (a `:` or `->` followed by `Any` on the same line)
modules_over_500      modules longer than 500 lines
functions_over_80     functions longer than 80 lines (docstrings count)
assert_isinstance     `assert isinstance(...)` narrowings
import_module         `import_module(` calls (draftsmith's own stages or third-party)

The last line is JSON. Without REV the working tree is read.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ANY = re.compile(r"(:|->)[^#]*\bAny\b")


def sources(rev: str | None) -> dict[str, str]:
    """Every .py file of src/draftsmith at `rev` (None: the working tree), by path."""
    if rev is None:
        return {str(p): p.read_text() for p in Path("src/draftsmith").rglob("*.py")}
    listed = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", rev, "src/draftsmith"], capture_output=True, text=True, check=True
    ).stdout.split()
    show = ["git", "show"]
    return {f: subprocess.run([*show, f"{rev}:{f}"], capture_output=True, text=True, check=True).stdout for f in listed}


def metrics(files: dict[str, str]) -> dict[str, int]:
    counts = dict.fromkeys(
        ("lines", "any", "modules_over_500", "functions_over_80", "assert_isinstance", "import_module"), 0
    )
    for text in (t for f, t in files.items() if f.endswith(".py")):
        counts["lines"] += text.count("\n")
        counts["any"] += sum(1 for line in text.splitlines() if ANY.search(line))
        counts["modules_over_500"] += text.count("\n") > 500
        functions = (n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))
        counts["functions_over_80"] += sum(1 for n in functions if (n.end_lineno or n.lineno) - n.lineno + 1 > 80)
        counts["assert_isinstance"] += text.count("assert isinstance")
        counts["import_module"] += text.count("import_module(")
    return counts


if __name__ == "__main__":
    print(json.dumps(metrics(sources(sys.argv[1] if len(sys.argv) > 1 else None))))
