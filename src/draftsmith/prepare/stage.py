"""The `prepare` stage: conversations -> token ids + assistant loss masks + token counts (a prepared data set).

    records (readers) -> normalised chats (messages.normalize_conversation)     main process, in file order
      -> rendered, tokenised, masked samples (chat.ChatEncoder)                  worker processes, in batches
      -> shards + token counts + manifest (prepared.write_prepared)              main process, in file order

A conversation is one sample, or several where its template rewrites what earlier generations saw (chat.py); a
conversation's samples go into one shard together.

Sample ids therefore follow input order whatever the number of workers. Every record that does not become a
sample is counted by reason (summary and manifest), with the first example of each reason, and per input file: a
file none of whose records is usable is named in a warning line of the summary, and when no file gives a single
conversation the error names every file with its counts and reasons.

A killed or failed run keeps the shards it completed (in `.NAME.resume` beside the output, with the tallies
up to the last of them); the same command run again reads past those records and continues from there.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.pool import Pool
from pathlib import Path
from typing import TypedDict

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from transformers import PreTrainedTokenizerBase

from draftsmith.config import PrepareConfig, RegenerateConfig, StageResult
from draftsmith.core import assets, recording
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import sha256_bytes
from draftsmith.core.manifest import TargetIdentity
from draftsmith.core.targets import load_tokenizer, resolve_target, target_identity
from draftsmith.methods.vocab import coverage_report
from draftsmith.prepare.chat import ChatEncoder, EncodedChat
from draftsmith.prepare.dataset import PreparedManifest, open_prepared, resume_point, write_prepared
from draftsmith.prepare.messages import ROLE_ALIASES, Chat, Skip
from draftsmith.prepare.readers import Skips, Source, chats_after, expand_sources
from draftsmith.prepare.vllm_chat import VllmRendering

BATCH = 16  # conversations per task sent to a worker
IN_FLIGHT_PER_WORKER = 4
SUMMARY_VOCAB_SIZES = (8192, 16384, 32000)


class _FileCounts(TypedDict):
    """One input file's records: how many, how many usable, the others by reason and the first of them."""

    records: int
    usable: int
    skipped: dict[str, int]
    first: str  # "record i: detail"


@dataclass
class _Tally(Skips):
    records: int = 0
    conversations: int = 0
    samples: int = 0
    generations: int = 0  # assistant generations trained on
    agentic: int = 0  # conversations that declare tools or call one
    one_sample_tokens: int = 0  # tokens had every conversation been one sample
    tokens: int = 0
    loss_tokens: int = 0
    truncated: int = 0
    leading_assistant_dropped: int = 0  # conversations that lost their leading assistant turns (option "drop")
    samples_dropped: dict[str, int] = field(default_factory=dict)  # samples of usable conversations left out
    needed: list[int] = field(default_factory=list)  # max_length each conversation skipped for it would need
    files: dict[str, _FileCounts] = field(default_factory=dict)  # per input file

    def add(self, where: tuple[str, int], item: EncodedChat | Skip, dropped: int) -> list[dict] | None:
        """Count one record's outcome (a Skip, or a conversation's samples), in all and for its file; its samples
        as rows, None if skipped."""
        source, index = where
        counts = self.files.setdefault(source, {"records": 0, "usable": 0, "skipped": {}, "first": ""})
        self.records += 1
        counts["records"] += 1
        if isinstance(item, Skip):
            self.skip(item.reason, f"{source} record {index}", item.detail)
            counts["skipped"][item.reason] = counts["skipped"].get(item.reason, 0) + 1
            counts["first"] = counts["first"] or f"record {index}: {item.detail}"
            self.needed += [item.needed] if item.needed else []
            return None
        counts["usable"] += 1
        self.conversations += 1
        self.leading_assistant_dropped += dropped > 0
        self.samples += len(item.samples)
        self.generations += item.generations
        self.agentic += item.agentic
        self.one_sample_tokens += item.one_sample_tokens
        for reason, n in item.dropped.items():
            self.samples_dropped[reason] = self.samples_dropped.get(reason, 0) + n
        for sample in item.samples:
            self.tokens += len(sample.input_ids)
            self.loss_tokens += int(sample.loss_mask.sum())
            self.truncated += sample.truncated
        return [{"input_ids": x.input_ids, "loss_mask": x.loss_mask, "truncated": x.truncated} for x in item.samples]


