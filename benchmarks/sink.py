"""The vLLM extraction's host side alone, this tree against a baseline tree, side by side in one run.

One Kimi-K2.5-shaped prefill step -- 16,384 tokens (4 requests of 4,096), 4 layer ids of hidden 7168, bf16: the
[16384, 4, 7168] states the layer taps or vLLM's aux outputs hand over on one rank -- goes through draftsmith's own
`RunnerTaps` (installed on a stand-in for vLLM's model runner) into a `StoreSink` writing an fp8 store (the Kimi
recipe's), until `finish_store` returns: the copy to the host, the NaN/Inf check, the fp8 encoding, the shard's
bytes, its hash and its write. On a GPU the copies and the encoding cost differently; here every "device" tensor is
already on the CPU, so this measures the host work the writer thread and the step do, in draftsmith's code.

Each side runs in a fresh process of this venv with PYTHONPATH set to one tree's src/ (the baseline is checked out
with `git worktree` into a temporary directory and removed after), rounds alternating.

    python benchmarks/sink.py [--baseline 4178c84~1] [--rounds 3] [--tokens 16384]

Last line: JSON with the median seconds of each side, tokens/s of each, their ratio and the load averages.

    python benchmarks/sink.py --copies --device cuda [--tokens 16384] [--rounds 5]

The crossing alone, in this process (the GPU check runs it): the same step's states on the device, as the sink took
them before (encoded there, then `.to("cpu")` into pageable memory, waiting) against `common.to_host` (encoded there,
copied into pinned memory on a side stream): the seconds the step is held, the seconds until the bytes are on the
host, and GB/s of the fp8 bytes. On a CPU (the rehearsal) there is no copy and no pinned memory: both rows time the
encoding alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from baseline import REPO, baseline_tree

LAYERS, HIDDEN, REQUESTS = [2, 30, 58, 61], 7168, 4

CHILD = r"""
import json, sys, time, tempfile
from pathlib import Path
import numpy as np, torch
from draftsmith.core.targets import resolve_target, target_identity
from draftsmith.extract import store as store_module
from draftsmith.extract.vllm import taps
from draftsmith.extract.vllm.driver import tag_request
from draftsmith.extract.vllm.sink import SinkConfig, StoreSink
from draftsmith.extract.vllm.taps import TapPlan
from draftsmith.prepare.dataset import open_prepared, write_prepared

tokens, layers, hidden, requests, work = int(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3]), \
    int(sys.argv[4]), Path(sys.argv[5])
per = tokens // requests
target = resolve_target(None)
prepared = work / "prepared"
if not prepared.exists():
    rng = np.random.default_rng(0)
    write_prepared(prepared, [{"input_ids": rng.integers(4, 1000, per), "loss_mask": np.ones(per, dtype=np.int64)}
                              for _ in range(requests)], target_identity(target), chat_template_hash="b",
                   max_length=per)
data = open_prepared(prepared)
spec = store_module.StoreSpec(target=target_identity(target), prepared=store_module.prepared_ref(data),
                              layer_ids=layers, hidden_size=hidden, dtype="fp8", backend="vllm")
torch.manual_seed(0)
aux = [torch.randn(tokens, hidden).to(torch.bfloat16) for _ in layers]


class Runner:  # what taps.install touches on vLLM's model runner
    def __init__(self):
        self.use_aux_hidden_state_outputs, self.execute_model_state = False, None
        self.model = type("M", (), {"set_aux_hidden_state_layers": lambda self, ids: None})()

    def get_model(self):
        return self.model

    def execute_model(self, step):
        self.execute_model_state = type("S", (), {"aux_hidden_states": aux})()


class Req:
    def __init__(self, i):
        self.req_id, self.prompt_token_ids = f"r{i}", data[i]["input_ids"].tolist()
        self.sampling_params = type("P", (), {"extra_args": tag_request("direct", i)})()


runner = Runner()
runner.input_batch = type("B", (), {"req_ids": [f"r{i}" for i in range(requests)], "num_reqs": requests})()
store = Path(tempfile.mkdtemp(dir=work)) / "store"
sink = StoreSink(SinkConfig(store=str(store), prepared=str(prepared), spec=spec, worker=(0, 1), shard_bytes=1 << 30))
taps.install(runner, sink, TapPlan(strategy="direct", layer_ids=layers, num_layers=max(layers), stack_class=None,
                                   vllm_ids=layers, hook_ids=[], stream_arg=1, two_phase=True))
