"""`draftsmith serve --record` without vLLM: the recording (core/recording.py) and the ASGI middleware that fills it
(serve/record.py) in front of an app that answers as vLLM's API server does, JSON and server-sent events."""

from __future__ import annotations

import asyncio
import json
import os
import stat

import pytest

from draftsmith.core import recording
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import sha256_file
from draftsmith.serve import record

SERVER = recording.ServerInfo(target="t" * 16, target_path="/models/target", vllm="0.32.0", acceptance="per request")
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris? key sk-12345"}]
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
ACCEPTANCE = {
    "mean_acceptance_length": 2.5,
    "num_spec_steps": 4,
    "num_accepted_draft_tokens": 6,
    "num_draft_tokens": 12,
}


def _conversation(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}


def _recorded(i: int, target: str = "t" * 16) -> dict:
    return {**_conversation(i), "recorded": {"time": float(i), "endpoint": "chat", "target": target}}


def test_records_are_on_disk_as_written_private_and_rotated_shards_carry_their_checksums(tmp_path):
    where = tmp_path / "rec"
    writer = recording.RecordingWriter(where, SERVER, shard_bytes=300)
    for i in range(12):
        assert writer.append(_recorded(i))
        # each record reaches the file when written: a kill -9 now would keep it
        lines = sum(p.read_bytes().count(b"\n") for p in recording.shard_paths(where))
        assert lines == i + 1
    writer.close()
    assert stat.S_IMODE(where.stat().st_mode) == 0o700
    shards = recording.shard_paths(where)
    assert len(shards) > 2 and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in shards)
    manifest = recording.read_recording(where)
    assert [s.name for s in manifest.shards] == [p.name for p in shards]
    assert all(s.sha256 == sha256_file(where / s.name) for s in manifest.shards)
    assert sum(s.records for s in manifest.shards) == 12 == recording.records_in(where)
    read = [r for _, _, r, _ in recording.iter_records(where)]
    assert [r["messages"][0]["content"] for r in read] == [f"q{i}" for i in range(12)]


def test_a_shard_a_killed_server_left_open_is_closed_by_the_next_as_it_is(tmp_path):
    where = tmp_path / "rec"
    first = recording.RecordingWriter(where, SERVER)
    for i in range(3):
        first.append(_recorded(i))
    open_shard = recording.shard_paths(where)[0]
    with open(open_shard, "ab") as f:  # what a kill -9 mid-write leaves: a cut last line
        f.write(b'{"messages": [{"role": "us')
    before = open_shard.read_bytes()
    second = recording.RecordingWriter(where, SERVER)  # first never closed: killed
    second.append(_recorded(3))
    second.close()
    manifest = recording.read_recording(where)
    assert open_shard.read_bytes() == before  # never rewritten
    assert manifest.shards[0].records == 3 and "stopped without closing" in manifest.shards[0].note
    assert manifest.shards[0].sha256 == sha256_file(open_shard) and len(manifest.servers) == 2
    seen = list(recording.iter_records(where))
    assert [r is not None for _, _, r, _ in seen] == [True, True, True, False, True]
    assert "damaged tail" in seen[3][3]


def test_max_bytes_and_a_full_disk_stop_the_recording_in_one_line_and_count_what_followed(
    tmp_path, capsys, monkeypatch
):
    writer = recording.RecordingWriter(tmp_path / "a", SERVER, max_bytes=500)
    kept = sum(writer.append(_recorded(i)) for i in range(20))
    assert 0 < kept < 20 and writer.dropped == 20 - kept
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--record-max-gb" in err[0] and "the server goes on serving" in err[0]
    assert recording.read_recording(tmp_path / "a").servers[-1].stopped
    assert recording.records_in(tmp_path / "a") == kept

    writer = recording.RecordingWriter(tmp_path / "b", SERVER)
    assert writer.append(_recorded(0))

    def full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(recording.os, "write", full)
    assert not writer.append(_recorded(1)) and not writer.append(_recorded(2))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device" in err[0] and str(tmp_path / "b") in err[0]
    monkeypatch.undo()
    assert recording.records_in(tmp_path / "b") == 1 and writer.dropped == 2


