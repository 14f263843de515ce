"""Local TCP ports: one free to listen on, and whether something listens on one (the Mooncake master, a server)."""

from __future__ import annotations

import contextlib
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at `host` now (the OS's choice)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def accepts(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """Something accepts TCP connections at host:port."""
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout_s):
        return True
    return False