_HINTS = {
    "no conversations": "a record needs `conversations: [{from, value}]` or `messages: [{role, content}]`",
    "unknown role": f"roles are {', '.join(sorted(ROLE_ALIASES))}",
    "starts with the assistant": "--leading-assistant drop keeps the rest of such conversations",
    "no assistant turn": "only assistant turns are trained on: a conversation needs at least one",
}


def by_count(label: str, counts: dict[str, int]) -> dict[str, int]:
    """A summary's `label: reason` rows of `counts`, the most frequent first."""
    return {f"{label}: {reason}": n for reason, n in sorted(counts.items(), key=lambda kv: -kv[1])}


def _file_counts(counts: _FileCounts | None) -> str:
    """`0 of 12 records usable: no assistant turn 12 (first: record 0: no turn is from the assistant)`"""
    if not counts or not counts["records"]:
        return "holds no records"
    line = f"{counts['usable']} of {counts['records']} records usable"
    if counts["skipped"]:
        line += ": " + ", ".join(
            f"{reason} {n}" for reason, n in sorted(counts["skipped"].items(), key=lambda kv: -kv[1])
        )
    return line + (f" (first: {counts['first']})" if counts["first"] else "")


def _needed(tally: _Tally) -> str:
    """What the conversations skipped for max_length need: `--max-length 9,870 reaches ... all 200 (4,410: half)`."""
    n = sorted(tally.needed)
    return f"--max-length {n[-1]:,} reaches the first assistant token of all {len(n)} ({n[(len(n) - 1) // 2]:,}: half)"


def _nothing_usable(sources: list[Source], tally: _Tally) -> DraftsmithError:
    """The error when no input file gave a single conversation: every file with its own counts and reasons."""
    lines = [f"{s.path}: {_file_counts(tally.files.get(str(s.path)))}" for s in sources]
    hint = "".join(f"; {text}" for reason, text in _HINTS.items() if reason in tally.skipped)
    hint += f"; {_needed(tally)}" if tally.needed else ""
    if len(lines) == 1:
        return DraftsmithError(lines[0] + hint)
    return DraftsmithError(f"no usable conversation in {len(lines)} input files: " + "; ".join(lines) + hint)


# ------------------------------------------------------------------------------------------------ workers

_ENCODER: ChatEncoder | None = None


def _init_worker(encoder: ChatEncoder) -> None:
    global _ENCODER
    _ENCODER = encoder
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _encode_batch(batch: list[tuple], encoder: ChatEncoder | None = None) -> list[tuple]:
    """(where, Chat | Skip, note) items -> (where, EncodedChat | Skip, note) items, order kept."""
    encoder = encoder or _ENCODER
    out = []
    for where, item, note in batch:
        if not isinstance(item, Skip):
            assert encoder is not None  # a pool worker's is set by _init_worker
            try:
                item = encoder.encode(item)
            except Skip as skip:
                item = skip
        out.append((where, item, note))
    return out


# ------------------------------------------------------------------------------------------------ pipeline


def _encoded_batches(batches: Iterator[list], encoder: ChatEncoder, workers: int) -> Iterator[list]:
    """Run `_encode_batch` over `batches`, in order, on `workers` processes (inline when workers == 1)."""
    if workers <= 1:
        for batch in batches:
            yield _encode_batch(batch, encoder)
        return
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    pool = ctx.Pool(workers, initializer=_init_worker, initargs=(encoder,))
    try:
        pending: collections.deque = collections.deque()
        for batch in batches:
            pending.append(pool.apply_async(_encode_batch, (batch,)))
            if len(pending) >= workers * IN_FLIGHT_PER_WORKER:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
    finally:
        _stop(pool, pending)


def _stop(pool: Pool, pending: collections.deque) -> None:
    """Stop the pool after letting in-flight tasks finish (an early stop, e.g. `max_samples`, leaves some).

    Terminating at once can deadlock: when the pool's feeder thread is half-way through writing a task larger than
    the pipe buffer, the terminated workers never drain it and `terminate()` waits on that thread for ever.
    """
    deadline = time.monotonic() + 120
    for result in pending:
        result.wait(max(0.0, deadline - time.monotonic()))
    if all(result.ready() for result in pending):
        pool.close()  # idle feeder: a clean shutdown
    else:
        pool.terminate()  # a worker died with its task: nothing else would finish it
    pool.join()


