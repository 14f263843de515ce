"""TTT attention: peak memory and speed of forward + backward over all TTT steps, the new kernel vs the dense ones.

Memory: the 8B-shaped draft's attention (hidden 4096 = 32 heads x head_dim 128, 8 KV heads, 7 TTT steps, batch 1)
at T = 512 .. --max-t, every run in a fresh subprocess: peak RSS (resource.getrusage) on CPU,
torch.cuda.max_memory_allocated with --device cuda. Kernels:
    ttt    this tree's ttt_attention (chunked causal + LSE merge on CPU, flex_attention on CUDA)
    main   ttt_attention of the baseline commit (--main-src, default /tmp/main-db7d796/src): dense [T, T] scores
    naive  naive_ttt_attention, the explicit [T, T*(k+1)] mask reference
A dense run whose extrapolated peak would not fit in the free memory is skipped (null). For each kernel the growth
ratio (peak(4T) - peak(2T)) / (peak(2T) - peak(T)) is 2 for linear memory and 4 for quadratic; the goal is <= 2.4
for 1024 -> 2048 -> 4096.

Speed: tokens/s of forward + backward at the default target's shapes (hidden 576 = 9 heads x 64, 3 KV heads, T 1024,
3 and 7 TTT steps), ttt vs main in one process, iterations alternating. --sweep-chunk times the chunk sizes of
ChunkedCausalAttention.

    .venv/bin/python benchmarks/ttt_memory.py [--device cuda] [--max-t 8192] [--skip-memory] [--skip-speed]
        [--threads 1 2] [--omp-wait-policy passive] [--sweep-chunk] [--kernels ttt main naive]

Inputs are random q/k/v (no projections), laid out as the model's; CPU runs fp32, CUDA bf16. On CPU the workers
run with MALLOC_MMAP_THRESHOLD_=65536 for the memory runs (see run_worker). The last printed line is JSON.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
ATTENTION_PY = REPO / "src" / "draftsmith" / "methods" / "attention.py"
SHAPES = {
    "8b": dict(heads=32, kv_heads=8, head_dim=128),  # Llama-3.1-8B-shaped draft
    "default": dict(heads=9, kv_heads=3, head_dim=64),  # the default target's (hidden 576)
}


# ---------------------------------------------------------------------------------------------- one run (worker)


def load_kernel(kernel: str, chunk: int | None):
    if kernel == "main":  # the baseline tree is first on PYTHONPATH (set by the parent)
        try:
            return importlib.import_module("draftsmith.model").ttt_attention  # db7d796
        except (ImportError, AttributeError):
            pass
        for name in ("draftsmith.methods.attention", "draftsmith.train.attention"):  # this layout, then before it
            try:
                return importlib.import_module(name).ttt_attention
            except ImportError:
                continue
        raise ImportError("no ttt_attention in the baseline tree")
    # This tree's module, loaded by path: it needs torch only, and stays clear of the package's other imports.
    spec = importlib.util.spec_from_file_location("ttt_attention_under_test", ATTENTION_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if chunk:
        module.CHUNK = chunk
    return module.ttt_attention if kernel == "ttt" else module.naive_ttt_attention


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def make_inputs(cfg: dict):
    """Per step q [B, Hq, T, D], k and v [B, Hkv, T, D], laid out as the model makes them: views of [B, T, H, D]
    projections (leaves here)."""
    device, dtype = torch.device(cfg["device"]), getattr(torch, cfg["dtype"])
    torch.manual_seed(0)
    b, t, steps = cfg["batch"], cfg["t"], cfg["steps"]

    def leaf(h):
        return torch.randn(b, t, h, cfg["head_dim"], device=device, dtype=dtype).requires_grad_()

    leaves = [[leaf(cfg[name]) for _ in range(steps)] for name in ("heads", "kv_heads", "kv_heads")]
    return [[x.transpose(1, 2) for x in group] for group in leaves] + [leaves]


def fwd_bwd(fn, qs, keys, values, leaves) -> float:
    """Forward of every TTT step's attention, one backward through all of them; seconds."""
    start = time.perf_counter()
    outs = [fn(qs[k], keys[: k + 1], values[: k + 1]) for k in range(len(qs))]
    sum(o.sum() for o in outs).backward()
    for x in (x for group in leaves for x in group):
        x.grad = None
    if qs[0].is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def worker(cfg: dict) -> dict:
    """kernel "ttt" / "main" / "naive": one kernel's peak memory and times. "pair": main and ttt in one process,
    iterations alternating (load drift on a shared machine hits both)."""
    cuda = cfg["device"] == "cuda"
    if cfg.get("threads"):
        torch.set_num_threads(cfg["threads"])
    if cfg["kernel"] == "pair":
        fns = {"main": load_kernel("main", None), "ttt": load_kernel("ttt", cfg.get("chunk"))}
        inputs = make_inputs(cfg)
        times = {name: [] for name in fns}
        for fn in fns.values():
            fwd_bwd(fn, *inputs)  # warm-up (and compilation on CUDA)
        for _ in range(cfg["iters"]):
            for name, fn in fns.items():
                times[name].append(round(fwd_bwd(fn, *inputs), 4))
        return {"seconds": times}
    fn = load_kernel(cfg["kernel"], cfg.get("chunk"))
    inputs = make_inputs(cfg)
    if cuda:
        fwd_bwd(fn, *inputs)  # compile / autotune outside the measurement
        torch.cuda.reset_peak_memory_stats()
        base_mb = torch.cuda.memory_allocated() / 2**20
    else:
        base_mb = current_rss_mb()
    times = [round(fwd_bwd(fn, *inputs), 4) for _ in range(cfg["iters"])]
    peak_mb = (
        torch.cuda.max_memory_allocated() / 2**20 if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )
    return {"peak_mb": round(peak_mb, 1), "base_mb": round(base_mb, 1), "seconds": times}


