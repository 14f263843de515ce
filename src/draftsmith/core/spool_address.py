"""Where the online spool lives, parsed once from `--spool` (train) or the spool `draftsmith feed` serves.

    PATH                      DirectoryAddress: a directory on local disk or /dev/shm (every rank sees it)
    mooncake                  LocalMooncake: draftsmith starts a Mooncake master on loopback (one node)
    mooncake://HOST:PORT[/RUN] MooncakeAddress: a running master, and the prefix of this run's keys

The config parses it (a bad address is one line before anything starts); the trainer and the engine process match on
the type, never on the string.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from draftsmith.core.errors import DraftsmithError

SCHEME = "mooncake"
DEFAULT_RUN = "draftsmith"


@dataclass(frozen=True)
class DirectoryAddress:
    path: Path

    def __str__(self) -> str:
        return str(self.path)


@dataclass(frozen=True)
class LocalMooncake:
    """A master draftsmith starts on loopback for this run (the trainer's rank 0 owns it)."""

    def __str__(self) -> str:
        return SCHEME


@dataclass(frozen=True)
class MooncakeAddress:
    """mooncake://HOST:PORT/RUN: the master's RPC address and the run's key prefix."""

    host: str
    port: int
    run: str = DEFAULT_RUN

    @classmethod
    def parse(cls, text: str) -> MooncakeAddress:
        found = re.fullmatch(r"mooncake://([^:/]+):(\d+)(?:/([A-Za-z0-9._-]+))?/?", str(text))
        if not found:
            raise DraftsmithError(
                f"--spool {text}: expected mooncake://HOST:PORT[/RUN] (the Mooncake master's address "
                "and a run name), or mooncake to have draftsmith start a master on loopback"
            )
        return cls(found.group(1), int(found.group(2)), found.group(3) or DEFAULT_RUN)

    @property
    def master(self) -> str:
        return f"{self.host}:{self.port}"

    def __str__(self) -> str:
        return f"mooncake://{self.master}/{self.run}"


SpoolAddress = DirectoryAddress | LocalMooncake | MooncakeAddress


def parse_spool(text: str | Path) -> SpoolAddress:
    """`--spool` as one of the three kinds; a `mooncake:` address that does not parse is one line."""
    if isinstance(text, Path):
        return DirectoryAddress(text)
    if text == SCHEME:
        return LocalMooncake()
    if text.startswith(f"{SCHEME}:"):
        return MooncakeAddress.parse(text)
    return DirectoryAddress(Path(text))


def check_spool(value: str | None) -> str | None:
    """The configs' validator: a bad --spool is one line before anything starts; the text is kept as given."""
    if value is not None:
        parse_spool(value)
    return value
