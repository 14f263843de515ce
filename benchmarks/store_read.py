"""Reading speed of the hidden-state store and the prepared set: this tree, optionally beside another one.

    .venv/bin/python benchmarks/store_read.py                                   # this tree
    .venv/bin/python benchmarks/store_read.py --against /tmp/main-db7d796/src   # side by side with an older tree

Builds once, under --work: the tests' tiny random Llama target (4 layers, hidden 64), a prepared set of random
token sequences (--samples, 8 to 64 tokens each) and a bf16 and an fp8 store extracted from it with the
transformers backend. Then it times reading every sample, one thread, in a fresh process per tree (PYTHONPATH
is that tree's src/; the files are the same for both, the formats being unchanged):

    store_bf16_f32   a bf16 store read as float32          store_fp8_f32    an fp8 store read as float32
    store_bf16_raw   ... in its storage dtype (dtype=None; an older tree without it: dtype=torch.bfloat16,
                     which was its zero-copy read)         store_fp8_raw    ... as fp8 + scales (newer trees only)
    prepared         the prepared set                       open_ms          opening both stores and the set

With --against, the trees take turns for --rounds rounds, so a change of machine load hits both alike; each
number is the best pass over all rounds, in microseconds per sample. Prints a table on stderr, then as its
LAST line a JSON object {"this": {...}, "against": {...}, "ratio": {case: this / against}}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = ["store_bf16_f32", "store_bf16_raw", "store_fp8_f32", "store_fp8_raw", "prepared", "open_ms"]


def build(work: Path, samples: int) -> None:
    """Target, prepared set and the two stores (skipped when already there)."""
    if (work / "store-fp8" / "manifest.json").is_file():
        return
    import numpy as np

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_tiny_target

    from draftsmith.config import ExtractConfig
    from draftsmith.core.targets import target_identity
    from draftsmith.extract.stage import run as extract
    from draftsmith.prepare.dataset import write_prepared

    target = build_tiny_target(work / "target")
    identity = target_identity(target)
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(samples):
        n = int(rng.integers(8, 65))
        rows.append({"input_ids": rng.integers(0, identity.vocab_size, n), "loss_mask": rng.integers(0, 2, n)})
    write_prepared(work / "prepared", rows, identity, chat_template_hash="bench", max_length=64, shard_samples=64)
    for dtype in ("bf16", "fp8"):
        extract(
            ExtractConfig(
                prepared=work / "prepared",
                output=work / f"store-{dtype}",
                dtype=dtype,
                token_budget=1024,
                shard_size_mb=0.25,
                device="cpu",
            ),
            show_progress=False,
        )


def measure(work: Path, passes: int) -> dict:
    """Best pass per case, µs per sample, with whatever `draftsmith` this process imports."""
    import torch

    torch.set_num_threads(1)
    try:
        from draftsmith.extract import store
        from draftsmith.prepare.dataset import open_prepared
    except ImportError:  # trees before the stage packages
        from draftsmith import store
        from draftsmith.prepared import open_prepared
    raw_ok = "None" in str(store.open.__annotations__.get("dtype", ""))

    def best(data) -> float:
        times = []
        for _ in range(passes):
            t = time.perf_counter()
            for i in range(len(data)):
                data[i]
            times.append(time.perf_counter() - t)
        return min(times) / len(data) * 1e6

    t = time.perf_counter()
    opened = [store.open(work / "store-bf16"), store.open(work / "store-fp8"), open_prepared(work / "prepared")]
    out = {
        "open_ms": (time.perf_counter() - t) * 1e3,
        "samples": len(opened[2]),
        "tokens": int(opened[0].num_tokens),
        "shards": len(opened[0].manifest.shards),
    }
    for dtype in ("bf16", "fp8"):
        out[f"store_{dtype}_f32"] = best(store.open(work / f"store-{dtype}", dtype=torch.float32))
        if raw_ok:
            out[f"store_{dtype}_raw"] = best(store.open(work / f"store-{dtype}", dtype=None))
        elif dtype == "bf16":
            out[f"store_{dtype}_raw"] = best(store.open(work / f"store-{dtype}", dtype=torch.bfloat16))
        else:
            out[f"store_{dtype}_raw"] = None
    out["prepared"] = best(opened[2])
    out["source"] = str(Path(store.__file__).resolve())
    return out


def _run(src: Path, work: Path, passes: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.run(
        [sys.executable, __file__, "--measure", "--work", str(work), "--passes", str(passes)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"reading with {src} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", type=Path, default=None, help="another tree's src/ directory to compare with")
    parser.add_argument("--samples", type=int, default=120, help="samples in the prepared set (~36 tokens each)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--passes", type=int, default=20, help="passes over every sample per round")
    parser.add_argument("--work", type=Path, default=None, help="where to build (default: a temp directory)")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.work, args.passes)))
        return

    with tempfile.TemporaryDirectory(prefix="draftsmith-store-read-") as tmp:
        work = args.work or Path(tmp)
        build(work, args.samples)
        trees = {"this": ROOT / "src"} | ({"against": args.against} if args.against else {})
        results: dict[str, dict] = {}
        for _ in range(args.rounds):
            for name, src in trees.items():
                got = _run(src, work, args.passes)
                seen = results.setdefault(name, got)
                for case in CASES:
                    if got.get(case) is not None:
                        seen[case] = min(seen[case], got[case])
    this = results["this"]
    print(
        f"{this['samples']} samples, {this['tokens']} tokens, {this['shards']} shards per store; "
        f"best of {args.rounds} x {args.passes} passes, us per sample (open: ms)",
        file=sys.stderr,
    )
    print(
        f"{'case':<16}" + "".join(f"{n:>12}" for n in results) + ("       ratio" if "against" in results else ""),
        file=sys.stderr,
    )
    ratio = {}
    for case in CASES:
        cells = [results[n].get(case) for n in results]
        line = f"{case:<16}" + "".join(f"{'-' if c is None else f'{c:.1f}':>12}" for c in cells)
        if "against" in results and None not in cells:
            ratio[case] = round(cells[0] / cells[1], 3)
            line += f"{ratio[case]:>12.2f}"
        print(line, file=sys.stderr)
    summary = {
        name: {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()} for name, r in results.items()
    }
    print(json.dumps({**summary, "ratio": ratio}))


if __name__ == "__main__":
    main()
