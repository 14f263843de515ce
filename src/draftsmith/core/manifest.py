"""Self-describing artefacts: the pieces every manifest shares, and their JSON I/O.

Each artefact module (prepared.py, store.py, checkpoint.py, export.py) defines its own pydantic manifest
that embeds `TargetIdentity`; this module only knows how to put one on disk and read it back.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import platform
import socket
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from draftsmith import __version__
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import atomic_write_text

MANIFEST_NAME = "manifest.json"


class TargetIdentity(BaseModel):
    """What a target is, in enough detail to refuse inputs made for another one."""

    model_config = ConfigDict(extra="forbid")

    path: str
    architecture: str
    config_hash: str
    tokenizer_hash: str
    num_layers: int
    hidden_size: int
    vocab_size: int

    def mismatch(self, other: TargetIdentity) -> str | None:
        """The first field that makes two targets incompatible (path alone may differ), or None."""
        for field in ("config_hash", "tokenizer_hash", "num_layers", "hidden_size", "vocab_size"):
            a, b = getattr(self, field), getattr(other, field)
            if a != b:
                return f"{field} {a!r} != {b!r}"
        return None


class WriterInfo(BaseModel):
    draftsmith_version: str = __version__
    host: str = Field(default_factory=socket.gethostname)
    python: str = Field(default_factory=platform.python_version)
    created_at: str = Field(default_factory=lambda: _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"))


class Manifest(BaseModel):
    """Base of every artefact manifest: `kind` lets `draftsmith inspect` tell artefacts apart."""

    model_config = ConfigDict(extra="forbid")

    kind: str
    format_version: int = 1
    writer: WriterInfo = Field(default_factory=WriterInfo)


M = TypeVar("M", bound=Manifest)


def write_manifest(directory: Path, manifest: Manifest) -> None:
    atomic_write_text(Path(directory) / MANIFEST_NAME, manifest.model_dump_json(indent=2) + "\n")


def read_manifest_json(directory: Path) -> dict:
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise DraftsmithError(f"{directory}: not a draftsmith artefact (no {MANIFEST_NAME})")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DraftsmithError(f"{path}: manifest is not valid JSON ({err}); the artefact is damaged") from None


def check_replaceable(output: Path, kind: str, what: str) -> None:
    """Only an empty directory or an earlier artefact of this `kind` may be replaced at `output`: never delete a
    user's other files. `what` names the artefact in the error ("a prepared data set")."""
    output = Path(output)
    if not output.exists() or (output.is_dir() and not any(output.iterdir())):
        return
    if output.is_dir() and (output / MANIFEST_NAME).is_file():
        with contextlib.suppress(DraftsmithError):
            if read_manifest_json(output).get("kind") == kind:
                return
    raise DraftsmithError(
        f"{output}: exists and is not {what}; refusing to replace it. Choose another --output or remove it first"
    )


def read_manifest(directory: Path, cls: type[M]) -> M:
    data = read_manifest_json(directory)
    expected = cls.model_fields["kind"].default
    if expected and data.get("kind") != expected:
        raise DraftsmithError(f"{directory}: is a {data.get('kind')!r} artefact, expected {expected!r}")
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        where = f"field {loc}: " if loc else ""  # a model-level validator names no field
        raise DraftsmithError(
            f"{directory}/{MANIFEST_NAME}: {where}{first['msg']}; this {expected or 'artefact'} "
            "manifest is damaged or was not written by draftsmith"
        ) from None
