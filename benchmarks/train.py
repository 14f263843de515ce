"""Training-step throughput and peak memory across sequence lengths, for the quickstart's draft and an 8B-shaped one.

One timed unit = one optimizer step at batch 1, exactly as the trainer runs it: the collate's StepIndex, the
target's distribution from layer N (draft vocabulary; the full vocabulary too on a logged step, one in
--log-every), the TTT unroll forward + backward, gradient clipping, AdamW. Features and weights are random
(throughput and memory do not depend on values). Shapes:
    quickstart  the default target's draft (hidden 576, 9/3 heads, target vocab 49152), draft vocab 8192, 3 TTT steps
    8b          Llama-3.1-8B-shaped (hidden 4096, 32/8 heads x 128, MLP 14336, target vocab 128256), draft vocab
                32000, 7 TTT steps
    kimi        Kimi-K2.5-shaped (hidden 7168, 56/8 heads x 128, MLP 18432, target vocab 163840), draft vocab 32000,
                7 TTT steps (the GPU check's reference-job step, with --checkpointing and --kernel flex / chunked)
Every (shape, T) runs in a fresh process, so its peak memory is its own: on CPU the peak RSS over the steps above
the RSS before them (VmHWM, reset through /proc/self/clear_refs: the steps' own memory), on a GPU
torch.cuda.max_memory_allocated above the memory allocated before them. `ratio_vs_naive` is the same step
with the explicit-mask attention reference (mode "naive", dense [T, T*(k+1)] scores) over ours, at the quickstart
shape and T 1024; `growth_8b` is (peak(4T) - peak(2T)) / (peak(2T) - peak(T)) over the 8b sweep (2 = linear).

    python benchmarks/train.py                       # quickstart T 512..8192, 8b T 1024..4096, CPU fp32
    python benchmarks/train.py --shape 8b --seqs 2048,8192 --device cuda --dtype bf16 [--compile]
    python benchmarks/train.py --shape kimi --seqs 4096 --vary 12 --compile --device cuda --dtype bf16
Last line: JSON with tokens_per_s_by_T, peak_mb_by_T (per shape), growth_8b and ratio_vs_naive; with --vary N, N
steps at random lengths in [T/2, T] in one process instead (as micro-batches come), and the number of graphs the
compiled layers and kernel made over them (`unique_graphs`: a handful, not one per length).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time

import torch

from draftsmith.methods.eagle3.modeling import Eagle3Draft
from draftsmith.methods.spec import DraftSpec
from draftsmith.train.objective import TargetHead, TTTModel
from draftsmith.train.unrolled import step_index

SHAPES = {
    "quickstart": dict(
        config={
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "head_dim": 64,
            "rms_norm_eps": 1e-5,
            "vocab_size": 49152,
            "max_position_embeddings": 8192,
            "rope_theta": 100000.0,
            "hidden_act": "silu",
            "num_hidden_layers": 30,
        },
        draft_vocab=8192,
        ttt_steps=3,
        aux=[2, 15, 27],
    ),
    "8b": dict(
        config={
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "rms_norm_eps": 1e-5,
            "vocab_size": 128256,
            "max_position_embeddings": 131072,
            "rope_theta": 500000.0,
            "hidden_act": "silu",
            "num_hidden_layers": 32,
        },
        draft_vocab=32000,
        ttt_steps=7,
        aux=[2, 16, 29],
    ),
}
SHAPES["kimi"] = dict(
    config={
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "num_attention_heads": 56,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "vocab_size": 163840,
        "max_position_embeddings": 262144,
        "rope_theta": 50000.0,
        "hidden_act": "silu",
        "num_hidden_layers": 61,
    },
    draft_vocab=32000,
    ttt_steps=7,
    aux=[2, 30, 58],
)
SHAPES["tiny"] = dict(
    config={
        **SHAPES["quickstart"]["config"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 320,
    },
    draft_vocab=128,
    ttt_steps=2,
    aux=[2, 15, 27],
)  # the GPU check's CPU rehearsal
DEFAULT_SEQS = {
    "quickstart": [512, 1024, 2048, 4096, 8192],
    "8b": [1024, 2048, 4096],
    "kimi": [4096],
    "tiny": [64, 128],
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def _reset_peak_rss() -> None:
    """Linux: make VmHWM (peak RSS) restart from the current RSS, so the peak read later is the step's."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _setup(shape: str, device: torch.device, compile_layers: str | None, lean: bool, kernel: str = "auto"):
    """The draft, target head, optimizer and one batch of random features of length `seq`, as the trainer has them."""
    s = SHAPES[shape]
    spec = DraftSpec.from_target_config(s["config"], s["draft_vocab"], 1, s["aux"])
    torch.manual_seed(0)
    with torch.device(device):
        draft = Eagle3Draft(spec)
        norm = torch.nn.RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        head_weight = torch.randn(spec.vocab_size, spec.hidden_size) * 0.05
    draft.init_weights(0)
    draft.set_draft_vocab(torch.sort(torch.randperm(spec.vocab_size)[: spec.draft_vocab_size]).values)
    if compile_layers:  # a torch.compile backend (inductor; eager only traces, for rehearsals)
        for layer in draft.layers:
            layer.compile(dynamic=True, backend=compile_layers)
    if lean:  # the frozen tensors in bf16 and no optimizer state: what stays the same at every T, made smaller
        head_weight = head_weight.bfloat16()
        draft.embed_tokens.weight.data = draft.embed_tokens.weight.data.bfloat16()
    head = TargetHead(norm, head_weight, draft.draft_to_target)
    model = TTTModel(draft, kernel)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = (
        torch.optim.SGD(params, lr=1e-4)
        if lean
        else torch.optim.AdamW(params, lr=1e-4, fused=True if device.type == "cuda" else None)
    )
    return spec, head, model, params, optimizer


