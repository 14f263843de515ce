"""`draftsmith evaluate`: measure a draft by real speculative decoding, with the reference decoder or vLLM.

The draft is an export directory (any format) or a training checkpoint; the target is the one it was trained
for (a different one is refused). For each k the same prompts are decoded with the draft, and once without it
for the speed-up; the report (JSON, markdown, PNG charts) goes to `cfg.output`.
"""

from __future__ import annotations

import functools
import random
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from transformers import PreTrainedModel

from draftsmith import export
from draftsmith.config import EvaluateConfig, StageResult, save_resolved_config
from draftsmith.core import targets
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.manifest import TargetIdentity
from draftsmith.evaluate import gate, load, vllm_runner
from draftsmith.evaluate.prompts import (
    HELD_OUT,
    MTBENCH,
    Domain,
    Prompt,
    held_out_split,
    load_domains,
    suite_domains,
    training_prompts,
)
from draftsmith.evaluate.report import (
    CHARTS_HINT,
    ConcurrencySweep,
    DecodeReport,
    DomainReport,
    EvaluationReport,
    GateReport,
    RunReport,
    several_segments,
    speedup_line,
    write_report,
)
from draftsmith.evaluate.segments import Segmenter, segment_report, split_rounds
from draftsmith.evaluate.specdec import (
    DecodeStats,
    DraftRunner,
    Measured,
    TargetRunner,
    lossless,
    merged,
    plain_generate,
    speculative_generate,
)
from draftsmith.evaluate.vllm_worker import GenerationResult
from draftsmith.extract.vllm.dtypes import DtypeChoice
from draftsmith.extract.vllm.probe import probe
from draftsmith.methods import method_of
from draftsmith.methods.artefact import DraftSource, draft_module, load_draft, resolve_draft_target
from draftsmith.methods.base import Draft

__all__ = ["Measured", "merged", "run", "build_draft_module", "evaluate_reference"]

CPU = torch.device("cpu")


def build_draft_module(
    source: DraftSource, target_model: torch.nn.Module, device: torch.device, dtype: torch.dtype
) -> Draft:
    """The draft's module holding its weights, with the target's embedding (DFlash: and lm_head), on `device` in
    `dtype`."""
    draft = draft_module(source, targets.embed_tokens(target_model).weight, targets.lm_head(target_model).weight)
    return draft.to(device=device, dtype=dtype).eval().requires_grad_(False)


def _say(line: str) -> None:
    """One line to stderr, at once (what evaluate chose, and why)."""
    print(line, file=sys.stderr, flush=True)


def evaluate_reference(  # noqa: PLR0913 - the decoding settings of one evaluation, as EvaluateConfig names them
    target_model: PreTrainedModel,
    draft: Draft,
    aux_layer_ids: list[int],
    prompts: list[Prompt],
    ks: list[int],
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    eos_ids: set[int],
    baseline: bool = True,
    device: torch.device = CPU,
    show_progress: bool = False,
    segmenter: Segmenter | None = None,
    paths: dict[int, list[list[int]]] | None = None,
) -> Measured:
    """Decode every prompt with the draft for each k (and once with the target alone); stats and outputs, and with
    a `segmenter` each k's rounds split by what the target was writing (`by_segment`). With `paths` (each k's
    outputs of another engine, greedy) each prompt is decoded along that engine's output (specdec's `path`)."""
    target = TargetRunner(target_model, aux_layer_ids)
    drafter = DraftRunner(draft)
    tensors = [torch.tensor(p.token_ids, device=device) for p in prompts]
    # Warm-up (allocator, kernels): not timed, so the first measured run is not penalised.
    speculative_generate(target, drafter, tensors[0], ks[0], min(8, max_new_tokens), 0.0, eos_ids)
    plain_generate(target, tensors[0], min(8, max_new_tokens), 0.0, eos_ids)
    result = Measured({}, {}, str(target_model.dtype).removeprefix("torch."))
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=True
    ) as progress:
        for k in ([0] if baseline else []) + list(ks):
            task = progress.add_task(f"k={k}" if k else "target alone", total=len(prompts), visible=show_progress)
            generator = torch.Generator(device=device).manual_seed(seed)
            total = DecodeStats(k=k)
            outputs = []
            segments = None
            for i, (prompt, ids) in enumerate(zip(prompts, tensors, strict=False)):
                if k == 0:
                    gen = plain_generate(target, ids, max_new_tokens, temperature, eos_ids, generator)
                else:
                    path = paths[k][i] if paths else None
                    gen = speculative_generate(
                        target, drafter, ids, k, max_new_tokens, temperature, eos_ids, generator, path
                    )
                    if segmenter is not None:
                        segments = split_rounds(segmenter.labels(prompt.token_ids, gen.tokens), gen.rounds, k, segments)
                total.add(gen.stats)
                outputs.append(gen.tokens)
                progress.advance(task)
            result.stats[k], result.outputs[k] = total, outputs
            if segments is not None:
                result.by_segment[k] = segments
    if baseline and temperature == 0:
        result.lossless = lossless(result.outputs, ks)
    return result