def test_a_directory_that_holds_other_files_is_refused_before_the_server_starts(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(DraftsmithError, match="holds other files and no recording"):
        recording.check_directory(tmp_path / "mine")
    (tmp_path / "file").write_text("")
    with pytest.raises(DraftsmithError, match="is a file"):
        recording.check_directory(tmp_path / "file")
    assert recording.check_directory(tmp_path / "new") == (tmp_path / "new").resolve()
    writer = recording.RecordingWriter(tmp_path / "new", SERVER)
    writer.close()
    assert recording.check_directory(tmp_path / "new")  # an earlier recording: added to


# ------------------------------------------------------------------------------------------ the middleware


def _sse(*chunks: dict) -> list[bytes]:
    return [f"data: {json.dumps(c)}\n\n".encode() for c in chunks] + [b"data: [DONE]\n\n"]


def _chat_stream() -> list[bytes]:
    """How vLLM streams a reasoning answer that ends in a tool call (each piece a chunk)."""
    pieces = [
        {"role": "assistant", "content": ""},
        {"reasoning_content": "The user wants "},
        {"reasoning": "the weather."},
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "weather"}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
    ]
    chunks = [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in pieces]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    chunks.append({"choices": [], "usage": {"completion_tokens": 9}, "metrics": {"speculative_decoding": ACCEPTANCE}})
    return _sse(*chunks)


def _chat_json() -> list[bytes]:
    message = {"role": "assistant", "content": "Sunny.", "reasoning": "Look it up.", "reasoning_content": "Look it up."}
    message["tool_calls"] = []
    body = {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}], "usage": {"completion_tokens": 3}}
    return [json.dumps(body).encode()]


def _completion() -> list[bytes]:
    return [json.dumps({"choices": [{"index": 0, "text": " world", "finish_reason": "length"}]}).encode()]


class FakeServer:
    """An ASGI app that answers as vLLM's API server does: `answers[path]`, in pieces; 400 for a body saying so."""

    def __init__(self):
        self.answers = {"/v1/chat/completions": _chat_json, "/v1/completions": _completion}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                pass
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body)
        status = 400 if request.get("bad") else 200
        pieces = _chat_stream() if request.get("stream") else self.answers[scope["path"]]()
        pieces = [b"<html>not an answer</html>"] if request.get("garbage") else pieces
        await send({"type": "http.response.start", "status": status, "headers": []})
        for i, piece in enumerate(pieces):
            await send({"type": "http.response.body", "body": piece, "more_body": i < len(pieces) - 1})