# ---------------------------------------------------------------------------------------------- driver


def run_worker(cfg: dict, main_src: str) -> dict | None:
    env = dict(os.environ)
    if cfg["kernel"] in ("main", "pair"):
        env["PYTHONPATH"] = main_src + os.pathsep + env.get("PYTHONPATH", "")
    if cfg.get("omp_wait_policy"):
        env["OMP_WAIT_POLICY"] = cfg["omp_wait_policy"]
    if cfg.pop("rss", False):
        # glibc serves blocks under its (dynamic, up to 32 MB) mmap threshold from heaps it seldom returns, so peak
        # RSS would follow fragmentation rather than live tensors; a fixed 64 kB threshold maps and unmaps them all.
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(cfg)], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        print(f"  {cfg['kernel']} T={cfg['t']}: failed (rc {proc.returncode}) {proc.stderr.strip()[-300:]}", flush=True)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def free_mb(device: str) -> float:
    if device == "cuda":
        return torch.cuda.mem_get_info()[0] / 2**20
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) / 1024


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def growth_ratios(peaks: dict[int, float | None]) -> dict[str, float | None]:
    ts = sorted(peaks)
    out = {}
    for t0, t1, t2 in zip(ts, ts[1:], ts[2:], strict=False):
        p0, p1, p2 = peaks[t0], peaks[t1], peaks[t2]
        key = f"{t0}->{t1}->{t2}"
        out[key] = round((p2 - p1) / (p1 - p0), 3) if None not in (p0, p1, p2) and p1 != p0 else None
    return out


def memory(args, common) -> dict:
    ts = [t for t in (512, 1024, 2048, 4096, 8192, 16384) if t <= args.max_t]
    result = {}
    for kernel in args.kernels:
        peaks: dict[int, float | None] = {}
        stopped = False
        for t in ts:
            known = [peaks[x] for x in sorted(peaks) if peaks[x] is not None]
            if stopped:
                peaks[t] = None
                continue
            if kernel != "ttt" and len(known) >= 2:  # quadratic extrapolation: doubling T adds 4x what it added
                predicted = known[-1] + 4 * (known[-1] - known[-2])
                if predicted > 0.8 * free_mb(args.device):
                    print(
                        f"  {kernel} T={t}: skipped, ~{predicted:.0f} MB predicted, {free_mb(args.device):.0f} MB free",
                        flush=True,
                    )
                    peaks[t], stopped = None, True
                    continue
            res = run_worker(
                dict(common, kernel=kernel, t=t, steps=7, iters=1, rss=args.device == "cpu", **SHAPES["8b"]),
                args.main_src,
            )
            peaks[t] = res["peak_mb"] if res else None
            stopped = res is None
            if res:
                print(
                    f"  {kernel} T={t}: peak {res['peak_mb']:.0f} MB (base {res['base_mb']:.0f}), "
                    f"fwd+bwd {res['seconds'][0]:.2f} s, load {load()}",
                    flush=True,
                )
        result[kernel] = {"peak_mb": {str(t): p for t, p in peaks.items()}, "growth_ratio": growth_ratios(peaks)}
    return result


