"""What this machine's CPU computes natively, read once: whether bf16 is worth using on it.

`--precision auto` (train) and `--compute-dtype auto` (extract, both backends) mean bf16 on a GPU and on a CPU that
computes bf16 in hardware (AVX-512 BF16 or AMX-BF16: oneDNN's bf16 matmuls run at about twice the fp32 rate
there), and fp32 on any other CPU (AVX2, plain AVX-512), where bf16 is emulated and slower than fp32.

The answer comes from the CPU's own flags in /proc/cpuinfo (avx512_bf16, amx_bf16: the CPUID bits torch's and
oneDNN's dispatch reads too), never from a model name, and without importing torch, so `draftsmith doctor` tells it
in a fraction of a second. The GPUs are read from the NVIDIA driver's /proc files the same way. What needs torch
(`auto_dtype` as a torch dtype, a device's memory) is core/devices.py, which asks this module.

What `auto` picks is only a default: `train --precision fp32|bf16`, `extract --compute-dtype float32|bfloat16` and
`--engine-dtype` name a dtype outright (to reproduce a run made on another machine, or, in the test suite, to make
a comparison exact on every CPU kind). Nothing in the environment overrides the probe.
"""

from __future__ import annotations

import contextlib
import functools
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

# cpuinfo flags that decide the kernels (reported with each benchmark row)
REPORTED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


@dataclass(frozen=True)
class CpuInfo:
    model: str  # /proc/cpuinfo's model name
    isa: str  # the widest vector ISA class of its flags: AMX, AVX512, AVX2 or baseline (what kernels dispatch to)
    flags: tuple[str, ...]  # REPORTED_FLAGS this CPU has
    native_bf16: bool  # what auto acts on
    why: str  # one phrase: which flags decided
    avx512_bf16: bool = False  # the flags vLLM's CPU kernels dispatch on
    amx: bool = False
    avx512: bool = False

    def as_dict(self) -> dict:
        return {**asdict(self), "flags": list(self.flags)}

    def describe(self) -> str:
        return f"{self.model} ({self.isa}; {self.why})"


def _cpuinfo() -> tuple[str, set[str]]:
    """(model name, flags) of the first CPU /proc/cpuinfo lists."""
    model, flags = None, None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "flags" and flags is None:
                flags = set(value.split())
            elif key.strip() == "model name" and model is None:
                model = value.strip()
    return model or platform.processor() or "unknown CPU", flags or set()


def isa_class(flags: set[str]) -> str:
    """The widest vector ISA class a CPU's flags name: AMX, AVX512, AVX2, else baseline."""
    for name, flag in (("AMX", "amx_tile"), ("AVX512", "avx512f"), ("AVX2", "avx2")):
        if flag in flags:
            return name
    return "baseline"


@functools.cache
def probe() -> CpuInfo:
    """This CPU as /proc/cpuinfo reports it."""
    model, flags = _cpuinfo()
    avx512_bf16, amx = "avx512_bf16" in flags, "amx_bf16" in flags
    native = avx512_bf16 or amx
    kinds = [name for name, has in (("AMX-BF16", amx), ("AVX512-BF16", avx512_bf16)) if has]
    why = (
        f"computes bf16 natively: {' + '.join(kinds)}, per /proc/cpuinfo"
        if native
        else "no native bf16 (no AVX512-BF16 or AMX, per /proc/cpuinfo)"
    )
    return CpuInfo(
        model,
        isa_class(flags),
        tuple(f for f in REPORTED_FLAGS if f in flags),
        native,
        why,
        avx512_bf16=avx512_bf16,
        amx=amx,
        avx512="avx512f" in flags,
    )


cpu_info = probe  # this CPU, read once per process


def native_bf16() -> bool:
    return cpu_info().native_bf16


def auto_dtype_name(device_type: str) -> str:
    """What `auto` computes in on a device of this type ("cpu", "cuda", ...): bfloat16 on accelerators and
    bf16-native CPUs, float32 on other CPUs. The one home of the choice (core/devices.py gives it as a torch dtype)."""
    if device_type != "cpu":
        return "bfloat16"
    return "bfloat16" if native_bf16() else "float32"


def gpu_names() -> list[str]:
    """The NVIDIA GPUs the driver lists in /proc/driver/nvidia/gpus (no CUDA initialised, no torch); [] without
    them. What torch.cuda would count where the CUDA build of torch is installed."""
    names = []
    for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
        try:
            lines = info.read_text(errors="replace").splitlines()
        except OSError:
            continue
        model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Model:")), None)
        names.append(model or info.parent.name)
    return names
