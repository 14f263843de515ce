"""The transformers extraction backend: run the target on CPU or GPU and keep only the layers the store needs.

Layer ids are vLLM's (docs/architecture.md): 0 = the hidden state entering decoder layer 0 (the embeddings),
k = the output of decoder layer k-1 (the residual stream), N = the last decoder layer's output *before* the
final norm. Forward hooks on exactly those layers copy their outputs into one preallocated [B, T, L, H] tensor;
the LM head never runs. Samples are sorted by length and packed into batches of at most `token_budget` padded
tokens, right-padded: in a causal LM a real token only attends to earlier positions, which are all real, so the
padding never reaches a real token's state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import transformers
from pydantic import JsonValue
from torch import nn

from draftsmith.config import ExtractConfig, StageResult
from draftsmith.core import devices, hardware
from draftsmith.core.capture import capture_hidden_states
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.targets import load_target, resolve_device
from draftsmith.extract import common

_COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    if name == "auto":  # bf16 on GPUs and bf16-native CPUs, fp32 on other CPUs
        return devices.auto_dtype(device)
    return _COMPUTE_DTYPES[name]


def run(cfg: ExtractConfig, *, show_progress: bool = True) -> StageResult:
    """Fill (or resume) the store at cfg.output with the target's kept layers over cfg.prepared."""
    plan = common.plan_extraction(cfg)
    device = resolve_device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DraftsmithError(f"--device {cfg.device}: CUDA is not available here; use --device cpu")
    compute_dtype = resolve_compute_dtype(cfg.compute_dtype, device)
    spec = common.store_spec(plan, backend="hf", compute_dtype=str(compute_dtype).removeprefix("torch."))
    info: dict[str, JsonValue] = {
        "engine": f"transformers {transformers.__version__}",
        "torch": torch.__version__,
        "device": str(device),
    }
    if device.type == "cpu":
        cpu = hardware.cpu_info()
        info["cpu"] = cpu.as_dict()
        if cfg.compute_dtype == "auto":
            common.stage_line("extract")(
                f"the target runs in {spec.compute_dtype} (--compute-dtype auto on {cpu.describe()})"
            )
    with common.Timer() as timer, common.open_writer(plan, spec, info) as writer:
        todo = common.pending_sample_ids(plan, writer)
        skipped = len(plan.sample_ids) - len(todo)
        batches = common.pending_batches(
            common.plan_batches(plan.sample_ids, plan.lengths, cfg.token_budget), writer.done_sample_ids()
        )
        tokens = int(sum(int(plan.lengths[i]) for b in batches for i in b))
        common.check_disk_space(plan, spec, todo)
        work = common.Timer()
        if batches:
            model = load_target(
                plan.target_dir, dtype=compute_dtype, device=device, trust_remote_code=cfg.trust_remote_code
            )
            with work:
                _extract(model, plan, batches, writer, device, tokens, show_progress)
                writer.flush()
    return common.result(
        plan,
        writer,
        timer.seconds,
        tokens=tokens,
        skipped=skipped,
        work_seconds=work.seconds,
        backend=f"hf ({device}, {spec.compute_dtype})",
    )


def _extract(
    model: nn.Module,
    plan: common.ExtractionPlan,
    batches: list[list[int]],
    writer,
    device: torch.device,
    total_tokens: int,
    show_progress: bool,
) -> None:
    storage = torch.bfloat16 if plan.cfg.dtype == "bf16" else None  # fp8 is encoded from the compute dtype
    on_gpu = device.type == "cuda"
    with common.BackgroundWriter(writer) as sink, common.progress_bar(total_tokens, enabled=show_progress) as advance:
        for batch in batches:
            samples = [plan.dataset[i] for i in batch]
            input_ids, attention_mask = pad_batch(samples)
            states = capture_hidden_states(model, input_ids, None, plan.layer_ids, dtype=storage)
            ready = scales = None
            if on_gpu:  # encoded on the GPU (half the copy for fp8), copied to pinned memory without waiting
                states, scales, ready = common.to_host(states.unbind(2), plan.cfg.dtype)
            items = []
            for b, (i, s) in enumerate(zip(batch, samples, strict=False)):
                n = len(s["input_ids"])
                item = (i, s["input_ids"], s["loss_mask"], states[b, :n])
                items.append(item if scales is None else (*item, scales[b, :n]))
            sink.submit(items, ready)
            advance(int(attention_mask.sum()))


__all__ = ["pad_batch", "run", "resolve_compute_dtype"]
