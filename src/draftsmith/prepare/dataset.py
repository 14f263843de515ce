"""The prepared data set: token ids, assistant loss masks and token counts, the only module that reads or writes it.

On disk (see docs/formats.md, "Prepared data set")::

    manifest.json                 PreparedManifest (kind "prepared")
    config.yaml                   the resolved PrepareConfig the set was made with (when a stage wrote it)
    shard-00000.safetensors       input_ids int32 [T], loss_mask uint8 [T], offsets int64 [n+1]
    shard-00001.safetensors       ... (samples first_sample .. first_sample+n-1 of the set)
    token_counts.safetensors      counts int64 [vocab]: how often each target token id is loss-masked
    prefixes.safetensors          order, parent, shared int64 [N]: the prefixes samples share (prefix_tree)

Sample i of a shard is `input_ids[offsets[i]:offsets[i+1]]`. Shards are read through
`draftsmith.core.tensorfile` (safetensors maps them into memory), so a set larger than memory is never loaded
whole, `lengths` comes from the offsets without touching any token, and a `PreparedDataset` pickles into
DataLoader workers as plain data (each process opens the files on its first read).
The whole directory is built beside its final place and renamed into it only when complete.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from numpy.typing import ArrayLike
from pydantic import BaseModel, ConfigDict, Field
from safetensors.numpy import save_file

from draftsmith.config import StageConfig, save_resolved_config
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import (
    atomic_dir,
    atomic_path,
    fresh_dir,
    load_resume,
    publish_resumed,
    resume_dir,
    save_resume,
    sha256_file,
)
from draftsmith.core.manifest import (
    MANIFEST_NAME,
    Manifest,
    TargetIdentity,
    check_replaceable,
    read_manifest,
    write_manifest,
)
from draftsmith.core.tensorfile import Samples, TensorFile

TOKEN_COUNTS_NAME = "token_counts.safetensors"
PREFIXES_NAME = "prefixes.safetensors"
REMEDY = "run `draftsmith prepare` again to rebuild the prepared set"


class PreparedShard(BaseModel):
    """One shard file: samples `first_sample .. first_sample + num_samples - 1` of the set."""

    model_config = ConfigDict(extra="forbid")

    file: str
    sha256: str
    num_samples: int
    num_tokens: int
    first_sample: int
    num_bytes: int = 0


class PreparedManifest(Manifest):
    """What a prepared set holds and which target / chat template it was tokenised for."""

    kind: str = "prepared"
    target: TargetIdentity
    chat_template_hash: str
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    max_length: int
    overflow: str = "truncate"
    num_truncated: int = 0
    shards: list[PreparedShard]
    token_counts_file: str = TOKEN_COUNTS_NAME
    token_counts_sha256: str = ""
    num_distinct_tokens: int = Field(0, description="tokens of the samples' prefix tree; 0: not counted (older set)")
    tokens_per_distinct_token: float = Field(0.0, description="num_tokens / num_distinct_tokens, 2 decimals")
    prefixes_file: str = Field("", description='"": a set written before prefixes were recorded: none shared')
    prefixes_sha256: str = ""
    skipped: dict[str, int] = Field(default_factory=dict)
    skip_examples: dict[str, str] = Field(default_factory=dict, description="first skipped record of each reason")
    damaged: list[str] = Field(default_factory=list, description="damaged input tails, one line each")
    sources: list[str] = Field(default_factory=list)
    stats: dict[str, object] = Field(default_factory=dict)


# --------------------------------------------------------------------------------------------------- writing


def _as_numpy(value: ArrayLike | torch.Tensor, dtype: type, what: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(f"sample {what} must be 1-D, got shape {arr.shape}")
    return arr.astype(dtype, copy=False)


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    with atomic_path(path) as tmp:
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp))


def resume_point(output: Path, fingerprint: str) -> dict | None:
    """The caller's `checkpoint()` state saved with the last complete shard of an interrupted
    `write_prepared(output, ..., fingerprint=fingerprint)`, or None when there is nothing to resume."""
    data = load_resume(resume_dir(Path(output)), fingerprint, PreparedShard)
    return data["state"] if data else None


@dataclass
class _ShardWriter:
    """Buffers samples and writes them as numbered shards into `directory`."""

    directory: Path
    target: TargetIdentity
    shard_samples: int
    shards: list[PreparedShard] = field(default_factory=list)  # written so far
    num_truncated: int = 0
    ids: list[np.ndarray] = field(default_factory=list, init=False)  # buffered samples
    masks: list[np.ndarray] = field(default_factory=list, init=False)

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.shards) + len(self.ids)

    def add(self, sample: dict | list[dict]) -> bool:
        """Buffer one sample, or a list of samples that must share a shard; True when that completed a shard (now
        on disk)."""
        for one in sample if isinstance(sample, list) else [sample]:
            self._buffer(one)
        if len(self.ids) >= self.shard_samples:
            self.flush()
            return True
        return False

    def _buffer(self, sample: dict) -> None:
        index = self.num_samples
        vocab = int(self.target.vocab_size)
        ids = _as_numpy(sample["input_ids"], np.int64, "input_ids")
        mask = _as_numpy(sample["loss_mask"], np.uint8, "loss_mask")
        if len(ids) != len(mask):
            raise ValueError(f"sample {index}: input_ids has {len(ids)} tokens but loss_mask has {len(mask)}")
        if len(ids) == 0:
            raise ValueError(f"sample {index}: empty input_ids")
        if ids.min() < 0 or ids.max() >= vocab:
            raise DraftsmithError(
                f"sample {index}: token id {int(ids.max())} is outside the target's vocabulary of {vocab} "
                f"(config.json vocab_size); the tokenizer does not belong to target {self.target.path}"
            )
        self.num_truncated += bool(sample.get("truncated", False))
        self.ids.append(ids.astype(np.int32))
        self.masks.append((mask != 0).astype(np.uint8))

    def flush(self) -> None:
        if not self.ids:
            return
        lengths = np.fromiter((len(a) for a in self.ids), dtype=np.int64, count=len(self.ids))
        offsets = np.zeros(len(self.ids) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        name = f"shard-{len(self.shards):05d}.safetensors"
        path = self.directory / name
        _write_safetensors(
            path, {"input_ids": np.concatenate(self.ids), "loss_mask": np.concatenate(self.masks), "offsets": offsets}
        )
        first = self.shards[-1].first_sample + self.shards[-1].num_samples if self.shards else 0
        self.shards.append(
            PreparedShard(
                file=name,
                sha256=sha256_file(path),
                num_samples=len(self.ids),
                num_tokens=int(offsets[-1]),
                first_sample=first,
                num_bytes=path.stat().st_size,
            )
        )
        self.ids.clear()
        self.masks.clear()

    def read_back(self) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Loss-masked token counts and `prefix_tree` over every shard written, read back from the shards."""
        counts = np.zeros(int(self.target.vocab_size), dtype=np.int64)

        def samples() -> Iterator[np.ndarray]:
            for shard in self.shards:
                file = _open_shard(self.directory / shard.file)
                ids, offsets = file.view("input_ids").numpy(), file.view("offsets").numpy()
                counts[:] += np.bincount(ids[file.view("loss_mask").numpy().astype(bool)], minlength=len(counts))
                yield from (ids[a:b] for a, b in itertools.pairwise(offsets))
                file.close()

        tree = prefix_tree(samples())
        return counts, tree


