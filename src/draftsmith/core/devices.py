"""What needs torch of the hardware facts: `auto` as a torch dtype for a device, and the memory one device has. The
choice itself is core/hardware.py's (`auto_dtype_name`), which reads the CPU without torch."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from draftsmith.core import hardware


def auto_dtype(device: torch.device | str) -> torch.dtype:
    """What `auto` computes in on this device: bf16 on accelerators and bf16-native CPUs, fp32 on other CPUs."""
    return getattr(torch, hardware.auto_dtype_name(torch.device(device).type))


def device_memory_bytes() -> int | None:
    """The memory a model on one device has: the first GPU's, else this host's (MemTotal); None when unknown."""
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return None
