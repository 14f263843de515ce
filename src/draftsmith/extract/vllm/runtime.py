"""`draftsmith doctor --runtime`: what vLLM resolves only when it builds its engine config (async scheduling's
`None` default), asked of the installed vLLM in a subprocess (the one reader that imports vLLM; the source readers
never do)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_RUNTIME_SCRIPT = """
import json, sys
from vllm.engine.arg_utils import EngineArgs
if sys.argv[1]:
    target = sys.argv[1]
else:
    from draftsmith.core import assets
    target = str(assets.default_target_dir())
config = EngineArgs(model=target).create_engine_config()
print("\\nDRAFTSMITH " + json.dumps({"async_scheduling": bool(config.scheduler_config.async_scheduling)}))
"""


def resolve_async_scheduling(target: str | Path | None, timeout: float = 600) -> tuple[bool | None, str]:
    """The runtime step: vLLM builds its engine config for the target in a subprocess (its log lines captured, never
    shown) and says what async_scheduling became. (value, words for the row); value None when it could not."""
    src = str(Path(__file__).resolve().parents[3])  # where this draftsmith is imported from, for the subprocess
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    try:
        done = subprocess.run(
            [sys.executable, "-c", _RUNTIME_SCRIPT, "" if target is None else str(target)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return None, f"not resolved (building the engine config took over {timeout:g} s)"
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("DRAFTSMITH "):
            value = bool(json.loads(line.removeprefix("DRAFTSMITH "))["async_scheduling"])
            return value, f"{'on' if value else 'off'} (engine config built in a subprocess)"
    last = next((ln.strip() for ln in reversed(done.stderr.splitlines()) if ln.strip()), f"exit {done.returncode}")
    return None, f"not resolved (the engine config could not be built: {last[:200]})"


__all__ = ["resolve_async_scheduling"]