def _max_model_len(cfg: EvaluateConfig, prompts: list[Prompt], target_path: Path) -> int:
    """vLLM's max_model_len: --max-model-len, else `_engine_context` within the target's own context."""
    return cfg.max_model_len or _engine_context(prompts, cfg, targets.context_length(targets.read_config(target_path)))


def _engine_context(prompts: list[Prompt], cfg: EvaluateConfig, context: int | None) -> int:
    """vLLM's max_model_len for these prompts: room for the longest prompt, its new tokens and a draft's k, never past
    the target's own context (`context`: generation then stops at the context, as the target alone would); a prompt
    that leaves no room for one new token is refused in one line."""
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i].token_ids))
    wanted = len(prompts[longest].token_ids) + cfg.max_new_tokens + max(cfg.k) + 8
    if context is None or wanted <= context:
        return wanted
    if len(prompts[longest].token_ids) >= context:
        raise DraftsmithError(
            f"{cfg.prompts}: prompt {longest} has {len(prompts[longest].token_ids)} tokens, no room "
            f"for a new one in the target's context of {context} positions; use shorter prompts"
        )
    return context


def _prompt_set(cfg: EvaluateConfig, source: DraftSource) -> str:
    """The prompt set: what was asked; else (and for `held-out`), for the gate, the held-out split of the draft's
    training data (the traffic it was trained for) where it is on this machine; else mt-bench."""
    if cfg.prompts is not None and cfg.prompts != HELD_OUT:
        return cfg.prompts
    if cfg.gate or cfg.prompts == HELD_OUT:
        prepared, why = training_prompts(source.training)
        said = why if prepared else f"mt-bench ({why}; --prompts FILE picks yours)"
        _say(f"evaluate: prompts: {said}")
        return prepared or MTBENCH
    return MTBENCH


def _engine(cfg: EvaluateConfig, source: DraftSource, target_path: Path) -> EvaluateConfig:
    """--engine auto as vLLM where it can decode this draft here, else the reference decoder, saying which and why."""
    if cfg.engine != "auto":
        return cfg
    verdict = vllm_runner.vllm_verdict(target_path, "--engine vllm", method=source.spec.method)
    engine = "vllm" if verdict.refusal is None else "hf"
    _say(
        f"evaluate --engine auto: {f'vLLM {verdict.version}' if engine == 'vllm' else f'reference decoder ({verdict.why_not})'}"
    )
    return cfg.model_copy(update={"engine": engine})


def _reference_run(
    cfg: EvaluateConfig,
    source: DraftSource,
    target_path: Path,
    tokenizer: Any,
    domains: list[Domain],
    dtype_name: str,
    along: list[Measured] | None = None,
) -> list[Measured]:
    """The reference decoder (transformers) on every k, and the target alone where cfg.baseline, each domain apart
    (the target loaded once); along `along`'s outputs (vLLM's, domain by domain) for the gate."""
    device = targets.resolve_device(cfg.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        dtype_name, torch.float32 if device.type == "cpu" else torch.bfloat16
    )
    target_model = targets.load_target(target_path, dtype=dtype, device=device, trust_remote_code=cfg.trust_remote_code)
    draft = build_draft_module(source, target_model, device, dtype)
    parts, eos_ids, segmenter = [], targets.eos_ids(tokenizer, target_path), Segmenter(tokenizer)
    for i, domain in enumerate(domains):
        measured = evaluate_reference(
            target_model,
            draft,
            source.spec.aux_layer_ids,
            domain.prompts,
            cfg.k,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            seed=cfg.seed,
            eos_ids=eos_ids,
            baseline=cfg.baseline,
            device=device,
            show_progress=True,
            segmenter=segmenter,
            paths=along[i].outputs if along else None,
        )
        measured.dtype = str(dtype).removeprefix("torch.")  # the dtype the target was loaded in
        parts.append(measured)
    return parts


