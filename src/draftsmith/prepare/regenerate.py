"""`draftsmith regenerate`: the target answers the conversations' user turns itself, so the draft trains on the
target's own answers (what it will have to predict when serving) instead of another model's.

`run(cfg)` is here: the conversations and their order (regenerate_conversations.py) go to an engine
(regenerate_engines.py: vLLM in a child process, or transformers `generate`) and come back as shards of the
regenerated set (regenerated_set.py, the artefact; docs/formats.md, "Regenerated data set").
`draftsmith prepare --data DIR` reads the directory as messages JSON Lines (its manifest.json is not data).

A killed run keeps its complete shards (in `.NAME.resume` beside the output, with the tallies of exactly the
records they were made from); the same command run again reads past those records and continues, so no
conversation is lost or written twice. Greedy answers do not depend on how requests were batched (up to
floating-point ties), so a resumed greedy run ends with the same set as an uninterrupted one; so does a sampled
one with vLLM, which seeds every answer on its own (transformers seeds each batch, and batches differ after a
resume: the answers are then other, equally valid samples).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch
from rich.console import Console
from transformers import PreTrainedTokenizerBase

from draftsmith.config import RegenerateConfig, StageResult
from draftsmith.core import vllm_launch
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import sha256_bytes
from draftsmith.core.manifest import TargetIdentity
from draftsmith.core.targets import context_length, read_config, resolve_device
from draftsmith.prepare import regenerate_engines as engines
from draftsmith.prepare import regenerated_set
from draftsmith.prepare.chat import ChatEncoder
from draftsmith.prepare.readers import Source
from draftsmith.prepare.regenerate_conversations import Regenerator, Tally, read_records
from draftsmith.prepare.regenerated_set import Generator, RegeneratedManifest, RegeneratedShard, Sampling
from draftsmith.prepare.stage import by_count, job_fingerprint, job_inputs, progress_bar
from draftsmith.prepare.vllm_chat import AnswerParser


def _summary(
    cfg: RegenerateConfig, manifest: RegeneratedManifest, resumed_records: int, seconds: float
) -> dict[str, object]:
    summary: dict[str, object] = {
        "output": str(cfg.output),
        "target": manifest.generator.target.path,
        "engine": manifest.generator.engine_version,
        "records read": manifest.stats.get("records", 0),
        **({"resumed after records": resumed_records} if resumed_records else {}),
        "conversations": manifest.num_conversations,
        "answers generated": manifest.num_assistant_turns,
        "new tokens": manifest.num_new_tokens,
        "truncated answers": manifest.num_truncated_turns,
        "conversations with a truncated answer": manifest.num_truncated_conversations,
        "conversations cut at max_length": manifest.num_cut_conversations,
        **(
            {"leading assistant turns dropped": manifest.stats.get("leading_assistant_turns_dropped", 0)}
            if cfg.leading_assistant == "drop"
            else {}
        ),
        **(
            {
                "tool calls written": manifest.num_tool_calls,
                "recorded tool results spliced": manifest.num_spliced_results,
                "tool loops ended early": sum(manifest.diverged.values()),
            }
            if cfg.tool_call_parser
            else {}
        ),
        "skipped": sum(manifest.skipped.values()),
        **by_count("ended early", manifest.diverged),
        **by_count("skipped", manifest.skipped),
    }
    if manifest.damaged:
        summary["damaged input"] = "; ".join(manifest.damaged)
    summary |= {
        "shards": len(manifest.shards),
        "new tokens/s": manifest.stats.get("new_tokens_per_s", 0.0),
        "seconds (total)": round(seconds, 1),
    }
    return summary


@dataclasses.dataclass
class _Plan:
    """One regenerate job: the target and its template, the inputs, the engine that answers, and their fingerprint
    (a resumed or finished job must match it)."""

    target_dir: Path
    identity: TargetIdentity
    tokenizer: PreTrainedTokenizerBase
    template: str
    sources: list[Source]
    eos: list[int]
    engine_name: str
    engine_version: str
    device: torch.device
    dtype: str
    max_length: int
    parsers_from: str | None
    fingerprint: str = ""

    @classmethod
    def of(cls, cfg: RegenerateConfig) -> _Plan:
        target_dir, identity, tokenizer, template, sources = job_inputs(cfg)
        engine_name, engine_version = engines.engine_choice(cfg)
        device = resolve_device(cfg.device if engine_name == "hf" else "auto")  # vLLM: the GPU where there is one
        positions = context_length(read_config(target_dir))
        plan = cls(
            target_dir,
            identity,
            tokenizer,
            template,
            sources,
            eos=engines.eos_token_ids(tokenizer, target_dir),
            engine_name=engine_name,
            engine_version=engine_version,
            device=device,
            dtype=engines.dtype_name(cfg, device),
            max_length=min(cfg.max_length, int(positions)) if positions else cfg.max_length,
            parsers_from=vllm_launch.vllm_version() if cfg.tool_call_parser or cfg.reasoning_parser else None,
        )
        job = {
            "job": job_fingerprint(cfg, plan.identity, plan.template, plan.sources),
            "engine": engine_version,
            "dtype": plan.dtype,
            "device": device.type,
            "eos": plan.eos,
            "format": 1,
            **({"parsers_from": plan.parsers_from} if plan.parsers_from else {}),
        }
        plan.fingerprint = sha256_bytes(json.dumps(job).encode("utf-8"))
        return plan

    def start_engine(self, cfg: RegenerateConfig, work: Path) -> engines.Engine:
        """Start the engine ("vllm" or "hf"; its version is what the run prints), its log (vLLM) in `work`."""
        note = " (about a minute on a CPU)" if self.engine_name == "vllm" and self.device.type == "cpu" else ""
        Console(stderr=True).print(f"[dim]starting {self.engine_version}{note}[/]", highlight=False)
        if self.engine_name == "vllm":
            log = work / engines.LOG_NAME
            return engines.VLLMEngine(self.target_dir, cfg, self.dtype, self.eos, self.max_length, log)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos[0]
        return engines.HFEngine(self.target_dir, cfg, self.device, self.dtype, self.eos, pad)


def _regenerate(
    cfg: RegenerateConfig, plan: _Plan, work: Path, shards: list[RegeneratedShard], tally: Tally
) -> Regenerator:
    """Answer the records past the resume point shard by shard, each shard written and the progress saved as it
    ends; returns the regenerator (closed), with its timings and the records it skipped at the end."""
    parser = (
        AnswerParser(plan.tokenizer, cfg.tool_call_parser, cfg.reasoning_parser, cfg.chat_template_kwargs)
        if (cfg.tool_call_parser or cfg.reasoning_parser)
        else None
    )

    records = read_records(plan.sources, tally.records, cfg.leading_assistant, agentic=bool(cfg.tool_call_parser))
    encoder = ChatEncoder(plan.tokenizer, plan.template, template_kwargs=cfg.chat_template_kwargs)
    regenerator = Regenerator(
        cfg, encoder, plan.max_length, lambda: plan.start_engine(cfg, work), records, tally, parser
    )
    progress, task = progress_bar("regenerate", cfg.max_samples, "{task.fields[tok_rate]:,.1f} new tok/s")
    try:
        with progress:
            progress.update(task, completed=tally.conversations, conversations=tally.conversations)
            for shard in regenerator.shards():
                lines = [json.dumps(conv.record(), ensure_ascii=False) + "\n" for conv in shard if tally.add(conv)]
                if lines:
                    regenerated_set.write_shard(work, shards, lines, tally.conversations - len(lines))
                regenerated_set.save_progress(work, plan.fingerprint, shards, dataclasses.asdict(tally))
                rate = regenerator.generated_tokens / max(regenerator.generate_s, 1e-9)
                progress.update(task, completed=tally.conversations, conversations=tally.conversations, tok_rate=rate)
    finally:
        regenerator.close()
    for skipped in regenerator.tail:
        tally.skip(*skipped)
    tally.records += len(regenerator.tail)
    return regenerator


def _manifest(
    cfg: RegenerateConfig, plan: _Plan, tally: Tally, shards: list[RegeneratedShard], stats: dict
) -> RegeneratedManifest:
    generator = Generator(
        target=plan.identity,
        chat_template_hash=sha256_bytes(plan.template.encode("utf-8")),
        engine=plan.engine_name,
        engine_version=plan.engine_version,
        dtype=plan.dtype,
        device=str(plan.device),
        parsers_from=plan.parsers_from,
        **cfg.model_dump(include={"chat_template_kwargs", "tool_call_parser", "reasoning_parser"}),
    )
    return RegeneratedManifest(
        generator=generator,
        sampling=Sampling(
            **cfg.model_dump(include={"temperature", "top_p", "max_new_tokens", "seed", "think"}),
            max_length=plan.max_length,
        ),
        fingerprint=plan.fingerprint,
        sources=regenerated_set.source_files(plan.sources),
        shards=shards,
        stats=stats,
        # each num_NAME count is the tally's NAME
        **{n: getattr(tally, n.removeprefix("num_")) for n in RegeneratedManifest.model_fields if n.startswith("num_")},
        **{name: getattr(tally, name) for name in ("diverged", "skipped", "skip_examples", "damaged")},
    )


def run(cfg: RegenerateConfig) -> StageResult:
    """Regenerate the assistant turns of `cfg.data` (default: the embedded ShareGPT) with `cfg.target`."""
    started = time.perf_counter()
    output = Path(cfg.output)
    plan = _Plan.of(cfg)
    regenerated_set.check_replaceable(output)
    finished = regenerated_set.finished_set(output, plan.fingerprint)
    if finished is not None:  # the same job already ran to the end: nothing to redo
        summary = _summary(cfg, finished, 0, time.perf_counter() - started)
        summary["already complete"] = "yes (same inputs and options); nothing regenerated"
        return StageResult(stage="regenerate", output=output, summary=summary)

    work, shards, saved = regenerated_set.open_work(output, plan.fingerprint, cfg.resume)
    tally = Tally(**saved) if saved else Tally()
    resumed_records = tally.records
    regenerator = _regenerate(cfg, plan, work, shards, tally)
    if not shards:
        raise DraftsmithError(
            f"{', '.join(str(s.path) for s in plan.sources)}: no usable conversations to regenerate"
            + (
                f" (skipped: {', '.join(f'{k} {v}' for k, v in tally.skipped.items())}; first: "
                f"{next(iter(tally.skip_examples.values()), '')})"
                if tally.skipped
                else ""
            )
        )

    seconds = time.perf_counter() - started
    stats = {
        "records": tally.records,
        "resumed_after_records": resumed_records,
        "leading_assistant_turns_dropped": tally.leading_assistant_dropped,
        "seconds": round(seconds, 2),
        "generate_seconds": round(regenerator.generate_s, 2),
        "new_tokens_this_run": regenerator.generated_tokens,
        "new_tokens_per_s": round(regenerator.generated_tokens / max(regenerator.generate_s, 1e-9), 1),
    }
    manifest = _manifest(cfg, plan, tally, shards, stats)
    regenerated_set.publish(work, output, cfg, manifest)
    return StageResult(stage="regenerate", output=output, summary=_summary(cfg, manifest, resumed_records, seconds))
