"""Run one vLLM generation job in its own process: `python -m draftsmith.evaluate.vllm_worker REQUEST.json`.

vLLM starts its engine core with the `spawn` method, which re-imports the main module, so it must be started
from a real file with a `__main__` guard; `vllm_runner.py` launches this file and reads back RESULT.json.
Everything vLLM-specific about the evaluation lives here and in vllm_runner.py (docs/architecture.md, engine coupling).

The job is a `GenerationJob`, the result a `GenerationResult` (a short warm-up run before the timed `generate`
call is not timed).

`run(job)` does one job in the calling process (`main` wraps it in the request and result files); with vLLM's
VLLM_ENABLE_V1_MULTIPROCESSING=0 the engine runs in that process too, which is how tests/test_families.py
affords one engine per family and measurement. The target starts as the extraction engines start it
(`target_engine_kwargs`: a multimodal wrapper with language_model_only, MLA in float32 on CPU with the CPU MLA
backend).
"""

from __future__ import annotations

import sys
import time
from itertools import zip_longest
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from draftsmith.core import vllm_launch
from draftsmith.core.fsio import atomic_write_text
from draftsmith.core.targets import is_multimodal_wrapper, read_config, text_config
from draftsmith.export.formats import vllm_speculative_config
from draftsmith.extract.vllm.probe import probe, target_engine_env, target_engine_kwargs


class GenerationJob(BaseModel):
    """One generation job, as `vllm_runner.run_vllm` writes it to REQUEST.json and this worker reads it."""

    model_config = ConfigDict(extra="forbid")

    target: str
    draft: str | None = None  # None: the target alone (the baseline)
    k: int = 0  # draft tokens per round
    prompts: list[list[int]] = []  # token ids
    max_new_tokens: int = 0
    temperature: float = 0.0
    seed: int = 0
    dtype: str = "auto"
    max_model_len: int
    trust_remote_code: bool = False
    max_num_seqs: int = 1  # prompts decoded at once
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    ignore_eos: bool = False  # generate max_new_tokens whatever the target writes
    groups: list[int] = []  # prompts per group (a suite's domains), each timed and counted apart; [] = one group
    result: str | None = None  # RESULT.json's path (`main`)


class SpecCounts(BaseModel):
    """vLLM's `vllm:spec_decode_*` counters (summed over engines and label sets), or their deltas over a call."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []

    def plus(self, other: SpecCounts, sign: int = 1) -> SpecCounts:
        per_pos = zip_longest(self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos, fillvalue=0)
        return SpecCounts(
            num_drafts=self.num_drafts + sign * other.num_drafts,
            num_draft_tokens=self.num_draft_tokens + sign * other.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens + sign * other.num_accepted_tokens,
            num_accepted_tokens_per_pos=[a + sign * b for a, b in per_pos],
        )

    def minus(self, before: SpecCounts) -> SpecCounts:
        return self.plus(before, -1)


class GroupResult(BaseModel):
    """One group of a job's prompts, decoded by a `generate` call of its own: its wall time and counters."""

    size: int
    elapsed_s: float
    spec: SpecCounts


class GenerationResult(BaseModel):
    """What a generation job measured, as this worker writes it to RESULT.json and `vllm_runner` reads it."""

    vllm_version: str | None = None
    elapsed_s: float  # the timed `generate` call's wall time
    outputs: list[list[int]]  # each prompt's output token ids
    spec: SpecCounts  # the counters' deltas over the timed call
    per_prompt: list[tuple[int, int]] | None = None  # [rounds, accepted draft tokens] of each prompt, where kept
    per_step: list[list[int]] | None = None  # each prompt's accepted draft tokens at each verify step, where kept
    groups: list[GroupResult] = []  # each of the job's groups: its own call's time and counters

    def span(self, group: int) -> slice:
        """Where group `group`'s prompts sit in `outputs`, `per_prompt` and `per_step`."""
        first = sum(g.size for g in self.groups[:group])
        return slice(first, first + self.groups[group].size)


def read_spec_metrics(llm) -> SpecCounts:
    """Sum the counters `vllm:spec_decode_<field>` (over engines / label sets); per-position counts as a list."""
    out = SpecCounts()
    for metric in llm.get_metrics():
        key = metric.name.removeprefix("vllm:spec_decode_")
        if key == metric.name or key not in SpecCounts.model_fields:
            continue
        if hasattr(metric, "values"):  # Vector
            summed = zip_longest(out.num_accepted_tokens_per_pos, metric.values, fillvalue=0)
            out.num_accepted_tokens_per_pos = [int(a) + int(v) for a, v in summed]
        else:
            setattr(out, key, getattr(out, key) + int(metric.value))
    return out


