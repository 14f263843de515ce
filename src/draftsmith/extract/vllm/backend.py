"""The vLLM extraction backend's stage: plan and check a job (probe, strategy, compute dtype, store spec), start
vLLM with draftsmith's capture in it, feed the prompts, and the strategies' benchmark."""

from __future__ import annotations

import contextlib
import math
import tempfile
from pathlib import Path

from pydantic import JsonValue

from draftsmith.config import ExtractConfig, StageResult
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.targets import context_length, is_multimodal_wrapper, read_config, text_config
from draftsmith.extract import common, store
from draftsmith.extract.vllm import dtypes, taps
from draftsmith.extract.vllm import probe as probing
from draftsmith.extract.vllm.driver import RUNNER_TAPS, Engine, EngineSpec, Prompt, prompts, start_engine
from draftsmith.extract.vllm.dtypes import DtypeChoice
from draftsmith.extract.vllm.sink import SinkConfig, SinkReport


def choose_strategy(  # noqa: C901 - one branch per fact the strategy choice reads
    asked: str, report: probing.ProbeReport, layer_ids: list[int] | None = None, dtype: str | None = None
) -> str:
    """`auto` -> the first strategy of probe.STRATEGIES usable for these store layer ids and compute dtype; a forced
    strategy must be usable here, else a one-line reason. The connector needs every id among vLLM's own aux states:
    asked for id 0 on an architecture whose aux states start at 1 (DeepSeek-V3, Kimi-K2.5), it is ruled out and
    direct or taps hook the embeddings themselves (direct only where the layer taps can be placed). A stack that
    rescales its stream in float16 (DeepSeek's overflow guard) gives no strategy float16 states equal to the model's."""
    if not report.facts.installed:
        raise DraftsmithError(f"--backend vllm: {report.reason}")
    refused = dtypes.dtype_refusal(report, dtype) if dtype is not None else None
    if refused:
        raise DraftsmithError(f"--backend vllm: {refused}; use --compute-dtype bfloat16, or --backend hf")
    facts = report.facts
    usable, why = dict(report.usable), {name: report.why_not(name) for name in report.usable}

    def rule_out(name: str, reason: str) -> None:
        if usable.get(name):
            usable[name], why[name] = False, reason

    own = [k for k in layer_ids or [] if k == 0 and not facts.reaches_embeddings]
    if own:
        rule_out("connector", f"vLLM's aux states of {report.architecture} do not include layer id 0 (the embeddings)")
        if not facts.layer_taps:
            rule_out(
                "direct",
                "layer id 0 needs draftsmith's own hook, and the layer taps cannot be placed here ("
                + (facts.unknown.get("layer_taps") or "not registered")
                + ")",
            )
    if dtype == "float16" and facts.taps_float16_rescale:
        where = report.support.taps.float16_rescale if report.support is not None else "its decoder layers"
        for name in usable:
            rule_out(
                name,
                f"{report.architecture}'s stack rescales its stream in float16 ({where}); extract in "
                "bfloat16 or float32",
            )
    if asked == "auto":
        for name in probing.STRATEGIES:
            if usable.get(name):
                return name
        raise DraftsmithError(
            f"--backend vllm: {report.reason}"
            if report.strategy is None
            else f"--backend vllm: no strategy fits layer ids {layer_ids} (dtype {dtype}) here ("
            + "; ".join(f"{n}: {why[n]}" for n in probing.STRATEGIES)
            + ")"
        )
    if not usable.get(asked, False):
        raise DraftsmithError(
            f"--vllm-strategy {asked}: not possible with this vLLM {report.facts.version} "
            f"({why.get(asked, '')}); use --vllm-strategy auto or see `draftsmith doctor`"
        )
    return asked


def _backend_info(report: probing.ProbeReport, strategy: str) -> dict[str, JsonValue]:
    """The engine as the store's manifest records it."""
    return {"engine": "vllm", "vllm": report.facts.version, "strategy": strategy, "platform": report.facts.platform}


def _sink_config(plan: common.ExtractionPlan, spec: store.StoreSpec, backend_info: dict[str, JsonValue]) -> SinkConfig:
    cfg = plan.cfg
    return SinkConfig(
        store=str(Path(cfg.output).resolve()),
        prepared=str(Path(cfg.prepared).resolve()),
        spec=spec,
        worker=plan.worker,
        dp_size=cfg.data_parallel_size,
        shard_bytes=int(cfg.shard_size_mb * (1 << 20)),
        backend_info=backend_info,
    )


