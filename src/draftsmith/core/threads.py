"""OpenMP's wait policy for training, chosen by `draftsmith train` before torch loads (cli.py calls `choose`, imports
the stage, then `release`); nothing is sampled at import.

With other processes running (sampled from /proc/stat's procs_running), idle threads sleep (PASSIVE): on a CPU shared
with other work, spinning threads wait for each other's time slices at every parallel region, and a training step
ran about 3x slower on this project's busy 2-core machines. On an otherwise idle CPU OpenMP keeps its default (a
thread spins a while before it sleeps): there PASSIVE costs every one of the step's few thousand parallel regions a
wake-up, about 30 % of a step on a 2-core Xeon (docs/benchmarks.md). An OMP_WAIT_POLICY the environment sets is
kept. The variable is removed again once torch has read it, so processes started later (vLLM) keep their own
defaults. It changes no result, only waiting; `WAIT_POLICY` says what and why (train prints it). No torch import
here: OpenMP reads its settings once, when torch loads it."""

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
        return None, "OpenMP's default (torch was already loaded)"
    others = _others_running()
    if others is None or others > 0:
        why = "state unknown" if others is None else f"{others} other runnable task{'s' * (others != 1)} at start"
        return "PASSIVE", f"idle OpenMP threads sleep ({why})"
    return None, "idle OpenMP threads spin a while, then sleep (CPU idle at start)"


WAIT_POLICY = "OpenMP's default (draftsmith.train used without the CLI)"  # the one-phrase reason train prints
_set: str | None = None


def choose() -> None:
    """Set OMP_WAIT_POLICY for the torch this process is about to load (see the module docstring)."""
    global WAIT_POLICY, _set
    _set, WAIT_POLICY = _choose_wait_policy()
    if _set:
        os.environ["OMP_WAIT_POLICY"] = _set


def release() -> None:
    """After torch has loaded: the variable goes, so processes started later keep their own defaults."""
    if _set and os.environ.get("OMP_WAIT_POLICY") == _set:
        del os.environ["OMP_WAIT_POLICY"]
