"""Training throughput of the EAGLE-3 draft with our TTT attention vs the explicit-mask reference, same run.

Dimensions come from the default target's config (SmolLM2-135M-Instruct: hidden 576, 9 heads / 3 KV heads, vocab
49152) with a 32000-token draft vocabulary; features and target head are random (throughput does not depend on
values). One timed unit = one optimizer step (target distribution, 7 TTT steps forward + backward, AdamW).

    python benchmarks/train.py --quick          # seq 1024, 1 warm-up + 2 timed steps per variant
    python benchmarks/train.py --device cuda --seq 8192   # on a GPU: bf16 autocast, as the trainer runs there
Last line: JSON with tokens_per_s (whole training step, ours), peak_rss_mb, ratio_vs_naive (tokens/s of our TTT
attention over the explicit-mask reference: all TTT steps, forward + backward, at the draft's head shapes) and
step_ratio_vs_naive (the same for the whole optimizer step, where the lm_head matmuls dilute the difference).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import sys
import time

import torch

from draftsmith.train.model import DraftSpec, Eagle3Draft
from draftsmith.train.ttt import TTTModel, needed_positions, target_distribution

FALLBACK_CONFIG = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
                   "head_dim": 64, "rms_norm_eps": 1e-5, "vocab_size": 49152, "max_position_embeddings": 8192,
                   "rope_theta": 100000.0, "hidden_act": "silu", "num_hidden_layers": 30}


def default_target_config() -> tuple[dict, str]:
    try:
        from draftsmith.core import assets, targets

        return targets.read_config(assets.default_target_dir()), "default target config"
    except Exception:  # noqa: BLE001 - offline machine without the cache: same numbers, written down
        return FALLBACK_CONFIG, "built-in SmolLM2-135M dimensions"


def make(seq: int, ttt_steps: int, draft_vocab: int, device: torch.device, seed: int = 0):
    config, source = default_target_config()
    cfg = DraftSpec.from_target_config(config, draft_vocab, 1, [2, 15, 27])  # three aux layers, as trained
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg)
    draft.init_weights(seed)
    draft.set_draft_vocab(torch.sort(torch.randperm(cfg.vocab_size)[:cfg.draft_vocab_size]).values)
    h = cfg.hidden_size
    norm = torch.nn.RMSNorm(h, eps=cfg.rms_norm_eps)
    head_weight = torch.randn(cfg.vocab_size, h) * 0.05
    ids = torch.randint(0, cfg.vocab_size, (1, seq))
    mask = torch.ones(1, seq, dtype=torch.bool)
    mask[:, : seq // 4] = False
    hidden = torch.randn(1, seq, 4, h)
    moved = [x.to(device) for x in (draft, norm, head_weight, ids, mask, hidden)]
    return cfg, source, *moved


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(device: torch.device):
    """bf16 autocast on a GPU, as the trainer runs there; fp32 on CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def time_steps(model: TTTModel, optimizer, norm, head_weight, ids, mask, hidden, ttt_steps: int, mode: str,
               warmup: int, steps: int) -> float:
    """Seconds per optimizer step (median of `steps`)."""
    aux = hidden[:, :, :-1].flatten(2)
    times = []
    for i in range(warmup + steps):
        _sync(hidden.device)
        t0 = time.perf_counter()
        with _autocast(hidden.device):
            target = target_distribution(hidden[:, :, -1], norm, head_weight, model.draft.draft_to_target,
                                         needed=needed_positions(mask))  # as the trainer does
            out = model(ids, mask, aux, target, ttt_steps, 0.8, None, mode=mode)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(hidden.device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        print(f"  {mode}: step {i + 1}/{warmup + steps} {time.perf_counter() - t0:.2f}s", file=sys.stderr, flush=True)
    return sorted(times)[len(times) // 2] if times else 0.0


def time_attention(cfg: DraftSpec, seq: int, ttt_steps: int, mode: str, repeats: int,
                   device: torch.device) -> float:
    """Seconds for the attention of all TTT steps, forward + backward, at the draft's head shapes."""
    from draftsmith.train.attention import naive_ttt_attention, ttt_attention

    fn = ttt_attention if mode == "ttt" else naive_ttt_attention
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    times = []
    for _ in range(repeats + 1):
        qs, ks, vs = ([torch.randn(1, heads, seq, d, device=device, dtype=dtype, requires_grad=True)
                       for _ in range(ttt_steps)] for heads in (hq, hkv, hkv))
        _sync(device)
        t0 = time.perf_counter()
        total = sum(fn(qs[k], ks[:k + 1], vs[:k + 1]).float().square().mean() for k in range(ttt_steps))
        total.backward()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[len(times[1:]) // 2]


def _peak_mb(device: torch.device) -> float:
    """Peak process RSS on CPU; peak allocated GPU memory on a GPU (what limits the batch there)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="seq 1024, 2 timed steps per variant")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i]; on a GPU the step runs under bf16 autocast")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    steps = args.steps or (2 if args.quick else 5)

    cfg, source, draft, norm, head_weight, ids, mask, hidden = make(args.seq, args.ttt_steps, args.draft_vocab, device)
    model = TTTModel(draft)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    # Ours first (its peak RSS is read before the reference ever runs), then both interleaved so that a
    # change in machine load hits both alike; each variant's time is the median of its timed steps.
    times: dict[str, list[float]] = {"ttt": [], "naive": []}
    time_steps(model, optimizer, norm, head_weight, ids, mask, hidden, args.ttt_steps, "ttt", warmup=1, steps=0)
    rss = {"ttt": _peak_mb(device)}
    if device.type == "cuda":  # RSS only grows; the GPU's peak can be reset so the reference gets its own
        torch.cuda.reset_peak_memory_stats(device)
    time_steps(model, optimizer, norm, head_weight, ids, mask, hidden, args.ttt_steps, "naive", warmup=1, steps=0)
    rss["naive"] = _peak_mb(device)
    for _ in range(steps):
        for mode in ("ttt", "naive"):
            times[mode].append(time_steps(model, optimizer, norm, head_weight, ids, mask, hidden, args.ttt_steps,
                                          mode, warmup=0, steps=1))
    results = {mode: sorted(t)[len(t) // 2] for mode, t in times.items()}
    attn = {mode: time_attention(cfg, args.seq, args.ttt_steps, mode, steps, device) for mode in ("ttt", "naive")}
    tokens = args.seq
    row = "{:<34} {:>12} {:>12}"
    print(f"draft for {source}: hidden {cfg.hidden_size}, heads {cfg.num_attention_heads}/{cfg.num_key_value_heads}, "
          f"target vocab {cfg.vocab_size}, draft vocab {cfg.draft_vocab_size}; seq {args.seq}, TTT steps "
          f"{args.ttt_steps}, device {_device_name(device)}, torch threads {torch.get_num_threads()}")
    print(row.format("", "ours (TTT)", "explicit mask"))
    print(row.format("train step: s", f"{results['ttt']:.3f}", f"{results['naive']:.3f}"))
    print(row.format("train step: tokens/s", f"{tokens / results['ttt']:.1f}", f"{tokens / results['naive']:.1f}"))
    print(row.format("attention fwd+bwd (all steps): s", f"{attn['ttt']:.3f}", f"{attn['naive']:.3f}"))
    print(row.format("attention: tokens/s", f"{tokens / attn['ttt']:.1f}", f"{tokens / attn['naive']:.1f}"))
    summary = {
        "tokens_per_s": round(tokens / results["ttt"], 1),
        "naive_tokens_per_s": round(tokens / results["naive"], 1),
        "peak_rss_mb": round(rss["ttt"], 1),
        "naive_peak_rss_mb": round(rss["naive"], 1),
        "ratio_vs_naive": round(attn["naive"] / attn["ttt"], 3),
        "step_ratio_vs_naive": round(results["naive"] / results["ttt"], 3),
        "seq": args.seq, "ttt_steps": args.ttt_steps, "draft_vocab": cfg.draft_vocab_size,
        "device": _device_name(device),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
