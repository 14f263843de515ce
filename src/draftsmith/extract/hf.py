"""The transformers extraction backend: run the target on CPU or GPU and keep only the layers the store needs.

Layer ids follow vLLM's convention (DESIGN.md): 0 = the hidden state entering decoder layer 0 (the embeddings),
k = the output of decoder layer k-1 (the residual stream), N = the last decoder layer's output *before* the
final norm. Forward hooks on exactly those layers copy their outputs into one preallocated [B, T, L, H] tensor;
the LM head never runs. Samples are sorted by length and packed into batches of at most `token_budget` padded
tokens, right-padded: in a causal LM a real token only attends to earlier positions, which are all real, so the
padding never reaches a real token's state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from draftsmith.config import ExtractConfig, StageResult
from draftsmith.errors import DraftsmithError
from draftsmith.extract import common
from draftsmith.targets import decoder_layers, load_target, resolve_device

_COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _StopForward(Exception):
    """Raised by the hook of the deepest layer needed, when the layers after it are not needed."""


def _base_model(model: nn.Module) -> nn.Module:
    """The decoder stack without the LM head (so no [B, T, vocab] logits are ever computed)."""
    get_decoder = getattr(model, "get_decoder", None)
    return get_decoder() if callable(get_decoder) else model


def capture_hidden_states(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                          layer_ids: Sequence[int], *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Hidden states of `layer_ids` (vLLM convention) for a batch: [B, T, L, H] on the model's device.

    `input_ids` [B, T]; `attention_mask` [B, T] (1 = real token) or None for unpadded / right-padded batches.
    `dtype` is the dtype of the returned tensor (default: the model's). The last layer id N is un-normalised.
    Layers after the deepest one asked for are not run.
    """
    layers = decoder_layers(model)
    num_layers = len(layers)
    bad = [k for k in layer_ids if not 0 <= k <= num_layers]
    if bad:
        raise ValueError(f"layer ids {bad} out of range 0..{num_layers}")
    first = next(model.parameters())
    B, T = input_ids.shape
    H = int(getattr(getattr(model, "config", None), "hidden_size", 0) or 0) or None
    out: torch.Tensor | None = None
    deepest = max(layer_ids)

    def store(j: int, hidden: torch.Tensor) -> None:
        nonlocal out
        if out is None:
            out = torch.empty(B, T, len(layer_ids), H or hidden.shape[-1], dtype=dtype or hidden.dtype,
                              device=hidden.device)
        out[:, :, j].copy_(hidden)

    def pre_hook(j):
        def hook(module, args, kwargs):
            store(j, args[0] if args else kwargs["hidden_states"])
        return hook

    def post_hook(j, stop):
        def hook(module, args, output):
            store(j, output[0] if isinstance(output, (tuple, list)) else output)
            if stop:
                raise _StopForward
        return hook

    handles = []
    try:
        for j, k in enumerate(layer_ids):
            if k == 0:
                handles.append(layers[0].register_forward_pre_hook(pre_hook(j), with_kwargs=True))
            else:
                stop = k == deepest and k < num_layers
                handles.append(layers[k - 1].register_forward_hook(post_hook(j, stop)))
        with torch.no_grad():
            try:
                _base_model(model)(input_ids=input_ids.to(first.device),
                                   attention_mask=None if attention_mask is None else attention_mask.to(first.device),
                                   use_cache=False)
            except _StopForward:
                pass
    finally:
        for handle in handles:
            handle.remove()
    assert out is not None
    return out


def forward_only(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
    """The same decoder-stack forward pass with no capture (the benchmark's baseline)."""
    first = next(model.parameters())
    with torch.no_grad():
        _base_model(model)(input_ids=input_ids.to(first.device),
                           attention_mask=None if attention_mask is None else attention_mask.to(first.device),
                           use_cache=False)


def pad_batch(samples: Sequence[dict], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad samples' input_ids: ([B, T] ids, [B, T] attention mask)."""
    T = max(len(s["input_ids"]) for s in samples)
    ids = torch.full((len(samples), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), T), dtype=torch.long)
    for b, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[b, :n] = s["input_ids"]
        mask[b, :n] = 1
    return ids, mask


def resolve_compute_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _COMPUTE_DTYPES[name]


def run(cfg: ExtractConfig, *, show_progress: bool = True) -> StageResult:
    """Fill (or resume) the store at cfg.output with the target's kept layers over cfg.prepared."""
    import transformers

    plan = common.plan_extraction(cfg)
    device = resolve_device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DraftsmithError(f"--device {cfg.device}: CUDA is not available here; use --device cpu")
    compute_dtype = resolve_compute_dtype(cfg.compute_dtype, device)
    spec = common.store_spec(plan, backend="hf", compute_dtype=str(compute_dtype).removeprefix("torch."))
    info = {"engine": f"transformers {transformers.__version__}", "torch": torch.__version__, "device": str(device)}
    with common.Timer() as timer, common.open_writer(plan, spec, info) as writer:
        todo = common.pending_sample_ids(plan, writer)
        skipped = len(plan.sample_ids) - len(todo)
        batches = common.pending_batches(common.plan_batches(plan.sample_ids, plan.lengths, cfg.token_budget),
                                         writer.done_sample_ids())
        tokens = int(sum(int(plan.lengths[i]) for b in batches for i in b))
        work = common.Timer()
        if batches:
            model = load_target(plan.target_dir, dtype=compute_dtype, device=device,
                                trust_remote_code=cfg.trust_remote_code)
            with work:
                _extract(model, plan, batches, writer, device, tokens, show_progress)
                writer.flush()
    return common.result(plan, writer, timer.seconds, tokens=tokens, skipped=skipped, work_seconds=work.seconds,
                         extra={"backend": f"hf ({device}, {spec.compute_dtype})"})


def _extract(model: nn.Module, plan: common.ExtractionPlan, batches: list[list[int]], writer, device: torch.device,
             total_tokens: int, show_progress: bool) -> None:
    storage = torch.bfloat16 if plan.cfg.dtype == "bf16" else None  # fp8 is encoded from the compute dtype
    on_gpu = device.type == "cuda"
    with common.BackgroundWriter(writer) as sink, common.progress_bar(total_tokens, enabled=show_progress) as advance:
        for batch in batches:
            samples = [plan.dataset[i] for i in batch]
            input_ids, attention_mask = pad_batch(samples)
            states = capture_hidden_states(model, input_ids, None, plan.layer_ids, dtype=storage)
            ready = None
            scales = None
            if on_gpu:  # encode on the GPU (half the copy for fp8), copy to pinned memory without waiting
                from draftsmith.store import encode_hidden_states

                states, scales = encode_hidden_states(states, plan.cfg.dtype)
                host = torch.empty(states.shape, dtype=states.dtype, pin_memory=True)
                host.copy_(states, non_blocking=True)
                if scales is not None:
                    host_scales = torch.empty(scales.shape, dtype=scales.dtype, pin_memory=True)
                    host_scales.copy_(scales, non_blocking=True)
                    scales = host_scales
                event = torch.cuda.Event()
                event.record()
                states, ready = host, event.synchronize
            items = []
            for b, (i, s) in enumerate(zip(batch, samples)):
                n = len(s["input_ids"])
                item = (i, s["input_ids"], s["loss_mask"], states[b, :n])
                items.append(item if scales is None else (*item, scales[b, :n]))
            sink.submit(items, ready)
            advance(int(attention_mask.sum()))


__all__ = ["capture_hidden_states", "forward_only", "pad_batch", "run", "resolve_compute_dtype"]
