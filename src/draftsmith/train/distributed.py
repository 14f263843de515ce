"""torchrun support: process group set-up, model wrapping (DDP or FSDP2), reductions, full state dicts.

DDP for drafts whose weights, gradients and AdamW state fit on every GPU (the one-layer drafts: the default);
FSDP2 (`fully_shard` per decoder layer and around the whole) when they would not (`choose_strategy`). Under both
the target's frozen embedding is the one thing never communicated: every rank reads it from the target itself, DDP
ignores it and FSDP2 leaves it out of its shards (`ignored_params`), so it is neither broadcast nor all-gathered.
Gradient accumulation communicates once per optimizer step: `grad_sync(model, info, last)` is DDP's `no_sync`,
or FSDP2's `set_requires_gradient_sync`, on every micro-batch but the last.

One process (no torchrun) is world size 1 and every helper here is then a no-op.
"""

from __future__ import annotations

import contextlib
import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from draftsmith.core.targets import resolve_device
from draftsmith.train.objective import TTTModel

STRATEGIES = ("auto", "ddp", "fsdp2")
# auto picks FSDP2 when the draft's trainable state (fp32 weights + gradients + two AdamW moments, 16 bytes a
# parameter) passes this, or its vocabulary head is this wide: e.g. a full 128k+-token draft vocabulary.
FSDP_STATE_BYTES = 16 << 30
FSDP_VOCAB = 131072
EMBEDDING = "draft.embed_tokens.weight"


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    strategy: str = "auto"

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init(device: str, strategy: str = "auto") -> DistInfo:
    """Read torchrun's environment; start gloo (CPU) or nccl (GPU) when there is more than one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local if world > 1 else 0)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if dev.type == "cuda" else "gloo", device_id=dev if dev.type == "cuda" else None
        )
    return DistInfo(rank, world, dev, strategy)


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def choose_strategy(requested: str, draft: nn.Module, draft_vocab_size: int) -> str:
    """ddp or fsdp2 for `--distributed auto|ddp|fsdp2` (see FSDP_STATE_BYTES)."""
    if requested != "auto":
        return requested
    trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    return "fsdp2" if 16 * trainable > FSDP_STATE_BYTES or draft_vocab_size >= FSDP_VOCAB else "ddp"


def wrap(model: TTTModel, info: DistInfo, param_dtype: torch.dtype | None = None) -> nn.Module:
    """DDP or FSDP2 `fully_shard` around a TTTModel (info.strategy, already chosen); the model itself when
    single-process. The frozen embedding stays out of both (module docstring).

    FSDP2: each decoder layer stays gathered from its first forward to its backward (`reshard_after_forward=False`):
    a TTT unroll calls every layer once per step, and resharding after each would all-gather the layer again at
    every step, in the backward and in each checkpointed recompute. `param_dtype` (the autocast dtype, bf16 on a
    GPU) is the dtype layers are gathered and computed in -- half the all-gathered bytes --, gradients reduced in
    fp32; None keeps the parameters' own dtype."""
    if not info.enabled:
        return model
    embedding = model.get_parameter(EMBEDDING)
    if info.strategy == "fsdp2":
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
        for layer in model.draft.layers:
            fully_shard(layer, reshard_after_forward=False, mp_policy=policy)
        fully_shard(model, ignored_params={embedding}, mp_policy=policy)
        return model
    # The embedding is every rank's own copy of the target's, and d2t / t2d never change: nothing to broadcast.
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, [EMBEDDING])
    return DistributedDataParallel(model, broadcast_buffers=False)  # single-device module: device_ids stays None


def grad_sync(model: nn.Module, info: DistInfo, sync: bool) -> contextlib.AbstractContextManager[None]:
    """Context for one micro-batch's forward + backward: gradients are reduced across ranks only when `sync`
    (the step's last micro-batch); before, each rank accumulates its own."""
    if not info.enabled:
        return contextlib.nullcontext()
    if info.strategy == "fsdp2":
        assert isinstance(model, FSDPModule)  # what wrap made of it
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    assert isinstance(model, DistributedDataParallel)  # what wrap made of it
    return contextlib.nullcontext() if sync else model.no_sync()


def unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum over ranks, on a copy on the process group's device, returned on t's device (no host sync on CUDA)."""
    if not info.enabled:
        return t
    x = t.to(info.device, copy=True)
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x.to(t.device)


def gather_objects(obj: object, info: DistInfo) -> list:
    """Every rank's `obj` (a few picklable values: what a rank found wrong), on every rank."""
    if not info.enabled:
        return [obj]
    out = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def full_model_state(model: nn.Module, info: DistInfo) -> dict[str, torch.Tensor]:
    """The draft's whole state dict on CPU, names without the wrapper's `draft.` (gathers FSDP2 shards: every rank
    must call this)."""
    if info.enabled and info.strategy == "fsdp2":
        state: dict[str, torch.Tensor] = get_model_state_dict(  # type: ignore[assignment]  # a model's: tensors only
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    else:
        state = unwrap(model).state_dict()
    return {k.removeprefix("draft."): v.detach().cpu() for k, v in state.items()}


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, info: DistInfo) -> dict:
    if info.enabled and info.strategy == "fsdp2":
        return get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    return optimizer.state_dict()


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict, info: DistInfo) -> None:
    if info.enabled and info.strategy == "fsdp2":
        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
        return
    optimizer.load_state_dict(state)


def broadcast_error(message: str | None, info: DistInfo) -> str | None:
    """Share rank 0's error (e.g. a failed checkpoint write) so every rank stops together."""
    if not info.enabled:
        return message
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shutdown(info: DistInfo) -> None:
    """Leave the process group together: a rank that tears gloo down while another is still in a collective's
    tail aborts ("terminate called without an active exception"), so every rank waits at a barrier first; what
    still holds gloo work (a wrapped model in a reference cycle) is collected before the group goes."""
    if info.enabled and dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