def engine_launch(job: GenerationJob) -> tuple[dict[str, object], dict[str, str]]:
    """(`vllm.LLM` keyword arguments, the environment it starts in) for a job: the target, what it needs to start
    here (the probe's findings), and the draft as EAGLE-3 speculator with k tokens per round (a P-EAGLE draft with
    parallel drafting, as its config.json says: export.vllm_speculative_config)."""
    config = read_config(Path(job.target))
    facts = probe(architecture=(config.get("architectures") or ["unknown"])[0], config=config).facts
    mla = "kv_lora_rank" in text_config(config)
    kwargs: dict[str, object] = dict(
        model=job.target,
        dtype=job.dtype,
        max_model_len=job.max_model_len,
        seed=job.seed,
        disable_log_stats=False,
        enforce_eager=job.enforce_eager,
        trust_remote_code=job.trust_remote_code,
        max_num_seqs=job.max_num_seqs,
        tensor_parallel_size=job.tensor_parallel_size,
    )
    kwargs.update(target_engine_kwargs(facts, mla=mla, multimodal=is_multimodal_wrapper(config), dtype=job.dtype))
    if job.draft:
        kwargs["speculative_config"] = vllm_speculative_config(job.draft, job.k)
        if facts.per_request_spec_metrics:  # τ per prompt (its interval), and each round (τ by segment) where kept
            kwargs["per_request_spec_decode_metrics"] = "detailed" if facts.per_request_spec_steps else "summary"
    env = vllm_launch.engine_environment(
        cpu_workers=job.tensor_parallel_size if facts.platform == "cpu" else 1,  # one CPU group per rank
        target_env=target_engine_env(facts, mla=mla),
    )
    return kwargs, env


def run(job: GenerationJob) -> GenerationResult:
    """One generation job in this process: start the engine, warm up, one timed `generate` per group, the counters'
    deltas; the engine is shut down before returning."""
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = vllm_launch.start_llm(*engine_launch(job))
    try:
        params = SamplingParams(
            temperature=job.temperature,
            max_tokens=job.max_new_tokens,
            seed=job.seed if job.temperature > 0 else None,
            ignore_eos=job.ignore_eos,
        )
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job.prompts]
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
        outputs, groups, start = [], [], 0
        for size in job.groups or [len(prompts)]:
            before = read_spec_metrics(llm)
            began = time.perf_counter()
            outputs += llm.generate(prompts[start : start + size], params, use_tqdm=False)
            groups.append(
                GroupResult(size=size, elapsed_s=time.perf_counter() - began, spec=read_spec_metrics(llm).minus(before))
            )
            start += size
        spec = SpecCounts()
        for group in groups:
            spec = spec.plus(group.spec)
        return GenerationResult(
            vllm_version=vllm.__version__,
            elapsed_s=sum(g.elapsed_s for g in groups),
            outputs=[list(o.outputs[0].token_ids) for o in outputs],
            spec=spec,
            per_prompt=_per_prompt_counts(outputs),
            per_step=_per_step_counts(outputs),
            groups=groups,
        )
    finally:
        vllm_launch.shutdown(llm)


def _request_metrics(outputs: list) -> list | None:
    """Each prompt's per-request speculative-decoding metrics (`per_request_spec_decode_metrics`); None when vLLM
    kept none (the baseline, or a vLLM without them)."""
    metrics = [getattr(out.outputs[0], "spec_decode_metrics", None) for out in outputs]
    return None if any(m is None for m in metrics) else metrics


def _per_prompt_counts(outputs: list) -> list[tuple[int, int]] | None:
    """[rounds, accepted draft tokens] of each prompt, from its acceptance histogram."""
    metrics = _request_metrics(outputs)
    if metrics is None:
        return None
    return [(sum(m.histogram), sum(j * n for j, n in enumerate(m.histogram))) for m in metrics]


def _per_step_counts(outputs: list) -> list[list[int]] | None:
    """Each prompt's accepted draft tokens at each verify step, in order (the `detailed` level); None without."""
    metrics = _request_metrics(outputs)
    if metrics is None or any(sum(m.histogram) and not m.per_step_accepted for m in metrics):
        return None
    return [list(m.per_step_accepted) for m in metrics]


def main(request_file: str) -> None:
    job = GenerationJob.model_validate_json(Path(request_file).read_text(encoding="utf-8"))
    atomic_write_text(Path(str(job.result)), run(job).model_dump_json())


if __name__ == "__main__":
    main(sys.argv[1])