def _vllm_run(  # noqa: PLR0913 - one evaluation's settings and where it writes
    cfg: EvaluateConfig,
    source: DraftSource,
    identity: TargetIdentity,
    target_path: Path,
    tokenizer: Any,
    domains: list[Domain],
    choice: DtypeChoice,
    output: Path,
) -> list[Measured]:
    """vLLM on every k, and the target alone where cfg.baseline: one engine each, every domain decoded in it (a
    `generate` call of its own, timed and counted apart); each domain's stats, outputs and rounds by segment."""
    if cfg.dtype == "auto":
        _say(f"evaluate: vLLM runs the target in {choice.dtype} (--dtype auto: {choice.why})")
    workdir = output / "vllm"  # requests, results and engine logs of this run (replaced each run)
    shutil.rmtree(workdir, ignore_errors=True)
    draft_dir = export.vllm_loadable(cfg.draft, source, identity, workdir / "vllm-draft")
    prompts = [p for d in domains for p in d.prompts]
    run_vllm = functools.partial(
        vllm_runner.run_vllm,
        target=target_path,
        prompts=[p.token_ids for p in prompts],
        groups=[len(d.prompts) for d in domains],
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        seed=cfg.seed,
        max_model_len=_max_model_len(cfg, prompts, target_path),
        kv_cache_gb=cfg.vllm_kv_cache_gb,
        timeout_s=cfg.vllm_timeout_s,
        workdir=workdir,
        trust_remote_code=cfg.trust_remote_code,
        tensor_parallel_size=cfg.tensor_parallel_size,
    )
    results: dict[int, GenerationResult] = {}
    dtype = choice.dtype

    def decode(draft: Path | None, k: int, name: str) -> GenerationResult:
        """One engine's run; the first, where the facts could not tell whether the dtype runs here, falls back
        once (DtypeChoice.fallback), saying why; the later ones keep the dtype that ran."""
        nonlocal dtype
        try:
            return run_vllm(draft=draft, k=k, name=name, dtype=dtype)
        except DraftsmithError as err:
            if choice.fallback is None or results:
                raise
            _say(f"evaluate: {choice.note(str(err))}")
            dtype = choice.fallback
            return run_vllm(draft=draft, k=k, name=f"{name}-{choice.fallback}", dtype=dtype)

    for k in ([0] if cfg.baseline else []) + list(cfg.k):
        results[k] = decode(draft_dir if k else None, k, f"k{k}" if k else "baseline")
    return [vllm_runner.served_domain(results, i, d.prompts, tokenizer, dtype) for i, d in enumerate(domains)]


def _gate(cfg: EvaluateConfig, source: DraftSource, served: Measured, reference: Measured) -> GateReport:
    """The gate's verdict at each k (gate.py): the reference decoder's runs along vLLM's outputs against vLLM's."""
    drift, unread = gate.served_drift(Path(cfg.draft))
    for key in unread:
        _say(f"evaluate --gate: warning: {drift[key]}; vLLM does not read it")
    checks = [
        gate.judge(
            reference.stats[k],
            served.stats[k],
            tolerance=cfg.gate_tolerance,
            vllm_version=served.vllm_version,
            dtype=served.dtype,
            drift=drift,
            unread=unread,
            training=source.training,
        )
        for k in cfg.k
    ]
    return GateReport(passed=all(c.passed for c in checks), checks=checks)


def _concurrency(
    cfg: EvaluateConfig, target_path: Path, tokenizer: Any, prompts: list[Prompt], dtype: str, output: Path
) -> ConcurrencySweep:
    """The speed-up by concurrency through `draftsmith serve` (load.py): the largest k, the dtype vLLM ran in."""
    options = load.ServerOptions(
        draft=Path(cfg.draft),
        k=max(cfg.k),
        dtype=dtype,
        max_model_len=_max_model_len(cfg, prompts, target_path),
        kv_cache_gb=cfg.vllm_kv_cache_gb,
        tensor_parallel_size=cfg.tensor_parallel_size,
        trust_remote_code=cfg.trust_remote_code,
        timeout_s=cfg.vllm_timeout_s,
        vllm_args=cfg.vllm_args,
    )
    _say(
        f"evaluate --concurrency {','.join(map(str, cfg.concurrency))}: draftsmith serve with the draft (k={options.k}), "
        "then the target alone, each loaded by vllm bench serve"
    )
    return load.sweep(
        options,
        [tokenizer.decode(p.token_ids) for p in prompts],  # as rendered, special tokens included: sent as they are
        cfg.concurrency,
        max_new_tokens=cfg.max_new_tokens,
        seed=cfg.seed,
        workdir=output / "load",
        vllm_version=probe().facts.version,
    )


