"""The vLLM extraction backend: probe the installed vLLM, pick a strategy, fill the store from inside vLLM.

    run(cfg)                       the extract stage with --backend vllm (called by draftsmith.extract.run)
    probe.probe(), probe.render_probe_table(report)       what `draftsmith doctor` shows
    benchmark(prepared, n)         extraction vs plain prefill throughput of the same vLLM, same prompts

Strategies (see docs/vllm-compat.md): "connector" = vLLM's own extract_hidden_states method + draftsmith's KV
connector (connector.py); "direct" = a worker extension tapping the model runner (direct.py). Both hand each
finished request to the store sink (sink.py) inside vLLM's worker; the driver (driver.py) only feeds prompts.
Nothing here imports vLLM at module import time, so the package loads (and the probe reports) without vLLM.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

from draftsmith.config import ExtractConfig, StageResult
from draftsmith.errors import DraftsmithError


def choose_strategy(asked: str, report: Any) -> str:
    """`auto` -> what the probe picked; a forced strategy must be usable here, else a one-line reason."""
    if not report.facts.installed:
        raise DraftsmithError(f"--backend vllm: {report.reason}")
    if asked == "auto":
        if report.strategy is None:
            raise DraftsmithError(f"--backend vllm: {report.reason}")
        return report.strategy
    if not report.usable.get(asked, False):
        raise DraftsmithError(f"--vllm-strategy {asked}: not possible with this vLLM {report.facts.version} "
                              f"({report.why_not(asked)}); use --vllm-strategy auto or see `draftsmith doctor`")
    return asked


def _sink_config(cfg: ExtractConfig, plan: Any, spec: Any, backend_info: dict[str, Any]) -> dict[str, Any]:
    return {"store": str(Path(cfg.output).resolve()), "prepared": str(Path(cfg.prepared).resolve()),
            "spec": spec.model_dump(mode="json"), "worker": list(plan.worker), "dp_size": cfg.data_parallel_size,
            "shard_bytes": int(cfg.shard_size_mb * (1 << 20)), "backend_info": backend_info}


def _engine_spec(cfg: ExtractConfig, plan: Any, report: Any, strategy: str, sink_config: dict[str, Any],
                 sample_ids: list[int]):
    from draftsmith.extract.vllm.driver import EngineSpec, resolve_dtype

    longest = max((int(plan.lengths[i]) for i in sample_ids), default=16)
    return EngineSpec(target_dir=str(plan.target_dir), strategy=strategy, facts=report.facts,
                      max_model_len=cfg.vllm_max_model_len or longest + 1,
                      max_num_batched_tokens=cfg.token_budget, tensor_parallel_size=cfg.tensor_parallel_size,
                      data_parallel_size=cfg.data_parallel_size, compile=cfg.vllm_compile,
                      dtype=resolve_dtype(cfg.compute_dtype, report.facts.platform),
                      trust_remote_code=cfg.trust_remote_code, sink_config=sink_config)


def run(cfg: ExtractConfig, *, show_progress: bool = True, timings: dict[str, float] | None = None) -> StageResult:
    """Fill (or resume) cfg.output with the target's hidden states computed by vLLM."""
    from draftsmith.extract import common
    from draftsmith.extract.vllm.driver import Engine, resolve_dtype
    from draftsmith.extract.vllm.probe import probe

    plan = common.plan_extraction(cfg)
    report = probe(architecture=plan.target.architecture, resolve_config=False)
    strategy = choose_strategy(cfg.vllm_strategy, report)
    spec = common.store_spec(plan, backend="vllm", compute_dtype=resolve_dtype(cfg.compute_dtype, report.facts.platform))
    backend_info = {"engine": "vllm", "vllm": report.facts.version, "strategy": strategy,
                    "platform": report.facts.platform}
    # Open as this worker once: checks the store is of the same kind, recovers crash leftovers, saves config.yaml
    # and tells what is done. The lock is then let go: inside vLLM, the sink becomes this worker's writer.
    writer = common.open_writer(plan, spec, backend_info)
    try:
        todo = common.pending_sample_ids(plan, writer)
    finally:
        writer.close()
    skipped = len(plan.sample_ids) - len(todo)
    extra = {"backend": f"vllm {report.facts.version} ({strategy}, {report.facts.platform})"}
    if not todo:
        return common.result(plan, writer, 0.0, tokens=0, skipped=skipped, extra=extra)
    prompts = [(i, plan.dataset[i]["input_ids"].tolist()) for i in todo]
    tokens = sum(len(ids) for _, ids in prompts)
    sink_config = _sink_config(cfg, plan, spec, backend_info)
    with Engine(_engine_spec(cfg, plan, report, strategy, sink_config, todo)) as engine:
        with common.Timer() as timer:  # from the first prompt until the last shard is in the store
            with common.progress_bar(tokens, f"extract (vllm {strategy})", enabled=show_progress) as advance:
                engine.generate(prompts, on_finished=advance)
            engine.wait_for_sink(len(prompts))
            reports = engine.close_sink()
    if timings is not None:
        timings.update({"engine_start_s": engine.start_seconds, "extract_s": timer.seconds})
    writer.samples_written = sum(r.get("samples_written", 0) for r in reports)
    writer.recovered = [note for r in reports for note in r.get("recovered", [])]
    extra["engine start (s)"] = round(engine.start_seconds, 1)
    return common.result(plan, writer, timer.seconds, tokens=tokens, skipped=skipped, extra=extra)


