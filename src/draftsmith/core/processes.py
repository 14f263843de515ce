"""Stopping a child that leads a process group of its own (a server started with start_new_session=True, whose
engine and workers are in its group): SIGTERM to the leader, again after each grace period it outlives, and then
SIGKILL to whatever is left of the group, so nothing of it outlives the caller."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence

__all__ = ["kill_group", "stop_group", "terminate"]


def terminate(proc: subprocess.Popen, graces_s: Sequence[float]) -> None:
    """SIGTERM to the leader, and again after each grace period it is still running (a server may lose a signal that
    comes while it starts); a Ctrl-C during a wait skips to the next one."""
    for grace in graces_s:
        if proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            continue


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL whatever is left in the leader's process group, then reap the leader."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def stop_group(proc: subprocess.Popen, graces_s: Sequence[float]) -> None:
    """terminate, then kill_group."""
    terminate(proc, graces_s)
    kill_group(proc)