step = type("Step", (), {"scheduled_new_reqs": [Req(i) for i in range(requests)],
                         "num_scheduled_tokens": {f"r{i}": per for i in range(requests)}})()
start = time.perf_counter()
runner.execute_model(step)
step_s = time.perf_counter() - start
report = sink.finish_store()
total = time.perf_counter() - start
assert report.error is None and report.samples_written == requests, report
print(json.dumps({"seconds": total, "step_seconds": step_s}))
"""


def run_side(src: Path, tokens: int, work: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(src))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tokens), json.dumps(LAYERS), str(HIDDEN), str(REQUESTS), str(work)],
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"the sink path failed in {src}: {done.stderr.strip().splitlines()[-3:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def copies(tokens: int, rounds: int, device: str) -> dict:
    """The crossing of one step's states to the host, pageable and synchronous against pinned on a side stream."""
    import time

    import torch

    from draftsmith.extract import common
    from draftsmith.extract.store.codec import encode_hidden_states

    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    layers = [torch.randn(tokens, HIDDEN, device=dev).to(torch.bfloat16) for _ in LAYERS]
    fp8_bytes = tokens * len(LAYERS) * (HIDDEN + 4)

    def pageable():
        data, scales = encode_hidden_states(torch.stack(layers, dim=1), "fp8")
        data.to("cpu"), scales.to("cpu")

    def pinned():
        return common.to_host(layers, "fp8")

    rows: dict[str, list[tuple[float, float]]] = {"pageable": [], "pinned": []}
    for i in range(rounds + 1):  # the first round of each warms the allocators (pinned: its caching host allocator)
        for name in rows:
            sync()
            start = time.perf_counter()
            out = pageable() if name == "pageable" else pinned()
            held = time.perf_counter() - start
            if out is not None and out.ready is not None:
                out.ready()
            sync()
            if i:
                rows[name].append((held, time.perf_counter() - start))
    result: dict = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "tokens": tokens,
        "layers": len(LAYERS),
        "hidden": HIDDEN,
        "fp8_mb": round(fp8_bytes / 2**20, 1),
    }
    for name, got in rows.items():
        held, done = statistics.median(h for h, _ in got), statistics.median(d for _, d in got)
        result[name] = {
            "step_held_s": round(held, 4),
            "on_host_s": round(done, 4),
            "gb_per_s": round(fp8_bytes / done / 1e9, 2),
        }
        print(
            f"{name}: the step held {held * 1e3:.1f} ms, bytes on the host after {done * 1e3:.1f} ms "
            f"({result[name]['gb_per_s']} GB/s of fp8)",
            flush=True,
        )
    result["pinned_vs_pageable"] = round(result["pageable"]["on_host_s"] / result["pinned"]["on_host_s"], 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="4178c84~1")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--copies", action="store_true", help="the crossing alone, pageable against pinned")
    parser.add_argument("--device", default="cuda", help="with --copies: where the states are (cuda, or cpu)")
    args = parser.parse_args()
    if args.copies:
        print(json.dumps(copies(args.tokens, args.rounds, args.device)))
        return
    runs: dict[str, list[dict]] = {"ours": [], "baseline": []}
    with baseline_tree(args.baseline) as base:
        for _ in range(args.rounds):
            for side, src in (("ours", REPO / "src"), ("baseline", base / "src")):
                out = run_side(src, args.tokens, base.parent)  # the prepared set is made once, there
                runs[side].append(out)
                print(f"{side}: {out['seconds']:.2f} s (the step itself {out['step_seconds']:.2f} s)", flush=True)
    median = {side: statistics.median(r["seconds"] for r in rs) for side, rs in runs.items()}
    step = {side: statistics.median(r["step_seconds"] for r in rs) for side, rs in runs.items()}
    print(
        json.dumps(
            {
                "tokens": args.tokens,
                "layers": len(LAYERS),
                "hidden": HIDDEN,
                "store": "fp8",
                "seconds": {k: round(v, 3) for k, v in median.items()},
                "step_seconds": {k: round(v, 3) for k, v in step.items()},
                "tokens_per_s": {k: round(args.tokens / v) for k, v in median.items()},
                "speedup": round(median["baseline"] / median["ours"], 2),
                "baseline": args.baseline,
                "load_average": [round(x, 2) for x in os.getloadavg()],
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