def prefix_tree(samples: Iterable[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(order, parent, shared) int64 [N]: `order` sorts the samples by their token ids, so a parent comes before its
    children; each sample's parent is its predecessor there, which shares the longest prefix any sample does
    (`shared`; parent -1 where 0), so sum(len - shared) counts the prefix tree's nodes. Holds 4 bytes a token."""
    keys = [ids.astype(">i4").tobytes() for ids in samples]  # ids >= 0: byte order is numeric order
    order = np.array(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)
    parent, shared = np.full(len(keys), -1, dtype=np.int64), np.zeros(len(keys), dtype=np.int64)
    for before, i in itertools.pairwise(order.tolist()):
        a, b = np.frombuffer(keys[before], ">i4"), np.frombuffer(keys[i], ">i4")
        n = min(len(a), len(b))
        differ = np.flatnonzero(a[:n] != b[:n])
        shared[i] = differ[0] if differ.size else n
        parent[i] = before if shared[i] else -1
    return order, parent, shared


def _write_all(
    writer: _ShardWriter,
    samples: Iterable[dict | list[dict]],
    on_shard,
    *,
    output: Path,
    skipped: dict[str, int] | None,
    config: StageConfig | None,
    fields: dict[str, object],
) -> PreparedManifest:
    """Write `samples` with `writer`, then the token counts and the manifest (`fields`: the caller's; `skipped` is
    read only now, after the last sample)."""
    for sample in samples:
        if writer.add(sample) and on_shard is not None:
            on_shard(writer)
    writer.flush()
    shards = writer.shards
    if not shards:
        raise DraftsmithError(
            f"{output}: no usable samples to write"
            + (f" (skipped: {', '.join(f'{k} {v}' for k, v in skipped.items())})" if skipped else "")
        )
    counts, (order, parent, shared) = writer.read_back()
    _write_safetensors(writer.directory / TOKEN_COUNTS_NAME, {"counts": counts})
    _write_safetensors(writer.directory / PREFIXES_NAME, {"order": order, "parent": parent, "shared": shared})
    num_tokens = sum(s.num_tokens for s in shards)
    distinct = num_tokens - int(shared.sum())
    manifest = PreparedManifest(
        target=writer.target,
        num_samples=writer.num_samples,
        num_tokens=num_tokens,
        num_loss_tokens=int(counts.sum()),
        num_truncated=writer.num_truncated,
        shards=shards,
        token_counts_sha256=sha256_file(writer.directory / TOKEN_COUNTS_NAME),
        num_distinct_tokens=distinct,
        tokens_per_distinct_token=round(num_tokens / max(distinct, 1), 2),
        prefixes_file=PREFIXES_NAME,
        prefixes_sha256=sha256_file(writer.directory / PREFIXES_NAME),
        skipped=dict(skipped or {}),
        **fields,
    )
    if config is not None:
        save_resolved_config(config, writer.directory)
    write_manifest(writer.directory, manifest)
    return manifest


def write_prepared(  # noqa: PLR0913 - the prepared manifest's fields
    output: Path,
    samples: Iterable[dict | list[dict]],
    target: TargetIdentity,
    *,
    chat_template_hash: str,
    max_length: int,
    skipped: dict[str, int] | None = None,
    sources: list[str] | None = None,
    shard_samples: int = 2048,
    config: StageConfig | None = None,
    fingerprint: str | None = None,
    checkpoint: Callable[[], dict] | None = None,
    resume: bool = False,
    **extra: object,
) -> PreparedManifest:
    """Write `samples` (dicts with "input_ids" and a same-length 0/1 "loss_mask", optionally "truncated": bool;
    a list of such dicts is kept in one shard) as a prepared set at `output`.

    `samples` is consumed as a stream, one shard in memory at a time. `skipped` may be a dict the caller keeps
    filling while the stream runs (it is read after the last sample). `config` (a StageConfig) is saved as
    config.yaml inside the set. `extra` are further PreparedManifest fields (overflow, damaged, skip_examples,
    stats). Raises DraftsmithError when there is no sample at all. Nothing appears at `output` until the set
    is complete.

    Resumable writes: with a `fingerprint` (naming the job: inputs and options), the set is built in
    `.NAME.resume` beside `output`, and after every shard the caller's `checkpoint()` state is saved with it.
    A failed or killed run leaves that directory; `resume_point(output, fingerprint)` then returns the saved
    state, and a call with `resume=True` keeps the shards written so far and takes `samples` as the ones that
    follow them.
    """
    output = Path(output)
    check_replaceable(output, "prepared", "a prepared data set")
    fields = dict(chat_template_hash=chat_template_hash, max_length=max_length, sources=list(sources or []), **extra)
    write_all = functools.partial(_write_all, output=output, skipped=skipped, config=config, fields=fields)
    if fingerprint is None:
        with atomic_dir(output) as tmp:
            return write_all(_ShardWriter(tmp, target, shard_samples), samples, None)

    work = resume_dir(output)
    previous = load_resume(work, fingerprint, PreparedShard) if resume else None
    if resume and previous is None:
        raise DraftsmithError(f"{work}: nothing to resume for this job; run without resume")
    if previous is None:
        fresh_dir(work)
    writer = _ShardWriter(
        work,
        target,
        shard_samples,
        shards=[PreparedShard.model_validate(s) for s in previous["shards"]] if previous else [],
        num_truncated=previous["num_truncated"] if previous else 0,
    )

    def on_shard(w: _ShardWriter) -> None:
        state = checkpoint() if checkpoint else {}
        save_resume(work, fingerprint, w.shards, num_truncated=w.num_truncated, state=state)

    manifest = write_all(writer, samples, on_shard)
    publish_resumed(work, output)
    return manifest


# --------------------------------------------------------------------------------------------------- reading


def _open_shard(path: Path, shard: PreparedShard | None = None) -> TensorFile:
    """A shard file, checked: input_ids I32 [T], loss_mask U8 [T], offsets I64 [n+1] (against `shard`, the
    manifest's record, when given)."""
    file = TensorFile(
        path,
        REMEDY,
        what="shard file",
        expected_bytes=shard.num_bytes if shard and shard.num_bytes else None,
        sha256=shard.sha256 if shard else None,
    )  # hashed on the first read of its tokens
    T = shard.num_tokens if shard else None
    file.expect("input_ids", "I32", (T,))
    file.expect("loss_mask", "U8", (T,))
    file.expect("offsets", "I64", (shard.num_samples + 1 if shard else None,))
    return file


class PreparedDataset(Samples):
    """Random access to a prepared set.

    `ds[i]` -> {"input_ids": LongTensor[T], "loss_mask": BoolTensor[T], "sample_id": i}; `ds.lengths` -> int64 [N].
    """

    what = "a prepared set"

    def __init__(self, path: Path, manifest: PreparedManifest):
        self.path = Path(path)
        self.manifest = manifest
        self._starts = [s.first_sample for s in manifest.shards]  # shard k holds samples _starts[k]..
        self._files: list[TensorFile] = []
        self._offsets: list[np.ndarray] = []
        expected_first = 0
        for shard in manifest.shards:
            if shard.first_sample != expected_first:
                raise DraftsmithError(
                    f"{self.path}/{MANIFEST_NAME}: shard {shard.file} starts at sample "
                    f"{shard.first_sample}, expected {expected_first}; the manifest is damaged"
                )
            expected_first += shard.num_samples
            file = _open_shard(self.path / shard.file, shard)
            offsets = file.read("offsets", verify=False).numpy()
            if int(offsets[0]) != 0 or int(offsets[-1]) != shard.num_tokens or bool(np.any(np.diff(offsets) <= 0)):
                raise file.error(
                    f"offsets do not match the manifest ({shard.num_samples} samples, {shard.num_tokens} tokens)"
                )
            self._files.append(file)
            self._offsets.append(offsets)
        self.lengths = np.concatenate([np.diff(o) for o in self._offsets]).astype(np.int64)

    def __len__(self) -> int:
        return self.manifest.num_samples

    def sample(self, i: int) -> dict:
        k = bisect.bisect_right(self._starts, i) - 1
        file, offsets = self._files[k], self._offsets[k]
        j = i - self._starts[k]
        a, b = int(offsets[j]), int(offsets[j + 1])
        return {  # numpy converts a few dozen values faster than torch dispatches
            "input_ids": torch.from_numpy(file.view("input_ids").numpy()[a:b].astype(np.int64)),
            "loss_mask": torch.from_numpy(file.view("loss_mask").numpy()[a:b].astype(np.bool_)),
            "sample_id": i,
        }

    @property
    def num_tokens(self) -> int:
        return self.manifest.num_tokens

    def prefix(self, i: int) -> tuple[int, int]:
        """(parent, shared): sample i's first `shared` token ids are sample `parent`'s first ones (-1, 0: none);
        its loss mask is its own."""
        return int(self.prefixes[1][i]), int(self.prefixes[2][i])

    @functools.cached_property
    def prefixes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(order, parent, shared) int64 [N] (`prefix_tree`); a set written before they were recorded shares none."""
        m, n = self.manifest, self.manifest.num_samples
        if not m.prefixes_file:
            return np.arange(n, dtype=np.int64), np.full(n, -1, dtype=np.int64), np.zeros(n, dtype=np.int64)
        file = TensorFile(self.path / m.prefixes_file, REMEDY, what="prefix file", sha256=m.prefixes_sha256 or None)
        for name in ("order", "parent", "shared"):
            file.expect(name, "I64", (n,))
        order, parent, shared = (file.read(name).numpy() for name in ("order", "parent", "shared"))
        file.close()
        return order, parent, shared

    def token_counts(self) -> torch.Tensor:
        """How often each target token id is loss-masked in this set: int64 [vocab]."""
        file = TensorFile(
            self.path / self.manifest.token_counts_file,
            REMEDY,
            what="token-count file",
            sha256=self.manifest.token_counts_sha256 or None,
        )
        file.expect("counts", "I64", (self.manifest.target.vocab_size,))
        counts = file.read("counts")
        file.close()
        return counts

    def verify(self) -> None:
        """Re-hash every shard, the token counts and the prefixes; DraftsmithError naming the first damaged file."""
        m = self.manifest
        named = [(m.token_counts_file, m.token_counts_sha256), (m.prefixes_file, m.prefixes_sha256)]
        files = [(s.file, s.sha256) for s in m.shards] + [(name, digest) for name, digest in named if digest]
        for name, digest in files:
            file = self.path / name
            if not file.is_file():
                raise DraftsmithError(f"{file}: missing; the prepared set is incomplete, run prepare again")
            if sha256_file(file) != digest:
                raise DraftsmithError(f"{file}: sha256 does not match the manifest (damaged shard); run prepare again")

    def __repr__(self) -> str:
        m = self.manifest
        return f"PreparedDataset({str(self.path)!r}, samples={m.num_samples}, tokens={m.num_tokens})"


def prepared_digest(path: Path) -> str:
    """One hash naming a prepared set's contents (its shards' and token counts' sha256 from the manifest): the same
    on every node that holds a copy of it."""
    manifest = open_prepared(path).manifest
    parts = [f"{s.file}:{s.sha256}:{s.num_samples}" for s in manifest.shards] + [manifest.token_counts_sha256]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def open_prepared(path: Path, verify: bool = False) -> PreparedDataset:
    """Open a prepared set (checking its structure; `verify=True` also re-hashes every file)."""
    path = Path(path)
    if not path.exists():
        raise DraftsmithError(f"{path}: prepared data set does not exist; run `draftsmith prepare` first")
    if not path.is_dir():
        raise DraftsmithError(f"{path}: expected a prepared data set directory, got a file")
    if not (path / MANIFEST_NAME).is_file():
        raise DraftsmithError(
            f"{path}: not a prepared data set (no {MANIFEST_NAME}); "
            "point at the output directory of `draftsmith prepare`"
        )
    manifest = read_manifest(path, PreparedManifest)
    if not manifest.shards or sum(s.num_samples for s in manifest.shards) != manifest.num_samples:
        raise DraftsmithError(
            f"{path}/{MANIFEST_NAME}: shard sample counts do not add up to {manifest.num_samples}; "
            "the manifest is damaged"
        )
    dataset = PreparedDataset(path, manifest)
    if verify:
        dataset.verify()
    return dataset


def split_indices(n: int, eval_fraction: float, seed: int = 0) -> tuple[list[int], list[int]]:
    """Deterministic train / held-out split of sample ids 0..n-1 (both sorted), shared by trainer and evaluator.

    The held-out part has round(n * eval_fraction) samples, at least one when eval_fraction > 0 and n >= 2,
    and never all of them.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise DraftsmithError(f"eval fraction must be in [0, 1), got {eval_fraction}")
    n_eval = int(round(n * eval_fraction))
    if eval_fraction > 0 and n >= 2:
        n_eval = max(1, n_eval)
    n_eval = min(n_eval, max(n - 1, 0))
    order = np.random.default_rng(seed).permutation(n)
    held_out = sorted(int(i) for i in order[:n_eval])
    train = sorted(int(i) for i in order[n_eval:])
    return train, held_out
