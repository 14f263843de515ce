"""`draftsmith quickstart`: prepare -> extract -> train -> export -> evaluate on the embedded default, resumably.

Each stage writes its own sub-directory and is itself resumable; `quickstart.json` records which stages have
finished, so a run killed at any point and started again skips what is done and continues the rest.
`--method peagle` trains a P-EAGLE draft on the same budget instead of an EAGLE-3 one, `--method dflash` a DFlash
block drafter (its store holds the DFlash layers; the budget's `dflash` shapes); the other stages read the method
from the draft itself.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from draftsmith import evaluate, export, prepare
from draftsmith.config import (
    EvaluateConfig,
    ExportConfig,
    ExtractConfig,
    PrepareConfig,
    QuickstartConfig,
    RegenerateConfig,
    StageResult,
    TrainConfig,
    save_resolved_config,
    validate_config,
)
from draftsmith.core import targets
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import atomic_write_json
from draftsmith.evaluate import vllm_runner
from draftsmith.evaluate.report import (
    ACCEPTANCE_PNG,
    CHARTS_HINT,
    REPORT_JSON,
    EvaluationReport,
    RunReport,
    read_report,
)
from draftsmith.export.formats import serve_commands
from draftsmith.extract import stage as extract
from draftsmith.methods import method
from draftsmith.prepare import regenerate
from draftsmith.prepare.dataset import open_prepared
from draftsmith.train import stage as train

STATE_NAME = "quickstart.json"
STAGES = ("prepare", "extract", "train", "export", "evaluate")
# `--regenerate` runs one more stage first; its expected time (vLLM, default target, 2-core CPU) drives the ETA:
# 32 conversations, every turn, max length 512, took 439 s there (docs/benchmarks.md, "Regenerate").
REGENERATE_S_PER_CONVERSATION = 13.0


@dataclass(frozen=True)
class Budget:
    """How much data and training each budget buys; `expected_s` drives the ETA until stages report real times."""

    conversations: int
    max_length: int
    epochs: int
    token_budget: int
    ttt_steps: int
    draft_vocab_size: int
    lr: float
    num_prompts: int  # of each domain of the evaluation suite (chat, code, math, agentic)
    max_new_tokens: int
    k: tuple[int, ...]  # draft lengths evaluated, one engine start each; shorter ones are read off the longest
    expected_s: tuple[float, float, float, float, float]
    max_steps: int | None = None  # a cap on the optimizer steps (else the epochs decide)
    # --method dflash: (block size, decoder layers = target layers read, anchors per sample); the block is the
    # largest k + 1 on a CPU (a round drafts block - 1 tokens), the peers' defaults on a GPU
    dflash: tuple[int, int, int] = (16, 5, 512)


BUDGETS: dict[str, Budget] = {
    # A smoke test of the whole path in a few minutes (CI's end-to-end test); τ is not meaningful at this size.
    "tiny": Budget(
        conversations=32,
        max_length=384,
        epochs=1,
        max_steps=24,
        token_budget=2048,
        ttt_steps=2,
        draft_vocab_size=4096,
        lr=1e-3,
        num_prompts=1,
        max_new_tokens=24,
        k=(3,),
        expected_s=(20, 30, 60, 10, 60),
        dflash=(4, 1, 16),
    ),
    # Sized on a 2-core x86-64 CPU (AVX2, fp32) to finish within 15 minutes: ~55k tokens extracted at ~285 tok/s,
    # two epochs of training at ~335 tok/s, then one vLLM run at k = 5 beside the target alone (a vLLM start costs
    # about a minute on such a CPU; docs/benchmarks.md has the measured runs: 13 min).
    "small": Budget(
        conversations=120,
        max_length=512,
        epochs=2,
        token_budget=1024,
        ttt_steps=3,
        draft_vocab_size=8192,
        lr=2e-3,
        num_prompts=2,
        max_new_tokens=64,
        k=(5,),
        expected_s=(10, 190, 320, 1, 120),
        dflash=(6, 2, 48),
    ),
    # About 80 minutes on the same CPU, from the rates measured there (docs/benchmarks.md, "Quickstart"): 600
    # conversations up to 1,024 tokens are 464k tokens, ~26 min to extract at ~300 tok/s; two epochs at ~340 tok/s
    # ~45 min; 20 prompts (5 a domain) x 128 tokens ~10 min. The small budget's shapes, 8.7x its tokens.
    "medium": Budget(
        conversations=600,
        max_length=1024,
        epochs=2,
        token_budget=2048,
        ttt_steps=3,
        draft_vocab_size=8192,
        lr=1e-3,
        num_prompts=5,
        max_new_tokens=128,
        k=(5,),
        expected_s=(15, 1550, 2750, 2, 600),
        dflash=(6, 3, 96),
    ),
    # For a GPU: the whole embedded ShareGPT (~13M tokens at 2,048), 7 TTT steps, a 32k draft vocabulary. Its
    # expected times are a guess for one GPU, not measured yet (no GPU has been lent); on a 2-core CPU it takes days.
    "large": Budget(
        conversations=17000,
        max_length=2048,
        epochs=5,
        token_budget=16384,
        ttt_steps=7,
        draft_vocab_size=32000,
        lr=3e-4,
        num_prompts=20,
        max_new_tokens=256,
        k=(1, 2, 3, 4, 5),
        expected_s=(300, 2400, 14400, 10, 1200),
    ),
}


def _load_state(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {"finished": {}}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        raise DraftsmithError(f"{path}: damaged quickstart state; delete it to start the run over") from None


def _evaluation_engine(cfg: QuickstartConfig, state: dict[str, Any] | None = None) -> tuple[str, str]:
    """(engine, why), chosen before the first stage runs. --engine hf: the reference decoder. auto: vLLM where
    `vllm_runner.vllm_verdict` finds it can decode the draft this run trains, else the reference decoder with the
    probe's reason; --engine vllm there is refused in one line, as `evaluate --engine vllm` would refuse it, before
    any stage. Once the evaluate stage has finished, the engine it used (recorded in the state) is the answer."""
    recorded = (state or {}).get("engine")
    if recorded and "evaluate" in (state or {}).get("finished", {}):
        return recorded["engine"], recorded["why"]
    if cfg.engine == "hf":
        return "hf", "reference decoder (asked for)"
    target = targets.resolve_target(cfg.target)
    verdict = vllm_runner.vllm_verdict(target, "--engine vllm", method=cfg.method)
    if verdict.refusal is None:
        return "vllm", f"vLLM {verdict.version}"
    if cfg.engine == "vllm":
        raise DraftsmithError(verdict.refusal)
    if not targets.hf_backend_hint(target):  # the reference decoder would load the whole target on one device
        return "none", (
            f"none here: {verdict.why_not}, and the target does not fit one device for the reference "
            "decoder; the run stops after export (evaluate the export where a vLLM that can decode it "
            "is installed)"
        )
    return "hf", f"reference decoder ({verdict.why_not})"


# The options that chain the stages together: a recipe section may not move them.
_CHAINED = {
    "regenerate": {"output"},
    "prepare": {"output"},
    "extract": {"prepared", "output"},
    "train": {"data", "output"},
    "export": {"checkpoint", "output"},
    "evaluate": {"draft", "output"},
}


def stage_configs(cfg: QuickstartConfig, engine: str) -> dict[str, Any]:
    """Each stage's config for this quickstart run: the budget's choices, then the recipe's sections on top."""
    configs = _budget_configs(cfg, engine)
    for stage, base in configs.items():
        section = cfg.regenerate_options if stage == "regenerate" else getattr(cfg, stage)
        chained = _CHAINED[stage] | ({"data"} if stage == "prepare" and cfg.regenerate else set())
        moved = sorted(chained & section.keys())
        if moved:
            raise DraftsmithError(
                f"quickstart section {stage}: option {moved[0]} is set by the quickstart itself "
                "(it chains the stages); use --output to place the run"
            )
        if stage == "train" and "method" in section:  # one place, which the resume check reads too
            raise DraftsmithError(
                "quickstart section train: option method is the quickstart's own --method; set "
                "`method:` at the top of the recipe"
            )
        if section:
            configs[stage] = validate_config(
                type(base), {**base.model_dump(), **section}, f"quickstart section {stage}: "
            )
    return configs


