"""torchrun support: process group set-up, model wrapping (DDP or FSDP2), reductions, full state dicts.

One process (no torchrun) is world size 1 and every helper here is then a no-op.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from draftsmith.core.errors import DraftsmithError


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    strategy: str = "ddp"

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init(device: str, strategy: str = "ddp") -> DistInfo:
    """Read torchrun's environment; start gloo (CPU) or nccl (GPU) when there is more than one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local if world > 1 else 0)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo", device_id=dev if dev.type == "cuda"
                                else None)
    return DistInfo(rank, world, local, dev, strategy)


def wrap(model: nn.Module, info: DistInfo) -> nn.Module:
    """DDP (default) or FSDP2 `fully_shard` around a TTTModel; the model itself when single-process."""
    if not info.enabled:
        return model
    if info.strategy == "fsdp2":
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # pragma: no cover - older torch
            raise DraftsmithError("--distributed fsdp2 needs torch >= 2.6 (torch.distributed.fsdp.fully_shard)") from None
        for layer in model.draft.layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)  # a single-device module: device_ids stays None


def unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum over ranks (in place on a copy; float64 CPU tensors go through the process group's device)."""
    if not info.enabled:
        return t
    x = t.to(info.device).clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x.to(t.device)


def full_model_state(model: nn.Module, info: DistInfo) -> dict[str, torch.Tensor]:
    """The draft's whole state dict on CPU, names without the wrapper's `draft.` (gathers FSDP2 shards: every rank
    must call this)."""
    if info.enabled and info.strategy == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = unwrap(model).state_dict()
    return {k.removeprefix("draft."): v.detach().cpu() for k, v in state.items()}


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, info: DistInfo) -> dict:
    if info.enabled and info.strategy == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return optimizer.state_dict()


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict, info: DistInfo) -> None:
    if info.enabled and info.strategy == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

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
    tail aborts ("terminate called without an active exception"), so every rank waits at a barrier first."""
    if info.enabled and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
