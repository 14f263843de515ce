"""The regenerated data set, the artefact of `draftsmith regenerate`: the one module that reads and writes it.

On disk (docs/formats.md, "Regenerated data set")::

    manifest.json          RegeneratedManifest (kind "regenerated"): generator, sampling, sources, counts
    config.yaml            the resolved RegenerateConfig
    shard-00000.jsonl      {"tools"?, "messages": [{role, content, reasoning_content?, tool_calls?}, ...],
    shard-00001.jsonl       "regenerated": {"source", "truncated_turns", "new_tokens", "cut_at_max_length",
                            "diverged"?}}, one conversation a line, in input order (messages in OpenAI form)

The set is built in `.NAME.resume` beside its place: each complete shard is written there atomically, then
`resume.json` (the job's fingerprint, the shards and the caller's tallies of exactly the records they were made
from); the finished directory is renamed into place.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from draftsmith.config import RegenerateConfig, save_resolved_config
from draftsmith.core import fsio
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.manifest import Manifest, TargetIdentity, read_manifest, write_manifest
from draftsmith.core.manifest import check_replaceable as manifest_check_replaceable
from draftsmith.prepare.readers import Source


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
    engine: str  # "vllm" or "hf"
    engine_version: str  # e.g. "vllm 0.32.0", "transformers 5.19.0, torch 2.13.0+cpu"
    dtype: str
    device: str
    chat_template_kwargs: dict[str, object] = Field(default_factory=dict)
    tool_call_parser: str | None = None  # vLLM's parser names the answers were read with
    reasoning_parser: str | None = None
    parsers_from: str | None = Field(None, description="the vLLM version whose parsers read the answers")


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
    num_tool_calls: int = Field(0, description="tool calls the target wrote")
    num_spliced_results: int = Field(0, description="recorded tool results placed after the target's calls")
    diverged: dict[str, int] = Field(
        default_factory=dict,
        description=("conversations whose tool loop ended early, by how the target's answer left the recorded one"),
    )
    shards: list[RegeneratedShard]
    skipped: dict[str, int] = Field(default_factory=dict)
    skip_examples: dict[str, str] = Field(default_factory=dict, description="first skipped record of each reason")
    damaged: list[str] = Field(default_factory=list, description="damaged input tails, one line each")
    stats: dict[str, object] = Field(default_factory=dict)


# --------------------------------------------------------------------------------------------------- reading


def open_regenerated(path: Path) -> RegeneratedManifest:
    """The manifest of a complete regenerated set, after checking every shard is there with its recorded size."""
    path = Path(path)
    manifest = read_manifest(path, RegeneratedManifest)
    for shard in manifest.shards:
        file = path / shard.file
        if not file.is_file() or file.stat().st_size != shard.num_bytes:
            raise DraftsmithError(
                f"{file}: missing or not the size the manifest records; the regenerated set is "
                "damaged, run `draftsmith regenerate` again"
            )
    return manifest


def read_conversations(path: Path) -> Iterator[dict]:
    """Every record of a regenerated set, in order (for tests and inspection; `prepare` reads the files itself)."""
    path = Path(path)
    for shard in open_regenerated(path).shards:
        with open(path / shard.file, encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)


def check_replaceable(output: Path) -> None:
    """Only an empty directory or an earlier regenerated set may be replaced."""
    manifest_check_replaceable(output, "regenerated", "a regenerated data set")


def finished_set(output: Path, fingerprint: str) -> RegeneratedManifest | None:
    """The complete set already at `output` for this very job, if there is one."""
    try:
        manifest = open_regenerated(output)
    except DraftsmithError:
        return None
    return manifest if manifest.fingerprint == fingerprint else None


# --------------------------------------------------------------------------------------------------- writing


def open_work(output: Path, fingerprint: str, resume: bool) -> tuple[Path, list[RegeneratedShard], dict | None]:
    """(the directory the set is built in, its complete shards, the tallies saved with them) for the job
    `fingerprint`: an interrupted run's when `resume` finds one, else an empty new directory."""
    work = fsio.resume_dir(output)
    state = fsio.load_resume(work, fingerprint, RegeneratedShard) if resume else None
    if state is None:
        fsio.fresh_dir(work)
        return work, [], None
    return work, [RegeneratedShard.model_validate(s) for s in state["shards"]], state["tally"]


def write_shard(work: Path, shards: list[RegeneratedShard], lines: list[str], first_conversation: int) -> None:
    """Write the next shard (`lines`, one JSON record each) and add it to `shards`."""
    name = f"shard-{len(shards):05d}.jsonl"
    fsio.atomic_write_text(work / name, "".join(lines))
    shards.append(
        RegeneratedShard(
            file=name,
            sha256=fsio.sha256_file(work / name),
            num_bytes=(work / name).stat().st_size,
            num_conversations=len(lines),
            first_conversation=first_conversation,
        )
    )


def save_progress(work: Path, fingerprint: str, shards: list[RegeneratedShard], tally: dict) -> None:
    """What a resumed run starts from: the complete shards and the caller's tallies of the records behind them."""
    fsio.save_resume(work, fingerprint, shards, tally=tally)


def source_files(sources: list[Source]) -> list[SourceFile]:
    return [
        SourceFile(path=str(p), sha256=fsio.sha256_file(p), num_bytes=p.stat().st_size)
        for s in sources
        for p in s.files
    ]


def publish(work: Path, output: Path, cfg: RegenerateConfig, manifest: RegeneratedManifest) -> None:
    """Finish the set built in `work` (its config and manifest) and rename it to `output`."""
    save_resolved_config(cfg, work)
    write_manifest(work, manifest)
    fsio.publish_resumed(work, output)
