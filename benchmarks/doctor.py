"""`draftsmith doctor` of this tree against a baseline tree (default: commit de881ea, before the probe read vLLM's
source instead of importing it), side by side in one run, rounds alternating.

Each run is `python -m draftsmith.cli doctor` in a fresh process of this venv with PYTHONPATH set to one tree's
src/ (the baseline is checked out with `git worktree` into a temporary directory and removed after). Per run: the
wall time and the number of vLLM log lines (`INFO`/`WARNING` with vLLM's prefix) in what doctor printed.

    python benchmarks/doctor.py [--baseline de881ea] [--rounds 3]

Last line: JSON with the median seconds of each side, their ratio, the log lines per side and the load averages.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from baseline import REPO, baseline_tree

VLLM_LOG = re.compile(r"\b(INFO|WARNING|DEBUG) \d\d-\d\d \d\d:\d\d:\d\d ")


def run_doctor(src: Path) -> tuple[float, int]:
    env = dict(os.environ, PYTHONPATH=str(src))
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "draftsmith.cli", "doctor"], env=env, capture_output=True, text=True, cwd=src.parent
    )
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"doctor failed in {src}: {done.stderr.strip().splitlines()[-1:]}")
    return elapsed, len(VLLM_LOG.findall(done.stdout + done.stderr))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="de881ea")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"ours": [], "baseline": []}
    logs: dict[str, int] = {}
    with baseline_tree(args.baseline) as base:
        for _ in range(args.rounds):
            for side, src in (("ours", REPO / "src"), ("baseline", base / "src")):
                seconds, lines = run_doctor(src)
                times[side].append(seconds)
                logs[side] = max(logs.get(side, 0), lines)
                print(f"{side}: {seconds:.1f} s, {lines} vLLM log lines", flush=True)
    ours, baseline = statistics.median(times["ours"]), statistics.median(times["baseline"])
    print(
        json.dumps(
            {
                "doctor_s_ours": round(ours, 2),
                "doctor_s_baseline": round(baseline, 2),
                "speedup": round(baseline / ours, 2),
                "baseline": args.baseline,
                "rounds": args.rounds,
                "vllm_log_lines_ours": logs["ours"],
                "vllm_log_lines_baseline": logs["baseline"],
                "times": times,
                "load_avg": os.getloadavg(),
            }
        )
    )


if __name__ == "__main__":
    main()
