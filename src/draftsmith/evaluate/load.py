"""`draftsmith evaluate --concurrency 1,4,16`: does the draft still pay at the concurrency it is served at?

Speculative decoding spends spare compute to take fewer target steps; as batches grow the spare compute shrinks and
the gain with it, on some hardware into a loss. This measures it where a draft is served, through the server a user
runs: `draftsmith serve DRAFT` (the target with the draft), then `draftsmith serve DRAFT --target-alone` (the target
alone, the same engine options), one after the other on a free local port. At each concurrency vLLM's own load
generator, `vllm bench serve` (loadgen.py), sends the evaluation's prompts to /v1/completions, greedy, with at most
that many requests in flight, and reports output tokens/s, inter-token latency (ITL) and time to first token. The
speed-up at a concurrency is the draft's output tokens/s over the target alone's; the draft stops paying at the first
concurrency where it is at most 1.

Both servers decode the same prompts greedily, so their outputs should be the same text: the report counts the
requests whose outputs are identical (batches of different sizes can round differently in low precision).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from draftsmith.core import processes
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import atomic_write_text
from draftsmith.core.net import free_port
from draftsmith.evaluate import loadgen
from draftsmith.evaluate.report import ConcurrencyRow, ConcurrencySweep, ServedRun

__all__ = ["Load", "ServerOptions", "sweep", "stops_paying_at"]

HOST = "127.0.0.1"
STOP_S = 90.0  # draftsmith serve's own stop: SIGTERM to vLLM, again after 15 s, SIGKILL after 30 more


@dataclass(frozen=True)
class ServerOptions:
    """What both servers are started with (`draftsmith serve` options)."""

    draft: Path
    k: int
    dtype: str
    max_model_len: int
    kv_cache_gb: int | None
    tensor_parallel_size: int
    trust_remote_code: bool
    timeout_s: int
    vllm_args: str | None = None  # more `vllm serve` options, as `draftsmith serve --vllm-args` takes them
    record: Path | None = None  # `draftsmith serve --record` (benchmarks/record.py: what recording costs)

    def argv(self, port: int, target_alone: bool) -> list[str]:
        argv = [sys.executable, "-m", "draftsmith", "serve", str(self.draft), "--host", HOST, "--port", str(port)]
        argv += ["--num-speculative-tokens", str(self.k), "--dtype", self.dtype]
        argv += ["--max-model-len", str(self.max_model_len), "--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.kv_cache_gb is not None:
            argv += ["--kv-cache-gb", str(self.kv_cache_gb)]
        if self.trust_remote_code:
            argv.append("--trust-remote-code")
        if self.vllm_args:
            argv += ["--vllm-args", self.vllm_args]
        if target_alone:
            argv.append("--target-alone")
        if self.record is not None:
            argv += ["--record", str(self.record)]
        return argv


def sweep(
    options: ServerOptions,
    prompts: list[str],
    concurrency: list[int],
    *,
    max_new_tokens: int,
    seed: int,
    workdir: Path,
    vllm_version: str | None = None,
) -> ConcurrencySweep:
    """Serve the draft, then the target alone, and load each at every concurrency; the table the report shows."""
    workdir.mkdir(parents=True, exist_ok=True)
    dataset = workdir / "prompts.jsonl"
    atomic_write_text(dataset, "".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    measured: dict[str, dict[int, ServedRun]] = {}
    texts: dict[str, dict[int, list[str]]] = {}
    load = Load(dataset, len(prompts), concurrency, max_new_tokens, seed, options.timeout_s)
    for name, alone in (("draft", False), ("target_alone", True)):
        measured[name], texts[name] = load.serve(functools.partial(options.argv, target_alone=alone), workdir / name)
    rows = []
    for c in concurrency:
        served, baseline = measured["draft"][c], measured["target_alone"][c]
        same = sum(a == b for a, b in zip(texts["draft"][c], texts["target_alone"][c], strict=False))
        rows.append(
            ConcurrencyRow(
                concurrency=c,
                requests=loadgen.requests_at(c, len(prompts)),
                draft=served,
                target_alone=baseline,
                speedup=_ratio(served.output_throughput, baseline.output_throughput),
                itl_ratio=_ratio(served.mean_itl_ms, baseline.mean_itl_ms),
                identical_outputs=f"{same}/{len(texts['draft'][c])}",
            )
        )
    return ConcurrencySweep(
        k=options.k,
        dtype=options.dtype,
        load_generator=f"vllm bench serve{f' (vLLM {vllm_version})' if vllm_version else ''}",
        max_new_tokens=max_new_tokens,
        rows=rows,
        stops_paying_at=stops_paying_at(rows),
    )


@dataclass(frozen=True)
class Load:
    """What each server is loaded with: the prompts (a JSONL of {"prompt": ...}), at each concurrency."""

    dataset: Path
    num_prompts: int
    concurrency: list[int]
    max_new_tokens: int
    seed: int
    timeout_s: int

    def serve(
        self, argv: Callable[[int], list[str]], results: Path
    ) -> tuple[dict[int, ServedRun], dict[int, list[str]]]:
        """Start the server `argv(port)` on a free port, load it at every concurrency, stop it: what vLLM's load
        generator measured and the texts it got back, by concurrency (its files under `results`)."""
        port = free_port(HOST)
        with _server(argv(port), results.with_name(f"serve-{results.name}.log"), port, self.timeout_s):
            _load(port, self, results)
        measured, texts = {}, {}
        for c in self.concurrency:
            raw = json.loads((results / loadgen.result_name(c)).read_text(encoding="utf-8"))
            measured[c] = ServedRun.model_validate({key: raw.get(key) for key in ServedRun.model_fields})
            texts[c] = list(raw.get("generated_texts") or [])
        return measured, texts


def stops_paying_at(rows: list[ConcurrencyRow]) -> int | None:
    """The first concurrency whose speed-up is at most 1 (None: the draft pays at every one measured)."""
    for row in sorted(rows, key=lambda r: r.concurrency):
        if row.speedup is not None and row.speedup <= 1.0:
            return row.concurrency
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _load(port: int, load: Load, results: Path) -> None:
    """vLLM's load generator (loadgen.py) against the server at `port`, every concurrency in one process."""
    argv = [sys.executable, "-m", "draftsmith.evaluate.loadgen", "--concurrency", ",".join(map(str, load.concurrency))]
    argv += ["--result-dir", str(results), "--num-prompts", str(load.num_prompts), "--"]
    argv += ["--backend", "openai", "--base-url", f"http://{HOST}:{port}", "--endpoint", "/v1/completions"]
    argv += ["--dataset-name", "custom", "--dataset-path", str(load.dataset), "--skip-chat-template"]
    argv += ["--custom-output-len", str(load.max_new_tokens), "--temperature", "0", "--seed", str(load.seed)]
    argv.append("--save-detailed")
    log = results.with_suffix(".log")
    results.mkdir(parents=True, exist_ok=True)
    with processes.ChildProcess(argv, log=log) as loadgen:
        try:
            code = loadgen.wait(load.timeout_s)
        except subprocess.TimeoutExpired:
            raise DraftsmithError(
                f"evaluate --concurrency: the load generator ran past {load.timeout_s} s; see {log}"
            ) from None
    if code != 0:
        raise DraftsmithError(f"evaluate --concurrency: the load generator failed:\n{_tail(log)}\n(all of it: {log})")


@contextmanager
def _server(argv: list[str], log: Path, port: int, timeout_s: int) -> Iterator[None]:
    """`draftsmith serve ...` in its own process group, logging to `log`, until /health answers; on exit SIGTERM
    (draftsmith serve stops its vLLM), then SIGKILL to what is left of the group."""
    env = dict(os.environ, VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"))
    with processes.ChildProcess(argv, log=log, env=env, graces_s=(STOP_S,)) as server:
        if not server.wait_until(lambda: _healthy(port), timeout_s, 1.0):
            if server.poll() is not None:
                raise DraftsmithError(
                    f"evaluate --concurrency: `{' '.join(argv[2:])}` exited with status {server.poll()} "
                    f"before it served:\n{_tail(log)}\n(all of it: {log})"
                )
            raise DraftsmithError(f"evaluate --concurrency: no server after {timeout_s} s; see {log}")
        yield


def _healthy(port: int) -> bool:
    """The server at `port` answers /health."""
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def _tail(log: Path) -> str:
    return "\n".join(processes.log_lines(log)[-15:])
