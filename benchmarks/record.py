"""What `draftsmith serve --record` costs: the same server with and without the recording, side by side.

    python benchmarks/record.py --draft runs/quickstart/export --concurrency 1,4 --rounds 2

Each round starts `draftsmith serve DRAFT` twice, without and then with `--record` (a fresh directory each time), and
loads each with vLLM's own load generator as `evaluate --concurrency` does (evaluate/load.py: the same prompts,
greedy, /v1/completions, every concurrency). Rounds alternate the order, so a machine that slows down over the run
does not favour one side. The ratio at a concurrency is output tokens/s with the recording over without, summed over
the rounds; the last line is JSON (`min_ratio`, the issue's bar: at least 0.97).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from draftsmith.core import recording
from draftsmith.evaluate import loadgen
from draftsmith.evaluate.load import Load, ServerOptions
from draftsmith.evaluate.prompts import requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", type=Path, required=True, help="an export")
    parser.add_argument("--prompts", default="mt-bench")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--vllm-args", default="--enforce-eager --max-num-seqs 8")
    args = parser.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    texts = [messages[-1]["content"] for _, messages, _, _ in requests(args.prompts, args.num_prompts)]
    tokens_per_s: dict[str, dict[int, list[float]]] = {"plain": {}, "record": {}}
    records = 0
    with tempfile.TemporaryDirectory(prefix="record-bench-") as tmp:
        work = Path(tmp)
        dataset = work / "prompts.jsonl"
        dataset.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
        load = Load(dataset, len(texts), concurrency, args.max_new_tokens, seed=0, timeout_s=1800)
        for r in range(args.rounds):
            for side in ("plain", "record") if r % 2 == 0 else ("record", "plain"):
                record = work / f"recording-{r}" if side == "record" else None
                options = ServerOptions(
                    draft=args.draft,
                    k=args.k,
                    dtype=args.dtype,
                    max_model_len=1024,
                    kv_cache_gb=1,
                    tensor_parallel_size=1,
                    trust_remote_code=False,
                    timeout_s=1800,
                    vllm_args=args.vllm_args,
                    record=record,
                )
                measured, _ = load.serve(lambda port, o=options: o.argv(port, False), work / f"{side}-{r}")
                for c, run in measured.items():
                    tokens_per_s[side].setdefault(c, []).append(run.output_throughput or 0.0)
                    print(f"round {r} {side:>6} concurrency {c}: {run.output_throughput:.1f} tok/s", flush=True)
                if record is not None:
                    records += recording.records_in(record)
    ratios = {c: sum(tokens_per_s["record"][c]) / sum(tokens_per_s["plain"][c]) for c in concurrency}
    for c, ratio in ratios.items():
        print(f"concurrency {c}: with the recording {ratio:.3f}x the tokens/s without")
    sent = args.rounds * sum(loadgen.requests_at(c, len(texts)) for c in concurrency)
    result = {
        "draft": str(args.draft),
        "prompts": f"{args.prompts} ({len(texts)})",
        "concurrency": concurrency,
        "rounds": args.rounds,
        "tokens_per_s": tokens_per_s,
        "ratio": ratios,
        "min_ratio": min(ratios.values()),
        "records": records,
        "requests_sent": sent,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
