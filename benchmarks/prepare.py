"""Throughput of `draftsmith prepare` on the embedded ShareGPT with the real SmolLM2 tokenizer.

    python benchmarks/prepare.py --quick        # 2,000 conversations
    python benchmarks/prepare.py                # the whole embedded file (17,671 complete records)

Prints a table, then as its LAST line a JSON object with `conversations_per_s` and `tokens_per_s`
(reading, rendering, tokenising, masking and writing; the one-off tokenizer load is reported apart).
On a shared machine wall-clock rates depend on the load, so CPU seconds and the load average are printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path


def _cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children (the tokeniser workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2,000 conversations instead of the whole file")
    parser.add_argument("--conversations", type=int, default=None, help="override the number of conversations")
    parser.add_argument("--workers", type=int, default=0, help="tokeniser processes (0: one per core)")
    parser.add_argument("--max-length", type=int, default=2048)
    args = parser.parse_args()

    from draftsmith.config import PrepareConfig
    from draftsmith.prepare.dataset import open_prepared
    from draftsmith.prepare.stage import run

    limit = args.conversations or (2000 if args.quick else None)
    with tempfile.TemporaryDirectory(prefix="draftsmith-bench-") as tmp:
        cfg = PrepareConfig(
            output=Path(tmp) / "prepared", max_samples=limit, num_workers=args.workers, max_length=args.max_length
        )
        load_before = os.getloadavg()[0]
        cpu_before = _cpu_seconds()
        started = time.perf_counter()
        result = run(cfg)
        wall = time.perf_counter() - started
        cpu = _cpu_seconds() - cpu_before
        stats = open_prepared(cfg.output).manifest.stats

    s = result.summary
    rows = [
        ("conversations", f"{s['conversations']:,}"),
        ("records read", f"{s['records read']:,}"),
        ("skipped", f"{s['skipped']:,}"),
        ("tokens", f"{s['tokens']:,}"),
        ("loss tokens", f"{s['loss tokens']:,}"),
        ("truncated at max_length", f"{s['truncated']:,}"),
        ("workers", str(s["workers"])),
        ("pipeline seconds", f"{stats['seconds']:.1f}"),
        ("conversations/s", f"{stats['conversations_per_s']:,.1f}"),
        ("tokens/s", f"{stats['tokens_per_s']:,.0f}"),
        ("wall seconds (incl. tokenizer load)", f"{wall:.1f}"),
        ("cpu seconds, all processes", f"{cpu:.1f}"),
        ("tokens per cpu second", f"{s['tokens'] / cpu:,.0f}"),
        ("load average at start", f"{load_before:.1f}"),
        ("cpu cores", str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())),
    ]
    width = max(len(k) for k, _ in rows)
    print(
        f"draftsmith prepare benchmark: {limit or 'all'} ShareGPT conversations, SmolLM2 tokenizer, "
        f"max_length {args.max_length}"
    )
    print("-" * (width + 16))
    for key, value in rows:
        print(f"{key:<{width}}  {value:>12}")
    print("-" * (width + 16))
    sys.stdout.flush()
    print(
        json.dumps(
            {
                "benchmark": "prepare",
                "conversations": s["conversations"],
                "tokens": s["tokens"],
                "conversations_per_s": stats["conversations_per_s"],
                "tokens_per_s": stats["tokens_per_s"],
                "pipeline_seconds": stats["seconds"],
                "wall_seconds": round(wall, 1),
                "workers": s["workers"],
                "cpu_seconds": round(cpu, 1),
                "tokens_per_cpu_s": round(s["tokens"] / cpu, 1),
                "load_average_at_start": round(load_before, 2),
                "max_length": args.max_length,
                "python": platform.python_version(),
            }
        )
    )


if __name__ == "__main__":
    main()
