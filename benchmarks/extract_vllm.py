"""vLLM extraction throughput against the same vLLM doing plain prefill (max_tokens=1) on the same prompts.

    .venv/bin/python benchmarks/extract_vllm.py --quick            # 60 ShareGPT conversations, uncompiled
    .venv/bin/python benchmarks/extract_vllm.py -n 300 --compile   # the full table (vLLM compiles: slow start on CPU)
    .venv/bin/python benchmarks/extract_vllm.py --quick --target tiny:deepseek_v3 --tensor-parallel-size 2

Prints a table, then as its last line a JSON object with tokens_per_s (extraction, engine start-up excluded),
prefill_tokens_per_s (a plain engine with the same knobs, no capture) and
ratio_vs_prefill (goal >= 0.85). Both engines are up at once and take turns on the same chunks of prompts, so a
busy machine slows both alike. benchmarks/extract.py --backend vllm calls the same function; `--target`
(a model directory or tiny:FAMILY from tests/families.py) and `--tensor-parallel-size` work as there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="60 conversations")
    parser.add_argument("-n", type=int, default=300, help="conversations (default 300)")
    parser.add_argument("--prepared", type=Path, help="an existing prepared set (default: prepare ShareGPT now)")
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--strategy", default="auto", choices=["auto", "connector", "direct"])
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="let vLLM compile (default: on GPUs only; minutes of start-up on CPU)")
    parser.add_argument("--token-budget", type=int, default=8192, help="vLLM max_num_batched_tokens")
    parser.add_argument("--chunks", type=int, default=4, help="alternating plain / extraction chunks")
    parser.add_argument("--target", help="model directory or tiny:FAMILY (default: the embedded SmolLM2)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--compute-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    args = parser.parse_args()
    n = 60 if args.quick else args.n
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    from draftsmith.extract.vllm import benchmark

    with tempfile.TemporaryDirectory(prefix="draftsmith-bench-") as tmp:
        prepared = args.prepared
        if prepared is None:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from extract import _prepared, _target  # benchmarks/extract.py: tiny:FAMILY targets, ShareGPT sets

            prepared = _prepared(Path(tmp), n, args.max_length, _target(args.target, Path(tmp)))
        result = benchmark(prepared, n, strategy=args.strategy, compile=args.compile, token_budget=args.token_budget,
                           chunks=args.chunks, tensor_parallel_size=args.tensor_parallel_size,
                           compute_dtype=args.compute_dtype)
    width = max(len(k) for k in result)
    for key, value in result.items():
        print(f"{key:<{width}}  {value}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
