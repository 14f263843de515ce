"""Read conversation records from ShareGPT JSON, JSON Lines, parquet / arrow files and `datasets` directories.

Every reader yields `Record`s in file order. A record that cannot be read (a bad JSON line, the damaged tail of
a file cut off mid-record) is yielded as a `Record` whose `bad` says why, so the caller counts it; nothing is
dropped silently. Problems that make a whole input unusable (missing file, mixed formats, a JSON array with a
syntax error in the middle) raise DraftsmithError naming the file and record.

JSON arrays are parsed as a stream of records, so a 100 MB file is never held as one Python object and a file
cut off mid-record keeps every complete record before the cut.
"""

from __future__ import annotations

import codecs
import glob
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from draftsmith.core import recording
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.manifest import MANIFEST_NAME
from draftsmith.prepare import bfcl
from draftsmith.prepare.messages import SURROGATE, TURN_KEYS, Chat, Skip, json_kind, normalize_conversation

FORMAT_OF_SUFFIX = {".json": "json", ".jsonl": "json", ".ndjson": "json", ".parquet": "parquet", ".arrow": "arrow"}
DAMAGED_TAIL = "damaged tail (file cut off mid-record)"
_CHUNK = 1 << 22


@dataclass
class Record:
    source: str  # the file (or dataset directory) it came from
    index: int  # 0-based record index within that source
    data: Any = None  # the parsed record (None when bad)
    bad: str | None = None  # counted reason when the record could not be read
    detail: str = ""  # one line saying exactly what was wrong
    offset: int | None = None  # bytes of the source consumed so far (for progress), when known


