"""The loop in real vLLM: a draft trained on chat serves code with `--record`, its server is killed mid-traffic, and
`draftsmith improve` on what was recorded promotes a draft that accepts more on the newest requests, proven in vLLM
(benchmarks/improve.py runs the same path at a larger scale)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
from pathlib import Path

import pytest

from draftsmith.core import recording
from draftsmith.core.net import free_port

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
_spec = importlib.util.spec_from_file_location("bench_improve", Path(__file__).parents[1] / "benchmarks" / "improve.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)  # type: ignore[union-attr]

REQUESTS, KILL_AFTER, CONCURRENCY, MAX_TOKENS = 24, 16, 2, 40


@pytest.fixture(scope="module")
def chat_draft(trained_run, tmp_path_factory) -> Path:
    """The small draft trained on ShareGPT chat (conftest.trained_run), exported at k = 3."""
    from draftsmith import export
    from draftsmith.config import ExportConfig

    out = tmp_path_factory.mktemp("chat-draft") / "export"
    export.run(ExportConfig(checkpoint=trained_run, output=out, format="vllm", speculative_tokens=3))
    return out


def test_a_recording_survives_kill_9_and_improve_promotes_a_draft_vllm_proves_better(chat_draft, tmp_path):
    pytest.importorskip("openai")
    pytest.importorskip("psutil")
    pytest.importorskip("vllm")
    from draftsmith.evaluate.prompts import requests

    code = requests("humaneval", REQUESTS)  # a domain the chat draft never saw
    where, log = tmp_path / "recording", tmp_path / "serve.log"
    port = free_port()
    server = bench.start_server(chat_draft, where, port, log)
    try:
        api = bench.api_server_pid(server)

        def kill(answered: int) -> bool:
            if answered < KILL_AFTER:
                return False
            os.kill(api, signal.SIGKILL)  # vLLM's API server, and the recording's writer with it
            return True

        first, in_flight = bench.send(port, code, CONCURRENCY, MAX_TOKENS, kill=kill)
        assert server.wait(timeout=120) != 0  # draftsmith serve goes down with its server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    recorded_first = recording.records_in(where)
    # every answer a client got is on disk; of the requests in flight, at most those
    assert len(first) <= recorded_first <= len(first) + in_flight, (len(first), recorded_first, in_flight)
    rest = [r for i, r in enumerate(code) if i not in set(first)]  # what the client sends again, to the next server
    server = bench.start_server(chat_draft, where, port, log)  # which closes the shard the killed one left open
    try:
        second, _ = bench.send(port, rest, CONCURRENCY, MAX_TOKENS)
    finally:
        assert bench.stop(server) == 0, log.read_text()[-3000:]
    assert len(second) == len(rest)
    manifest = recording.read_recording(where)
    assert all(s.sha256 for s in manifest.shards) and "stopped without closing" in manifest.shards[0].note
    assert recording.records_in(where) == recorded_first + len(rest)  # N, where no request was cut in flight
    assert "per request" in manifest.servers[0].acceptance  # vLLM 0.32 reports each request's acceptance
    read = [r for _, _, r, _ in recording.iter_records(where) if r is not None]
    assert sum(r["recorded"]["acceptance"] is not None for r in read) >= len(read) // 2  # the streamed: with usage

    round_dir, state = bench.improve(
        chat_draft,
        where,
        tmp_path / "improve",
        ["--held-out", "0.34", "--max-steps", "100", "--lr", "1e-3", "--token-budget", "1024"]
        + ["--max-new-tokens", str(MAX_TOKENS)],
    )
    decided = state["finished"]["decide"]
    taus = bench.taus(round_dir, 3)
    assert decided["promoted"] == "v2", (decided, taus)
    before, after = taus["current"], taus["candidate"]
    assert after["tau_95"][0] > before["tau_95"][1] and before["num_prompts"] >= 8, taus
    assert os.readlink(tmp_path / "improve" / "current") == "v2"
    for name in ("eval-current", "eval-candidate"):
        report = json.loads((round_dir / name / "report.json").read_text())
        assert report["gate"]["passed"], (name, report["gate"])
        # the target alone decoded once, for both drafts' speed-up: in the current draft's proof
        assert (report["baseline"] is not None) == (name == "eval-current"), name
