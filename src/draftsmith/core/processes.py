"""A child process draftsmith starts and owns (a host of vLLM, vLLM's load generator, the Mooncake master): in a
process group of its own (its engine and workers join it), its output in a log file; stopped by SIGTERM to the leader,
again after each grace period it outlives (a server may lose a signal that comes while it starts), then SIGKILL to
whatever is left of the group, so nothing of it outlives the caller. Why it failed is one line of its log."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path


class ChildProcess:
    """`argv` started in its own process group with `env` (None: this process's), its output written to `log` (or
    appended: `append`; None: this process's terminal) and nothing on its stdin; with `pipes`, its stdin and stdout are
    text pipes from this process (`proc.stdin`, `proc.stdout`) and its stderr alone goes to `log`. As a context, it
    is stopped on the way out after `graces_s`."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        log: Path | None = None,
        env: Mapping[str, str] | None = None,
        append: bool = False,
        pipes: bool = False,
        graces_s: Sequence[float] = (),
        preexec_fn: Callable[[], None] | None = None,
    ):
        self.graces_s, self._stopped = tuple(graces_s), False
        with open(log, "ab" if append else "wb") if log is not None else contextlib.nullcontext() as out:
            self.proc = subprocess.Popen(
                list(argv),
                env=None if env is None else dict(env),
                stdin=subprocess.PIPE if pipes else subprocess.DEVNULL if out is not None else None,
                stdout=subprocess.PIPE if pipes else out,
                stderr=out if pipes or out is None else subprocess.STDOUT,
                encoding="utf-8" if pipes else None,
                start_new_session=True,
                preexec_fn=preexec_fn,
            )

    def __enter__(self) -> ChildProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def poll(self) -> int | None:
        """Its exit status, None while it runs."""
        return self.proc.poll()

    def wait(self, timeout_s: float | None = None) -> int:
        """Its exit status once it exits (subprocess.TimeoutExpired after `timeout_s`)."""
        return self.proc.wait(timeout_s)

    def wait_until(self, ready: Callable[[], bool], timeout_s: float, every_s: float) -> bool:
        """Ask `ready` every `every_s` until it says yes (True), or until the child exits or `timeout_s` passes
        (False: `poll()` tells which)."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(every_s)
        return True

    def stop(self, graces_s: Sequence[float] | None = None) -> None:
        """SIGTERM to the leader, again after each grace period (`graces_s`, else the child's) it is still running (a
        Ctrl-C during a wait skips to the next one), then SIGKILL to whatever is left of its group; the leader reaped.
        Once: a second call does nothing."""
        if self._stopped:
            return
        self._stopped = True
        for grace in self.graces_s if graces_s is None else graces_s:
            if self.proc.poll() is not None:
                break
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired, KeyboardInterrupt):
                self.proc.wait(grace)
        with contextlib.suppress(OSError):  # nothing left of the group
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send this process `sig` when its parent dies, even by SIGKILL (Linux: prctl PR_SET_PDEATHSIG;
    elsewhere nothing), so a child is never left running on its own."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, sig)


def log_lines(log: Path | None) -> list[str]:
    """The non-blank lines of a child's log (none where it has none, or it cannot be read)."""
    with contextlib.suppress(OSError):
        if log is not None:
            return [line for line in log.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    return []


def failure_line(log: Path | None) -> str:
    """Why a child failed, as its log says: the last line naming an error (not a `raise` line of a traceback, not
    pydantic's link to its error pages), else the last line; at most 300 characters."""
    lines = log_lines(log)
    errors = [x for x in lines if "rror" in x and "errors.pydantic.dev" not in x and not x.lstrip().startswith("raise")]
    return (errors or lines or [""])[-1].strip()[:300]
