"""A recording of what a target served (`draftsmith serve --record DIR`): the artefact `prepare --data DIR` trains
from and `draftsmith improve` splits, held out and proves on.

    DIR/                     0700, never shared: the recording holds users' requests
      manifest.json          kind "recording": its shards and the servers that wrote them
      shard-000001.jsonl     0600, one record per line, appended
      shard-000002.jsonl     ...

A record is a conversation as `prepare` reads one: `messages` (the history the client sent, then the target's answer
as the last assistant turn, its `reasoning_content`, `content` and `tool_calls` as the server's own parsers split
them), `tools`, `tool_choice`, `chat_template_kwargs`, and `recorded`: when (`time`), what (`endpoint`, `sampling`,
`finish_reason`, `usage`), for which target (`target`, its fingerprint) and the request's speculative-decoding
`acceptance` where the server's vLLM reports it per request (else null; the manifest says why once).

Durability. Each record is written and flushed when its response ends: a `kill -9` of the server loses only the
requests in flight. The open shard is fsync'd at least every FSYNC_S seconds and when it closes (a power cut loses
at most that much). A shard closes at SHARD_BYTES, or when the server stops, with its record count and sha256 in the
manifest; a shard a killed server left open is closed by the next server on DIR (counted as it is, never rewritten).
`max_bytes` bounds the shards together; reaching it, or a full disk, stops the recording in one line: the server
goes on serving.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel, Field

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import sha256_file
from draftsmith.core.manifest import MANIFEST_NAME, Manifest, read_manifest, write_manifest

KIND = "recording"
SHARD_BYTES = 64 << 20  # a shard closes (its checksum taken) past this size
FSYNC_S = 1.0  # the open shard is fsync'd at least this often while records arrive
SHARD_PATTERN = "shard-*.jsonl"


class ShardInfo(BaseModel):
    name: str
    records: int = 0  # lines that end in a newline (a killed server's last line may not)
    bytes: int = 0
    sha256: str | None = None  # None while a server writes it
    note: str = ""  # how it closed, where not by its own server


class ServerInfo(BaseModel):
    """One server's run on the recording: what it served and how it recorded."""

    started: str = Field(default_factory=lambda: _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"))
    target: str  # the target's fingerprint (`fingerprint`), as each of its records carries it
    target_path: str
    draft: str | None = None
    vllm: str = ""
    acceptance: str = ""  # how each request's acceptance is recorded, or why it is not
    sample: float = 1.0
    redactions: int = 0  # how many --record-redact patterns were applied (the patterns are not kept)
    stopped: str = ""  # why it stopped recording before the server stopped (a full disk, --record-max-gb)


class RecordingManifest(Manifest):
    kind: str = KIND
    shards: list[ShardInfo] = Field(default_factory=list)
    servers: list[ServerInfo] = Field(default_factory=list)


def fingerprint(config_hash: str, tokenizer_hash: str) -> str:
    """A target as its records name it: its config and tokenizer (the chat template with it)."""
    return hashlib.sha256(f"{config_hash}\n{tokenizer_hash}".encode()).hexdigest()[:16]


def _private_dir(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)


def check_directory(directory: Path) -> Path:
    """`directory` ready for a server to record into (made, 0700): refused in one line where it is not a recording
    and not empty (the recording never mixes with other files), or cannot be written."""
    directory = Path(directory).expanduser().resolve()
    if directory.exists() and not directory.is_dir():
        raise DraftsmithError(f"--record {directory}: is a file; give a directory for the recording")
    if directory.is_dir() and any(directory.iterdir()) and not is_recording(directory):
        raise DraftsmithError(
            f"--record {directory}: holds other files and no recording; give an empty or new directory, or an "
            "earlier recording to add to"
        )
    try:
        _private_dir(directory)
        if is_recording(directory):
            read_recording(directory)  # a damaged manifest is named now, not by the server
        probe = directory / ".draftsmith-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise DraftsmithError(f"--record {directory}: cannot write there ({os.strerror(err.errno or 5)})") from None
    return directory


def records_in(directory: Path) -> int:
    """The records the recording's shards hold (a shard still open counted by its lines; none before a server wrote
    its manifest)."""
    if not (Path(directory) / MANIFEST_NAME).is_file():
        return 0
    manifest = read_recording(directory)
    return sum(s.records if s.sha256 is not None else _lines(Path(directory) / s.name) for s in manifest.shards)


def _lines(path: Path) -> int:
    with contextlib.suppress(OSError), open(path, "rb") as f:
        return sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 20), b""))
    return 0


def is_recording(directory: Path) -> bool:
    try:
        return json.loads((directory / MANIFEST_NAME).read_text(encoding="utf-8")).get("kind") == KIND
    except (OSError, ValueError, AttributeError):
        return False


def read_recording(directory: Path) -> RecordingManifest:
    directory = Path(directory)
    if not directory.is_dir():
        what = "is a file, not a recording" if directory.exists() else "no such recording"
        raise DraftsmithError(f"{directory}: {what} (draftsmith serve --record DIR writes one)")
    if not (directory / MANIFEST_NAME).is_file():
        raise DraftsmithError(
            f"{directory}: not a recording (no {MANIFEST_NAME}; draftsmith serve --record writes one)"
        )
    return read_manifest(directory, RecordingManifest)