def _budget_configs(cfg: QuickstartConfig, engine: str) -> dict[str, Any]:
    b = BUDGETS[cfg.budget]
    out = Path(cfg.output)

    def num_layers() -> int:  # the target's decoder layers, read only by a method that asks (DFlash's spread)
        return int(targets.text_config(targets.read_config(targets.resolve_target(cfg.target)))["num_hidden_layers"])

    store_layers, shape = method(cfg.method).quickstart_options(b, cfg.k or b.k, num_layers)
    configs: dict[str, Any] = {
        "prepare": PrepareConfig(
            data=cfg.data,
            target=cfg.target,
            output=out / "prepared",
            max_length=b.max_length,
            max_samples=b.conversations,
        ),
        "extract": ExtractConfig(
            prepared=out / "prepared", output=out / "store", backend="hf", device=cfg.device, aux_layer_ids=store_layers
        ),
        "train": TrainConfig(
            data=out / ("prepared" if cfg.online else "store"),
            output=out / "train",
            method=cfg.method,
            epochs=b.epochs,
            max_steps=b.max_steps,
            token_budget=b.token_budget,
            lr=b.lr,
            warmup_steps=20,
            device=cfg.device,
            save_every=100,
            **shape,
        ),
        "export": ExportConfig(checkpoint=out / "train", format="vllm", output=out / "export", speculative_tokens=3),
        "evaluate": EvaluateConfig(
            draft=out / "export",
            engine="vllm" if engine == "none" else engine,
            output=out / "eval",
            prompts="suite",  # every domain a target serves, one engine start: per-domain τ
            num_prompts=cfg.num_prompts or b.num_prompts,
            k=cfg.k or list(b.k),
            max_new_tokens=cfg.max_new_tokens or b.max_new_tokens,
            temperature=0.0,
            device=cfg.device,
            # the last step where vLLM decodes: the reference decoder on the same prompts must agree with it
            gate=engine == "vllm",
        ),
    }
    if cfg.regenerate:  # the target answers the data's user turns first, and prepare reads its answers
        # generating needs no speculative decoding: vLLM wherever it is installed (auto), unless hf was asked for
        configs = {
            "regenerate": RegenerateConfig(
                data=cfg.data,
                target=cfg.target,
                output=out / "regenerated",
                engine="hf" if cfg.engine == "hf" else "auto",
                max_length=b.max_length,
                max_samples=b.conversations,
                shard_samples=32,
                device=cfg.device,
            ),
            **configs,
        }
        configs["prepare"].data = [str(out / "regenerated")]
    return configs


