"""`draftsmith train` of this tree against a baseline tree (default: commit db7d796, checked out in /tmp/main-db7d796),
side by side on the quickstart's store and shapes, runs alternating.

The quickstart's `small` budget (src/draftsmith/quickstart.py): 120 ShareGPT conversations x 512 tokens on the
default target, token budget 1024, 3 TTT steps, draft vocabulary 8192, lr 2e-3, 20 warm-up steps, fp32 on the
CPU. Each run is `python -m draftsmith train` in a fresh process with PYTHONPATH set to one tree's src/; tokens/s
is measured between the run's first and last metrics lines (elapsed = tokens_seen / tokens_per_s on each line,
both counted from the loop's start), so start-up and the first steps are left out. Rounds alternate
ours, main, ours, main, ...; each side's figure is the median of its rounds.

    python benchmarks/train_vs_main.py [--store DIR] [--steps 20] [--log-every 5] [--rounds 2] [--wait-policy PASSIVE]

As shipped, this tree's trainer lets OpenMP's idle threads sleep (OMP_WAIT_POLICY=PASSIVE, set on import when
unset: see draftsmith/train/__init__.py) and the baseline's spin; --wait-policy PASSIVE gives both the same
policy, which leaves the difference the training step itself makes.

Without --store the quickstart's store is made once in --work (prepare + extract, a few minutes on 2 cores).
Last line: JSON with tokens_per_s_ours, tokens_per_s_main, ratio, final_loss_ours, final_loss_main, the loss
curves and the load averages.
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
SHAPES = [
    "--token-budget",
    "1024",
    "--ttt-steps",
    "3",
    "--draft-vocab-size",
    "8192",
    "--lr",
    "2e-3",
    "--warmup-steps",
    "20",
    "--device",
    "cpu",
    "--save-every",
    "100000",
]


def quickstart_store(work: Path) -> Path:
    """The quickstart's `small` store (120 conversations x 512 tokens, hf backend), made once in `work`."""
    store = work / "store"
    if (store / "manifest.json").is_file():
        return store
    from draftsmith.config import ExtractConfig, PrepareConfig
    from draftsmith.extract.stage import run as extract
    from draftsmith.prepare.stage import run as prepare

    prepare(PrepareConfig(output=work / "prepared", max_length=512, max_samples=120))
    extract(ExtractConfig(prepared=work / "prepared", output=store, backend="hf", device="cpu"), show_progress=False)
    return store


def run_once(
    src: Path,
    store: Path,
    out: Path,
    options: list[str],
    threads: int | None = None,
    wait_policy: str | None = None,
) -> dict:
    """`draftsmith train` of the tree `src` on `store` with `options`: its tokens/s between its first and last metrics
    lines and from the loop's start, and its losses."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if wait_policy:
        env["OMP_WAIT_POLICY"] = wait_policy
    cmd = [
        sys.executable,
        "-m",
        "draftsmith",
        "train",
        "--data",
        str(store),
        "--output",
        str(out),
        "--force",
        "--no-resume",
        *options,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [m for m in lines if m["type"] == "train"]
    first, last = train[0], train[-1]
    elapsed = [m["tokens_seen"] / m["tokens_per_s"] for m in (first, last)]
    return {
        "tokens_per_s": (last["tokens_seen"] - first["tokens_seen"]) / (elapsed[1] - elapsed[0]),
        "losses": [round(m["loss"], 6) for m in train],
        "steps": [m["step"] for m in train],
        "tokens_per_s_all": last["tokens_per_s"],  # from the loop's start: every step, the first one included
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", type=Path, help="the quickstart's store (default: made in --work)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "draftsmith-train-vs-main")
    parser.add_argument("--main-src", type=Path, default=Path("/tmp/main-db7d796/src"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for both (default: torch's)")
    parser.add_argument(
        "--wait-policy",
        choices=["PASSIVE", "ACTIVE"],
        default=None,
        help="OMP_WAIT_POLICY for both (default: unset, each tree as shipped: this one's trainer "
        "sets PASSIVE when unset)",
    )
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    store = args.store or quickstart_store(args.work)
    trees = {"ours": REPO / "src", "main": args.main_src}
    results: dict[str, list[dict]] = {"ours": [], "main": []}
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for name, src in trees.items():
            options = ["--max-steps", str(args.steps), "--log-every", str(args.log_every), *SHAPES]
            res = run_once(src, store, args.work / f"{name}-{r}", options, args.threads, args.wait_policy)
            loads.append(os.getloadavg()[0])
            results[name].append(res)
            print(
                f"round {r + 1} {name}: {res['tokens_per_s']:.1f} tokens/s, losses {res['losses']} "
                f"(load {loads[-1]:.1f})",
                file=sys.stderr,
                flush=True,
            )
    rate = {name: statistics.median(x["tokens_per_s"] for x in runs) for name, runs in results.items()}
    print(f"{'':>6} {'tokens/s (median)':>18} {'rounds':>30} {'final loss':>12}")
    for name, runs in results.items():
        rounds = " ".join(f"{x['tokens_per_s']:.1f}" for x in runs)
        print(f"{name:>6} {rate[name]:>18.1f} {rounds:>30} {runs[-1]['losses'][-1]:>12.6f}")
    print(f"ratio {rate['ours'] / rate['main']:.3f}; load average {min(loads):.1f}..{max(loads):.1f}")
    print(
        json.dumps(
            {
                "tokens_per_s_ours": round(rate["ours"], 1),
                "tokens_per_s_main": round(rate["main"], 1),
                "ratio": round(rate["ours"] / rate["main"], 3),
                "final_loss_ours": results["ours"][-1]["losses"][-1],
                "final_loss_main": results["main"][-1]["losses"][-1],
                "loss_curve_ours": results["ours"][-1]["losses"],
                "loss_curve_main": results["main"][-1]["losses"],
                "logged_steps": results["ours"][-1]["steps"],
                "rounds": args.rounds,
                "steps": args.steps,
                "load_avg": [round(min(loads), 1), round(max(loads), 1)],
                "store": str(store),
                "wait_policy": args.wait_policy or "as shipped",
            }
        )
    )


if __name__ == "__main__":
    main()