class RecordingWriter:
    """Appends records to a recording (one server's, from one thread); see the module for what survives what."""

    def __init__(
        self, directory: Path, server: ServerInfo, max_bytes: int | None = None, shard_bytes: int = SHARD_BYTES
    ):
        self.directory, self.max_bytes, self.shard_bytes = Path(directory), max_bytes, shard_bytes
        _private_dir(self.directory)
        existing = read_recording(self.directory) if (self.directory / MANIFEST_NAME).is_file() else None
        self.manifest = existing or RecordingManifest()
        for shard in self.manifest.shards:
            if shard.sha256 is None:  # left open by a server that did not stop: closed as it is
                self._seal(shard, note="closed by the next server (the one writing it stopped without closing it)")
        self.server = server
        self.manifest.servers.append(server)
        self.total = sum(s.bytes for s in self.manifest.shards)
        self.stopped = ""
        self.dropped = 0  # records that came after the recording stopped
        self._file: int | None = None
        self._shard: ShardInfo | None = None
        self._synced = time.monotonic()
        self._dirty = False
        self._open_shard()

    # -- shards
    def _open_shard(self) -> None:
        number = max((int(s.name[6:12]) for s in self.manifest.shards), default=0) + 1
        self._shard = ShardInfo(name=f"shard-{number:06d}.jsonl")
        path = self.directory / self._shard.name
        self._file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.manifest.shards.append(self._shard)
        write_manifest(self.directory, self.manifest)

    def _seal(self, shard: ShardInfo, note: str = "") -> None:
        path = self.directory / shard.name
        if path.is_file():
            shard.records, shard.bytes, shard.sha256 = _lines(path), path.stat().st_size, sha256_file(path)
        else:
            shard.records, shard.bytes, shard.sha256 = 0, 0, ""
            note = note or "missing"
        shard.note = note

    def _close_shard(self) -> None:
        if self._file is None or self._shard is None:
            return
        os.fsync(self._file)
        os.close(self._file)
        self._file = None
        self._seal(self._shard)
        write_manifest(self.directory, self.manifest)

    # -- records
    def append(self, record: dict) -> bool:
        """Write one record (False, and counted, once the recording has stopped)."""
        if self.stopped:
            self.dropped += 1
            return False
        line = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
        if self.max_bytes is not None and self.total + len(line) > self.max_bytes:
            self.stop(f"it reached --record-max-gb ({self.max_bytes / 2**30:g} GiB)")
            self.dropped += 1
            return False
        assert self._file is not None and self._shard is not None  # open until the recording stops
        try:
            written = os.write(self._file, line)
            if written != len(line):
                raise OSError(28, "No space left on device")
        except OSError as err:
            self.stop(f"writing {self.directory / self._shard.name} failed: {os.strerror(err.errno or 5)}")
            self.dropped += 1
            return False
        self.total += len(line)
        self._shard.bytes += len(line)
        self._dirty = True
        if self._shard.bytes >= self.shard_bytes:
            self._close_shard()
            self._open_shard()
        self.sync(every=FSYNC_S)
        return True

    def sync(self, every: float = 0.0) -> None:
        """fsync the open shard when it has unsynced records and `every` seconds have passed since the last."""
        if self._dirty and self._file is not None and time.monotonic() - self._synced >= every:
            os.fsync(self._file)
            self._synced, self._dirty = time.monotonic(), False

    def stop(self, why: str) -> None:
        """Stop recording (the server goes on): one line on stderr, the open shard closed."""
        self.stopped = why
        self.server.stopped = why
        print(
            f"draftsmith serve --record {self.directory}: {why}; recording stopped, the server goes on serving",
            file=sys.stderr,
            flush=True,
        )
        try:
            self._close_shard()
        except OSError:  # the disk that stopped it may refuse the manifest too: the shard is closed by the next server
            self._file = None

    def close(self) -> None:
        if not self.stopped:
            self._close_shard()


def skip_reason(record: dict, target: str | None) -> tuple[str, str] | None:
    """(counted reason, detail) where a recorded request is not one to train `target` on (its fingerprint), else
    None: a completions request (a raw prompt, no chat turns), or one another target answered."""
    recorded = record.get("recorded")
    if not isinstance(recorded, dict):
        return None
    if recorded.get("endpoint") == "completions":
        return "a completions request", "a raw prompt with no chat turns (prepare trains on chat requests)"
    if target is not None and recorded.get("target") != target:
        return "recorded for another target", f"target {recorded.get('target')!r}, not this target's {target!r}"
    return None


def shard_paths(directory: Path) -> list[Path]:
    return sorted(Path(directory).glob(SHARD_PATTERN))


def iter_records(directory: Path) -> Iterator[tuple[str, int, dict | None, str]]:
    """(shard, line number, record, why it is not one) for every line of every shard, in the order written; a
    record is None where its line does not parse (a killed server's cut last line) or is not a recorded conversation."""
    for path in shard_paths(directory):
        with open(path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                try:
                    data = json.loads(raw)
                except (UnicodeDecodeError, json.JSONDecodeError):
                    cut = not raw.endswith(b"\n")
                    yield path.name, number, None, "damaged tail (a server stopped mid-record)" if cut else "not JSON"
                    continue
                ok = isinstance(data, dict) and isinstance(data.get("recorded"), dict)
                ok = ok and ("messages" in data or "prompt" in data)
                yield path.name, number, data if ok else None, "" if ok else "not a recorded request"
