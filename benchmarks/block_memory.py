"""DFlash training at the peers' defaults on the default target: peak memory and tokens/s, this tree against another.

One timed unit = one optimizer step as the trainer runs it (`train.stage`): the batch's BlockIndex (block 16, 512
anchors per sample), the target's distribution at layer N through the default target's own final norm and lm_head
(TargetHead in bf16, under bf16 autocast: `train --precision auto` on a CPU that computes bf16), the DFlash forward
(5 draft layers reading target layers dflash_aux_layer_ids(30, 5)), the loss (block positions weighted
exp(-(j - 1) / 7)), backward, gradient clipping at 1.0 and AdamW. Step i computes the metrics (the target's
top-1, the acceptance) when i % --log-every == 0, as the trainer's logged steps do: the warm-up step here.

The draft is DFlashDraft.from_target on the default target, SmolLM2-135M-Instruct (`core.assets`; its embedding
and lm_head, 49,152 tokens, hidden 576, 30 layers), loaded without its decoder layers (`targets.load_target_head`).
The target is NOT run: its hidden states are random -- the 5 aux layers [1, 1024, 5 * 576] and layer N
[1, 1024, 576], bf16 as a store keeps them --, since a step's memory and time do not depend on their values. One
sample of 1,024 tokens whose first quarter is a prompt (not scored): 766 positions can anchor a block, 512 are drawn
(7,621 scored block rows, 767 target rows).

Every run is a fresh subprocess; its peak RSS is resource.getrusage(RUSAGE_SELF).ru_maxrss -- the whole process:
Python, torch, the target's head, the draft, the optimizer and the steps. Each tree runs twice:
    glibc    the allocator as `train` runs it (glibc's defaults): peak_mb and the timings. After the first step
             glibc's dynamic mmap threshold has grown to the freed tensors' size (up to 32 MB), so later steps' tensors
             come from heaps it seldom returns: the peak includes that fragmentation.
    mmap64k  MALLOC_MMAP_THRESHOLD_=65536 (fixed; as benchmarks/ttt_memory.py): every tensor is mapped and unmapped,
             so the peak follows the live tensors (peak_mb_live; the warm-up and one step, slower, not timed).
The trees, run alternately (--repeats times each) so that load on a shared machine hits both:
    before  the code of --main-src (default: `git archive 037a87d` of this repository, extracted under
            /tmp/draftsmith-037a87d), its src first on sys.path
    after   this tree's src

    .venv/bin/python benchmarks/block_memory.py [--steps 3] [--repeats 1] [--log-every 10] [--checkpointing]
        [--skip-live] [--omp-wait-policy passive] [--main-src DIR] [--method dspark] [--draft-vocab-size N] [--draft-vocab-size N]

--draft-vocab-size N: the 'after' run trains a draft over a reduced draft vocabulary of N ids (`train --method dflash
--draft-vocab-size N`: its own lm_head [N, H] from the target's rows, trained; the N most frequent ids of the sample's
loss-masked tokens, ties by id) and 'before' defaults to this tree's src too (the target's whole vocabulary): the two
differ by the draft vocabulary alone.

--method dspark: 'after' is DSpark's draft in this tree (DFlash's backbone with the rank-256 Markov and confidence heads,
every block row proposing: 512 anchors of 16 rows), 'before' this tree's DFlash; --draft-vocab-size N: 'after' is
this tree's DFlash over N ids. Either way the 'before' tree is this one.

--checkpointing runs both trees with `train --activation-checkpointing` (the draft layers' activations recomputed in
the backward). Progress goes to stderr; the LAST stdout line is one JSON object: per tree, peak_mb (glibc) and
peak_mb_live (mmap64k) with each run's, the RSS before the steps, the median seconds and tokens/s of the timed steps
(glibc, after the warm-up), the logged step's seconds, the first step's loss and metrics (the same seeds and inputs
for both trees: they agree), which src was imported; the machine's load average at the start and the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_COMMIT = "037a87d"
PEERS = dict(block_size=16, anchors_per_sample=512, num_layers=5, seq=1024, loss_decay=7.0)


# ---------------------------------------------------------------------------------------------- one run (worker)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(cfg: dict) -> dict:
    """Build the DFlash draft on the default target's head and time `warmup + steps` optimizer steps."""
    import numpy as np
    import torch

    import draftsmith
    from draftsmith.core import assets, targets
    from draftsmith.core.layers import dflash_aux_layer_ids

    try:
        from draftsmith.methods.dflash.modeling import DFlashDraft  # the method packages
        from draftsmith.methods.spec import DraftSpec
    except ImportError:  # a tree before them
        from draftsmith.train.model import DraftSpec  # type: ignore[no-redef]

        try:
            from draftsmith.train.dflash_model import DFlashDraft  # type: ignore[no-redef]  # since 8128af8
        except ImportError:  # 037a87d, the default 'before' tree
            from draftsmith.train.model import DFlashDraft  # type: ignore[attr-defined, no-redef]
    from draftsmith.train.blocks import block_index

    try:
        from draftsmith.methods.objective import Anchors  # the method packages
    except ImportError:  # a tree before them
        from draftsmith.train.blocks import Anchors  # type: ignore[no-redef]
    from draftsmith.train.objective import TargetHead, TTTModel, summarise

    try:
        from draftsmith.core.hostmem import trim_freed_heap as trim
    except ImportError:  # a tree before it
        trim = None  # type: ignore[assignment]

    torch.manual_seed(0)
    path = assets.default_target_dir()
    config = targets.read_config(path)
    parts = targets.load_target_head(path, dtype=torch.float32)  # what `train` loads offline on a CPU
    layers, block, seq = cfg["num_layers"], cfg["block_size"], cfg["seq"]
    aux_ids = dflash_aux_layer_ids(int(config["num_hidden_layers"]), layers)
    spec = DraftSpec.from_target_config(config, int(config["vocab_size"]), layers, aux_ids)
    mask_id = config.get("pad_token_id") or 0  # setup.mask_token_id's choice for this target (its pad token)
    spec = spec.model_copy(update=dict(method="dflash", block_size=block, mask_token_id=int(mask_id)))
    dspark = (
        cfg.get("method") == "dspark"
    )  # DSpark's draft (this tree only): DFlash's with the Markov and confidence heads
    if dspark:
        from draftsmith.methods.dspark.method import DEFAULT_MARKOV_RANK
        from draftsmith.methods.dspark.modeling import DSparkDraft

        spec = spec.model_copy(update=dict(method="dspark", markov_rank=DEFAULT_MARKOV_RANK))
        draft = DSparkDraft.from_target(spec, parts, 0)
    elif cfg.get("draft_vocab_size"):  # a reduced draft vocabulary (this tree only)
        from draftsmith.methods.vocab import build_draft_vocab

        sample = torch.randint(0, spec.vocab_size, (1, seq), generator=torch.Generator().manual_seed(1))
        counts = np.bincount(sample[0, seq // 4 :].numpy(), minlength=spec.vocab_size)  # the loss-masked tokens'
        vocab = build_draft_vocab(counts, cfg["draft_vocab_size"])
        spec = spec.model_copy(update={"draft_vocab_size": vocab.draft_vocab_size})
        draft = DFlashDraft.from_target(spec, parts, 0, vocab.draft_to_target)
    else:
        draft = DFlashDraft.from_target(spec, parts, 0)
    head = TargetHead(targets.final_norm(parts), targets.lm_head(parts).weight, draft.draft_to_target, torch.bfloat16)
    model = TTTModel(draft)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    step_weight = math.exp(-1.0 / cfg["loss_decay"])

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec.vocab_size, (1, seq), generator=gen)
    mask = np.ones((1, seq), dtype=bool)
    mask[:, : seq // 4] = False  # a prompt
    # (trees before DSpark have no from_anchor)
    anchors = (
        Anchors(block, cfg["anchors_per_sample"], 0, from_anchor=True)
        if dspark
        else Anchors(block, cfg["anchors_per_sample"], 0)
    )
    index = block_index(mask, anchors, [0])
    proposals = block if dspark else block - 1  # DSpark's anchor row proposes too
    h = spec.target_hidden_size
    aux = torch.randn(1, seq, len(aux_ids) * h, generator=gen).bfloat16()
    last = torch.randn(1, seq, h, generator=gen).bfloat16()

    base = _rss_mb()
    times, logged, first = [], None, None
    for i in range(cfg["warmup"] + cfg["steps"]):
        metrics = i % cfg["log_every"] == 0
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            target = head(last, index, full=metrics)
            out = model(
                ids,
                aux,
                target,
                index,
                proposals,
                step_weight=step_weight,
                metrics=metrics,
                checkpointed=cfg["checkpointed"],
            )
            out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if trim is not None:  # as train.stage.optimizer_step on a CPU (since core/hostmem.py)
            trim()
        seconds = time.perf_counter() - start
        if first is None:
            first = {"loss": out.loss.item(), **summarise(*out.sums, step_weight)}
        if metrics:
            logged = seconds
        if i >= cfg["warmup"]:
            times.append(seconds)
        print(f"    step {i + 1}: {seconds:.2f} s{' (metrics)' if metrics else ''}", file=sys.stderr, flush=True)
        del out, target
    return {
        "src": str(Path(draftsmith.__file__).resolve().parents[1]),
        "scored_rows": int(sum(len(r) for r in index.scored)),
        "needed_rows": int(len(index.needed)),
        "rss_before_steps_mb": round(base, 1),
        "peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "seconds": [round(t, 3) for t in times],
        "logged_step_s": None if logged is None else round(logged, 3),
        "first_step": first,
        "threads": torch.get_num_threads(),
    }


# ---------------------------------------------------------------------------------------------- driver


def main_tree(commit: str) -> Path:
    """`git archive <commit>` of this repository's src, extracted once under /tmp; returns its src."""
    root = Path(tempfile.gettempdir()) / f"draftsmith-{commit}"
    if not (root / "src" / "draftsmith").is_dir():
        root.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", "--format=tar", commit, "src"], capture_output=True, check=True
        )
        with tempfile.TemporaryFile() as f:
            f.write(archive.stdout)
            f.seek(0)
            with tarfile.open(fileobj=f) as tar:
                tar.extractall(root, filter="data")
    return root / "src"


def run_worker(cfg: dict, src: Path, live: bool, omp_wait_policy: str | None = None) -> dict | None:
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if live:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    if omp_wait_policy:
        env["OMP_WAIT_POLICY"] = omp_wait_policy
    env["PYTHONPATH"] = str(src) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(cfg)], env=env, capture_output=True, text=True
    )
    sys.stderr.write(
        proc.stderr
        if proc.returncode
        else "".join(x + "\n" for x in proc.stderr.splitlines() if x.startswith("    step"))
    )
    if proc.returncode != 0:
        print(f"  {src}: failed (rc {proc.returncode})", file=sys.stderr, flush=True)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def summary(runs: list[dict], live: list[dict], seq: int) -> dict:
    times = [t for r in runs for t in r["seconds"]]
    median = statistics.median(times) if times else None
    return {
        "src": runs[0]["src"],
        "peak_mb": max(r["peak_mb"] for r in runs),
        "peak_mb_runs": [r["peak_mb"] for r in runs],
        "peak_mb_live": max((r["peak_mb"] for r in live), default=None),
        "peak_mb_live_runs": [r["peak_mb"] for r in live],
        "rss_before_steps_mb": [r["rss_before_steps_mb"] for r in runs],
        "step_s_median": None if median is None else round(median, 3),
        "step_s": times,
        "tokens_per_s": None if median is None else round(seq / median, 1),
        "logged_step_s": [r["logged_step_s"] for r in runs],
        "first_step": runs[0]["first_step"],
        "scored_rows": runs[0]["scored_rows"],
        "needed_rows": runs[0]["needed_rows"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--main-src", help=f"the 'before' tree's src (default: {DEFAULT_COMMIT}, git archive)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run, after one warm-up step")
    parser.add_argument("--repeats", type=int, default=1, help="runs per tree and allocator, alternating")
    parser.add_argument("--log-every", type=int, default=10, help="step i computes the metrics when i %% N == 0")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing in both trees")
    parser.add_argument("--skip-live", action="store_true", help="no mmap64k runs (glibc's peak and the timings only)")
    parser.add_argument(
        "--omp-wait-policy",
        choices=("active", "passive"),
        help="OMP_WAIT_POLICY of the workers: on a CPU shared with other jobs, libgomp's spinning waits (the "
        "default) make every multi-threaded op wait for a descheduled thread (steps 5-15x slower in a rehearsal)",
    )
    parser.add_argument(
        "--method",
        choices=("dflash", "dspark"),
        default="dflash",
        help="the 'after' run's method: dspark runs DSpark's draft (rank-256 Markov and confidence heads) against "
        "this tree's DFlash ('before'), at the same block, anchors and layers",
    )
    parser.add_argument(
        "--draft-vocab-size",
        type=int,
        help="the 'after' run's draft over a reduced vocabulary of N ids ('before': this tree, the whole vocabulary)",
    )
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.main_src:
        before = Path(args.main_src)
    else:
        before = REPO / "src" if args.draft_vocab_size or args.method != "dflash" else main_tree(DEFAULT_COMMIT)
    trees = {"before": before, "after": REPO / "src"}
    cfg = dict(PEERS, warmup=1, steps=args.steps, log_every=args.log_every, checkpointed=args.checkpointing)
    vocab = {"before": None, "after": args.draft_vocab_size}  # the draft vocabulary of each run (None: the target's)
    cfg["draft_vocab_size"], cfg["method"] = vocab, {"before": "dflash", "after": args.method}
    report: dict = {"config": cfg, "trees": {k: str(v) for k, v in trees.items()}, "load_before": load()}
    report["omp_wait_policy"] = args.omp_wait_policy
    runs: dict[tuple[str, bool], list[dict]] = {(name, live): [] for name in trees for live in (False, True)}
    for repeat in range(args.repeats):
        for live in (False,) if args.skip_live else (False, True):
            for name, src in trees.items():
                what = f"{name}, {'mmap64k' if live else 'glibc'}, run {repeat + 1}/{args.repeats}"
                print(f"  {what} ({src}), load {load()}", file=sys.stderr, flush=True)
                one = dict(cfg, draft_vocab_size=vocab[name], method="dflash" if name == "before" else args.method)
                res = run_worker(dict(one, steps=1) if live else one, src, live, args.omp_wait_policy)  # live: step 2
                if res is not None:
                    runs[name, live].append(res)
                    print(f"  {what}: peak {res['peak_mb']:.0f} MB, steps {res['seconds']} s", file=sys.stderr)
    for name in trees:
        report[name] = summary(runs[name, False], runs[name, True], cfg["seq"]) if runs[name, False] else None
    if report["before"] and report["after"]:
        b, a = report["before"], report["after"]
        report["peak_ratio"] = round(a["peak_mb"] / b["peak_mb"], 3)
        if a["peak_mb_live"] and b["peak_mb_live"]:
            report["peak_live_ratio"] = round(a["peak_mb_live"] / b["peak_mb_live"], 3)
        report["speedup"] = round(a["tokens_per_s"] / b["tokens_per_s"], 3)
        report["loss_rel_diff"] = abs(a["first_step"]["loss"] - b["first_step"]["loss"]) / abs(b["first_step"]["loss"])
    report["load_after"] = load()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
