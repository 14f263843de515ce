"""`draftsmith serve --record DIR`: every request the server answers, written with what training needs.

`RecordMiddleware` is an ASGI middleware that vLLM's own API server loads (`vllm serve --middleware
draftsmith.serve.record.RecordMiddleware`); `draftsmith serve` hands it its options in DRAFTSMITH_RECORD. For each
POST to /v1/chat/completions or /v1/completions that the server answers with 200 (and that `--record-sample` keeps),
it keeps the request body and the response body (a JSON answer, or the server-sent events of a stream) as they pass,
and when the response ends hands both to a writer thread. That thread builds the record: the client's messages, then
the target's answer as the server's own parsers split it (`reasoning_content`, `content`, `tool_calls`), the finish
reason, the usage and, where vLLM reports it per request, the request's speculative-decoding acceptance
(`metrics.speculative_decoding`; a stream carries it only when the client asks for usage). `--record-redact` patterns
replace what they match in every text before anything is written. The recording itself is core/recording.py.

The server's event loop does no parsing and no I/O for the recording: it waits (without blocking) for the writer
thread to have written a request's records before it passes on the response's last piece, so an answer a client has
whole is on disk, and a `kill -9` of the server loses only requests still in flight. At shutdown (ASGI lifespan) the
writer drains its queue and closes the open shard.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import queue
import random
import re
import sys
import threading
import time
import traceback
import uuid
from concurrent.futures import Future, InvalidStateError
from typing import Any

from draftsmith.core.recording import FSYNC_S, RecordingWriter, ServerInfo

ENV = "DRAFTSMITH_RECORD"  # the options draftsmith serve hands the server process (JSON)
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
DONE = b"data: [DONE]"  # the last event of a stream
REDACTED = "[redacted]"
SAMPLING_KEYS: tuple[str, ...] = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens")
SAMPLING_KEYS += ("n", "seed", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
SAMPLING_KEYS += ("response_format", "stream")
CHAT_KEYS = ("tools", "tool_choice", "chat_template_kwargs", "chat_template", "add_generation_prompt")


def options(directory: str, server: ServerInfo, max_gb: float | None, redact: list[str], sample: float) -> str:
    """The DRAFTSMITH_RECORD value for these --record options."""
    max_bytes = int(max_gb * 2**30) if max_gb is not None else None
    payload = {"directory": directory, "server": server.model_dump(), "max_bytes": max_bytes, "redact": redact}
    return json.dumps({**payload, "sample": sample})


# ------------------------------------------------------------------------------------ the target's answer


def _merge_delta(choice: dict, delta: dict) -> None:
    """One streamed chunk's delta (or a whole message) added to its choice's answer so far. vLLM names the reasoning
    `reasoning`; 0.11 sends `reasoning_content` beside it with the same text: one of them is taken."""
    if isinstance(delta.get("content"), str):
        choice["content"] = choice.get("content", "") + delta["content"]
    reasoning = next((delta[k] for k in ("reasoning", "reasoning_content") if isinstance(delta.get(k), str)), None)
    if reasoning is not None:
        choice["reasoning_content"] = choice.get("reasoning_content", "") + reasoning
    for call in delta.get("tool_calls") or []:
        calls = choice.setdefault("tool_calls", [])
        index = call.get("index", len(calls))
        while len(calls) <= index:
            calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        into = calls[index]
        into["id"] = call.get("id") or into["id"]
        into["type"] = call.get("type") or into["type"]
        function = call.get("function") or {}
        into["function"]["name"] += function.get("name") or ""
        into["function"]["arguments"] += function.get("arguments") or ""


def _events(body: bytes) -> list[dict]:
    """The JSON payloads of a server-sent event stream (`data: {...}` lines; `[DONE]` ends it)."""
    out = []
    for line in body.decode("utf-8", errors="replace").splitlines():
        if line.startswith("data:") and (data := line[5:].strip()) and data != "[DONE]":
            out.append(json.loads(data))
    return out


def answer(endpoint: str, body: bytes, streamed: bool) -> tuple[list[dict], dict]:
    """(one answer per choice, the response's `usage` and `metrics`) from the server's response body. A chat answer
    is an assistant message; a completion's is {"text": ...}; each carries its `finish_reason`."""
    chunks = _events(body) if streamed else [json.loads(body)]
    choices: dict[int, dict] = {}
    extra: dict = {}
    for chunk in chunks:
        for key in ("usage", "metrics"):
            if chunk.get(key):
                extra[key] = chunk[key]
        for c in chunk.get("choices") or []:
            choice = choices.setdefault(c.get("index", 0), {})
            if c.get("finish_reason"):
                choice["finish_reason"] = c["finish_reason"]
            if endpoint == "completions":
                choice["text"] = choice.get("text", "") + (c.get("text") or "")
            elif streamed:
                _merge_delta(choice, c.get("delta") or {})
            else:
                message = c.get("message") or {}
                _merge_delta(choice, {k: v for k, v in message.items() if k != "tool_calls"})
                choice["tool_calls"] = message.get("tool_calls") or []
    return [choices[i] for i in sorted(choices)], extra


def records(endpoint: str, request: dict, body: bytes, when: float, target: str) -> list[dict]:
    """The records of one answered request: one per choice."""
    streamed = bool(request.get("stream"))
    answers, extra = answer(endpoint, body, streamed)
    acceptance = (extra.get("metrics") or {}).get("speculative_decoding")
    request_id = uuid.uuid4().hex
    out = []
    for index, choice in enumerate(answers):
        recorded = {
            "id": request_id,
            "choice": index,
            "time": when,
            "endpoint": endpoint,
            "target": target,
            "model": request.get("model"),
            "sampling": {k: request[k] for k in SAMPLING_KEYS if k in request},
            "finish_reason": choice.pop("finish_reason", None),
            "usage": extra.get("usage"),
            "acceptance": acceptance if len(answers) == 1 else None,
        }
        if endpoint == "completions":
            out.append({"prompt": request.get("prompt"), "completion": choice.get("text", ""), "recorded": recorded})
            continue
        said = {"role": "assistant", "content": choice.get("content") or ""}
        if choice.get("reasoning_content"):
            said["reasoning_content"] = choice["reasoning_content"]
        if choice.get("tool_calls"):
            said["tool_calls"] = choice["tool_calls"]
        record = {"messages": [*request.get("messages", []), said]}
        record.update({k: request[k] for k in CHAT_KEYS if request.get(k) is not None})
        out.append({**record, "recorded": recorded})
    return out


def redact(value: Any, patterns: list[re.Pattern[str]]) -> Any:
    """`value` with every match of `patterns` in its texts (keys aside) replaced."""
    if isinstance(value, str):
        for pattern in patterns:
            value = pattern.sub(REDACTED, value)
        return value
    if isinstance(value, list):
        return [redact(v, patterns) for v in value]
    if isinstance(value, dict):
        return {k: redact(v, patterns) for k, v in value.items()}
    return value


# ------------------------------------------------------------------------------------ the writer thread


class Recorder:
    """The recording's writer thread: requests in through `submit` (from the event loop), records out to disk."""

    def __init__(self, config: dict):
        self.patterns = [re.compile(p) for p in config.get("redact") or []]
        self.sample = float(config.get("sample", 1.0))
        self.server = ServerInfo.model_validate({**config["server"], "sample": self.sample})
        self.server.redactions = len(self.patterns)
        self.writer = RecordingWriter(config["directory"], self.server, config.get("max_bytes"))
        self.queue: queue.Queue[tuple[str, bytes, bytes, float, Future] | None] = queue.Queue()
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="draftsmith-record", daemon=True)
        self.thread.start()
        atexit.register(self.close)

    def sampled(self) -> bool:
        return self.sample >= 1.0 or random.random() < self.sample

    def submit(self, endpoint: str, request: bytes, response: bytes) -> Future:
        """Hand one answered request to the writer; the future is done once its records are written (or refused)."""
        done: Future = Future()
        if self.closed or not self.thread.is_alive():  # shut down: the response is not held for it
            done.set_result(0)
        else:
            self.queue.put((endpoint, request, response, time.time(), done))
        return done

    def _run(self) -> None:
        while True:
            try:
                item = self.queue.get(timeout=FSYNC_S)
            except queue.Empty:
                self._quietly(self.writer.sync)
                continue
            if item is None:
                return
            endpoint, request, response, when, done = item
            written = 0
            try:
                for record in records(endpoint, json.loads(request), response, when, self.server.target):
                    self._quietly(self.writer.append, redact(record, self.patterns) if self.patterns else record)
                    written += 1
            except Exception:  # noqa: BLE001 - an answer this version cannot read: said, and the server goes on
                print(f"draftsmith serve --record: a {endpoint} answer could not be recorded:", file=sys.stderr)
                traceback.print_exc()
            finally:
                with contextlib.suppress(InvalidStateError):  # the response it holds goes on either way
                    done.set_result(written)

    def _quietly(self, call, *args) -> None:
        try:
            call(*args)
        except OSError as err:  # fsync or the manifest on a failing disk: the recording stops, the server does not
            if not self.writer.stopped:
                self.writer.stop(f"{os.strerror(err.errno or 5)} ({err})")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.queue.put(None)  # after every request handed in: the writer drains them first
        self.thread.join(timeout=60)
        self._quietly(self.writer.close)


