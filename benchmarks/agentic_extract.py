"""Agentic traffic at the cost of its distinct tokens: a backend's store of BFCL's multi-turn tool-use set, the
samples that share a prefix computed and stored once (extract's prefix chains: one KV cache per chain with the hf
backend, prefix caching with vLLM), against the same set extracted one whole sample at a time (what extraction did
before), side by side in one run.

    .venv/bin/python benchmarks/agentic_extract.py                      # the first 40 conversations
    .venv/bin/python benchmarks/agentic_extract.py --conversations 200 --prefix-only  # the whole set, prefix run only
    .venv/bin/python benchmarks/agentic_extract.py --backend vllm       # through the installed vLLM (its auto strategy)
    .venv/bin/python benchmarks/agentic_extract.py --data bfcl-multi-turn-long-context  # the set no test reads

The target is a tiny random Llama (tests/conftest.py; 4 layers, hidden 128) whose tokenizer carries a Qwen3-shaped,
tool-aware chat template (tests/agentic.py), which drops earlier turns' reasoning, so each generation is a sample of
its own; `prepare --data bfcl-multi-turn --max-length 32768` makes the set (its config allows 40,960 positions, as
vLLM asks). Both stores are bf16, computed in float32. "tokens_computed" is what the backend computed: for vLLM, each
prompt less the tokens its prefix cache held.

Prints a table on stderr, then as its LAST line a JSON object: the set's samples, tokens and distinct tokens (its
prefix tree's nodes); per run ("prefix", "whole") the tokens computed, seconds and store bytes; and the goals of
issue 52: extraction_tokens_per_distinct (<= 1.10) and store_bytes_per_distinct_state (store bytes over distinct
tokens x layers x hidden x 2 bytes; <= 1.15), with the speed-up of the prefix run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=40)
    parser.add_argument("--prefix-only", action="store_true", help="skip the whole-sample run (15M tokens at 200)")
    parser.add_argument("--work", type=Path, default=None, help="keep the target, set and stores here")
    parser.add_argument("--backend", choices=["hf", "vllm"], default="hf")
    parser.add_argument("--data", default="bfcl-multi-turn", help="or bfcl-multi-turn-long-context (held out)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from agentic import QWEN3_MARKERS, QWEN3_SHAPED_TEMPLATE
    from conftest import build_tiny_target

    from draftsmith.config import ExtractConfig, PrepareConfig
    from draftsmith.extract import common, store
    from draftsmith.extract import stage as extract
    from draftsmith.prepare import stage as prepare
    from draftsmith.prepare.dataset import open_prepared

    work = args.work or Path(tempfile.mkdtemp(prefix="draftsmith-agentic-"))
    target = work / "target"
    if not (target / "config.json").is_file():
        template = QWEN3_SHAPED_TEMPLATE.read_text()  # hidden 128: head_dim 32, the least vLLM's CPU attention runs
        build_tiny_target(target, hidden_size=128, chat_template=template, added_tokens=QWEN3_MARKERS)
        config = json.loads((target / "config.json").read_text())
        (target / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 40960}))
    prepared = work / f"{args.data}-{args.conversations}"
    if not (prepared / "manifest.json").is_file():
        prepare.run(
            PrepareConfig(
                data=[args.data],
                target=str(target),
                max_length=32768,
                max_samples=args.conversations,
                output=prepared,
            )
        )
    manifest = open_prepared(prepared).manifest
    runs = {}
    for name in ("prefix",) if args.prefix_only else ("prefix", "whole"):
        if name == "whole":  # every sample whole: extraction as it was
            common.chains = lambda prefixes, lengths, ids: [[(i, -1, 0)] for i in ids]
        output = work / f"store-{args.backend}-{args.data}-{args.conversations}-{name}"
        cfg = ExtractConfig(
            prepared=prepared, output=output, backend=args.backend, compute_dtype="float32", vllm_compile=False
        )
        done = extract.run(cfg, show_progress=False).result
        size = sum(s.num_bytes for s in store.open(output).manifest.shards)
        runs[name] = {"tokens_computed": done.tokens_this_run, "seconds": round(done.work_seconds, 1), "bytes": size}
    layers, hidden = (
        len(store.open(work / f"store-{args.backend}-{args.data}-{args.conversations}-prefix").layer_ids),
        manifest.target.hidden_size,
    )
    distinct = manifest.num_distinct_tokens
    result = {
        "backend": done.backend,
        "data": args.data,
        "conversations": args.conversations,
        "samples": manifest.num_samples,
        "tokens": manifest.num_tokens,
        "distinct_tokens": distinct,
        "tokens_per_distinct": round(manifest.num_tokens / distinct, 2),
        **{f"{name}_{key}": value for name, run in runs.items() for key, value in run.items()},
        "extraction_tokens_per_distinct": round(runs["prefix"]["tokens_computed"] / distinct, 3),
        "store_bytes_per_distinct_state": round(runs["prefix"]["bytes"] / (distinct * layers * hidden * 2), 3),
    }
    if "whole" in runs:
        result["speedup"] = round(runs["whole"]["seconds"] / max(runs["prefix"]["seconds"], 1e-9), 2)
        result["bytes_ratio_whole_to_prefix"] = round(runs["whole"]["bytes"] / runs["prefix"]["bytes"], 2)
    for key, value in result.items():
        print(f"{key:34} {value}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