def _batch(spec, shape: str, seq: int, device: torch.device):
    s = SHAPES[shape]
    ids = torch.randint(0, spec.vocab_size, (1, seq))
    mask = torch.ones(1, seq, dtype=torch.bool)
    mask[:, : seq // 4] = False  # a prompt: a quarter of the positions are not scored
    index = step_index(mask.numpy(), s["ttt_steps"]).map(lambda x: x.to(device))
    store_dtype = torch.bfloat16  # as a store keeps it; decoded on the device
    hidden = torch.randn(1, seq, len(s["aux"]) + 1, spec.hidden_size, device=device, dtype=store_dtype)
    return ids.to(device), index, hidden


def _step(shape, seq, head, model, params, optimizer, batch, dtype, device, mode, checkpointed, full) -> None:
    ids, index, hidden = batch
    compute = torch.bfloat16 if dtype == "bf16" else torch.float32
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()
    with autocast:
        aux = hidden[:, :, :-1].to(compute).reshape(1, seq, -1)
        target = head(hidden[:, :, -1].to(compute), index, full=full)
        out = model(
            ids, aux, target, index, SHAPES[shape]["ttt_steps"], metrics=full, mode=mode, checkpointed=checkpointed
        )
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 0.5)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def vary(
    shape: str,
    seq: int,
    n: int,
    device: torch.device,
    dtype: str,
    compile_layers: str | None,
    checkpointed: bool,
    kernel: str = "auto",
) -> dict:
    """`n` optimizer steps at random lengths in [seq/2, seq] in this process, as the trainer's micro-batches come:
    tokens/s over them and the graphs dynamo made (a new graph per length would recompile every step and, past its
    cache limit, fall back to eager flex with dense scores)."""
    import random

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    spec, head, model, params, optimizer = _setup(shape, device, compile_layers, False, kernel)
    rng = random.Random(0)
    lengths = [rng.randint(seq // 2, seq) for _ in range(n)]
    tokens, start = 0, time.perf_counter()
    for i, t in enumerate(lengths):
        batch = _batch(spec, shape, t, device)
        _step(shape, t, head, model, params, optimizer, batch, dtype, device, "ttt", checkpointed, False)
        _sync(device)
        tokens += t
        print(
            f"  {shape} vary {i + 1}/{n} T={t} graphs so far {counters['stats']['unique_graphs']}",
            file=sys.stderr,
            flush=True,
        )
    seconds = time.perf_counter() - start
    return {
        "shape": shape,
        "lengths": lengths,
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
        "compile": compile_layers,
        "kernel": kernel,
        "device": str(device),
        "dtype": dtype,
    }


def measure(
    shape: str,
    seq: int,
    steps: int,
    warmup: int,
    mode: str,
    device: torch.device,
    dtype: str,
    compile_layers: str | None,
    checkpointed: bool,
    log_every: int,
    lean: bool = False,
    kernel: str = "auto",
) -> dict:
    """One (shape, T) in this process: seconds per step (median) and the step's peak memory."""
    spec, head, model, params, optimizer = _setup(shape, device, compile_layers, lean, kernel)
    batch = _batch(spec, shape, seq, device)
    _sync(device)
    _reset_peak_rss()
    base = _status_mb("VmRSS:")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) / 2**20
    times = []
    for i in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        _step(shape, seq, head, model, params, optimizer, batch, dtype, device, mode, checkpointed, i % log_every == 0)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        print(
            f"  {shape} T={seq} {mode}: step {i + 1}/{warmup + steps} {time.perf_counter() - t0:.2f}s",
            file=sys.stderr,
            flush=True,
        )
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20 - base
    else:
        peak = _status_mb("VmHWM:") - base
    median = sorted(times)[len(times) // 2]
    return {
        "shape": shape,
        "seq": seq,
        "mode": mode,
        "s_per_step": round(median, 3),
        "tokens_per_s": round(seq / median, 1),
        "peak_mb": round(peak, 1),
    }


def _child(args, shape: str, seq: int, mode: str) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        shape,
        str(seq),
        mode,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--log-every",
        str(args.log_every),
    ]
    cmd += ["--compile", args.compile] * bool(args.compile) + ["--checkpointing"] * args.checkpointing
    cmd += ["--lean"] * args.lean + ["--kernel", args.kernel]
    cmd += ["--threads", str(args.threads)] if args.threads else []
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"{shape} T={seq} {mode}: failed ({proc.stderr.strip().splitlines()[-1:]})", file=sys.stderr)
        return {"shape": shape, "seq": seq, "mode": mode, "error": proc.stderr.strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=[*SHAPES, "both"], default="both", help="both: quickstart and 8b")
    parser.add_argument("--seqs", help="comma-separated sequence lengths (default per shape)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default=None,
        metavar="BACKEND",
        help="torch.compile the draft's decoder layers (backend: inductor, or eager to only trace)",
    )
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing of each TTT step")
    parser.add_argument("--no-naive", action="store_true", help="skip the explicit-mask reference")
    parser.add_argument(
        "--lean",
        action="store_true",
        help="frozen embedding and target head in bf16, SGD instead "
        "of AdamW: less memory that does not depend on T (to fit the 8b sweep in a small RAM)",
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--kernel",
        choices=["auto", "flex", "chunked"],
        default="auto",
        help="the TTT attention kernel (auto: flex on a GPU, chunked elsewhere)",
    )
    parser.add_argument(
        "--vary",
        type=int,
        default=0,
        metavar="N",
        help="N steps at random lengths in [T/2, T] in one process; count the compiled graphs",
    )
    parser.add_argument("--child", nargs=3, metavar=("SHAPE", "T", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.vary:
        shape = "tiny" if args.shape == "both" else args.shape
        seq = int(args.seqs.split(",")[-1]) if args.seqs else DEFAULT_SEQS[shape][-1]
        result = vary(
            shape, seq, args.vary, torch.device(args.device), args.dtype, args.compile, args.checkpointing, args.kernel
        )
        print(
            f"{shape}: {args.vary} steps at lengths {min(result['lengths'])}..{max(result['lengths'])}, "
            f"{result['unique_graphs']} compiled graphs, {result['tokens_per_s']:.1f} tokens/s"
        )
        print(json.dumps(result))
        return
    if args.child:
        shape, seq, mode = args.child
        print(
            json.dumps(
                measure(
                    shape,
                    int(seq),
                    args.steps,
                    args.warmup,
                    mode,
                    torch.device(args.device),
                    args.dtype,
                    args.compile,
                    args.checkpointing,
                    args.log_every,
                    args.lean,
                    args.kernel,
                )
            )
        )
        return
    shapes = ["quickstart", "8b"] if args.shape == "both" else [args.shape]
    rows = []
    for shape in shapes:
        seqs = [int(x) for x in args.seqs.split(",")] if args.seqs else DEFAULT_SEQS[shape]
        for seq in seqs:
            rows.append(_child(args, shape, seq, "ttt"))
    naive = None
    if "quickstart" in shapes and not args.no_naive:
        ours = next((r for r in rows if r["shape"] == "quickstart" and r["seq"] == 1024 and "error" not in r), None)
        ours = ours or _child(args, "quickstart", 1024, "ttt")
        naive = _child(args, "quickstart", 1024, "naive")
    print(
        f"device {args.device}, {args.dtype}, compile {args.compile}, checkpointing {args.checkpointing}, "
        f"lean {args.lean}, "
        f"torch threads {args.threads or torch.get_num_threads()}, batch 1"
    )
    print(f"{'shape':>10} {'T':>6} {'s/step':>8} {'tokens/s':>9} {'peak MB':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:>10} {r['seq']:>6} failed: {r['error']}")
        else:
            print(
                f"{r['shape']:>10} {r['seq']:>6} {r['s_per_step']:>8.2f} {r['tokens_per_s']:>9.1f} {r['peak_mb']:>9.0f}"
            )
    summary: dict = {
        "device": args.device,
        "dtype": args.dtype,
        "compile": args.compile,
        "kernel": args.kernel,
        "checkpointing": args.checkpointing,
        "lean": args.lean,
        "tokens_per_s_by_T": {},
        "peak_mb_by_T": {},
    }
    for shape in shapes:
        ok = [r for r in rows if r["shape"] == shape and "error" not in r]
        summary["tokens_per_s_by_T"][shape] = {r["seq"]: r["tokens_per_s"] for r in ok}
        summary["peak_mb_by_T"][shape] = {r["seq"]: r["peak_mb"] for r in ok}
    peaks = summary["peak_mb_by_T"].get("8b", {})
    seqs = sorted(peaks)
    if len(seqs) >= 3 and seqs[1] == 2 * seqs[0] and seqs[2] == 2 * seqs[1]:
        summary["growth_8b"] = round((peaks[seqs[2]] - peaks[seqs[1]]) / (peaks[seqs[1]] - peaks[seqs[0]]), 3)
        print(
            f"8b peak growth ({seqs[1]} -> {seqs[2]}) / ({seqs[0]} -> {seqs[1]}): {summary['growth_8b']} "
            "(2 = linear, 4 = quadratic)"
        )
    if naive is not None and "error" not in naive and "error" not in ours:
        summary["ratio_vs_naive"] = round(naive["s_per_step"] / ours["s_per_step"], 3)
        summary["naive_peak_mb_1024"] = naive["peak_mb"]
        print(
            f"quickstart T=1024: explicit-mask reference {naive['s_per_step']:.2f} s/step, ours "
            f"{ours['s_per_step']:.2f}: ratio {summary['ratio_vs_naive']}"
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
