"""How τ grows with training tokens on the default target, within a fixed training time (a GPU check).

Trains online (the target runs inside the trainer) on the embedded ShareGPT for `--minutes`, sizing the step count
from a short probe of the real step's tokens/s, evaluates the held-out split along the way (simulated acceptance
length), then exports the draft and measures τ on MT-bench first turns (reference decoder, temperature 0).

    python benchmarks/tau_vs_tokens.py --device cuda --minutes 5      # a GPU lease: millions of tokens
    python benchmarks/tau_vs_tokens.py --device cpu --minutes 3 --max-samples 200 --prompts 2   # a smoke run
Last line: JSON with tokens_per_s, tokens trained, the learning curve and the measured τ per k.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def _train_lines(run: Path, kind: str) -> list[dict]:
    path = run / "metrics.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []
    return [m for m in lines if m["type"] == kind]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--minutes", type=float, default=5.0, help="training time (probe excluded)")
    parser.add_argument("--prepared", type=Path, help="a prepared set (default: all of ShareGPT, prepared now)")
    parser.add_argument("--target", help="target directory (default: the one the prepared set was made for)")
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--max-samples", type=int, default=None, help="conversations to prepare / train on")
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--ttt-steps", type=int, default=5)
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--prompts", type=int, default=40, help="MT-bench prompts")
    parser.add_argument("--prompt-set", default="mt-bench", help="prompts evaluated (draftsmith evaluate --prompts)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", default="3", help="comma-separated draft lengths to measure")
    parser.add_argument("--work", type=Path, help="keep runs here (default: a temp dir)")
    args = parser.parse_args()

    from draftsmith import evaluate as evaluation
    from draftsmith import export
    from draftsmith.config import EvaluateConfig, ExportConfig, PrepareConfig, TrainConfig
    from draftsmith.prepare import stage as prepare
    from draftsmith.train import stage as trainer

    work = args.work or Path(tempfile.mkdtemp(prefix="draftsmith-tau-"))
    prepared = args.prepared
    if prepared is None:
        prepared = work / "prepared"
        prepare.run(PrepareConfig(output=prepared, max_length=args.max_length, max_samples=args.max_samples))
    common = dict(
        data=prepared,
        target=args.target,
        draft_vocab_size=args.draft_vocab,
        ttt_steps=args.ttt_steps,
        token_budget=args.token_budget,
        lr=args.lr,
        warmup_steps=30,
        device=args.device,
        log_every=10,
        max_samples=args.max_samples,
        resume=False,
        force=True,
    )

    t0 = time.perf_counter()
    trainer.run(TrainConfig(**common, output=work / "probe", max_steps=20, eval_fraction=0.0, save_every=10**6))
    probe = _train_lines(work / "probe", "train")[-1]
    tokens_per_step = probe["tokens_seen"] / probe["step"]
    steps = max(10, int(args.minutes * 60 * probe["tokens_per_s"] / tokens_per_step))
    print(
        f"probe: {probe['tokens_per_s']:,.0f} tokens/s, {tokens_per_step:,.0f} tokens/step -> {steps} steps "
        f"({time.perf_counter() - t0:.0f} s)",
        file=sys.stderr,
    )

    t0 = time.perf_counter()
    result = trainer.run(
        TrainConfig(**common, output=work / "train", max_steps=steps, eval_every=max(1, steps // 6), save_every=10**6)
    )
    train_s = time.perf_counter() - t0
    export.run(ExportConfig(checkpoint=work / "train", output=work / "export"))
    ks = sorted({int(k) for k in args.k.split(",")})
    report = evaluation.run(
        EvaluateConfig(
            draft=work / "export",
            engine="hf",
            target=args.target,
            output=work / "eval",
            k=ks,
            prompts=args.prompt_set,
            num_prompts=args.prompts,
            max_new_tokens=args.max_new_tokens,
            baseline=False,
            device=args.device,
        )
    )
    assert report.result is not None
    runs = report.result.runs

    curve = [
        (e["step"], e["step"] * tokens_per_step, e["acc"][0], e["acceptance_length"])
        for e in _train_lines(work / "train", "eval")
    ]
    print(
        f"online training on {prepared} ({args.device}), draft vocab {args.draft_vocab}, TTT {args.ttt_steps}, "
        f"lr {args.lr}, {train_s:.0f} s"
    )
    print(f"{'step':>6} {'tokens':>12} {'step-0 acc':>11} {'sim. τ (held out)':>18}")
    for step, tokens, acc, tau in curve:
        print(f"{step:>6} {tokens:>12,.0f} {acc:>11.3f} {tau:>18.3f}")
    for r in runs:
        per_pos = " ".join(f"{a:.2f}" for a in r.acceptance_per_pos)
        print(
            f"{args.prompt_set} ({args.prompts} prompts x {args.max_new_tokens} tokens), k={r.k}: τ {r.tau:.2f}; "
            f"acceptance per position {per_pos}"
        )
    print(
        json.dumps(
            {
                "device": args.device,
                "tokens_per_s": result.summary["tokens/s"],
                "tokens": result.summary["tokens"],
                "train_s": round(train_s, 1),
                "curve": [{"step": s, "tokens": round(t), "acc0": a, "sim_tau": x} for s, t, a, x in curve],
                "tau": {r.k: r.tau for r in runs},
                "report": str(report.output),
            }
        )
    )


if __name__ == "__main__":
    main()