def _engine_spec(
    plan: common.ExtractionPlan,
    report: probing.ProbeReport,
    strategy: str,
    sink_config: SinkConfig | None,
    sample_ids: list[int],
    dtype: str,
    prefix_caching: bool = False,
) -> EngineSpec:
    cfg = plan.cfg
    longest = max((int(plan.lengths[i]) for i in sample_ids), default=16)
    config = read_config(plan.target_dir)
    context = context_length(config)
    if context is not None and longest > context and cfg.vllm_max_model_len is None:
        raise DraftsmithError(
            f"{cfg.prepared}: a sample of {longest} tokens is longer than the target's context "
            f"({context} positions in its config.json); prepare again with --max-length {context}"
        )
    # Each prompt is sent with max_tokens=1: vLLM wants room for that one sampled token, which is never fed back (the
    # request ends there), so a sample filling the whole context needs one position past it, allowed explicitly.
    max_model_len = cfg.vllm_max_model_len or longest + 1
    tap_plan = None
    if strategy in RUNNER_TAPS:
        tap_plan = taps.plan(strategy, list(plan.layer_ids), plan.num_layers, report.facts, report.support)
    return EngineSpec(
        target_dir=str(plan.target_dir),
        strategy=strategy,
        facts=report.facts,
        tap_plan=tap_plan,
        mla="kv_lora_rank" in text_config(config),
        multimodal=is_multimodal_wrapper(config),
        max_model_len=max_model_len,
        past_context=context is not None and max_model_len == longest + 1 > context,
        max_num_batched_tokens=cfg.token_budget,
        tensor_parallel_size=cfg.tensor_parallel_size,
        data_parallel_size=cfg.data_parallel_size,
        compile=cfg.vllm_compile,
        dtype=dtype,
        trust_remote_code=cfg.trust_remote_code,
        sink_config=sink_config,
        prefix_caching=prefix_caching,
    )


def compute_dtype(cfg: ExtractConfig, report: probing.ProbeReport, config: dict | None) -> DtypeChoice:
    """The dtype the engine computes in (dtypes.choose_dtype); `auto` resuming a store that holds samples takes the
    dtype they were computed in (a run that fell back to float32 resumes in float32)."""
    stored = store.stored_compute_dtype(cfg.output) if cfg.compute_dtype == "auto" else None
    if stored is not None:
        return DtypeChoice(dtype=stored, why=f"the store {cfg.output} holds samples computed in {stored}")
    return dtypes.choose_dtype(cfg.compute_dtype, report, config)


def say_dtype(stage: str, choice: DtypeChoice, asked: str) -> None:
    """The one line that tells what `auto` chose and why (nothing when a dtype was asked for)."""
    if asked == "auto":
        common.stage_line(stage)(f"vLLM runs the target in {choice.dtype} (--compute-dtype auto: {choice.why})")


