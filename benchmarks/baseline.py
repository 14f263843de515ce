"""A baseline commit of this repository checked out beside the working tree, for the benchmarks that measure this
tree against it side by side (`git worktree` into a temporary directory, removed after)."""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def baseline_tree(commit: str) -> Iterator[Path]:
    """The tree of `commit` (its src/ goes on PYTHONPATH); its parent directory is a scratch directory too."""
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "baseline"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(base), commit], check=True, capture_output=True
        )
        try:
            yield base
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], capture_output=True)