@dataclass
class Skips:
    """The records that did not become conversations: a count and the first example of each reason, and every
    damaged input tail."""

    skipped: dict[str, int] = field(default_factory=dict)
    skip_examples: dict[str, str] = field(default_factory=dict)
    damaged: list[str] = field(default_factory=list)

    def skip(self, reason: str, where: str, detail: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        self.skip_examples.setdefault(reason, f"{where}: {detail}")
        if reason == DAMAGED_TAIL:
            self.damaged.append(f"{where}: {detail}")


@dataclass
class Source:
    path: Path
    format: str  # "json" (array or lines), "parquet", "arrow", "dataset" (a `datasets.save_to_disk` directory)

    @property
    def files(self) -> list[Path]:
        """The file, or every file under the directory (a `datasets` directory), sorted."""
        return [self.path] if self.path.is_file() else sorted(p for p in self.path.rglob("*") if p.is_file())

    @property
    def size(self) -> int:
        return sum(p.stat().st_size for p in self.files)


def _directory_sources(directory: Path) -> list[Source]:
    if (directory / "state.json").is_file() and (directory / "dataset_info.json").is_file():  # datasets.save_to_disk
        return [Source(directory, "dataset")]
    files = sorted(
        p
        for p in directory.rglob("*")
        if p.is_file()
        and p.suffix.lower() in FORMAT_OF_SUFFIX
        and not any(part.startswith(".") for part in p.relative_to(directory).parts)
        and p != directory / MANIFEST_NAME
    )  # an artefact's own manifest (`draftsmith regenerate`'s set)
    if not files:
        kind = _artefact_kind(directory)
        raise DraftsmithError(
            f"{directory}: "
            + (
                f"is a draftsmith {kind!r} artefact, not conversations; --data takes JSON / JSONL / parquet / arrow files "
                "or a directory of them"
                if kind
                else "no .json / .jsonl / .parquet / .arrow files in this directory"
            )
        )
    by_format: dict[str, list[Path]] = {}
    for f in files:
        by_format.setdefault(FORMAT_OF_SUFFIX[f.suffix.lower()], []).append(f)
    if len(by_format) > 1:
        counts = ", ".join(f"{len(v)} {k}" for k, v in sorted(by_format.items()))
        raise DraftsmithError(
            f"{directory}: directory mixes formats ({counts} files); keep one format per directory, or list the "
            f"files you mean comma-separated in --data"
        )
    ((fmt, paths),) = by_format.items()
    return [Source(p, fmt) for p in paths]


def _artefact_kind(directory: Path) -> str | None:
    """The `kind` of the draftsmith artefact `directory` is (its manifest.json), if it is one."""
    try:
        kind = json.loads((directory / MANIFEST_NAME).read_text(encoding="utf-8")).get("kind")
    except (OSError, ValueError, AttributeError):
        return None
    return str(kind) if kind else None


NAMED_BFCL = "bfcl-multi-turn"  # prepare/bfcl.py: BFCL's multi-turn tool-use tasks as conversations


def expand_sources(specs: Sequence[str | Path]) -> list[Source]:
    """Files, directories, glob patterns and named data sets (`bfcl-multi-turn`) -> the input files, each with its
    format. Raises for missing paths."""
    sources: list[Source] = []
    for spec in specs:
        text = str(spec)
        if text in bfcl.SPLITS:  # a named data set, built into the cache on first use
            sources.append(Source(bfcl.conversations_path(text), "json"))
            continue
        pattern = any(c in text for c in "*?[")
        paths = sorted(Path(p) for p in glob.glob(text, recursive=True)) if pattern else [Path(text).expanduser()]
        if not paths:
            raise DraftsmithError(f"{text}: no file matches this pattern")
        for path in paths:
            if path.is_dir():
                sources.extend(_directory_sources(path))
            elif path.is_file():
                sources.append(Source(path, FORMAT_OF_SUFFIX.get(path.suffix.lower(), "json")))
            elif not path.exists():
                raise DraftsmithError(f"{path}: input file does not exist")
            else:
                raise DraftsmithError(f"{path}: not a regular file or directory")
    return sources


def chats_after(
    sources: list[Source],
    skip_records: int,
    leading_assistant: str,
    keep_trailing: bool = False,
    target: str | None = None,
) -> Iterator[tuple[Source, Record, Chat | Skip]]:
    """(source, record, its conversation normalised, or the Skip that counts it) for every record of every source,
    in order, past the first `skip_records` (those already in the shards of an interrupted run). A recorded request
    (`draftsmith serve --record`) that `target` (a fingerprint) did not answer is skipped, counted."""
    seen = 0
    for source in sources:
        for record in iter_source(source):
            seen += 1
            if seen <= skip_records:
                continue
            if record.bad is not None:
                yield source, record, Skip(record.bad, record.detail)
                continue
            if isinstance(record.data, dict) and (why := recording.skip_reason(record.data, target)):
                yield source, record, Skip(*why)
                continue
            try:
                chat: Chat | Skip = normalize_conversation(record.data, leading_assistant, keep_trailing=keep_trailing)
            except Skip as skip:
                chat = skip
            yield source, record, chat


def iter_source(source: Source) -> Iterator[Record]:
    if source.format == "json":
        return _iter_json(source.path)
    if source.format == "parquet":
        return _iter_parquet(source.path)
    return _iter_datasets(source)


# ------------------------------------------------------------------------------------------------ JSON


def _decoder():
    # surrogateescape keeps going past bytes that are not UTF-8; the record holding them is then skipped by
    # normalize_conversation ("not valid UTF-8") instead of failing the whole file.
    return codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")


def _iter_json(path: Path) -> Iterator[Record]:
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed by the `with f` below, once open is known to have worked
    except OSError as err:
        raise DraftsmithError(f"{path}: cannot open ({err.strerror})") from None
    with f:
        head = f.read(_CHUNK)
        text = _decoder().decode(head, final=False).lstrip("\ufeff \t\r\n")
        if not text:
            raise DraftsmithError(f"{path}: file is empty")
        f.seek(0)
        if text[0] == "[":
            yield from _iter_json_array(path, f)
        elif text[0] == "{" and _looks_like_json_lines(text):
            yield from _iter_json_lines(path, f)
        elif text[0] == "{":
            yield from _iter_json_document(path, f)
        else:
            raise DraftsmithError(
                f"{path}: {_not_json_reason(head, text)}; expected a JSON array of conversations or JSON Lines (UTF-8)"
            )


_UTF16_32_BOMS = {
    codecs.BOM_UTF32_LE: "UTF-32",
    codecs.BOM_UTF32_BE: "UTF-32",
    codecs.BOM_UTF16_LE: "UTF-16",
    codecs.BOM_UTF16_BE: "UTF-16",
}  # UTF-32 LE starts like UTF-16 LE: checked first


def _not_json_reason(head: bytes, text: str) -> str:
    """Why a file that starts with neither '[' nor '{' is not read, in a few words."""
    encoding = next((name for bom, name in _UTF16_32_BOMS.items() if head.startswith(bom)), None)
    if encoding:
        return f"file is {encoding} text; convert it to UTF-8 (iconv -f {encoding} -t UTF-8)"
    if b"\0" in head[:1024] or SURROGATE.search(text[:1024]):
        return f"not a text file (starts with bytes {head[:8].hex(' ')})"
    first = text.split("\n", 1)[0].strip()
    try:
        value = json.loads(first)
    except ValueError:
        return f"invalid JSON (the text starts with {first[:40]!r})"
    return f"holds a JSON {json_kind(value)} ({first[:40]!r}), not a list of conversations"


def _looks_like_json_lines(text: str) -> bool:
    """Does one of the first few lines hold a whole JSON object (JSON Lines, even with a damaged first line)?"""
    lines = [line.strip() for line in text.split("\n", 6)[:6] if line.strip()]
    for line in lines[:5]:
        try:
            if isinstance(json.loads(line), dict):
                return True
        except json.JSONDecodeError:
            continue
    return False


def _iter_json_document(path: Path, f) -> Iterator[Record]:
    """One JSON object spread over many lines: a single conversation, or an object holding one list of them
    (e.g. {"data": [...]})."""
    try:
        doc = json.loads(f.read().decode("utf-8", errors="surrogateescape"))
    except json.JSONDecodeError as err:
        raise DraftsmithError(
            f"{path}: record 0: invalid JSON at line {err.lineno} column {err.colno}: {err.msg}"
        ) from None
    if any(k in doc for k in TURN_KEYS):
        yield Record(str(path), 0, doc)
        return
    lists = [k for k, v in doc.items() if isinstance(v, list) and v and all(isinstance(r, dict) for r in v)]
    if len(lists) != 1:
        raise DraftsmithError(
            f"{path}: a JSON object that is neither a conversation nor holds one list of them "
            f"(keys: {', '.join(map(str, doc))}); expected a JSON array of conversations "
            "or JSON Lines"
        )
    for index, record in enumerate(doc[lists[0]]):
        yield Record(str(path), index, record)


def _iter_json_lines(path: Path, f) -> Iterator[Record]:
    index = 0
    offset = 0
    for line_no, raw in enumerate(f, start=1):
        offset += len(raw)
        line = raw.decode("utf-8", errors="surrogateescape").strip().lstrip("\ufeff")
        if not line:
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as err:
            if not raw.endswith(b"\n") and line_no > 1:  # the file was cut off in its last line
                bad, detail = DAMAGED_TAIL, f"line {line_no} (the last) is cut off: {err.msg}"
            else:
                bad, detail = "invalid JSON", f"line {line_no}: {err.msg} at column {err.colno}"
            yield Record(str(path), index, bad=bad, offset=offset, detail=detail)
        else:
            yield Record(str(path), index, data, offset=offset)
        index += 1


_PARTIAL_VALUE = re.compile(r"\s*(t(r(ue?)?)?|f(a(l(se?)?)?)?|n(u(ll?)?)?|[-+0-9.eE]*)\s*")


def _runs_out(err: json.JSONDecodeError, buf: str) -> bool:
    """Did the parser stop because the text ended (more may follow), rather than at a real syntax error?"""
    if err.msg.startswith("Unterminated string"):
        return True
    rest = buf[err.pos :]
    if err.msg.startswith("Invalid \\uXXXX escape") and len(rest) <= 6:
        return True
    return _PARTIAL_VALUE.fullmatch(rest) is not None


class _ArrayText:
    """A JSON array file's text, read a chunk at a time: the buffer, the position in it, what was read so far."""

    def __init__(self, f) -> None:
        self.f = f
        self.text_decoder = _decoder()
        self.buf = ""
        self.pos = 0
        self.consumed_chars = 0  # characters dropped from the front of buf
        self.eof = False
        self.bytes_read = 0

    def more(self) -> bool:
        """Read the next chunk onto the buffer (re-based on pos); False at end of input."""
        if self.eof:
            return False
        chunk = self.f.read(_CHUNK)
        self.bytes_read += len(chunk)
        if not chunk:
            self.eof = True
            self.buf += self.text_decoder.decode(b"", final=True)
            return False
        self.buf = self.buf[self.pos :] + self.text_decoder.decode(chunk)
        self.consumed_chars += self.pos
        self.pos = 0
        return True

    def skip_ws(self) -> bool:
        """Advance past whitespace; False at end of input."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n\ufeff":
                self.pos += 1
            if self.pos < len(self.buf):
                return True
            if not self.more():
                return False

    def value(self, decoder: json.JSONDecoder, record: str) -> tuple[object, int | None]:
        """The JSON value at pos and None, or None and the characters present of one the file's end cut off;
        `record` names it in the error for a real syntax error."""
        start = self.pos
        while True:
            try:
                data, self.pos = decoder.raw_decode(self.buf, start)
                return data, None
            except json.JSONDecodeError as err:
                near_end = _runs_out(err, self.buf)
                if near_end and self.more():
                    start = self.pos  # `more` re-based the buffer on pos
                    continue
                if near_end:  # and at end of file: the record was cut off
                    return None, len(self.buf) - start
                raise DraftsmithError(
                    f"{record}: invalid JSON at character {self.consumed_chars + err.pos}: {err.msg}"
                ) from None

    def trim(self) -> None:
        """Keep the buffer small: drop what was read."""
        if self.pos > _CHUNK:
            self.buf = self.buf[self.pos :]
            self.consumed_chars += self.pos
            self.pos = 0


def _iter_json_array(path: Path, f) -> Iterator[Record]:
    """Stream the elements of a top-level JSON array, keeping every complete one of a file cut off mid-way."""
    decoder = json.JSONDecoder()
    text = _ArrayText(f)

    def cut(index: int, detail: str) -> Record:
        return Record(str(path), index, bad=DAMAGED_TAIL, offset=text.bytes_read, detail=detail)

    text.skip_ws()
    text.pos += 1  # the opening "["
    index = 0
    while True:
        if not text.skip_ws():
            yield cut(index, f"file ends at byte {text.bytes_read} without closing the array after record {index - 1}")
            return
        ch = text.buf[text.pos]
        if ch == "]":
            return
        if index:  # a comma between records
            if ch != ",":
                raise DraftsmithError(
                    f"{path}: record {index}: invalid JSON at character {text.consumed_chars + text.pos}: expected "
                    f"',' or ']' between records, found {ch!r}"
                )
            text.pos += 1
            if not text.skip_ws():
                yield cut(index, f"file ends at byte {text.bytes_read} right after record {index - 1}")
                return
        data, lost = text.value(decoder, f"{path}: record {index}")
        if lost is not None:
            yield cut(
                index,
                f"cut off by the end of the file at byte {text.bytes_read} ({lost} characters of the record present)",
            )
            return
        yield Record(str(path), index, data, offset=max(0, text.bytes_read - (len(text.buf) - text.pos)))
        index += 1
        text.trim()


# ------------------------------------------------------------------------------------------------ parquet / arrow


def _iter_parquet(path: Path) -> Iterator[Record]:
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise DraftsmithError(f"{path}: not a readable parquet file ({err})".replace("\n", " ")) from None
    rows = (row for batch in pf.iter_batches(batch_size=1024) for row in batch.to_pylist())
    for index, row in enumerate(rows):
        yield Record(str(path), index, row)


def _iter_datasets(source: Source) -> Iterator[Record]:
    try:
        import datasets
    except ImportError:
        raise DraftsmithError(
            f"{source.path}: reading a `datasets` directory or file needs the `datasets` package, "
            "which is not installed: pip install datasets (or draftsmith[datasets])"
        ) from None

    try:
        if source.format == "dataset":
            ds = datasets.load_from_disk(str(source.path))
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds:
                    raise DraftsmithError(
                        f"{source.path}: a DatasetDict without a 'train' split "
                        f"(splits: {', '.join(ds)}); point --data at one split's directory"
                    )
                ds = ds["train"]
        else:
            ds = datasets.Dataset.from_file(str(source.path))
    except DraftsmithError:
        raise
    except Exception as err:  # noqa: BLE001 - `datasets` raises many types for an unreadable file
        raise DraftsmithError(
            f"{source.path}: `datasets` cannot read this ({type(err).__name__}: {err})".replace("\n", " ")
        ) from None
    for index, row in enumerate(ds):
        yield Record(str(source.path), index, row)
