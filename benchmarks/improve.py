"""What `draftsmith improve` gains on traffic its draft never saw, proven in real vLLM.

    python benchmarks/improve.py --draft runs/quickstart/export --prompts humaneval --requests 40 \
        --output /tmp/bench/improve --improve-args "--max-steps 150 --lr 1e-3 --token-budget 1024"

1. `draftsmith serve DRAFT --record OUTPUT/recording`; an OpenAI client sends --requests chat requests of --prompts
   (any prompt set `evaluate --prompts` names: a domain the draft was not trained on), --concurrency at a time,
   greedy, at most --max-tokens each, every other one streamed.
2. `draftsmith improve --draft DRAFT --recording OUTPUT/recording --output OUTPUT/improve --engine vllm`: both drafts
   proven on the newest requests, in vLLM, the gate for each.

Prints τ of both drafts with their intervals and the decision; the last line is JSON. tests/test_improve_vllm.py
runs the same path on a small scale (and kills the server mid-traffic).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

SERVE_ARGS = ["--dtype", "float32", "--kv-cache-gb", "1", "--max-model-len", "1024"]
VLLM_ARGS = "--enforce-eager --max-num-seqs 4"


def start_server(draft: Path, recording: Path, port: int, log: Path, timeout_s: float = 900) -> subprocess.Popen:
    """`draftsmith serve DRAFT --record RECORDING` on `port`, once it answers /health."""
    argv = [sys.executable, "-m", "draftsmith", "serve", str(draft), "--port", str(port), "--record", str(recording)]
    argv += [*SERVE_ARGS, "--vllm-args", VLLM_ARGS]
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
    with open(log, "a") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"draftsmith serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        health = f"http://127.0.0.1:{port}/health"
        with (
            contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError),
            urllib.request.urlopen(health, timeout=5) as response,
        ):
            if response.status == 200:
                return proc
        time.sleep(1)
    stop(proc)
    raise RuntimeError(f"draftsmith serve did not come up in {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> int:
    """SIGTERM to draftsmith serve (it stops vLLM and closes the recording), SIGKILL to its group if it hangs."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=150)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def api_server_pid(proc: subprocess.Popen) -> int:
    """vLLM's API server: the child of draftsmith serve that runs the recording's middleware."""
    import psutil

    for child in psutil.Process(proc.pid).children(recursive=True):
        if "draftsmith.serve.server" in " ".join(child.cmdline()):
            return child.pid
    raise RuntimeError("no vLLM API server under draftsmith serve")


def ask(port: int, request: tuple, max_tokens: int, stream: bool) -> str:
    """One chat request through the OpenAI client; the answer's text."""
    import openai

    _, messages, tools, options = request
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=600, max_retries=0)
    model = client.models.list().data[0].id
    extra = {"chat_template_kwargs": options} if options else {}
    kwargs = dict(model=model, messages=messages, temperature=0, max_tokens=max_tokens, extra_body=extra)
    if tools:
        kwargs["tools"] = tools
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content or ""
    pieces = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    return "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)


def send(port: int, requests: list[tuple], concurrency: int, max_tokens: int, kill=None) -> tuple[list[int], int]:
    """Send `requests`, `concurrency` at a time: (the indices answered, how many were in flight when `kill` ran).
    `kill(answered)`: called after each answer; True once it has killed the server (the rest then fail)."""
    answered: list[int] = []
    in_flight_at_kill = -1
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        pending = {pool.submit(ask, port, r, max_tokens, i % 2 == 1): i for i, r in enumerate(requests)}
        for future in concurrent.futures.as_completed(pending):
            try:
                future.result()
            except Exception:  # noqa: BLE001 - a request the killed server never answered
                continue
            answered.append(pending[future])
            if in_flight_at_kill < 0 and kill is not None and kill(len(answered)):
                in_flight_at_kill = sum(1 for f in pending if f.running())
    return answered, max(in_flight_at_kill, 0)


def improve(draft: Path, recording: Path, out: Path, extra: list[str]) -> tuple[Path, dict]:
    """`draftsmith improve` to the end; its last round's directory and state."""
    argv = [sys.executable, "-m", "draftsmith", "improve", "--draft", str(draft), "--recording", str(recording)]
    argv += ["--output", str(out), "--engine", "vllm", *extra]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"draftsmith improve failed ({done.returncode}):\n{done.stderr[-4000:]}")
    last = sorted((out / "rounds").glob("[0-9][0-9][0-9]"))[-1]
    return last, json.loads((last / "state.json").read_text())


def taus(round_dir: Path, k: int) -> dict[str, dict]:
    """Both drafts' τ, interval and acceptance per position at k on the held-out requests."""
    out = {}
    for name in ("current", "candidate"):
        report = json.loads((round_dir / f"eval-{name}" / "report.json").read_text())
        run = next(r for r in report["runs"] if r["k"] == k)
        out[name] = {key: run.get(key) for key in ("tau", "tau_95", "acceptance_per_pos", "num_prompts", "by_segment")}
    return out


def main() -> None:
    from draftsmith.core.net import free_port
    from draftsmith.evaluate.prompts import requests

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", type=Path, required=True, help="the current draft: an export")
    parser.add_argument("--prompts", default="humaneval", help="what the traffic asks (evaluate --prompts)")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--improve-args", default="", help="more `draftsmith improve` options, one string")
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    recording, port = args.output / "recording", free_port()
    traffic = requests(args.prompts, args.requests)
    t0 = time.perf_counter()
    server = start_server(args.draft, recording, port, args.output / "serve.log")
    try:
        answered, _ = send(port, traffic, args.concurrency, args.max_tokens)
    finally:
        stop(server)
    served_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    round_dir, state = improve(args.draft, recording, args.output / "improve", args.improve_args.split())
    improve_s = time.perf_counter() - t0
    k = next(iter(json.loads((round_dir / "eval-current" / "report.json").read_text())["runs"]))["k"]
    measured = taus(round_dir, k)
    for name, m in measured.items():
        lo, hi = m["tau_95"] or (float("nan"), float("nan"))
        print(f"{name:>9}: τ {m['tau']:.3f} [{lo:.3f}, {hi:.3f}] on {m['num_prompts']} held-out requests (k={k})")
    decided = state["finished"]["decide"]
    print(f"decision: {decided['promoted'] or 'kept the current draft'} ({decided['why']})")
    result = {
        "prompts": args.prompts,
        "requests": len(traffic),
        "answered": len(answered),
        "served_s": round(served_s, 1),
        "improve_s": round(improve_s, 1),
        "steps": {step: done["seconds"] for step, done in state["finished"].items()},
        "k": k,
        "tau": {name: m["tau"] for name, m in measured.items()},
        "tau_95": {name: m["tau_95"] for name, m in measured.items()},
        "promoted": decided["promoted"],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