class _Job:
    """A checked vLLM extraction: plan, probe, strategy, store spec and the samples still to do."""

    def __init__(self, cfg: ExtractConfig, choice: DtypeChoice | None = None):
        self.cfg = cfg
        self.plan = plan = common.plan_extraction(cfg)
        config = read_config(plan.target_dir)
        self.report = report = probing.probe(architecture=plan.target.architecture, resolve_config=False, config=config)
        self.choice = choice or compute_dtype(cfg, report, config)
        self.dtype = dtype = self.choice.dtype
        self.strategy = choose_strategy(cfg.vllm_strategy, report, plan.layer_ids, dtype)
        self.spec = common.store_spec(plan, backend="vllm", compute_dtype=dtype)
        backend_info = _backend_info(report, self.strategy)
        # Open as this worker once: checks the store is of the same kind, recovers crash leftovers, saves
        # config.yaml and tells what is done. The lock is then let go: inside vLLM the sink becomes this writer.
        self.writer = common.open_writer(plan, self.spec, backend_info)
        try:
            self.todo = common.pending_sample_ids(plan, self.writer)
        finally:
            self.writer.close()
        # samples sharing prefixes go to one engine, whose cache and writer hold their parents (not data parallel)
        self.prompts = prompts(plan.dataset, plan.lengths, self.todo, share=cfg.data_parallel_size == 1)
        self.shares = any(p.parent >= 0 for p in self.prompts)
        common.check_disk_space(plan, self.spec, self.todo, sum(p.shared for p in self.prompts))
        self.skipped = len(plan.sample_ids) - len(self.todo)
        self.recovered = list(self.writer.recovered)  # what opening the store cleaned up or adopted
        self.sink_config = _sink_config(plan, self.spec, backend_info)
        self.label = f"vllm {report.facts.version} ({self.strategy}, {report.facts.platform})"

    def engine_spec(self, strategy: str | None = None) -> EngineSpec:
        config = self.sink_config if strategy is None else None
        strategy = strategy or self.strategy
        return _engine_spec(self.plan, self.report, strategy, config, self.todo, self.dtype, self.shares)

    def start(self) -> tuple[_Job, Engine]:
        """(the job as it runs, its started engine): where the engine cannot run in the chosen dtype and the facts
        could not tell (choice.fallback), the job is planned again in the fallback dtype (the store holds nothing
        yet: it takes the new dtype) and started once more."""
        jobs = {self.dtype: self}

        def spec_for(dtype: str) -> EngineSpec:
            if dtype not in jobs:
                jobs[dtype] = _Job(self.cfg, DtypeChoice(dtype=dtype, why=f"fallback from {self.dtype}"))
            return jobs[dtype].engine_spec()

        engine, dtype = start_engine(self.choice, spec_for, say=common.stage_line("extract"))
        return jobs[dtype], engine

    def result(self, seconds: float, tokens: int, reports: list[SinkReport], engine_start_s: float) -> StageResult:
        self.writer.samples_written = sum(r.samples_written for r in reports)
        self.writer.recovered = self.recovered + [note for r in reports for note in r.recovered]
        return common.result(
            self.plan,
            self.writer,
            seconds,
            tokens=tokens,
            skipped=self.skipped,
            backend=self.label,
            engine_start_s=engine_start_s,
        )


def run(cfg: ExtractConfig, *, show_progress: bool = True) -> StageResult:
    """Fill (or resume) cfg.output with the target's hidden states computed by vLLM."""
    job = _Job(cfg)
    if not job.todo:
        return job.result(0.0, 0, [], 0.0)
    say_dtype("extract", job.choice, cfg.compute_dtype)
    job, engine = job.start()
    tokens = sum(len(p.ids) - p.shared for p in job.prompts)
    with engine, common.Timer() as timer:  # from the first prompt until the last shard is in the store
        with common.progress_bar(tokens, f"extract (vllm {job.strategy})", enabled=show_progress) as advance:
            engine.generate(job.prompts, on_finished=advance)
        engine.wait_for_sink(len(job.prompts))
        reports = engine.close_sink()
    return job.result(timer.seconds, engine.computed_tokens, reports, engine.start_seconds)


def offered_strategies(prepared: Path, *, compute_dtype: str = "auto") -> list[str]:
    """The strategies the installed vLLM offers for this prepared set's target, its layer ids and compute dtype."""
    plan = common.plan_extraction(
        ExtractConfig(
            prepared=Path(prepared), output=Path(prepared) / "unused", backend="vllm", compute_dtype=compute_dtype
        )
    )
    config = read_config(plan.target_dir)
    report = probing.probe(architecture=plan.target.architecture, config=config)
    dtype = dtypes.choose_dtype(compute_dtype, report, config).dtype
    offered = []
    for name in probing.STRATEGIES:
        try:
            offered.append(choose_strategy(name, report, plan.layer_ids, dtype))
        except DraftsmithError:
            continue
    return offered


