"""`draftsmith serve`: vLLM's OpenAI-compatible server with a draftsmith draft as its EAGLE-3 speculator.

The draft (an export in any format, or a training checkpoint) is read and checked before vLLM starts: its
manifest names the target and the draft length, and a target that is not the one it was trained for is refused
in one line, as is a vLLM that the probe finds cannot decode it here (no EAGLE-3 on this platform; for a P-EAGLE
draft, no parallel drafting). A draft vLLM cannot load as it is (a checkpoint, an SGLang export) is written as a
vLLM export into a temporary directory, removed when the server stops. The server is vLLM's own (server.py), run
as a child process in its own process group with the options `vllm serve` takes.

SIGINT (Ctrl-C) or SIGTERM to draftsmith stops the server: SIGTERM to vLLM, again if it is still running after
a grace period (vLLM 0.32 loses a signal that comes while it waits for its engine to start: its ZMQ socket
context swallows KeyboardInterrupt, and the server then waits for an engine that will never report), and
finally SIGKILL to whatever is left in the process group, so no engine or worker process outlives draftsmith.

`--target-alone` serves the draft's target without it, with the same engine options and nothing asked of vLLM's
speculative decoding: the baseline `evaluate --concurrency` loads beside the draft.

The commands printed for an export (`draftsmith serve EXPORT`, and vLLM's own `vllm serve` for GPU installs) are
export.serve_commands.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console

from draftsmith.config import ServeConfig, StageResult
from draftsmith.core import processes, recording, vllm_launch
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.manifest import TargetIdentity
from draftsmith.core.recording import ServerInfo, fingerprint
from draftsmith.core.targets import is_multimodal_wrapper, read_config, text_config
from draftsmith.evaluate.vllm_runner import check_vllm_can_serve, engine_dtype
from draftsmith.export import read_export_manifest, vllm_loadable
from draftsmith.export.formats import vllm_speculative_config
from draftsmith.extract.vllm.probe import ProbeFacts, probe, target_engine_env, target_engine_kwargs
from draftsmith.methods.artefact import DraftSource, load_draft, resolve_draft_target
from draftsmith.serve import record

__all__ = ["run", "vllm_serve_args"]

DEFAULT_K = 3  # draft tokens per step when the draft does not record any (a training checkpoint)
SERVER = [sys.executable, "-m", "draftsmith.serve.server"]
STOP_GRACE_S = (15.0, 30.0)  # seconds vLLM gets after the first and the second SIGTERM, then SIGKILL
# What a refusal to serve offers instead ("use a vLLM whose `draftsmith doctor` row ... says yes, or ...").
MEASURE_WITHOUT_VLLM = "measure the draft with the reference decoder (draftsmith evaluate --engine hf)"


def run(cfg: ServeConfig, console: Console | None = None) -> StageResult:
    """Check the draft against its target, then serve both with vLLM until it exits or SIGINT / SIGTERM."""
    console = console or Console(stderr=True)
    draft = Path(cfg.draft)
    source = load_draft(draft)
    target_path, identity = resolve_draft_target(cfg.target, source, str(draft), "serve it")
    exported = read_export_manifest(draft)  # None for a training run or checkpoint
    k = cfg.num_speculative_tokens or (exported.speculative_tokens if exported else DEFAULT_K)
    if not cfg.target_alone:
        check_vllm_can_serve(target_path, "draftsmith serve", method=source.spec.method, instead=MEASURE_WITHOUT_VLLM)
    if cfg.record is not None:  # refused before vLLM starts where it cannot hold a recording
        cfg = cfg.model_copy(update={"record": recording.check_directory(cfg.record)})
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    url = f"http://{host}:{cfg.port}/v1"
    started = time.perf_counter()
    with _sigterm_interrupts(), _vllm_draft_dir(draft, source, identity, k, cfg.target_alone) as draft_dir:
        alone = f"{target_path.name} alone (the target of {draft})"
        what = alone if cfg.target_alone else f"{draft} (k={k}) with {target_path.name}"
        say = f"serving {what} at {url} once vLLM has started; Ctrl-C stops it"
        console.print(say, highlight=False, soft_wrap=True)
        if cfg.record is not None:
            console.print(f"recording every request it answers into {cfg.record}", highlight=False, soft_wrap=True)
        if cfg.dtype == "auto":  # on a CPU, what this vLLM runs fastest and runs at all (vLLM's own auto is bf16)
            choice = engine_dtype(target_path, cfg.dtype)
            if choice.platform == "cpu":
                say = f"vLLM runs the target in {choice.dtype} (--dtype auto: {choice.why})"
                console.print(say, highlight=False, soft_wrap=True)
                cfg = cfg.model_copy(update={"dtype": choice.dtype})
        flags, launch_env = target_launch(target_path, cfg, identity, draft)
        env = dict(os.environ, **launch_env)  # vLLM's own log level: the user's server
        if cfg.api_key:
            env["VLLM_API_KEY"] = cfg.api_key  # vLLM reads it there: the key stays out of the process list
        argv = vllm_serve_args(cfg, target_path, draft_dir, k, flags)
        status = serve_until_stopped([*SERVER, *argv], env)
    if status not in (None, 0):
        raise DraftsmithError(f"vLLM's server exited with status {status}; its messages are above")
    return StageResult(
        stage="serve",
        output=draft,
        summary={
            "target": str(target_path),
            "draft": str(draft),
            "speculative tokens": "none (--target-alone)" if cfg.target_alone else k,
            "address": url,
            "stopped": f"after {(time.perf_counter() - started) / 60:.1f} min",
            "output": "none (a server keeps nothing)"
            if cfg.record is None
            else f"{cfg.record} ({recording.records_in(cfg.record)} records)",
        },
    )


@contextmanager
def _vllm_draft_dir(
    draft: Path, source: DraftSource, identity: TargetIdentity, k: int, target_alone: bool = False
) -> Iterator[Path | None]:
    """The draft as a directory vLLM loads (export.vllm_loadable); one written for the server lives as long as it.
    None for --target-alone: no draft is served."""
    if target_alone:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="draftsmith-serve-") as tmp:
        yield vllm_loadable(draft, source, identity, Path(tmp) / "draft", speculative_tokens=k)


def target_launch(
    target_path: Path, cfg: ServeConfig, identity: TargetIdentity | None = None, draft: Path | None = None
) -> tuple[list[str], dict[str, str]]:
    """(the `vllm serve` flags, the variables its environment needs) for this target in the installed vLLM, as
    extraction and evaluation start it (core.vllm_launch with the probe's target_engine_kwargs / _env): a multimodal
    wrapper such as Kimi-K2.5 --language-model-only (no vision tower), an MLA target in float32 on a CPU
    --attention-backend CPU_MLA; the KV cache; on a CPU, one group of cores per tensor-parallel worker. With
    --record, the recording's middleware and its options (`_record_launch`)."""
    config = read_config(target_path)
    facts = probe(architecture=(config.get("architectures") or ["unknown"])[0], config=config).facts
    mla = "kv_lora_rank" in text_config(config)
    kwargs = target_engine_kwargs(facts, mla=mla, multimodal=is_multimodal_wrapper(config), dtype=cfg.dtype)
    flags: list[str] = []
    for name, value in kwargs.items():
        flag = "--" + name.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    env = vllm_launch.engine_environment(
        cfg.kv_cache_gb,
        cpu_workers=cfg.tensor_parallel_size if facts.platform == "cpu" else 1,
        target_env=target_engine_env(facts, mla=mla),
    )
    if cfg.record is not None and identity is not None:
        more, env[record.ENV] = _record_launch(cfg, facts, identity, draft)
        flags += more
    return flags, env


def _record_launch(
    cfg: ServeConfig, facts: ProbeFacts, identity: TargetIdentity, draft: Path | None
) -> tuple[list[str], str]:
    """(the `vllm serve` flags, DRAFTSMITH_RECORD) of --record: vLLM's API server loads the recording's middleware;
    where this vLLM reports acceptance per request, it reports it (each verify step's, where it keeps them)."""
    assert cfg.record is not None  # the caller's condition
    if not facts.api_middleware:
        raise DraftsmithError(
            f"--record: vLLM {facts.version}'s API server takes no --middleware (the probe found "
            f"{'none' if facts.api_middleware is False else 'no FrontendArgs'}), where the recording plugs in; "
            "every vLLM from 0.11.1 to 0.33 has it"
        )
    if os.environ.get("VLLM_USE_RUST_FRONTEND", "0") not in ("", "0"):  # vLLM 0.32's: it loads no ASGI middleware
        raise DraftsmithError(
            "--record: VLLM_USE_RUST_FRONTEND serves through vLLM's Rust front end, which loads "
            "no --middleware; unset it to record"
        )
    servers = _given(cfg.vllm_args, "--api-server-count", "-asc")
    if servers not in (None, "1"):
        raise DraftsmithError(
            f"--record: --vllm-args asks for {servers} API server processes; one writes the recording (--record "
            "starts vLLM with one: leave --api-server-count out)"
        )
    # one API server process, the recording's one writer (vLLM starts one per data-parallel rank where not told)
    flags = ["--middleware", "draftsmith.serve.record.RecordMiddleware", "--api-server-count", "1"]
    asked = _given(cfg.vllm_args, "--per-request-spec-decode-metrics") is not None
    if cfg.target_alone:
        acceptance = "none: --target-alone serves no draft"
    elif not facts.per_request_spec_metrics:
        acceptance = f"not recorded: vLLM {facts.version} does not report acceptance per request (0.32 does)"
    else:
        level = "detailed" if facts.per_request_spec_steps else "summary"
        flags += [] if asked else ["--per-request-spec-decode-metrics", level]
        acceptance = (
            f"per request, vLLM {facts.version}'s speculative-decoding metrics ({level}); a stream's only where "
            "the client asks for usage (stream_options.include_usage)"
        )
    server = ServerInfo(
        target=fingerprint(identity.config_hash, identity.tokenizer_hash),
        target_path=identity.path,
        draft=None if cfg.target_alone else str(draft),
        vllm=facts.version or "",
        acceptance=acceptance,
    )
    directory = str(Path(cfg.record).expanduser().resolve())
    return flags, record.options(directory, server, cfg.record_max_gb, cfg.record_redact, cfg.record_sample)


def _given(vllm_args: str | None, *names: str) -> str | None:
    """The value --vllm-args gives the first of `names` (`--name V` or `--name=V`); None where none is given."""
    given = shlex.split(vllm_args or "")
    for i, arg in enumerate(given):
        name, eq, value = arg.partition("=")
        if name in names:
            return value if eq else (given[i + 1] if i + 1 < len(given) else "")
    return None


def vllm_serve_args(
    cfg: ServeConfig, target_path: Path, draft_dir: Path | None, k: int, flags: Sequence[str] = ()
) -> list[str]:
    """The `vllm serve` arguments for this config (the target's own flags, then --vllm-args last, so they can
    override the rest; the API key goes to vLLM in VLLM_API_KEY). A P-EAGLE draft gets parallel drafting; no
    `draft_dir` (--target-alone), no speculative config."""
    argv = [str(target_path)]
    if draft_dir is not None:
        argv += ["--speculative-config", json.dumps(vllm_speculative_config(draft_dir, k))]
    argv += ["--host", cfg.host, "--port", str(cfg.port)]
    argv += ["--tensor-parallel-size", str(cfg.tensor_parallel_size), *flags]
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
    """Run the server `command` in its own process group (the terminal's Ctrl-C reaches this process only) until it
    exits (its status) or this process gets KeyboardInterrupt (None: then it is stopped, SIGTERM again after a grace
    period: vLLM may have lost the first). Nothing of its process group outlives this call."""
    with processes.ChildProcess(command, env=env, graces_s=STOP_GRACE_S) as server:
        try:
            return server.wait()
        except KeyboardInterrupt:
            return None
