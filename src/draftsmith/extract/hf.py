"""The transformers extraction backend: run the target on CPU or GPU and keep only the layers the store needs.

Layer ids are vLLM's (docs/architecture.md): 0 = the hidden state entering decoder layer 0 (the embeddings),
k = the output of decoder layer k-1 (the residual stream), N = the last decoder layer's output *before* the
final norm. Forward hooks on exactly those layers copy their outputs into one preallocated [B, T, L, H] tensor;
the LM head never runs. Samples are sorted by length and packed into batches of at most `token_budget` padded
tokens, right-padded: in a causal LM a real token only attends to earlier positions, which are all real, so the
padding never reaches a real token's state. Samples that share a long prefix (`common.chains`) run one after another
on one KV cache, cropped to the prefix each shares with the one before: each distinct token is computed and stored
once, for every target whose layers all attend to every earlier token (`_new_cache`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import transformers
from pydantic import JsonValue
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer

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
    config = transformers.AutoConfig.from_pretrained(plan.target_dir, trust_remote_code=cfg.trust_remote_code)
    runs = [[(i, -1, 0)] for i in plan.sample_ids]
    if _new_cache(config) is not None:
        runs = common.chains(plan.dataset.prefixes, plan.lengths, plan.sample_ids)
    with common.Timer() as timer, common.open_writer(plan, spec, info) as writer:
        todo, done = common.pending_sample_ids(plan, writer), writer.done_sample_ids()
        skipped = len(plan.sample_ids) - len(todo)
        chains = [run for run in runs if len(run) > 1 and any(i not in done for i, _, _ in run)]
        alone = [run[0][0] for run in runs if len(run) == 1]
        batches = common.pending_batches(common.plan_batches(alone, plan.lengths, cfg.token_budget), done)
        tokens = int(sum(int(plan.lengths[i]) for b in batches for i in b))
        tokens += sum(int(plan.lengths[i]) - n for run in chains for i, _, n in run)
        common.check_disk_space(plan, spec, todo, sum(n for run in chains for i, _, n in run if i not in done))
        work = common.Timer()
        if batches or chains:
            model = load_target(
                plan.target_dir, dtype=compute_dtype, device=device, trust_remote_code=cfg.trust_remote_code
            )
            with (
                work,
                common.BackgroundWriter(writer) as sink,
                common.progress_bar(tokens, enabled=show_progress) as bar,
            ):
                _extract(model, config, plan, (batches, chains), done, sink, bar)
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


def _new_cache(config: transformers.PretrainedConfig) -> DynamicCache | None:
    """An empty KV cache that samples sharing a prefix can share: None where a layer of the target forgets earlier
    tokens (a sliding window, linear attention), as a cache cropped to a prefix would then not be the prefix's."""
    config = config.get_text_config()
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or []):
        return None
    cache = DynamicCache(config=config)
    return cache if all(type(layer) is DynamicLayer for layer in cache.layers) else None


def _extract(
    model: nn.Module,
    config: transformers.PretrainedConfig,
    plan: common.ExtractionPlan,
    work: tuple[list[list[int]], list[list[tuple[int, int, int]]]],
    done: set[int],
    sink: common.BackgroundWriter,
    advance,
) -> None:
    """The batches, then each chain from its first sample on one cache (its samples not stored yet are stored with
    their prefix). On a GPU the states are encoded there (half the copy for fp8) and copied to pinned memory
    without waiting."""
    storage = torch.bfloat16 if plan.cfg.dtype == "bf16" else None  # fp8 is encoded from the compute dtype
    on_gpu = next(model.parameters()).device.type == "cuda"

    def captured(input_ids: torch.Tensor, cache: DynamicCache | None = None) -> common.HostStates:
        states = capture_hidden_states(model, input_ids, None, plan.layer_ids, dtype=storage, past_key_values=cache)
        return common.to_host(states.unbind(2), plan.cfg.dtype) if on_gpu else common.HostStates(states)

    batches, chains = work
    for batch in batches:
        samples = [plan.dataset[i] for i in batch]
        input_ids, attention_mask = pad_batch(samples)
        states, scales, ready = captured(input_ids)
        items = []
        for b, (i, s) in enumerate(zip(batch, samples, strict=False)):
            n = len(s["input_ids"])
            item = (i, s["input_ids"], s["loss_mask"], states[b, :n])
            items.append(item if scales is None else (*item, scales[b, :n]))
        sink.submit(items, ready)
        advance(int(attention_mask.sum()))
    for chain in chains:
        cache = _new_cache(config)  # never None here: `run` forms chains only where it is not
        for i, parent, shared in chain:
            s, held = plan.dataset[i], cache.get_seq_length() if cache is not None else 0
            if cache is not None and held > shared:
                cache.crop(shared - held)  # negative: drop that many (transformers 4 and 5 alike)
            states, scales, ready = captured(s["input_ids"][None, shared:], cache)
            if cache is None or cache.get_seq_length() != len(s["input_ids"]):
                raise DraftsmithError(f"{plan.target_dir}: its forward pass keeps no KV cache; please report it")
            if i not in done:
                row = (i, s["input_ids"], s["loss_mask"], states[0], None if scales is None else scales[0])
                sink.submit([(*row, parent, shared)], ready)
            advance(len(s["input_ids"]) - shared)


__all__ = ["pad_batch", "run", "resolve_compute_dtype"]
