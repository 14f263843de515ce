"""Throughput of `draftsmith regenerate` on the embedded default (SmolLM2-135M-Instruct answering ShareGPT).

    python benchmarks/regenerate.py                          # 96 first user turns, both engines, 128 new tokens
    python benchmarks/regenerate.py --engines vllm --conversations 120 --multi-turn

By default the prompts are the first user turns of the first N ShareGPT conversations, one answer each: that
measures the engines. With --multi-turn every assistant turn of those conversations is answered; a conversation's
answers come one after another, so a small N measures mostly its longest conversation (ShareGPT has one with 26).
For each engine: the run's wall time (engine start included), the time spent waiting for the engine, and new
tokens per second of that time. Prints a table, then as its LAST line a JSON object with one entry per engine.
On a shared machine the rates depend on the load, so the load average is printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="vllm,hf", help="comma-separated: vllm, hf")
    parser.add_argument("--conversations", type=int, default=96)
    parser.add_argument("--multi-turn", action="store_true", help="answer every turn, not only the first")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--shard-samples", type=int, default=128)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    args = parser.parse_args()

    from draftsmith.config import RegenerateConfig
    from draftsmith.core import assets
    from draftsmith.prepare import regenerate, regenerated_set
    from draftsmith.prepare.messages import Skip, normalize_conversation
    from draftsmith.prepare.readers import Source, iter_source

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="draftsmith-bench-") as tmp:
        data = []
        if not args.multi_turn:  # the first user turn of each conversation, as a prompt to answer
            prompts = Path(tmp) / "prompts.jsonl"
            with open(prompts, "w", encoding="utf-8") as f:
                for record in iter_source(Source(assets.sharegpt_path(), "json")):
                    try:
                        messages = normalize_conversation(record.data).messages
                    except Skip:
                        continue
                    first = next(m for m in messages if m["role"] == "user")
                    f.write(json.dumps({"messages": [first]}) + "\n")
            data = [str(prompts)]
        for engine in args.engines.split(","):
            cfg = RegenerateConfig(
                data=data,
                output=Path(tmp) / engine,
                engine=engine,
                max_samples=args.conversations,
                max_new_tokens=args.max_new_tokens,
                max_length=args.max_length,
                device="cpu",
                shard_samples=args.shard_samples,
                hf_batch_size=args.hf_batch_size,
            )
            load_before = os.getloadavg()[0]
            started = time.perf_counter()
            regenerate.run(cfg)
            wall = time.perf_counter() - started
            m = regenerated_set.open_regenerated(cfg.output)
            results[engine] = {
                "engine": m.generator.engine_version,
                "dtype": m.generator.dtype,
                "conversations": m.num_conversations,
                "answers": m.num_assistant_turns,
                "new_tokens": m.num_new_tokens,
                "truncated_answers": m.num_truncated_turns,
                "wall_s": round(wall, 1),
                "generate_s": m.stats["generate_seconds"],
                "new_tokens_per_s": m.stats["new_tokens_per_s"],
                "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            }

    what = "conversations, every turn" if args.multi_turn else "first user turns"
    print(
        f"draftsmith regenerate, default target, {args.conversations} {what}, max_new_tokens "
        f"{args.max_new_tokens}, {platform.machine()} x{os.cpu_count()}"
    )
    for r in results.values():
        print(
            f"  {r['engine']:<40} {r['answers']:>4} answers {r['new_tokens']:>7,} new tokens  "
            f"generate {r['generate_s']:>7.1f} s  {r['new_tokens_per_s']:>6.1f} tok/s  wall {r['wall_s']:>6.1f} s  "
            f"(truncated {r['truncated_answers']}, load {r['load_average'][0]} -> {r['load_average'][1]})"
        )
    print(
        json.dumps(
            {
                "conversations": args.conversations,
                "multi_turn": args.multi_turn,
                "max_new_tokens": args.max_new_tokens,
                "engines": results,
            }
        )
    )


if __name__ == "__main__":
    main()