def _settled(cfg: EvaluateConfig, source: DraftSource) -> EvaluateConfig:
    """What will run: the rounds the draft's method proposes, the gate's engine and greedy decoding, the prompt set."""
    rounds = sorted({method_of(source.spec).round_tokens(source.spec, k) for k in cfg.k})
    if rounds != sorted(set(cfg.k)):  # a method whose round is fixed (DFlash: its block's masks), as vLLM drafts it
        cfg = cfg.model_copy(update={"k": rounds})
    if cfg.gate:  # the gate decodes greedily in the vLLM the user has, and with the reference decoder along it
        cfg = cfg.model_copy(update={"engine": "vllm", "temperature": 0.0})
    return cfg.model_copy(update={"prompts": _prompt_set(cfg, source)})


def _vllm_choice(cfg: EvaluateConfig, source: DraftSource, target_path: Path) -> DtypeChoice | None:
    """The dtype vLLM runs in, where vLLM runs at all; refused in one line, before anything, where vLLM is not
    installed or cannot decode this draft here."""
    if cfg.engine != "vllm" and not cfg.concurrency:
        return None
    choice = vllm_runner.engine_dtype(target_path, cfg.dtype)
    vllm_runner.check_vllm_can_serve(
        target_path,
        "--gate" if cfg.gate else "--engine vllm" if cfg.engine == "vllm" else "--concurrency",
        method=source.spec.method,
        dtype=choice.dtype,
    )
    return choice


def _runs(cfg: EvaluateConfig, measured: Measured) -> tuple[DecodeReport | None, list[RunReport]]:
    """The target alone's run and each k's, as the report shows them."""
    stats, base = measured.stats, measured.stats.get(0)
    runs = [
        RunReport(
            **stats[k].to_dict(),
            speedup=(stats[k].tokens_per_s / base.tokens_per_s) if base and base.tokens_per_s > 0 else None,
            by_segment={name: segment_report(c) for name, c in measured.by_segment[k].items()}
            if k in measured.by_segment
            else None,
        )
        for k in cfg.k
    ]
    return (DecodeReport(**base.to_dict()) if base else None), runs


def _report(  # noqa: PLR0913 - what one evaluation measured, as the report holds it
    cfg: EvaluateConfig,
    source: DraftSource,
    target_path: Path,
    domains: list[Domain],
    parts: list[Measured],
    verdict: GateReport | None,
    concurrency: ConcurrencySweep | None,
) -> EvaluationReport:
    whole = merged(parts)
    baseline, runs = _runs(cfg, whole)
    assert cfg.prompts is not None
    return EvaluationReport(
        engine=cfg.engine,
        target=str(target_path),
        draft=str(cfg.draft),
        prompts=cfg.prompts,
        num_prompts=sum(len(d.prompts) for d in domains),
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        aux_layer_ids=source.spec.aux_layer_ids,
        draft_vocab_size=source.spec.draft_vocab_size,
        lossless=whole.lossless,
        vllm_version=whole.vllm_version,
        dtype=whole.dtype,
        gate=verdict,
        concurrency=concurrency,
        baseline=baseline,
        runs=runs,
        domains=[
            DomainReport(name=d.name, prompts=d.source, num_prompts=len(d.prompts), baseline=b, runs=r)
            for d, (b, r) in zip(domains, (_runs(cfg, p) for p in parts), strict=True)
        ]
        if suite_domains(cfg.prompts)
        else [],
        segments_note=whole.segments_note,
    )


