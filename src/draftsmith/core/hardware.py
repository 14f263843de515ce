"""What this machine's CPU computes natively, read once: whether bf16 is worth using on it.

`--precision auto` (train) and `--compute-dtype auto` (extract, both backends) mean bf16 on a GPU and on a CPU that
computes bf16 in hardware (AVX-512 BF16 or AMX-BF16: oneDNN's bf16 matmuls run at about twice the fp32 rate
there), and fp32 on any other CPU (AVX2, plain AVX-512), where bf16 is emulated and slower than fp32.

The answer comes from torch's own CPU probe (`torch.cpu._is_avx512_bf16_supported`, `_is_amx_tile_supported`:
what its kernels will dispatch to), with /proc/cpuinfo's flags as the fallback for a torch without them. Never
from a model name.

DRAFTSMITH_CPU_BF16=1 or 0 overrides the probe (the test suite pins 0, so that results compare bit for bit on
every CPU kind; a user can pin either to reproduce a run made on another machine).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

OVERRIDE_ENV = "DRAFTSMITH_CPU_BF16"
# cpuinfo flags that decide the kernels (reported with each benchmark row)
REPORTED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")

__all__ = ["CpuInfo", "probe", "cpu_info", "native_bf16", "auto_dtype", "OVERRIDE_ENV"]


@dataclass(frozen=True)
class CpuInfo:
    model: str  # /proc/cpuinfo's model name
    torch_capability: str  # torch's dispatch level: AVX2, AVX512, ...
    flags: tuple[str, ...]  # REPORTED_FLAGS this CPU has
    native_bf16: bool  # what auto acts on
    why: str  # one phrase: which probe (or override) decided
    avx512_bf16: bool = False  # the probe's findings, whatever the override: what vLLM's CPU kernels dispatch on
    amx: bool = False
    avx512: bool = False

    def as_dict(self) -> dict:
        return {**asdict(self), "flags": list(self.flags)}

    def describe(self) -> str:
        return f"{self.model} ({self.torch_capability}; {self.why})"


def _cpuinfo() -> tuple[str, set[str]]:
    """(model name, flags) of the first CPU /proc/cpuinfo lists."""
    model, flags = None, None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "flags" and flags is None:
                flags = set(value.split())
            elif key.strip() == "model name" and model is None:
                model = value.strip()
    except OSError:
        pass
    return model or platform.processor() or "unknown CPU", flags or set()


def _torch_probe() -> tuple[bool, bool] | None:
    """(avx512_bf16, amx) as torch's CPU dispatch sees them, or None when this torch cannot tell."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported()), bool(torch.cpu._is_amx_tile_supported())
    except AttributeError:
        return None


@functools.cache
def probe() -> CpuInfo:
    """This CPU as torch (or /proc/cpuinfo) reports it, without the override."""
    model, flags = _cpuinfo()
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except AttributeError:
        capability = "unknown"
    seen = _torch_probe()
    if seen is not None:
        avx512_bf16, amx = seen
        source = "torch"
    else:
        avx512_bf16, amx = "avx512_bf16" in flags, "amx_bf16" in flags
        source = "/proc/cpuinfo"
    native = avx512_bf16 or amx
    kinds = [name for name, has in (("AMX-BF16", amx), ("AVX512-BF16", avx512_bf16)) if has]
    why = (f"computes bf16 natively: {' + '.join(kinds)}, per {source}" if native
           else f"no native bf16 (no AVX512-BF16 or AMX, per {source})")
    avx512 = capability.startswith("AVX512") or "avx512f" in flags
    return CpuInfo(model, capability, tuple(f for f in REPORTED_FLAGS if f in flags), native, why,
                   avx512_bf16=bool(avx512_bf16), amx=bool(amx), avx512=avx512)


def cpu_info() -> CpuInfo:
    """This CPU, with DRAFTSMITH_CPU_BF16 (1 / 0) applied over the probe."""
    info = probe()
    forced = os.environ.get(OVERRIDE_ENV, "").strip()
    if forced in ("0", "1"):
        native = forced == "1"
        return dataclasses.replace(info, native_bf16=native, why=f"{OVERRIDE_ENV}={forced} (the probe says: {info.why})")
    return info


def native_bf16() -> bool:
    return cpu_info().native_bf16


def device_memory_bytes() -> int | None:
    """The memory a model on one device has: the first GPU's, else this host's (MemTotal); None when unknown."""
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def auto_dtype(device: torch.device | str) -> torch.dtype:
    """What `auto` computes in on this device: bf16 on accelerators and bf16-native CPUs, fp32 on other CPUs."""
    kind = torch.device(device).type
    if kind != "cpu":
        return torch.bfloat16
    return torch.bfloat16 if native_bf16() else torch.float32