# Each stage's module, whose `run(cfg) -> StageResult` the quickstart calls.
_STAGE_MODULES = {
    "regenerate": regenerate,
    "prepare": prepare,
    "extract": extract,
    "train": train,
    "export": export,
    "evaluate": evaluate,
}


# Seconds of expected stage time the ETA's speed estimate leans on before any stage has run: a quick first stage
# (prepare takes seconds) must not scale the long ones down (a 2-second prepare made "about 1 min left" of 12).
ETA_PRIOR_S = 120.0


def _eta(budget: Budget, state: dict[str, Any], remaining: list[str]) -> float:
    """Seconds left: the budget's expected stage times, scaled by how fast the finished stages ran against theirs
    (shrunk towards 1 by ETA_PRIOR_S, so that short stages move it little and long ones a lot)."""
    expected = dict(
        zip(STAGES, budget.expected_s, strict=False), regenerate=budget.conversations * REGENERATE_S_PER_CONVERSATION
    )
    done = [s for s in state["finished"] if s in expected]
    actual = sum(state["finished"][s]["seconds"] for s in done)
    scale = (actual + ETA_PRIOR_S) / (sum(expected[s] for s in done) + ETA_PRIOR_S)
    return scale * sum(expected[s] for s in remaining)


def run(cfg: QuickstartConfig, console: Console | None = None) -> StageResult[EvaluationReport]:
    console = console or Console(stderr=True)
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / STATE_NAME
    state = _load_state(state_path)
    for option in ("budget", "online", "regenerate", "method"):  # what shapes the stages; each checks its own options
        value = getattr(cfg, option)
        if state.get(option, value) != value:
            raise DraftsmithError(
                f"{out}: was started with --{option} {state[option]}; use another --output or the same --{option}"
            )
        state[option] = value
    engine, engine_why = _evaluation_engine(cfg, state)
    state["engine"] = {"engine": engine, "why": engine_why}
    if "evaluate" not in state["finished"]:
        console.print(f"evaluation engine: {engine_why}", highlight=False, soft_wrap=True)
    configs = stage_configs(cfg, engine)
    save_resolved_config(cfg, out)
    budget = BUDGETS[cfg.budget]
    started = time.perf_counter()
    # online: the trainer runs the target; no engine that can evaluate here: the run ends with the export
    stages = [s for s in STAGES if not (cfg.online and s == "extract") and not (engine == "none" and s == "evaluate")]
    stages = ["regenerate"] * cfg.regenerate + stages
    for index, stage in enumerate(stages, start=1):
        remaining = [s for s in stages if s not in state["finished"]]
        if stage in state["finished"]:
            console.print(f"[dim][{index}/{len(stages)}] {stage}: finished earlier, skipped[/]")
            continue
        elapsed = time.perf_counter() - started
        note = f" — evaluating with {engine_why}" if stage == "evaluate" else ""
        console.rule(
            f"[bold][{index}/{len(stages)}] {stage}[/]  elapsed {elapsed / 60:.1f} min, "
            f"about {_eta(budget, state, remaining) / 60:.0f} min left{note}"
        )
        t0 = time.perf_counter()
        result = _STAGE_MODULES[stage].run(configs[stage])
        state["finished"][stage] = {
            "seconds": round(time.perf_counter() - t0, 1),
            "output": str(result.output),
            "summary": json.loads(json.dumps(result.summary, default=str)),
        }
        atomic_write_json(state_path, state)
    evaluated = "evaluate" in state["finished"]
    report = read_report(Path(configs["evaluate"].output) / REPORT_JSON) if evaluated else None
    summary, commands = _summary(cfg, configs, state, engine_why, report)
    return StageResult(stage="quickstart", output=out, result=report, summary=summary, commands=commands)