def speed(args, common) -> dict:
    result = {}
    for threads in args.threads:
        for steps in (3, 7):
            key = f"steps_{steps}" + (f"_threads_{threads}" if threads else "")
            res = run_worker(
                dict(
                    common, kernel="pair", t=1024, steps=steps, iters=args.iters, threads=threads, **SHAPES["default"]
                ),
                args.main_src,
            )
            if res is None:
                result[key] = None
                continue
            med = {k: statistics.median(v) for k, v in res["seconds"].items()}
            row = {f"{k}_tokens_per_s": round(common["batch"] * 1024 / v, 1) for k, v in med.items()}
            row["speedup"] = round(med["main"] / med["ttt"], 3)
            row["load"] = load()
            print(
                f"  speed, {steps} TTT steps, threads {threads or torch.get_num_threads()}: median of "
                f"{args.iters}, tokens/s main {row['main_tokens_per_s']}, ttt {row['ttt_tokens_per_s']} "
                f"(x{row['speedup']}), load {row['load']}",
                flush=True,
            )
            result[key] = row
    return result


def sweep_chunk(args, common) -> dict:
    result = {}
    for name, t, steps in (("default", 1024, 7), ("8b", 1024, 3)):
        row = {}
        for chunk in (32, 64, 128, 256, 512):
            res = run_worker(
                dict(
                    common,
                    kernel="ttt",
                    t=t,
                    steps=steps,
                    iters=args.iters,
                    chunk=chunk,
                    threads=args.threads[0],
                    **SHAPES[name],
                ),
                args.main_src,
            )
            row[str(chunk)] = round(statistics.median(res["seconds"][1:]), 4) if res else None
        print(f"  chunk sweep {name} T={t} steps={steps}: seconds {row}, load {load()}", flush=True)
        result[f"{name}_T{t}_steps{steps}"] = row
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    parser.add_argument("--max-t", type=int, default=8192)
    parser.add_argument("--kernels", nargs="+", default=["ttt", "main", "naive"])
    parser.add_argument("--main-src", default="/tmp/main-db7d796/src")
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[0],
        help="torch threads in the speed workers (0: torch's default); one speed run per value",
    )
    parser.add_argument(
        "--omp-wait-policy",
        choices=("active", "passive"),
        help="OMP_WAIT_POLICY of the workers: on a CPU shared with other jobs, libgomp's spinning "
        "waits (the default) can make every multi-threaded op wait for a descheduled thread",
    )
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--sweep-chunk", action="store_true")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    common = dict(device=args.device, dtype=dtype, batch=1, omp_wait_policy=args.omp_wait_policy)
    report = {
        "device": args.device,
        "dtype": dtype,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "omp_wait_policy": args.omp_wait_policy,
        "load_before": load(),
    }
    if args.device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
    if not Path(args.main_src).is_dir():
        print(f"  no baseline tree at {args.main_src}: the main kernel is left out", flush=True)
        args.kernels = [k for k in args.kernels if k != "main"]
        args.skip_speed = True
    if args.sweep_chunk:
        report["chunk_sweep_seconds"] = sweep_chunk(args, common)
    if not args.skip_memory:
        report["memory_8b_7_steps"] = memory(args, common)
    if not args.skip_speed:
        report["tokens_per_s_default_T1024"] = speed(args, common)
    report["load_after"] = load()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