def benchmark(  # noqa: PLR0913 - the benchmark's settings, as its CLI names them
    prepared: Path,
    n: int = 300,
    *,
    strategies: list[str] | None = None,
    compile: bool | None = None,
    token_budget: int = 8192,
    chunks: int = 4,
    output: Path | None = None,
    tensor_parallel_size: int = 1,
    compute_dtype: str = "auto",
) -> dict[str, object]:
    """Each strategy's extraction throughput against the same vLLM doing plain max_tokens=1 prefill of the same
    prompts, all in one run.

    `strategies`: names, or None for every one the installed vLLM offers here (`offered_strategies`). One engine per
    strategy and one plain engine (no capture) are up at once, with the same knobs; the prompts are cut into
    `chunks`, and each chunk runs on the plain engine, then is extracted by each strategy in turn (the first one
    rotating from chunk to chunk), so a busy machine slows all alike. A strategy's tokens_per_s counts extraction
    from each chunk's first prompt until its states reached the sink, plus the final flush of its store; engine
    start-up is excluded. `compile` None: vLLM compiles on GPUs, not on CPUs (its inductor compilation takes minutes
    there). The runner taps (direct, taps) always run uncompiled, so where `compile` is on only the connector and
    the plain engine compile.
    """
    names = list(strategies) if strategies else offered_strategies(prepared, compute_dtype=compute_dtype)
    if not names:
        raise DraftsmithError(f"{prepared}: the installed vLLM offers no extraction strategy for this target")
    with tempfile.TemporaryDirectory(prefix="draftsmith-vllm-bench-") as tmp:
        root = Path(output) if output is not None else Path(tmp)
        knobs = dict(  # the same for every strategy
            prepared=Path(prepared),
            backend="vllm",
            max_samples=n,
            token_budget=token_budget,
            tensor_parallel_size=tensor_parallel_size,
            compute_dtype=compute_dtype,
        )
        jobs = {name: _Job(ExtractConfig(output=root / name, vllm_strategy=name, **knobs)) for name in names}
        first = jobs[names[0]]
        for job in jobs.values():
            job.shares = False  # every strategy computes every token of the same prompts, as the plain engine
        if compile is None:
            compile = first.report.facts.platform not in ("cpu", None)
        for job in jobs.values():
            job.cfg.vllm_compile = compile
        sent = first.prompts
        size = math.ceil(len(sent) / max(1, chunks))
        parts = [[Prompt(p.sample_id, p.ids) for p in sent[k : k + size]] for k in range(0, len(sent), size)]
        seconds, prefill_s, starts = _race(jobs, parts, compile)
        stored = {name: len(store.open(root / name)) for name in names}
    tokens = sum(len(p.ids) for p in sent)
    prefill_per_s = tokens / prefill_s
    rows = {
        name: {
            "label": jobs[name].label,
            "tokens_per_s": round(tokens / seconds[name], 1),
            "ratio_vs_prefill": round(tokens / seconds[name] / prefill_per_s, 3),
            "stored": stored[name],
            "engine_start_s": round(starts[name], 1),
            "compiled": bool(compile and name == "connector"),
        }
        for name in names
    }
    return {
        "backend": "vllm",
        "vllm": first.report.facts.version,
        "platform": first.report.facts.platform,
        "target": first.plan.target.architecture,
        "tensor_parallel_size": tensor_parallel_size,
        "compute_dtype": first.dtype,
        "samples": len(sent),
        "tokens": tokens,
        "chunks": len(parts),
        "prefill_tokens_per_s": round(prefill_per_s, 1),
        "prefill_compiled": bool(compile),
        "strategies": rows,
    }


def _race(
    jobs: dict[str, _Job], parts: list[list[Prompt]], compile: bool
) -> tuple[dict[str, float], float, dict[str, float]]:
    """`benchmark`'s run (as its docstring tells): each strategy's seconds, the plain engine's, and each engine's
    start-up seconds."""
    names = list(jobs)
    seconds = dict.fromkeys(names, 0.0)
    prefill_s = 0.0
    with contextlib.ExitStack() as stack:
        engines = {name: stack.enter_context(Engine(job.engine_spec())) for name, job in jobs.items()}
        plain_spec = jobs[names[0]].engine_spec("plain")
        plain_spec.compile = compile
        plain = stack.enter_context(Engine(plain_spec))
        done = 0
        for i, part in enumerate(parts):
            prefill_s += plain.generate(part, tag=False)
            done += len(part)
            turn = names[i % len(names) :] + names[: i % len(names)]  # each strategy first in turn
            for name in turn:
                engine = engines[name]
                with common.Timer() as timer:
                    engine.generate(part)
                    engine.wait_for_sink(done)
                seconds[name] += timer.seconds
        for name, engine in engines.items():
            with common.Timer() as timer:
                engine.close_sink()
            seconds[name] += timer.seconds
        starts = {name: engine.start_seconds for name, engine in engines.items()}
    return seconds, prefill_s, starts


__all__ = ["benchmark", "choose_strategy", "compute_dtype", "offered_strategies", "run", "say_dtype"]