def chat_template_of(
    cfg: PrepareConfig | RegenerateConfig, tokenizer: PreTrainedTokenizerBase, target_dir: Path
) -> str:
    """The chat template a job renders with: --chat-template FILE, else the target tokenizer's own."""
    if cfg.chat_template is not None:
        path = Path(cfg.chat_template)
        if not path.is_file():
            raise DraftsmithError(f"{path}: chat template file does not exist (option chat_template)")
        return path.read_text(encoding="utf-8")
    try:
        template = tokenizer.get_chat_template()
    except ValueError:
        template = None
    if not template:
        raise DraftsmithError(
            f"{target_dir}: the target's tokenizer has no chat template; pass one with --chat-template FILE.jinja"
        )
    return template


def job_inputs(
    cfg: PrepareConfig | RegenerateConfig,
) -> tuple[Path, TargetIdentity, PreTrainedTokenizerBase, str, list[Source]]:
    """A job's target (directory, identity, tokenizer), chat template and inputs (default: the embedded ShareGPT)."""
    target_dir = resolve_target(cfg.target)
    identity = target_identity(target_dir)
    tokenizer = load_tokenizer(target_dir, trust_remote_code=cfg.trust_remote_code)
    template = chat_template_of(cfg, tokenizer, target_dir)
    sources = expand_sources(cfg.data) if cfg.data else [Source(assets.sharegpt_path(), "json")]
    return target_dir, identity, tokenizer, template, sources


def progress_bar(stage: str, total: int | None, *rates: str) -> tuple[Progress, TaskID]:
    """A stage's progress bar on stderr (drawn on a terminal only): conversations done, then `rates` (columns of the
    task's `rate` and `tok_rate`), the time elapsed and left."""
    progress = Progress(
        TextColumn(f"[bold]{stage}[/]"),
        BarColumn(),
        TextColumn("{task.fields[conversations]:,} conversations"),
        *map(TextColumn, rates),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not sys.stderr.isatty(),
        transient=False,
    )
    return progress, progress.add_task(stage, total=total, conversations=0, rate=0.0, tok_rate=0.0)


