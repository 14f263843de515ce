"""Training on agentic traffic at the cost of its distinct tokens: `draftsmith train` on BFCL's multi-turn store with
tree-packed batches (train/packing.py: a conversation's generations in one sequence, each shared row once) against
the same store trained one padded sample at a time (the tree at --base, default 43de1df, the commit before tree
packing), side by side in one run.

    .venv/bin/python benchmarks/agentic_train.py                     # 10 conversations, one epoch each
    .venv/bin/python benchmarks/agentic_train.py --conversations 40 --padded-steps 5

The store is benchmarks/agentic_extract.py's (its tiny random Llama target, hidden 128, with a Qwen3-shaped tool
template that drops earlier turns' reasoning; `prepare --max-length 32768`; extracted with the hf backend, each
distinct token once), made once in --work. Both trees train the same fresh EAGLE-3 draft (the default 7 TTT steps,
--token-budget 65536: a batch holds a conversation's tree, whose context alone is up to 18k tokens; no held-out
split, fp32 on the CPU) for --epochs epochs, each in a
fresh process (benchmarks/train_vs_main.py's run_once: tokens/s over every step from the training loop's start, the
start-up left out: a tree-packed epoch is a few large batches, each a different share of shared rows). Both supervise the same tokens per epoch, so the ratio of their sample tokens
per second is the ratio of supervised tokens per second. `--padded-steps N` stops the padded run after N steps (its
batches are a random draw of the epoch's: its rate estimates the epoch's; an epoch of the whole set one padded sample
at a time is 15.5M tokens, hours on a CPU). Rounds alternate tree, base, tree, base; each side's figure
is the median of its rounds.

Prints a table on stderr, then as its LAST line a JSON object: the store's samples, tokens, distinct tokens and
supervised tokens; per side the sample tokens and supervised tokens per second and the final loss; the speed-up
(issue 52's goal: >= 10x on the BFCL set).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from train_vs_main import run_once  # noqa: E402 - the benchmarks directory is not a package

OPTIONS = ["--eval-fraction", "0", "--precision", "fp32", "--device", "cpu"]


def agentic_store(work: Path, conversations: int) -> Path:
    """benchmarks/agentic_extract.py's prefix-shared hf store of the first `conversations` BFCL conversations."""
    store = work / f"store-hf-bfcl-multi-turn-{conversations}-prefix"
    if not (store / "manifest.json").is_file():
        cmd = [sys.executable, str(REPO / "benchmarks" / "agentic_extract.py")]
        cmd += ["--conversations", str(conversations), "--prefix-only", "--work", str(work)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return store


def base_tree(commit: str) -> Path:
    """The repository at `commit`, checked out once beside it (a git worktree), its src/ returned."""
    path = Path(tempfile.gettempdir()) / f"draftsmith-base-{commit}"
    if not (path / "src").is_dir():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), commit], check=True)
    return path / "src"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--token-budget", type=int, default=65536, help="rows a batch holds (>= the longest sample)")
    parser.add_argument("--padded-steps", type=int, default=None, help="the padded run's steps (default: its epochs)")
    parser.add_argument("--base", default="43de1df", help="the commit trained one padded sample at a time")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "draftsmith-agentic-train")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO / "src"))
    from draftsmith.extract import store as store_mod

    path = agentic_store(args.work, args.conversations)
    st = store_mod.open(path, dtype=None)
    rows = sum(s.num_rows or s.num_tokens for s in st.manifest.shards)
    supervised = sum(int(st.sample(i, int(st.lengths[i]))["loss_mask"].sum()) for i in range(len(st)))
    trees = {"tree": REPO / "src", "padded": base_tree(args.base)}
    options = [*OPTIONS, "--token-budget", str(args.token_budget), "--epochs", str(args.epochs), "--log-every", "1"]
    results: dict[str, list[dict]] = {name: [] for name in trees}
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for name, src in trees.items():
            limit = ["--max-steps", str(args.padded_steps)] if name == "padded" and args.padded_steps else []
            res = run_once(src, path, args.work / f"train-{name}-{r}", [*options, *limit])
            loads.append(os.getloadavg()[0])
            results[name].append(res)
            print(f"round {r + 1} {name}: {res['tokens_per_s_all']:.0f} sample tokens/s", file=sys.stderr, flush=True)
    rate = {name: statistics.median(x["tokens_per_s_all"] for x in runs) for name, runs in results.items()}
    per_token = supervised / st.num_tokens  # supervised tokens per sample token, in both layouts
    print(f"{'':>7} {'sample tokens/s':>16} {'supervised/s':>13} {'final loss':>11}", file=sys.stderr)
    for name, runs in results.items():
        loss = runs[-1]["losses"][-1]
        print(f"{name:>7} {rate[name]:>16.0f} {rate[name] * per_token:>13.1f} {loss:>11.4f}", file=sys.stderr)
    print(
        json.dumps(
            {
                "conversations": args.conversations,
                "samples": len(st),
                "tokens": st.num_tokens,
                "distinct_rows": rows,
                "supervised_tokens": supervised,
                "epochs": args.epochs,
                "token_budget": args.token_budget,
                "padded_steps": args.padded_steps,
                "rounds": args.rounds,
                "sample_tokens_per_s": {name: round(v, 1) for name, v in rate.items()},
                "supervised_tokens_per_s": {name: round(v * per_token, 2) for name, v in rate.items()},
                "final_loss": {name: runs[-1]["losses"][-1] for name, runs in results.items()},
                "speedup": round(rate["tree"] / rate["padded"], 2),
                "load_avg": [round(min(loads), 1), round(max(loads), 1)],
                "base": args.base,
            }
        )
    )


if __name__ == "__main__":
    main()
