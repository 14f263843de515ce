"""Extraction throughput against the same target doing only its forward pass, over the same batches.

    .venv/bin/python benchmarks/extract.py --quick                 # 300 ShareGPT conversations, cut to 128 tokens
    .venv/bin/python benchmarks/extract.py --max-length 2048       # the same conversations at full length
    .venv/bin/python benchmarks/extract.py --quick --backend vllm  # the vLLM backend's own benchmark
    .venv/bin/python benchmarks/extract.py --quick --backend vllm --target tiny:deepseek_v3 --tensor-parallel-size 2

hf backend: the default target (SmolLM2-135M-Instruct) is loaded once. Its batches (the extraction plan:
longest first, `--token-budget` padded tokens each) are split into chunks; each chunk runs both as a plain
forward pass of the decoder stack (the baseline: what any extraction must compute, LM head excluded) and as the
full extraction (hooks on the kept layers, bf16 encoding, background writer, shard files, fsync, manifest),
alternating which goes first, so a change of machine load hits both alike. Then the bf16 store is re-encoded
as fp8 (no forward needed) to measure fp8's bytes per token.

`--target` takes a model directory or `tiny:FAMILY`, a tiny random checkpoint shaped like a served model, built by
tests/families.py (llama, qwen3, qwen3_moe, deepseek_v3, kimi_k25); the prepared set is made for that target.
`--tensor-parallel-size` runs the vLLM backend's engines with tensor parallelism (on a CPU draftsmith binds each
rank's threads to its share of the CPUs).

Prints a table on stderr, then as its LAST line a JSON object: hf backend: tokens_per_s, forward_tokens_per_s,
ratio_vs_forward (goal >= 0.90) and bytes_per_token for bf16 and fp8; vllm backend: prefill_tokens_per_s and, per
strategy the installed vLLM offers, tokens_per_s and ratio_vs_prefill (benchmarks/extract_vllm.py's function).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def _target(spec: str | None, work: Path) -> str | None:
    """A model directory as given, or `tiny:FAMILY` built once under `work` by tests/families.py."""
    if not spec or not spec.startswith("tiny:"):
        return spec
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import families

    name = spec.removeprefix("tiny:")
    if name not in families.FAMILIES:
        sys.exit(f"--target {spec}: unknown family; one of {', '.join(families.FAMILIES)}")
    path = work / f"target-{name}"
    if not (path / "config.json").is_file():
        families.build(name, path)
    return str(path)


def _prepared(work: Path, n: int, max_length: int, target: str | None = None) -> Path:
    from draftsmith.config import PrepareConfig
    from draftsmith.core import assets
    from draftsmith.prepare import stage as prepare

    path = work / (f"prepared-{n}-{max_length}" + (f"-{Path(target).name}" if target else ""))
    if not (path / "manifest.json").is_file():
        prepare.run(
            PrepareConfig(
                data=[str(assets.sharegpt_path())], max_samples=n, max_length=max_length, output=path, target=target
            )
        )
    return path


def _bench_hf(prepared: Path, work: Path, args: argparse.Namespace) -> dict:
    import torch

    from draftsmith.config import ExtractConfig
    from draftsmith.core import capture
    from draftsmith.core.targets import load_target, resolve_device
    from draftsmith.extract import common, hf, store

    output = work / "store-bf16"
    cfg = ExtractConfig(prepared=prepared, output=output, device=args.device, token_budget=args.token_budget)
    if args.tensor_parallel_size > 1:
        sys.exit("--tensor-parallel-size: the hf backend runs on one device; use --backend vllm")
    plan = common.plan_extraction(cfg)
    device = resolve_device(cfg.device)
    compute_dtype = hf.resolve_compute_dtype(cfg.compute_dtype, device)
    t0 = time.perf_counter()
    model = load_target(plan.target_dir, dtype=compute_dtype, device=device)
    load_s = time.perf_counter() - t0
    batches = common.plan_batches(plan.sample_ids, plan.lengths, cfg.token_budget)
    tokens = int(plan.lengths[plan.sample_ids].sum())
    padded = sum(len(b) * int(plan.lengths[b[0]]) for b in batches)
    capture.forward_only(model, torch.zeros(1, 16, dtype=torch.long))  # first call pays lazy imports / kernel set-up

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    cpu = {"forward": 0.0, "extraction": 0.0}  # CPU seconds of the whole process (all threads) per pass

    def forward(chunk: list[list[int]]) -> float:
        start, cpu0 = time.perf_counter(), time.process_time()
        for batch in chunk:
            ids, _ = hf.pad_batch([plan.dataset[i] for i in batch])
            capture.forward_only(model, ids)
        sync()
        cpu["forward"] += time.process_time() - cpu0
        return time.perf_counter() - start

    spec = common.store_spec(plan, backend="hf", compute_dtype=str(compute_dtype).removeprefix("torch."))
    writer = common.open_writer(plan, spec)

    def extraction(chunk: list[list[int]], last: bool) -> float:
        start, cpu0 = time.perf_counter(), time.process_time()
        hf._extract(model, plan, chunk, writer, device, 0, show_progress=False)
        if last:
            writer.close()
        cpu["extraction"] += time.process_time() - cpu0
        return time.perf_counter() - start

    chunk_size = max(1, len(batches) // args.chunks)
    chunks = [batches[i : i + chunk_size] for i in range(0, len(batches), chunk_size)]
    fwd_s = ext_s = 0.0
    cpu0 = time.process_time()
    for k, chunk in enumerate(chunks):
        last = k == len(chunks) - 1
        if k % 2 == 0:
            fwd_s += forward(chunk)
            ext_s += extraction(chunk, last)
        else:
            ext_s += extraction(chunk, last)
            fwd_s += forward(chunk)
        print(f"  chunk {k + 1}/{len(chunks)}: forward {fwd_s:.1f}s, extraction {ext_s:.1f}s", file=sys.stderr)
    cpu_s = time.process_time() - cpu0

    st = store.open(output)
    assert st.manifest.num_tokens == tokens and len(st) == len(plan.sample_ids)
    bf16_bytes = sum(s.num_bytes for s in st.manifest.shards)
    fp8_spec = spec.model_copy(update={"dtype": "fp8"})
    with store.create_or_resume(work / "store-fp8", fp8_spec) as fp8_writer:  # re-encode: no forward needed
        for k in range(len(st)):
            item = st[k]
            fp8_writer.add(item["sample_id"], item["input_ids"], item["loss_mask"], item["hidden_states"])
    fp8_bytes = sum(s.num_bytes for s in store.open(work / "store-fp8").manifest.shards)
    return {
        "backend": f"hf ({device}, {spec.compute_dtype}, {torch.get_num_threads()} threads)",
        "target": plan.target_dir.name,
        "samples": len(plan.sample_ids),
        "tokens": tokens,
        "padding_overhead": round(padded / tokens - 1, 4),
        "batches": len(batches),
        "layer_ids": plan.layer_ids,
        "model_load_s": round(load_s, 2),
        "forward_s": round(fwd_s, 2),
        "extraction_s": round(ext_s, 2),
        "cpu_s_both": round(cpu_s, 1),
        "cpu_s_forward": round(cpu["forward"], 1),
        "cpu_s_extraction": round(cpu["extraction"], 1),
        "load_average": round(os.getloadavg()[0], 2),
        "tokens_per_s": round(tokens / ext_s, 1),
        "forward_tokens_per_s": round(tokens / fwd_s, 1),
        "ratio_vs_forward": round(fwd_s / ext_s, 4),
        "bytes_per_token": {"bf16": round(bf16_bytes / tokens, 1), "fp8": round(fp8_bytes / tokens, 1)},
        "state_bytes_per_token": {"bf16": store.bytes_per_token(spec), "fp8": store.bytes_per_token(fp8_spec)},
    }


def _bench_vllm(prepared: Path, work: Path, args: argparse.Namespace) -> dict:
    """The vLLM backend's own benchmark (draftsmith.extract.vllm.benchmark), on the same prepared set."""
    try:
        from draftsmith.extract.vllm.backend import benchmark
    except ImportError as err:
        sys.exit(f"--backend vllm: the vLLM backend's benchmark is not available ({err})")
    return benchmark(
        prepared,
        args.n,
        token_budget=args.token_budget,
        tensor_parallel_size=args.tensor_parallel_size,
        compute_dtype=args.compute_dtype,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="300 conversations cut to 128 tokens")
    parser.add_argument("--backend", choices=["hf", "vllm"], default="hf")
    parser.add_argument("-n", type=int, default=300, help="ShareGPT conversations (default 300)")
    parser.add_argument(
        "--max-length", type=int, default=None, help="tokens per conversation (default 2048; 128 with --quick)"
    )
    parser.add_argument("--prepared", type=Path, help="an existing prepared set (default: prepare ShareGPT now)")
    parser.add_argument("--target", help="model directory or tiny:FAMILY (default: the embedded SmolLM2)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="vllm backend: tensor parallel size")
    parser.add_argument(
        "--compute-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="vllm backend: dtype the target runs in (auto: bf16 where the CPU/GPU has it)",
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--token-budget", type=int, default=8192)
    parser.add_argument("--chunks", type=int, default=6, help="alternating forward / extraction chunks")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--work", type=Path, help="keep prepared set and stores here (default: a temp dir)")
    args = parser.parse_args()
    max_length = args.max_length or (128 if args.quick else 2048)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="draftsmith-bench-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        target = _target(args.target, work)
        prepared = args.prepared or _prepared(work, args.n, max_length, target)
        for stale in ("store-bf16", "store-fp8"):
            import shutil

            shutil.rmtree(work / stale, ignore_errors=True)
        result = (_bench_hf if args.backend == "hf" else _bench_vllm)(prepared, work, args)

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"extract benchmark ({args.backend})", show_header=False, title_justify="left")
    for key, value in result.items():
        table.add_row(key, str(value))
    Console(stderr=True).print(table)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