class RecordMiddleware:
    """ASGI middleware (vLLM's --middleware) that hands each answered request to the recording (see the module)."""

    def __init__(self, app: Any):
        self.app = app
        config = os.environ.get(ENV)
        self.recorder = Recorder(json.loads(config)) if config else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        recorder = self.recorder
        if recorder is None:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "lifespan":

            async def lifespan_receive() -> dict:
                message = await receive()
                if message["type"] == "lifespan.shutdown":
                    recorder.close()
                return message

            await self.app(scope, lifespan_receive, send)
            return
        endpoint = ENDPOINTS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if endpoint is None or scope.get("method") != "POST" or not recorder.sampled():
            await self.app(scope, receive, send)
            return
        request, response, status, handed = bytearray(), bytearray(), [0], [False]

        async def keep_request() -> dict:
            message = await receive()
            if message["type"] == "http.request":
                request.extend(message.get("body", b""))
            return message

        async def keep_response(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body" and status[0] == 200 and not handed[0]:
                body = message.get("body", b"")
                response.extend(body)
                if not message.get("more_body") or body.rstrip().endswith(DONE):  # a stream's end: [DONE]
                    handed[0] = True  # on disk before the client has the whole answer (shielded: a client that
                    # goes away does not take the record with it)
                    await asyncio.shield(
                        asyncio.wrap_future(recorder.submit(endpoint, bytes(request), bytes(response)))
                    )
            await send(message)

        await self.app(scope, keep_request, keep_response)
