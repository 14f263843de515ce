"""Every vLLM extraction strategy against the same vLLM doing plain prefill (max_tokens=1) on the same prompts.

    .venv/bin/python benchmarks/extract_vllm.py --quick            # 60 ShareGPT conversations, uncompiled
    .venv/bin/python benchmarks/extract_vllm.py -n 300 --compile   # the full table (vLLM compiles: slow start on CPU)
    .venv/bin/python benchmarks/extract_vllm.py --quick --target tiny:deepseek_v3 --tensor-parallel-size 2
    .venv/bin/python benchmarks/extract_vllm.py --quick --strategies taps,connector

Every strategy the installed vLLM offers for the target (connector, direct, taps; or --strategies) gets an engine,
and one plain engine (no capture) runs the same prompts with the same knobs; all are up at once and take turns on
the same chunks, so a busy machine slows all alike. Prints a table, then as its last line a JSON object: per
strategy tokens_per_s (extraction, engine start-up excluded) and ratio_vs_prefill (goal >= 0.85), plus
prefill_tokens_per_s, taps_vs_connector (goal >= 0.9) and the machine (CPU flags, load). benchmarks/extract.py
--backend vllm calls the same function; `--target` (a model directory or tiny:FAMILY from tests/families.py) and
`--tensor-parallel-size` work as there.
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
    parser.add_argument(
        "--strategies", default=None, help="comma-separated (connector, direct, taps); default: every one offered here"
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="let vLLM compile (default: on GPUs only; minutes of start-up on CPU)",
    )
    parser.add_argument("--token-budget", type=int, default=8192, help="vLLM max_num_batched_tokens")
    parser.add_argument("--chunks", type=int, default=4, help="alternating plain / extraction chunks")
    parser.add_argument("--target", help="model directory or tiny:FAMILY (default: the embedded SmolLM2)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--compute-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    args = parser.parse_args()
    n = 60 if args.quick else args.n
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    from draftsmith.extract.vllm.backend import benchmark

    with tempfile.TemporaryDirectory(prefix="draftsmith-bench-") as tmp:
        prepared = args.prepared
        if prepared is None:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from extract import _prepared, _target  # benchmarks/extract.py: tiny:FAMILY targets, ShareGPT sets

            prepared = _prepared(Path(tmp), n, args.max_length, _target(args.target, Path(tmp)))
        load_before = os.getloadavg()[0]
        result = benchmark(
            prepared,
            n,
            strategies=args.strategies.split(",") if args.strategies else None,
            compile=args.compile,
            token_budget=args.token_budget,
            chunks=args.chunks,
            tensor_parallel_size=args.tensor_parallel_size,
            compute_dtype=args.compute_dtype,
        )
    rows = result["strategies"]
    if "taps" in rows and "connector" in rows:
        result["taps_vs_connector"] = round(rows["taps"]["tokens_per_s"] / rows["connector"]["tokens_per_s"], 3)
    result["machine"] = _machine(load_before)
    print(
        f"{'strategy':<10} {'tokens/s':>9} {'÷ prefill':>9} {'start s':>8}  ({result['tokens']} tokens, "
        f"prefill {result['prefill_tokens_per_s']} tokens/s)",
        file=sys.stderr,
    )
    for name, row in rows.items():
        print(
            f"{name:<10} {row['tokens_per_s']:>9} {row['ratio_vs_prefill']:>9} {row['engine_start_s']:>8}",
            file=sys.stderr,
        )
    print(json.dumps(result))


def _machine(load_before: float) -> dict:
    """The CPU (model name and the flags that decide vLLM's kernels: draftsmith.core.hardware), cores and load."""
    import torch

    from draftsmith.core import hardware

    cpu = hardware.probe()
    return {
        "cpu": cpu.model,
        "flags": list(cpu.flags),
        "native_bf16": cpu.native_bf16,
        "cores": os.cpu_count(),
        "gpu": torch.cuda.is_available(),
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
    }


if __name__ == "__main__":
    main()
