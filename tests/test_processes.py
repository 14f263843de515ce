"""core/processes.py: a child in its own process group, logging to a file, waited for, stopped with grace periods and
then SIGKILL to its group, and the one line of its log that says why it failed (tiny `python -c` children)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from draftsmith.core import processes
from draftsmith.core.processes import ChildProcess


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    """`pid` no longer runs (killed and reaped; a zombie not yet reaped by init counts as gone)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_child_runs_in_its_own_group_and_is_waited_for_until_ready(tmp_path):
    ready, log = tmp_path / "ready", tmp_path / "child.log"
    code = f"import os, time; print('starting', flush=True); time.sleep(0.3); open({str(ready)!r}, 'w').write(''); "
    code += "time.sleep(60)"
    with ChildProcess(_python(code), log=log) as child:
        assert os.getpgid(child.proc.pid) == child.proc.pid != os.getpgid(0)  # the leader of a group of its own
        assert child.wait_until(ready.exists, timeout_s=30, every_s=0.05)
        assert child.poll() is None
        assert processes.log_lines(log)[-5:] == ["starting"]
    assert child.poll() is not None  # stopped on the way out of the context
    child.stop()  # once: a second stop does nothing


def test_waiting_ends_when_the_child_exits_or_the_time_is_up(tmp_path):
    with ChildProcess(_python("import sys; sys.exit(3)"), log=tmp_path / "a.log") as child:
        assert not child.wait_until(lambda: False, timeout_s=60, every_s=0.05)
        assert child.poll() == 3
    started = time.monotonic()
    with ChildProcess(_python("import time; time.sleep(60)"), log=tmp_path / "b.log") as child:
        assert not child.wait_until(lambda: False, timeout_s=0.3, every_s=0.05)
        assert child.poll() is None and time.monotonic() - started < 30


def test_the_failure_line_is_the_last_error_that_is_not_a_raise_or_pydantics_link(tmp_path):
    log = tmp_path / "worker.log"
    lines = [
        "INFO starting the engine",
        "RuntimeError: the first error",
        "Traceback (most recent call last):",
        "    raise ValueError(msg)",
        "ValueError: 1 validation error for EngineArgs",
        "    For further information visit https://errors.pydantic.dev/2.11/v/value_error",
        "",
        "   ",
    ]
    code = f"import sys; print({chr(10).join(lines)!r}); sys.exit(1)"
    with ChildProcess(_python(code), log=log) as child:
        assert child.wait(30) == 1
    assert processes.failure_line(log) == "ValueError: 1 validation error for EngineArgs"
    assert processes.log_lines(log)[-2:] == lines[4:6]  # blank lines are not lines of a tail
    log.write_text("loading weights\n" + "x" * 400 + "\n\n")  # no error named: the last line, cut at 300 characters
    assert processes.failure_line(log) == "x" * 300
    assert processes.failure_line(tmp_path / "missing.log") == "" and processes.log_lines(None) == []


def test_a_child_appends_to_its_log_and_a_piped_one_logs_its_stderr_only(tmp_path):
    log = tmp_path / "append.log"
    log.write_text("before\n")
    with ChildProcess(_python("print('after')"), log=log, append=True) as child:
        child.wait(30)
    assert log.read_text().split() == ["before", "after"]
    echo = "import sys; print('to the log', file=sys.stderr, flush=True); print(input().upper(), flush=True)"
    with ChildProcess(_python(echo), log=tmp_path / "pipe.log", pipes=True) as child:
        assert child.proc.stdin is not None and child.proc.stdout is not None
        child.proc.stdin.write("hello\n")
        child.proc.stdin.flush()
        assert child.proc.stdout.readline() == "HELLO\n"
        assert child.wait(30) == 0
    assert (tmp_path / "pipe.log").read_text() == "to the log\n"


# The leader ignores the first SIGTERM (as vLLM's server may while it starts) and its grandchild ignores every one.
STUBBORN = """
import os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                                "open(%r, 'w').write('up'); time.sleep(600)"])
open(%r, "w").write(str(child.pid))
terms = []
signal.signal(signal.SIGTERM, lambda *a: terms.append(1) if len(terms) < %d else sys.exit(0))
time.sleep(600)
"""


@pytest.mark.parametrize("lost", [1, 5])
def test_stop_sends_sigterm_again_after_each_grace_then_sigkills_the_group(tmp_path, lost):
    """Lost once: the second SIGTERM stops the leader; lost every time: SIGKILL after the graces. Either way the
    grandchild that ignores SIGTERM goes with the group."""
    up, pid_file = tmp_path / "up", tmp_path / "grandchild.pid"
    child = ChildProcess(_python(STUBBORN % (str(up), str(pid_file), lost)), log=tmp_path / "stubborn.log")
    assert child.wait_until(lambda: up.exists() and pid_file.exists(), timeout_s=60, every_s=0.05)
    time.sleep(0.2)  # the leader's handler is set after it writes the pid
    started = time.monotonic()
    child.stop((0.5, 0.5))
    took = time.monotonic() - started
    assert child.poll() == (0 if lost == 1 else -9)  # 0: the second SIGTERM stopped it, not SIGKILL
    assert (took >= 1.0 if lost > 1 else True) and took < 30  # lost every time: both graces waited out
    assert _gone(int(pid_file.read_text()))


# A child that starts a grandchild in a group of its own, bound to its life (as the Mooncake master is to the trainer).
PARENT = """
import sys, time
from draftsmith.core.processes import ChildProcess, die_with_parent
grandchild = ChildProcess([sys.executable, "-c", "import time; time.sleep(600)"], preexec_fn=die_with_parent)
print(grandchild.proc.pid, flush=True)
time.sleep(600)
"""


def test_a_child_bound_to_its_parent_dies_with_it_even_by_sigkill(tmp_path):
    log = tmp_path / "parent.log"
    parent = ChildProcess(_python(PARENT), log=log)
    assert parent.wait_until(lambda: bool(processes.log_lines(log)), timeout_s=60, every_s=0.05)
    grandchild = int(processes.log_lines(log)[0])
    assert os.getpgid(grandchild) != parent.proc.pid  # not in the parent's group: SIGKILL to that group misses it
    parent.stop(())
    assert parent.poll() == -9 and _gone(grandchild)
