"""Speculative decoding with the reference decoder vs the target alone, same process, same prompts.

    .venv/bin/python benchmarks/specdec.py --quick            # default target, a few MT-bench prompts, k = 3
    .venv/bin/python benchmarks/specdec.py --draft runs/export --k 1,2,3,4,5 --num-prompts 20

Without --draft it uses a small draft trained once for the default target (prepare 120 ShareGPT conversations,
30 online training steps; cached under $DRAFTSMITH_CACHE/bench/, a few minutes the first time on a 2-core CPU).
`--random-draft` measures an untrained draft instead (τ ≈ 1: the cost of drafting with nothing accepted).

Prints a table, then as its last line JSON with `tau` and `speedup` (tokens/s with the draft over tokens/s of the
target alone) for the first k, and the same per k.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

QUICK_DRAFT_VERSION = "v2"  # v2: target identities no longer hash tokenizer_config.json loading keys


def quick_trained_draft() -> Path:
    """A small draft for the default target, trained once and cached (prepare + 30 online TTT steps)."""
    from draftsmith.config import PrepareConfig, TrainConfig
    from draftsmith.core import assets
    from draftsmith.core.fsio import file_lock
    from draftsmith.prepare.stage import run as prepare
    from draftsmith.train.stage import run as train

    root = assets.cache_dir() / "bench" / f"specdec-draft-{QUICK_DRAFT_VERSION}"
    with file_lock(assets.cache_dir() / "locks" / f"specdec-draft-{QUICK_DRAFT_VERSION}.lock"):
        if not (root / "run" / "best" / "manifest.json").is_file():
            print(f"training a small draft for the default target into {root} (once) ...", file=sys.stderr)
            if not (root / "prepared" / "manifest.json").is_file():
                prepare(
                    PrepareConfig(
                        data=[str(assets.sharegpt_path())], output=root / "prepared", max_length=256, max_samples=120
                    )
                )
            train(
                TrainConfig(
                    data=root / "prepared",
                    output=root / "run",
                    draft_vocab_size=8000,
                    ttt_steps=3,
                    lr=2e-3,
                    warmup_steps=3,
                    token_budget=512,
                    max_steps=30,
                    eval_every=10,
                    eval_fraction=0.05,
                    log_every=5,
                    device="cpu",
                )
            )
    return root / "run"


def random_draft_source(target_path: Path, draft_vocab_size: int = 8000):
    """An untrained draft (random weights, lm_head from the target's rows) as a DraftSource."""
    from draftsmith.core import layers, targets
    from draftsmith.methods.artefact import DraftSource
    from draftsmith.methods.eagle3.modeling import Eagle3Draft
    from draftsmith.methods.layers import draft_tensors
    from draftsmith.methods.spec import DraftSpec

    config = json.loads((target_path / "config.json").read_text())
    model = targets.load_target(target_path)
    aux = layers.default_aux_layer_ids(config["num_hidden_layers"])
    spec = DraftSpec.from_target_config(config, draft_vocab_size, 1, aux)
    ids = torch.linspace(0, spec.vocab_size - 1, spec.draft_vocab_size).round().long()
    draft = Eagle3Draft.from_target(spec, model, ids)
    return DraftSource(
        spec=spec,
        tensors=draft_tensors(draft.state_dict()),
        target=targets.target_identity(target_path),
        origin=Path("random"),
        training={},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 MT-bench prompts, 48 new tokens, k = 3")
    parser.add_argument("--draft", type=Path, help="an export directory or a training checkpoint")
    parser.add_argument("--random-draft", action="store_true", help="an untrained draft (lower bound)")
    parser.add_argument("--target", help="target (default: the draft's, or the embedded SmolLM2)")
    parser.add_argument("--k", default=None, help="comma-separated draft lengths (default 3 quick, 1,2,3,4,5 full)")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from draftsmith.core import targets
    from draftsmith.evaluate import build_draft_module, evaluate_reference, resolve_evaluation_target
    from draftsmith.evaluate.prompts import load_prompts
    from draftsmith.methods.artefact import load_draft

    ks = [int(x) for x in args.k.split(",")] if args.k else ([3] if args.quick else [1, 2, 3, 4, 5])
    num_prompts = args.num_prompts or (4 if args.quick else 20)
    max_new = args.max_new_tokens or (48 if args.quick else 128)

    if args.random_draft:
        source = random_draft_source(targets.resolve_target(args.target))
        draft_name = "random (untrained)"
    else:
        path = args.draft or quick_trained_draft()
        source = load_draft(path)
        draft_name = str(path)
    target_path, _ = resolve_evaluation_target(args.target, source, draft_name)
    model = targets.load_target(target_path)
    tokenizer = targets.load_tokenizer(target_path)
    prompts = load_prompts("mt-bench", tokenizer, num_prompts=num_prompts)
    draft = build_draft_module(source, model, torch.device("cpu"), torch.float32)
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    start = time.perf_counter()
    measured = evaluate_reference(
        model,
        draft,
        source.spec.aux_layer_ids,
        prompts,
        ks,
        max_new_tokens=max_new,
        temperature=0.0,
        seed=0,
        eos_ids=eos,
        baseline=True,
    )
    wall = time.perf_counter() - start
    base = measured.stats[0]
    lossless = all(measured.outputs[k] == measured.outputs[0] for k in ks)

    print(
        f"target {target_path.name}, draft {draft_name}, {len(prompts)} MT-bench prompts, {max_new} new tokens, "
        f"greedy, fp32, {args.threads} threads"
    )
    print(f"{'k':>3} {'tau':>7} {'acceptance per position':<36} {'tok/s':>8} {'speed-up':>9}")
    print(f"{'-':>3} {'':>7} {'(target alone)':<36} {base.tokens_per_s:8.2f} {1.0:9.2f}")
    per_k = {}
    for k in ks:
        s = measured.stats[k]
        speedup = s.tokens_per_s / base.tokens_per_s
        per_pos = ", ".join(f"{a:.2f}" for a in s.acceptance_per_pos)
        print(f"{k:>3} {s.tau:7.3f} {per_pos:<36} {s.tokens_per_s:8.2f} {speedup:9.2f}")
        per_k[str(k)] = {
            "tau": round(s.tau, 4),
            "speedup": round(speedup, 4),
            "tokens_per_s": round(s.tokens_per_s, 3),
            "acceptance_per_pos": [round(a, 4) for a in s.acceptance_per_pos],
        }
    first = per_k[str(ks[0])]
    print(
        json.dumps(
            {
                "target": target_path.name,
                "draft": draft_name,
                "k": ks[0],
                "tau": first["tau"],
                "speedup": first["speedup"],
                "tokens_per_s_target": round(base.tokens_per_s, 3),
                "tokens_per_s_spec": first["tokens_per_s"],
                "lossless": lossless,
                "num_prompts": len(prompts),
                "max_new_tokens": max_new,
                "wall_s": round(wall, 1),
                "per_k": per_k,
            }
        )
    )


if __name__ == "__main__":
    main()