def _available_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def job_fingerprint(
    cfg: PrepareConfig | RegenerateConfig, identity: TargetIdentity, template: str, sources: list[Source]
) -> str:
    """Names the job for resuming: same inputs (path, size, mtime), target, template and output-shaping options."""
    job = {
        "options": cfg.model_dump(mode="json", exclude={"num_workers", "resume", "output", "check_with_vllm"}),
        "target": identity.model_dump(exclude={"path"}),
        "template": sha256_bytes(template.encode("utf-8")),
        "sources": [[[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in s.files] for s in sources],
        "format": 1,
    }
    return sha256_bytes(json.dumps(job, sort_keys=True).encode("utf-8"))


def check_with_vllm(cfg: PrepareConfig, sources: list[Source], encoder: ChatEncoder, target_dir: Path) -> str:
    """Render the first `cfg.check_with_vllm` usable conversations' prompts as vLLM's server would and compare
    them with the contexts draftsmith trains each generation in; DraftsmithError at the first differing token."""
    try:
        vllm = VllmRendering(target_dir, encoder.tokenizer, encoder.chat_template, cfg.trust_remote_code)
    except ImportError:
        raise DraftsmithError(
            "--check-with-vllm: vLLM is not installed; install it beside draftsmith (see README) or leave the check out"
        ) from None

    def token(seq: list[int], at: int) -> str:
        if at >= len(seq):
            return "nothing (the prompt ends there)"
        return f"{seq[at]} {encoder.tokenizer.convert_ids_to_tokens(seq[at])!r}"

    conversations = prompts = 0
    for source, record, chat in chats_after(sources, 0, cfg.leading_assistant):
        if conversations == cfg.check_with_vllm:
            break
        try:
            if isinstance(chat, Skip):
                raise chat
            messages = encoder.as_rendered(chat)
            ours = list(encoder.prompts(chat))
        except Skip:
            continue  # counted by the run itself
        for k, ids in ours:
            theirs = vllm.prompt_ids(messages[:k], chat.tools, cfg.chat_template_kwargs)
            ids = ids.tolist()
            if ids != theirs:
                at = next(
                    (i for i, (a, b) in enumerate(zip(ids, theirs, strict=False)) if a != b), min(len(ids), len(theirs))
                )
                raise DraftsmithError(
                    f"{source.path.name} record {record.index}: the prompt of turn {k} differs from vLLM "
                    f"{vllm.version}'s rendering at token {at} of {len(theirs)}: draftsmith {token(ids, at)}, vLLM "
                    f"{token(theirs, at)} (draftsmith renders with apply_chat_template; check --chat-template and "
                    "--chat-template-kwargs against the server's)"
                )
            prompts += 1
        conversations += 1
    return f"vLLM {vllm.version}: {conversations} conversations, {prompts} prompts token for token the same"


@dataclass
class _Job:
    """One prepare run being written: its inputs, its tallies (from the resume point on) and its progress bar."""

    cfg: PrepareConfig
    identity: TargetIdentity
    sources: list[Source]
    encoder: ChatEncoder
    workers: int
    tally: _Tally
    stats: dict[str, object] = field(default_factory=dict)  # the manifest's, filled when the last sample is read
    t0: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        self.resumed = (self.tally.records, self.tally.conversations, self.tally.tokens)
        self.total_bytes = sum(s.size for s in self.sources)
        self.progress, self.task = progress_bar(
            "prepare",
            self.cfg.max_samples or self.total_bytes,
            "{task.fields[rate]:,.0f} conv/s",
            "{task.fields[tok_rate]:,.0f} tok/s",
        )

    def full(self) -> bool:
        return bool(self.cfg.max_samples and self.tally.conversations >= self.cfg.max_samples)

    def on_bytes(self, done: int) -> None:
        if not self.cfg.max_samples:
            self.progress.update(self.task, completed=min(done, self.total_bytes))

    def _batches(self) -> Iterator[list[tuple]]:
        """(where: (file, record index), normalised conversation or counted Skip, leading assistant turns dropped)
        for every record past the resume point, in order, in batches."""
        batch: list[tuple] = []
        sizes = (s.size for s in self.sources)
        before = dict(zip(map(id, self.sources), itertools.accumulate(sizes, initial=0), strict=False))  # bytes ahead
        recorded_by = recording.fingerprint(self.identity.config_hash, self.identity.tokenizer_hash)
        chats = chats_after(self.sources, self.resumed[0], self.cfg.leading_assistant, target=recorded_by)
        for source, record, item in chats:
            batch.append(
                ((str(source.path), record.index), item, item.leading_dropped if isinstance(item, Chat) else 0)
            )
            if len(batch) >= BATCH:
                self.on_bytes(before[id(source)] + (record.offset or 0))
                yield batch
                batch = []
        if batch:
            yield batch
        self.on_bytes(self.total_bytes)

    def samples(self) -> Iterator[list[dict]]:
        """Each usable conversation's samples as one unit: a shard (and a resume point) never splits them."""
        cfg, tally = self.cfg, self.tally
        for batch in _encoded_batches(self._batches(), self.encoder, self.workers):
            for where, item, dropped in batch:
                if self.full():
                    break
                rows = tally.add(where, item, dropped)
                if rows is not None:
                    yield rows
            elapsed = max(time.perf_counter() - self.t0, 1e-9)
            self.progress.update(
                self.task,
                conversations=tally.conversations,
                rate=(tally.conversations - self.resumed[1]) / elapsed,
                tok_rate=(tally.tokens - self.resumed[2]) / elapsed,
                completed=tally.conversations if cfg.max_samples else None,
            )
            if self.full():
                break
        if not tally.conversations:
            raise _nothing_usable(self.sources, tally)
        self.stats.update(self._stats(max(time.perf_counter() - self.t0, 1e-9)))

    def _stats(self, seconds: float) -> dict[str, object]:
        tally = self.tally
        return dict(
            records=tally.records,
            conversations=tally.conversations,
            samples=tally.samples,
            generations=tally.generations,
            agentic_conversations=tally.agentic,
            layout_tokens=tally.tokens,
            one_sample_per_conversation_tokens=tally.one_sample_tokens,
            samples_dropped=dict(tally.samples_dropped),
            chat_template_kwargs=self.cfg.chat_template_kwargs,
            workers=self.workers,
            resumed_after_records=self.resumed[0],
            leading_assistant_turns_dropped=tally.leading_assistant_dropped,
            seconds=round(seconds, 2),
            conversations_per_s=round((tally.conversations - self.resumed[1]) / seconds, 1),
            tokens_per_s=round((tally.tokens - self.resumed[2]) / seconds, 1),
        )

    def summary(
        self, manifest: PreparedManifest, target: str, checked: str | None, per_file: bool
    ) -> dict[str, object]:
        """The stage's summary rows but the timing ones; `per_file`: the tallies count records per input file."""
        cfg, tally = self.cfg, self.tally
        summary: dict[str, object] = {
            "output": str(cfg.output),
            "target": target,
            "records read": tally.records,
            **({"resumed after records": self.resumed[0]} if self.resumed[0] else {}),
            "conversations": tally.conversations,
            **({"agentic conversations": tally.agentic} if tally.agentic else {}),
            **({"rendering checked against": checked} if checked else {}),
            **(
                {
                    "samples": f"{manifest.num_samples} (generations that saw different contexts: "
                    f"{tally.tokens / max(tally.one_sample_tokens, 1):.2f}x the tokens of one per conversation)"
                }
                if manifest.num_samples != tally.conversations
                else {}
            ),
            "tokens": manifest.num_tokens,
            "distinct tokens": f"{manifest.num_distinct_tokens:,} (shared prefixes once; tokens / distinct: "
            f"{manifest.tokens_per_distinct_token:.1f}x)",
            "loss tokens": manifest.num_loss_tokens,
            "truncated": tally.truncated,
            **(
                {"leading assistant turns dropped": tally.leading_assistant_dropped}
                if cfg.leading_assistant == "drop"
                else {}
            ),
            "skipped": sum(tally.skipped.values()),
            **by_count("skipped", tally.skipped),
            **({"max_length needed": _needed(tally)} if tally.needed else {}),
            **by_count("samples left out", tally.samples_dropped),
        }
        if tally.damaged:
            summary["damaged input"] = "; ".join(tally.damaged)
        for source in map(str, (s.path for s in self.sources)) if not self.full() and per_file else ():
            if source not in tally.files or not tally.files[source]["usable"]:
                summary[f"warning: {source}"] = _file_counts(tally.files.get(source))
        return summary


def run(cfg: PrepareConfig) -> StageResult:
    """Prepare `cfg.data` (default: the embedded ShareGPT) for `cfg.target` (default: embedded SmolLM2)."""
    started = time.perf_counter()
    target_dir, identity, tokenizer, template, sources = job_inputs(cfg)
    encoder = ChatEncoder(
        tokenizer, template, max_length=cfg.max_length, overflow=cfg.overflow, template_kwargs=cfg.chat_template_kwargs
    )
    workers = max(1, cfg.num_workers or _available_cores())
    checked = check_with_vllm(cfg, sources, encoder, target_dir) if cfg.check_with_vllm else None

    tally = _Tally()
    fingerprint = job_fingerprint(cfg, identity, template, sources)
    state = resume_point(cfg.output, fingerprint) if cfg.resume else None
    if state:
        for key, value in state["tally"].items():
            setattr(tally, key, value)
    job = _Job(cfg, identity, sources, encoder, workers, tally)
    with job.progress:
        manifest = write_prepared(
            cfg.output,
            job.samples(),
            identity,
            chat_template_hash=sha256_bytes(template.encode("utf-8")),
            max_length=cfg.max_length,
            skipped=tally.skipped,
            sources=[str(s.path) for s in sources],
            shard_samples=cfg.shard_samples,
            config=cfg,
            overflow=cfg.overflow,
            damaged=tally.damaged,
            skip_examples=tally.skip_examples,
            stats=job.stats,
            fingerprint=fingerprint,
            checkpoint=lambda: {"tally": dataclasses.asdict(tally)},
            resume=bool(state),
        )

    per_file = not state or "files" in state["tally"]  # a run resumed from an older draftsmith has no file counts
    summary = job.summary(manifest, identity.path, checked, per_file)
    for size, cover in coverage_report(open_prepared(cfg.output).token_counts(), SUMMARY_VOCAB_SIZES):
        summary[f"draft vocab {size} covers"] = f"{cover:.2%}"
    summary |= {
        "shards": len(manifest.shards),
        "workers": workers,
        "conversations/s": job.stats["conversations_per_s"],
        "tokens/s": job.stats["tokens_per_s"],
        "seconds (total)": round(time.perf_counter() - started, 1),
    }
    return StageResult(stage="prepare", output=Path(cfg.output), summary=summary)