def _summary(cfg: EvaluateConfig, report: EvaluationReport, paths: dict[str, Path]) -> dict[str, object]:
    """The table the CLI prints."""
    summary: dict[str, object] = {"engine": cfg.engine, "prompts": f"{cfg.prompts} ({report.num_prompts})"}
    for check in report.gate.checks if report.gate else []:
        summary[f"gate (k={check.k})"] = check.verdict
    if report.baseline:
        summary["target alone tokens/s"] = round(report.baseline.tokens_per_s, 2)
    for r in report.runs:
        summary[f"k={r.k} τ"] = round(r.tau, 3)
        if r.tau_95:
            summary[f"k={r.k} τ 95 % interval"] = f"{r.tau_95[0]:.3f} .. {r.tau_95[1]:.3f} (over prompts)"
        summary[f"k={r.k} acceptance/pos"] = [round(a, 3) for a in r.acceptance_per_pos]
        if several_segments(r):
            summary[f"k={r.k} τ by segment"] = ", ".join(
                f"{name} {c.tau:.3f} ({c.rounds} rounds)" for name, c in (r.by_segment or {}).items() if c.rounds
            )
        if r.speedup is not None:
            summary[f"k={r.k} speed-up"] = round(r.speedup, 3)
        if report.domains:
            summary[f"k={r.k} τ by domain"] = ", ".join(
                f"{d.name} {run.tau:.3f}" + (f" ({run.tau_95[0]:.2f}..{run.tau_95[1]:.2f})" if run.tau_95 else "")
                for d in report.domains
                for run in d.runs
                if run.k == r.k
            )
    if report.concurrency:
        summary["speed-up by concurrency"] = speedup_line(report.concurrency)
    summary["report"] = str(paths["markdown"])
    if "acceptance_chart" not in paths:
        summary["charts"] = f"none: {CHARTS_HINT}"
        _say(f"evaluate: the report has no charts ({CHARTS_HINT})")
    return summary


def run(cfg: EvaluateConfig) -> StageResult[EvaluationReport]:
    """`draftsmith evaluate`: τ, per-position acceptance and speed-up for each k, plus the report; with --gate, the
    reference decoder against vLLM (gate.py), failing (GateFailed, after the report) where they disagree."""
    source = load_draft(cfg.draft)
    target_path, identity = resolve_draft_target(cfg.target, source, str(cfg.draft), "evaluate it")
    cfg = _engine(_settled(cfg, source), source, target_path)
    assert cfg.prompts is not None
    choice = _vllm_choice(cfg, source, target_path)
    tokenizer = targets.load_tokenizer(target_path, cfg.trust_remote_code)
    domains = load_domains(
        cfg.prompts,
        tokenizer,
        target=identity,
        num_prompts=cfg.num_prompts,
        template_kwargs=cfg.chat_template_kwargs,
        **held_out_split(cfg.eval_fraction, cfg.split_seed, source.training),
    )
    output = Path(cfg.output)
    output.mkdir(parents=True, exist_ok=True)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    verdict = None
    if cfg.engine == "hf":
        parts = _reference_run(cfg, source, target_path, tokenizer, domains, cfg.dtype)
    else:
        assert choice is not None
        parts = _vllm_run(cfg, source, identity, target_path, tokenizer, domains, choice, output)
        if cfg.gate:  # the reference decoder in the dtype vLLM ran, along vLLM's greedy outputs
            along = cfg.model_copy(update={"baseline": False})
            reference = _reference_run(along, source, target_path, tokenizer, domains, parts[0].dtype, parts)
            verdict = _gate(cfg, source, merged(parts), merged(reference))
    concurrency = None
    if cfg.concurrency and (verdict is None or verdict.passed):  # a draft the gate failed is not worth timing
        assert choice is not None
        dtype = parts[0].dtype if cfg.engine == "vllm" else choice.dtype  # the one vLLM ran above
        prompts = [p for d in domains for p in d.prompts]
        concurrency = _concurrency(cfg, target_path, tokenizer, prompts, dtype, output)
    report = _report(cfg, source, target_path, domains, parts, verdict, concurrency)
    paths = write_report(output, report)
    save_resolved_config(cfg, output)
    summary = _summary(cfg, report, paths)
    failed = [c for c in verdict.checks if not c.passed] if verdict else []
    if failed:  # after the report: a pipeline stops here, and the report says why
        raise gate.GateFailed(f"{failed[0].verdict} (report: {paths['markdown']})")
    return StageResult(stage="evaluate", output=output, result=report, summary=summary)
