"""What `train --probe-every` costs: the same training run with and without probes, side by side.

    python benchmarks/probes.py --data runs/quickstart/store --steps 60 --probe-every 20 \
        --train-args "--token-budget 1024 --ttt-steps 3 --draft-vocab-size 8192 --lr 2e-3 --warmup-steps 20"

Each side is a fresh `draftsmith train` process (the same data, seed and steps; the probe's engine as `auto` picks it
here unless --engine is given). Prints each probe's τ and seconds, the time a probe costs and its share of the run;
the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def train(data: str, out: Path, steps: int, extra: list[str]) -> float:
    """One `draftsmith train` run; its wall time in seconds."""
    argv = [sys.executable, "-m", "draftsmith", "train", "--data", data, "--output", str(out)]
    argv += ["--max-steps", str(steps), "--save-every", str(10 * steps), *extra]
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"draftsmith train failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="a store or prepared set")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--probe-every", type=int, default=20)
    parser.add_argument("--engine", default="auto", choices=["auto", "hf", "vllm"])
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--train-args", default="", help="more `draftsmith train` options, one string")
    args = parser.parse_args()
    extra = args.train_args.split()
    probing = ["--probe-every", str(args.probe_every), "--probe-engine", args.engine]
    probing += ["--probe-num-prompts", str(args.num_prompts), "--probe-max-new-tokens", str(args.max_new_tokens)]
    with tempfile.TemporaryDirectory(prefix="probes-") as tmp:
        plain = train(args.data, Path(tmp) / "plain", args.steps, extra)
        probed = train(args.data, Path(tmp) / "probed", args.steps, extra + probing)
        lines = [json.loads(x) for x in (Path(tmp) / "probed" / "metrics.jsonl").read_text().splitlines()]
    probes = [x for x in lines if x["type"] == "probe"]
    for p in probes:
        print(
            f"step {p['step']:>5}: τ {p['acceptance_length']:.3f} ({p['engine']}, {p['prompts']}) in {p['seconds']} s"
        )
    per_probe = (probed - plain) / max(len(probes), 1)
    print(f"train alone {plain:.1f} s, with {len(probes)} probes {probed:.1f} s: {per_probe:.1f} s a probe")
    result = {
        "steps": args.steps,
        "probe_every": args.probe_every,
        "probes": len(probes),
        "engine": probes[0]["engine"] if probes else None,
        "train_s": round(plain, 1),
        "train_with_probes_s": round(probed, 1),
        "seconds_per_probe": round(per_probe, 1),
        "probe_seconds_logged": [p["seconds"] for p in probes],
        "share_of_run": round((probed - plain) / probed, 3),
        "taus": [round(p["acceptance_length"], 3) for p in probes],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