def tau_lines(runs: list[RunReport], depths_trained: int | None = None) -> dict[str, str]:
    """One line per k = 1..max(k): measured runs as they are; a k not run is read off the longest run.

    At temperature 0 position i of a k-token draft is accepted only when positions < i were, so vLLM's
    per-position acceptance a_i of the longest run gives τ(k) ≈ 1 + a_1 + ... + a_k for every shorter k
    without another engine start (the draft start points differ slightly between runs: a k=2 round that accepts
    both tokens ends where a k=5 round goes on, so the rounds of the two runs start at different positions).

    The shortcut holds for a P-EAGLE draft as well, to the same approximation. Its d-th proposal is the output of
    the slot at position t+d, which attends causally to the real slots up to t and to the parallel slots t+1..t+d-1;
    every parallel slot reads the same input (the mask token's embedding, fc(mask_hidden)) whatever k is, and the
    slots after t+d, the only ones a longer k adds, are masked out. So proposals 1..d of a round are the same for
    every k >= d, in vLLM (its drafting kernel lays the k-1 parallel slots after the real ones, causal attention)
    and in the reference decoder alike; only floating-point rounding of a forward over more slots can differ.
    `depths_trained` (P-EAGLE: its TTT depths) marks the k past them: those slots were never trained.
    """
    by_k = {r.k: r for r in runs}
    longest = by_k[max(by_k)] if by_k else None
    lines: dict[str, str] = {}
    for k in range(1, max(by_k, default=0) + 1):
        r = by_k.get(k)
        past = f" — past the {depths_trained} depths trained" if depths_trained and k > depths_trained else ""
        if r is None:
            assert longest is not None  # by_k holds a run
            derived = 1 + sum(longest.acceptance_per_pos[:k])
            lines[f"k={k}"] = f"τ {derived:.2f} (read off the k={longest.k} run){past}"
            continue
        speed = f", speed-up {r.speedup:.2f}x" if r.speedup else ""
        per_pos = " ".join(f"{a:.2f}" for a in r.acceptance_per_pos)
        interval = f" (95 % over prompts {r.tau_95[0]:.2f}..{r.tau_95[1]:.2f})" if r.tau_95 else ""
        lines[f"k={k}"] = f"τ {r.tau:.2f}{interval}{speed}; acceptance per position {per_pos}{past}"
    return lines


def _summary(
    cfg: QuickstartConfig,
    configs: dict[str, Any],
    state: dict[str, Any],
    engine_why: str,
    report: EvaluationReport | None,
) -> tuple[dict[str, object], dict[str, str]]:
    """(the summary table, the commands that serve the exported draft); `report`: the evaluation's, where it ran."""
    finished = state["finished"]
    prepared = open_prepared(configs["prepare"].output).manifest
    target_dir = Path(prepared.target.path)
    summary: dict[str, object] = {
        "data": f"{prepared.num_samples:,} {'conversations' if cfg.data else 'ShareGPT conversations'}"
        f"{', answers regenerated by the target' if cfg.regenerate else ''}, {prepared.num_tokens:,} tokens",
        "training time": f"{finished['train']['seconds'] / 60:.1f} min",
        "total time": f"{sum(v['seconds'] for v in finished.values()) / 60:.1f} min",
        "evaluation": f"{engine_why}; the suite ({', '.join(d.name for d in report.domains)}), "
        f"{report.num_prompts} prompts, temperature 0"
        if report
        else engine_why,
    }
    summary["draft"] = method(configs["train"].method.name).describe_run(configs["train"])
    summary["exported draft"] = str(configs["export"].output)
    if report is None:
        summary["evaluate it"] = f"draftsmith evaluate --draft {configs['export'].output} --engine vllm"
    else:
        if report.gate:  # vLLM decoded it as the reference decoder does (else evaluate stopped the run)
            summary["gate"] = "; ".join(check.verdict for check in report.gate.checks)
        summary.update(tau_lines(report.runs, method(configs["train"].method.name).depths_trained(configs["train"])))
        k = report.runs[-1].k
        summary[f"τ by domain (k={k})"] = ", ".join(
            f"{d.name} {r.tau:.2f}" for d in report.domains for r in d.runs if r.k == k
        )
        summary["report"] = str(Path(configs["evaluate"].output) / "report.md")
        if not (Path(configs["evaluate"].output) / ACCEPTANCE_PNG).is_file():
            summary["charts"] = f"none: {CHARTS_HINT}"
    exported = configs["export"]
    return summary, serve_commands(target_dir, Path(exported.output).resolve(), exported.speculative_tokens)