def benchmark(prepared: Path, n: int = 300, *, strategy: str = "auto", compile: bool | None = None,
              token_budget: int = 8192, output: Path | None = None) -> dict[str, Any]:
    """Extraction throughput vs the same vLLM doing plain max_tokens=1 prefill of the same prompts, same run.

    Returns tokens_per_s (extraction from the first prompt until the last shard is stored; engine start-up
    excluded), prefill_tokens_per_s (a plain engine with the same knobs and no capture, started after the
    extraction engine is shut down), ratio_vs_prefill, and the strategy. `compile` None: vLLM compiles on GPUs,
    not on CPUs (its inductor compilation takes minutes there); both engines use the same setting.
    """
    if compile is None:
        from draftsmith.extract.vllm.probe import probe as _probe

        compile = _probe(resolve_config=False).facts.platform not in ("cpu", None)
    from draftsmith.extract import common
    from draftsmith.extract.vllm.driver import Engine
    from draftsmith.extract.vllm.probe import probe

    with tempfile.TemporaryDirectory(prefix="draftsmith-vllm-bench-") as tmp:
        out = Path(output) if output is not None else Path(tmp) / "store"
        cfg = ExtractConfig(prepared=Path(prepared), output=out, backend="vllm", max_samples=n,
                            vllm_strategy=strategy, vllm_compile=compile, token_budget=token_budget)
        timings: dict[str, float] = {}
        result = run(cfg, show_progress=False, timings=timings)
        tokens = int(result.summary["tokens this run"])
        plan = common.plan_extraction(cfg)
        report = probe(architecture=plan.target.architecture, resolve_config=False)
        prompts = [(i, plan.dataset[i]["input_ids"].tolist()) for i in plan.sample_ids]
        plain = _engine_spec(cfg, plan, report, "plain", {}, plan.sample_ids)
        plain.compile = compile and "connector" in result.summary["backend"]  # direct always runs uncompiled
        with Engine(plain) as engine:
            prefill_s = engine.generate(prompts, tag=False)
    tokens_per_s = tokens / timings["extract_s"] if timings.get("extract_s") else math.nan
    prefill_per_s = tokens / prefill_s if prefill_s else math.nan
    return {"backend": "vllm", "strategy": result.summary["backend"], "samples": len(prompts), "tokens": tokens,
            "tokens_per_s": round(tokens_per_s, 1), "prefill_tokens_per_s": round(prefill_per_s, 1),
            "ratio_vs_prefill": round(tokens_per_s / prefill_per_s, 3) if prefill_per_s else math.nan,
            "compiled": plain.compile, "engine_start_s": round(timings.get("engine_start_s", math.nan), 1)}


__all__ = ["benchmark", "choose_strategy", "run"]