def _post(app, path: str, payload: dict, seen=None) -> bytes:
    """POST `payload` to `app`; `seen(piece)` is called with each piece of the answer as the client gets it."""
    data = json.dumps(payload).encode()
    halves = [data[: len(data) // 2], data[len(data) // 2 :]]  # a body in two messages
    got = bytearray()

    async def receive():
        piece = halves.pop(0)
        return {"type": "http.request", "body": piece, "more_body": bool(halves)}

    async def send(message):
        got.extend(message.get("body", b""))
        if seen is not None:
            seen(message.get("body", b""))

    asyncio.run(app({"type": "http", "method": "POST", "path": path}, receive, send))
    return bytes(got)


def _shutdown(app) -> None:
    messages = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]

    async def receive():
        return messages.pop(0)

    async def send(message):
        pass

    asyncio.run(app({"type": "lifespan"}, receive, send))


@pytest.fixture
def recorded_app(tmp_path, monkeypatch):
    def make(**options):
        where = tmp_path / "rec"
        config = record.options(str(where), SERVER, options.get("max_gb"), options.get("redact", []), 1.0)
        monkeypatch.setenv(record.ENV, config)
        return record.RecordMiddleware(FakeServer()), where

    return make


def test_every_answered_request_is_one_conversation_as_the_servers_parsers_split_it(recorded_app):
    app, where = recorded_app(redact=[r"sk-[0-9]+"])
    plain = _post(app, "/v1/chat/completions", {"model": "m", "messages": ASK, "temperature": 0.7})
    assert json.loads(plain)["choices"][0]["message"]["content"] == "Sunny."  # the client's answer untouched
    streamed = _post(app, "/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "stream": True, "max_tokens": 64})
    assert streamed.count(b"data:") == 9 and streamed.endswith(b"data: [DONE]\n\n")
    _post(app, "/v1/completions", {"prompt": "Hello", "max_tokens": 1})
    _post(app, "/v1/chat/completions", {"messages": ASK, "bad": True})  # refused by the server: nothing recorded
    _shutdown(app)  # the writer drains and closes its shard
    records = [r for _, _, r, _ in recording.iter_records(where)]
    assert len(records) == 3 and recording.read_recording(where).shards[0].sha256
    chat, stream, completion = records
    assert chat["messages"][:-1] == [ASK[0], {"role": "user", "content": "Weather in Paris? key [redacted]"}]
    assert chat["messages"][-1] == {"role": "assistant", "content": "Sunny.", "reasoning_content": "Look it up."}
    assert chat["recorded"]["sampling"] == {"temperature": 0.7} and chat["recorded"]["finish_reason"] == "stop"
    assert chat["recorded"]["target"] == SERVER.target and chat["recorded"]["acceptance"] is None
    said = stream["messages"][-1]
    assert said["reasoning_content"] == "The user wants the weather." and said["content"] == ""
    assert said["tool_calls"] == [CALL] and stream["tools"] == TOOLS
    assert stream["recorded"]["acceptance"] == ACCEPTANCE and stream["recorded"]["finish_reason"] == "tool_calls"
    assert stream["recorded"]["sampling"] == {"max_tokens": 64, "stream": True}
    assert completion["prompt"] == "Hello" and completion["completion"] == " world"
    assert chat["recorded"]["time"] <= stream["recorded"]["time"] <= completion["recorded"]["time"]
    assert b"sk-12345" not in b"".join(p.read_bytes() for p in recording.shard_paths(where))


def test_without_the_option_the_middleware_passes_requests_through_untouched(tmp_path, monkeypatch):
    monkeypatch.delenv(record.ENV, raising=False)
    app = record.RecordMiddleware(FakeServer())
    assert app.recorder is None
    assert json.loads(_post(app, "/v1/completions", {"prompt": "Hi"}))["choices"][0]["text"] == " world"
    assert not any(tmp_path.iterdir())


def test_sampling_keeps_about_the_fraction_asked(tmp_path, monkeypatch):
    where = tmp_path / "rec"
    monkeypatch.setenv(record.ENV, record.options(str(where), SERVER, None, [], 0.25))
    app = record.RecordMiddleware(FakeServer())
    record.random.seed(0)
    for _ in range(200):
        _post(app, "/v1/completions", {"prompt": "Hi"})
    _shutdown(app)
    kept = recording.records_in(where)
    assert 30 <= kept <= 70, kept
    assert recording.read_recording(where).servers[0].sample == 0.25


def test_the_middleware_files_are_private_even_under_a_permissive_umask(recorded_app):
    previous = os.umask(0)
    try:
        app, where = recorded_app()
        _post(app, "/v1/completions", {"prompt": "Hi"})
        _shutdown(app)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(where.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in where.iterdir())


# ------------------------------------------------------------------------------------------ prepare --data DIR


def test_prepare_reads_a_recording_and_counts_what_it_cannot_train_on(tmp_path, tiny_target_dir):
    from draftsmith.config import PrepareConfig
    from draftsmith.core.targets import target_identity
    from draftsmith.prepare.dataset import open_prepared
    from draftsmith.prepare.stage import run

    identity = target_identity(tiny_target_dir)
    ours = recording.fingerprint(identity.config_hash, identity.tokenizer_hash)
    where = tmp_path / "rec"
    writer = recording.RecordingWriter(where, SERVER.model_copy(update={"target": ours}))
    for i in range(4):
        writer.append(_recorded(i, target=ours))
    writer.append(_recorded(4, target="another target"))
    writer.append({"prompt": "Hi", "completion": " there", "recorded": {"endpoint": "completions", "target": ours}})
    shard = recording.shard_paths(where)[0]
    with open(shard, "ab") as f:  # a killed server's cut last line
        f.write(b'{"messages": [{"role": "user", "content": "q')
    before = {p.name: p.read_bytes() for p in where.iterdir()}
    result = run(PrepareConfig(data=[str(where)], target=str(tiny_target_dir), output=tmp_path / "out", num_workers=1))
    assert result.summary["conversations"] == 4
    skipped = open_prepared(tmp_path / "out").manifest.skipped
    assert skipped == {
        "recorded for another target": 1,
        "a completions request": 1,
        "damaged tail (file cut off mid-record)": 1,
    }, skipped
    assert {p.name: p.read_bytes() for p in where.iterdir()} == before  # read, never altered


def test_a_recorded_requests_own_template_options_render_it(tmp_path):
    from conftest import CHATML_TEMPLATE, build_tiny_tokenizer

    from draftsmith.prepare.chat import ChatEncoder
    from draftsmith.prepare.messages import normalize_conversation

    template = "{% if brief %}BRIEF {% endif %}" + CHATML_TEMPLATE
    encoder = ChatEncoder(build_tiny_tokenizer(template))
    plain = normalize_conversation(_recorded(0))
    brief = normalize_conversation({**_recorded(0), "chat_template_kwargs": {"brief": True}})
    assert brief.template_kwargs == {"brief": True} and plain.template_kwargs is None
    (said_plain,), (said_brief,) = encoder.generations(plain), encoder.generations(brief)
    assert said_brief.text == "BRIEF " + said_plain.text


def test_record_flags_repeat_and_bad_ones_are_one_line(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from draftsmith import cli
    from draftsmith.config import StageResult

    seen = []

    def fake_run(cfg):
        seen.append(cfg)
        return StageResult(stage="serve", output=tmp_path, summary={})

    monkeypatch.setattr(cli, "_runner", lambda name: fake_run)
    runner = CliRunner()
    args = ["serve", str(tmp_path), "--record", str(tmp_path / "rec"), "--record-redact", "sk-[a-z]{2,8}"]
    done = runner.invoke(cli.app, [*args, "--record-redact", r"\d{3}-\d{4}", "--record-sample", "0.5"])
    assert done.exit_code == 0, done.output
    assert seen[0].record_redact == ["sk-[a-z]{2,8}", r"\d{3}-\d{4}"] and seen[0].record_sample == 0.5
    for bad, says in (
        (["--record-redact", "("], "is not a regular expression"),
        (["--record-sample", "0.5"], "need --record DIR"),
    ):
        plain = ["serve", str(tmp_path), *(["--record", str(tmp_path / "rec")] if "(" in bad else []), *bad]
        done = runner.invoke(cli.app, plain)
        assert done.exit_code == 1 and says in done.output and "Traceback" not in done.output, done.output


@pytest.mark.parametrize("release", ["0.32.0", "0.16.0"])
def test_serve_record_loads_the_middleware_and_asks_for_acceptance_where_vllm_reports_it(
    tmp_path, tiny_target_dir, monkeypatch, release
):
    pytest.importorskip("vllm")  # the probe reads the installed release's source; its facts are then set per release
    from conftest import random_eagle3_export

    from draftsmith import serve
    from draftsmith.config import ServeConfig
    from draftsmith.core.targets import target_identity

    draft = random_eagle3_export(tiny_target_dir, tmp_path / "draft", (1, 2, 3))
    real = serve.probe
    per_request = release == "0.32.0"
    facts = {"version": release, "per_request_spec_metrics": per_request, "per_request_spec_steps": per_request}
    facts["api_middleware"] = True

    def probe(**kw):
        report = real(**kw)
        return report.model_copy(update={"facts": report.facts.model_copy(update=facts)})

    seen = {}
    monkeypatch.setattr(serve, "probe", probe)
    monkeypatch.setattr(serve, "check_vllm_can_serve", lambda target, what, **kw: None)
    monkeypatch.setattr(serve, "serve_until_stopped", lambda command, env: seen.update(argv=command, env=env) or 0)
    result = serve.run(ServeConfig(draft=draft, record=tmp_path / "rec", record_redact=["x"]))
    argv, options = seen["argv"], json.loads(seen["env"][record.ENV])
    assert argv[argv.index("--middleware") + 1] == "draftsmith.serve.record.RecordMiddleware"
    assert argv[argv.index("--api-server-count") + 1] == "1"  # the recording's one writer, with data parallelism too
    assert ("--per-request-spec-decode-metrics" in argv) == per_request
    if per_request:
        assert argv[argv.index("--per-request-spec-decode-metrics") + 1] == "detailed"
    identity = target_identity(tiny_target_dir)
    server = options["server"]
    assert server["target"] == recording.fingerprint(identity.config_hash, identity.tokenizer_hash)
    assert server["vllm"] == release and server["draft"] == str(draft)
    assert server["acceptance"].startswith("per request" if per_request else "not recorded: vLLM 0.16.0")
    assert options["redact"] == ["x"]
    assert options["directory"] == str((tmp_path / "rec").resolve())
    assert stat.S_IMODE((tmp_path / "rec").stat().st_mode) == 0o700 and "0 records" in result.summary["output"]
    with pytest.raises(DraftsmithError, match="asks for 2 API server processes; one writes the recording"):
        serve.run(ServeConfig(draft=draft, record=tmp_path / "rec", vllm_args="--api-server-count=2"))
    monkeypatch.setenv("VLLM_USE_RUST_FRONTEND", "1")
    with pytest.raises(DraftsmithError, match="Rust front end, which loads no --middleware"):
        serve.run(ServeConfig(draft=draft, record=tmp_path / "rec"))
    monkeypatch.delenv("VLLM_USE_RUST_FRONTEND")
    facts["api_middleware"] = False  # a release whose API server takes no middleware: one line, no server
    seen.clear()
    with pytest.raises(DraftsmithError, match=f"vLLM {release}'s API server takes no --middleware"):
        serve.run(ServeConfig(draft=draft, record=tmp_path / "rec"))
    assert not seen


def test_an_answer_the_recorder_cannot_read_is_said_once_and_the_client_still_gets_it(recorded_app, capfd):
    app, where = recorded_app()
    assert _post(app, "/v1/completions", {"prompt": "Hi", "garbage": True}) == b"<html>not an answer</html>"
    assert json.loads(_post(app, "/v1/completions", {"prompt": "Hi"}))["choices"][0]["text"] == " world"
    _shutdown(app)
    assert "a completions answer could not be recorded" in capfd.readouterr().err
    assert recording.records_in(where) == 1


def test_a_stream_is_on_disk_before_its_client_sees_done_and_a_client_gone_then_loses_nothing(recorded_app):
    app, where = recorded_app()
    on_disk_at_done = []

    def seen(piece: bytes) -> None:
        if b"[DONE]" in piece:
            on_disk_at_done.append(recording.records_in(where))
            raise asyncio.CancelledError  # the client has what it needs and goes away

    with pytest.raises(asyncio.CancelledError):
        _post(app, "/v1/chat/completions", {"messages": ASK, "stream": True}, seen)
    assert on_disk_at_done == [1]
    _post(app, "/v1/completions", {"prompt": "Hi"})  # the writer lives on
    _shutdown(app)
    assert recording.records_in(where) == 2
