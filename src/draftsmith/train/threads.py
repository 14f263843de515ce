"""OpenMP's wait policy for training, chosen before torch loads (draftsmith/train/__init__.py applies it): sleep
(PASSIVE) when other processes are running on the machine at start, OpenMP's default (spin a while, then sleep)
on an otherwise idle CPU. No torch import here: OpenMP reads its settings once, when torch loads it."""

import os
import sys
import time


def _others_running(samples: int = 5, interval_s: float = 0.01) -> int | None:
    """Other runnable tasks on this machine now (the median over a few samples of /proc/stat's procs_running,
    less this process), or None where /proc/stat cannot be read."""
    seen = []
    for i in range(samples):
        try:
            with open("/proc/stat", encoding="ascii") as f:
                seen += [int(line.split()[1]) for line in f if line.startswith("procs_running")]
        except (OSError, ValueError, IndexError):
            return None
        if i + 1 < samples:
            time.sleep(interval_s)
    return max(0, sorted(seen)[len(seen) // 2] - 1) if seen else None


def _choose_wait_policy() -> tuple[str | None, str]:
    if "OMP_WAIT_POLICY" in os.environ:
        return None, f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']} (set by the environment)"
    if "torch" in sys.modules:
        return None, "OpenMP's default (torch was loaded before draftsmith.train)"
    others = _others_running()
    if others is None or others > 0:
        why = "state unknown" if others is None else f"{others} other runnable task{'s' * (others != 1)} at start"
        return "PASSIVE", f"idle OpenMP threads sleep ({why})"
    return None, "idle OpenMP threads spin a while, then sleep (CPU idle at start)"


WAIT_POLICY_SET, WAIT_POLICY = _choose_wait_policy()  # (what to set, or None; the one-phrase reason)
