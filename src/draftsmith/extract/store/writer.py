"""Writing a store: one writer per worker tag, crash-safe shards, the manifest under a lock, recovery after crashes.

A shard is written to a temp file, fsynced, renamed into `shards/`, and only then added to the manifest (itself
replaced atomically, under `.locks/manifest.lock`, so several writer processes may fill one store). A shard file
that exists but is not in the manifest is what a crash between those two steps leaves: the next writer adopts it
when it is whole and belongs to this store, and deletes it otherwise. A sample is in the store exactly when its
shard is in the manifest, so a resumed run skips exactly those (`done_sample_ids`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

import torch
from pydantic import JsonValue

from draftsmith.config import parse_shard
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import (
    _explain_os_error,
    atomic_path,
    file_lock,
    sha256_file,
)
from draftsmith.core.manifest import (
    MANIFEST_NAME,
    read_manifest,
    read_manifest_json,
    write_manifest,
)
from draftsmith.extract.store import shards
from draftsmith.extract.store.codec import TORCH_DTYPES, encode_hidden_states
from draftsmith.extract.store.schema import (
    DEFAULT_SHARD_BYTES,
    LOCK_DIR,
    SHARD_DIR,
    ShardInfo,
    StoreManifest,
    StoreSpec,
    sample_ranges,
)


class TryLock:
    """A non-blocking exclusive flock on the file at `path` (a writer's `.locks/<tag>.lock`, held while it lives)."""

    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = None

    def try_acquire(self) -> bool:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            self.fd = None
            return False
        return True

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


class StoreWriter:
    """Adds samples to a store; buffers them and writes one shard per `shard_bytes` (or per `flush()`).

    Any producer uses it the same way (the transformers and vLLM backends do)::

        with create_or_resume(path, spec, worker="0/1") as writer:
            todo = [i for i in my_ids if i not in writer.done_sample_ids()]
            for i in todo:
                writer.add(i, input_ids, loss_mask, hidden_states)   # [T], [T], [T, L, H]
        # leaving the block flushes; an exception inside drops only the unflushed buffer

    Not thread-safe: call it from one thread (the backends give it a writer thread of its own).
    """

    def __init__(
        self,
        path: Path,
        spec: StoreSpec,
        tag: str,
        lock: TryLock,
        shard_bytes: int,
        backend_info: dict[str, JsonValue] | None = None,
    ):
        self.path = Path(path)
        self.spec = spec
        self.tag = tag
        self.shard_bytes = int(shard_bytes)
        self.backend_info = dict(backend_info or {})
        self._lock = lock
        self._buffer: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int, int]] = []
        self._buffered_ids: set[int] = set()
        self._buffered_bytes = 0
        self._done: set[int] = read_manifest(self.path, StoreManifest).sample_ids()
        self._next_seq = self._first_free_seq()
        self.samples_written = 0
        self.tokens_written = 0
        self.bytes_written = 0
        self.shards_written = 0
        self.closed = False
        self.recovered: list[str] = []

    # -- what is there
    def done_sample_ids(self) -> set[int]:
        """Sample ids already in the store (any writer) or buffered here; re-read from the manifest."""
        self._done = read_manifest(self.path, StoreManifest).sample_ids()
        return self._done | self._buffered_ids

    def _first_free_seq(self) -> int:
        seqs = [-1]
        for p in (self.path / SHARD_DIR).iterdir():
            m = shards.SHARD_NAME.match(p.name)
            if m and m["tag"] == self.tag:
                seqs.append(int(m["seq"]))
        return max(seqs) + 1

    # -- adding
    def add(
        self,
        sample_id: int,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        hidden_states: torch.Tensor,
        scales: torch.Tensor | None = None,
        parent: int = -1,
        shared: int = 0,
        *,
        flush_if_full: bool = True,
    ) -> None:
        """Buffer one sample: input_ids [T], loss_mask [T], hidden_states [T, L, H] (layers in `spec.layer_ids` order).

        hidden_states may be any float dtype on any device (encoded here to the storage dtype), or already encoded
        (bf16; or float8_e4m3fn with its `scales` [T, L] from `encode_hidden_states`). A sample whose first `shared`
        tokens are those of sample `parent` (stored or buffered already) gives only its own states: [T - shared, L, H].
        """
        if self.closed:
            raise RuntimeError("StoreWriter is closed")
        sample_id = int(sample_id)
        if sample_id in self._buffered_ids or sample_id in self._done:
            raise ValueError(f"sample {sample_id} is already in store {self.path}; skip done_sample_ids()")
        if self.spec.prepared is not None and not 0 <= sample_id < self.spec.prepared.num_samples:
            raise ValueError(f"sample id {sample_id} outside the prepared set's {self.spec.prepared.num_samples}")
        T, L, H = int(input_ids.shape[0]), len(self.spec.layer_ids), self.spec.hidden_size
        if input_ids.ndim != 1 or loss_mask.shape != input_ids.shape or hidden_states.shape != (T - shared, L, H):
            raise ValueError(
                f"sample {sample_id}: expected input_ids [T], loss_mask [T], hidden_states [T - {shared}, {L}, {H}]; "
                f"got {tuple(input_ids.shape)}, {tuple(loss_mask.shape)}, {tuple(hidden_states.shape)}"
            )
        if not 0 <= shared < T or (shared > 0) == (int(parent) < 0):
            raise ValueError(f"sample {sample_id}: {T} tokens, {shared} of them shared with sample {parent}")
        if shared and int(parent) not in self._done and int(parent) not in self._buffered_ids:
            raise ValueError(f"sample {sample_id}: its prefix's sample {parent} is not stored before it")
        storage = TORCH_DTYPES[self.spec.dtype]
        if hidden_states.dtype == storage and (self.spec.dtype == "bf16" or scales is not None):
            data = hidden_states
        else:
            data, scales = encode_hidden_states(hidden_states, self.spec.dtype)
        data = data.detach().to("cpu").contiguous()
        scales = None if scales is None else scales.detach().to("cpu", torch.float32).contiguous()
        ids = input_ids.detach().to("cpu", torch.int32)[shared:]  # the prefix's are its parent's
        mask = loss_mask.detach().to("cpu", torch.bool)
        self._buffer.append((sample_id, ids, mask, data, scales, int(parent), int(shared)))
        self._buffered_ids.add(sample_id)
        self._buffered_bytes += (
            data.numel() * data.element_size() + (0 if scales is None else scales.numel() * 4) + ids.numel() * 4 + T
        )
        if flush_if_full:
            self.maybe_flush()

    def maybe_flush(self) -> None:
        """Write a shard if the buffer has reached `shard_bytes`."""
        if self._buffered_bytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> ShardInfo | None:
        """Write everything buffered as one shard and record it in the manifest (atomic; no-op when empty)."""
        if not self._buffer:
            return None
        buffer = self._buffer
        sample_ids = torch.tensor([b[0] for b in buffer], dtype=torch.int64)
        offsets, rows = _offsets([b[2].shape[0] for b in buffer]), _offsets([b[3].shape[0] for b in buffer])
        tensors: dict[str, torch.Tensor | list[torch.Tensor]] = {
            "hidden_states": [b[3] for b in buffer],  # written piece by piece, never joined in memory
            "input_ids": torch.cat([b[1] for b in buffer]),
            "loss_mask": torch.cat([b[2] for b in buffer]),
            "offsets": offsets,
            "sample_ids": sample_ids,
        }
        if self.spec.dtype == "fp8":
            scales = [b[4] for b in buffer if b[4] is not None]
            assert len(scales) == len(buffer)  # fp8 states come with their scales
            tensors["hidden_scales"] = scales
        chained = any(b[6] for b in buffer)
        if chained:  # the module docstring of shards.py
            tensors["row_offsets"] = rows
            tensors["prefix_parents"], tensors["prefix_shared"] = (torch.tensor([b[k] for b in buffer]) for k in (5, 6))
        name = shards.shard_name(self.tag, self._next_seq)
        final = self.path / SHARD_DIR / name
        with atomic_path(final) as tmp:
            sha256, num_bytes = shards.write_shard(tmp, tensors, self.spec)
        self._next_seq += 1
        info = ShardInfo(
            file=f"{SHARD_DIR}/{name}",
            sha256=sha256,
            num_bytes=num_bytes,
            num_samples=len(buffer),
            num_tokens=int(offsets[-1]),
            num_rows=int(rows[-1]) if chained else None,
            sample_ranges=sample_ranges(sample_ids.tolist()),
            writer=self.tag,
        )
        _add_shards(self.path, [info], self.backend_info)
        self._done |= self._buffered_ids
        self.samples_written += len(buffer)
        self.tokens_written += info.num_tokens
        self.bytes_written += info.num_bytes
        self.shards_written += 1
        self._buffer, self._buffered_ids, self._buffered_bytes = [], set(), 0
        return info

    def close(self) -> None:
        """Flush and let go of the writer lock."""
        if self.closed:
            return
        try:
            self.flush()
        finally:
            self.abort()

    def abort(self) -> None:
        """Drop the unflushed buffer (those samples are recomputed on resume) and let go of the lock."""
        self._buffer, self._buffered_ids, self._buffered_bytes = [], set(), 0
        self._lock.release()
        self.closed = True

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.cumsum(torch.tensor([0, *lengths], dtype=torch.int64), 0)


def _add_shards(path: Path, infos: list[ShardInfo], backend_info: dict[str, JsonValue] | None = None) -> None:
    """Append shards to the manifest under the store lock (readers see the old or the new manifest, never half)."""
    with file_lock(path / LOCK_DIR / "manifest.lock"):
        manifest = read_manifest(path, StoreManifest)
        if backend_info:
            manifest.backend_info.update(backend_info)
        _record(path, manifest, infos)


def _record(path: Path, manifest: StoreManifest, infos: list[ShardInfo]) -> None:
    """Add shards to a manifest read under the store lock, and write it."""
    manifest.shards.extend(infos)
    manifest.num_samples += sum(i.num_samples for i in infos)
    manifest.num_tokens += sum(i.num_tokens for i in infos)
    write_manifest(path, manifest)


def _recover(path: Path, spec: StoreSpec, own_tag: str) -> list[str]:  # noqa: C901 - one branch per state a killed writer can leave
    """Clean up after crashed writers (never a live one): drop temp files, adopt or delete orphan shards."""
    notes: list[str] = []
    shard_dir = path / SHARD_DIR
    live: set[str] = set()
    dead: dict[str, TryLock] = {}
    for lock_file in sorted((path / LOCK_DIR).glob("*.lock")):
        lock_tag = lock_file.stem
        if lock_tag == "manifest" or lock_tag == own_tag:
            continue
        lock = TryLock(path / LOCK_DIR / f"{lock_tag}.lock")
        if lock.try_acquire():
            dead[lock_tag] = lock
        else:
            live.add(lock_tag)
    try:

        def owner(name: str) -> str | None:
            m = shards.SHARD_NAME.match(name.lstrip(".").split(".safetensors")[0] + ".safetensors")
            return m["tag"] if m else None

        for tmp in shard_dir.glob(".part-*.tmp"):
            if owner(tmp.name) not in live:
                tmp.unlink(missing_ok=True)
        with file_lock(path / LOCK_DIR / "manifest.lock"):
            manifest = read_manifest(path, StoreManifest)
            listed = {Path(s.file).name for s in manifest.shards}
            done = manifest.sample_ids()
            adopted: list[ShardInfo] = []
            for file in sorted(shard_dir.glob("part-*.safetensors")):
                tag = owner(file.name)
                if file.name in listed or tag is None or tag in live:
                    continue
                try:
                    shard, index = shards.open_shard(file, spec)
                    shard.close()
                    if done.intersection(index.sample_ids):
                        raise DraftsmithError("its samples are already in the store")
                except DraftsmithError as err:
                    file.unlink()
                    notes.append(f"removed orphan shard {file.name} left by an interrupted writer ({err})")
                    continue
                adopted.append(
                    ShardInfo(
                        file=f"{SHARD_DIR}/{file.name}",
                        sha256=sha256_file(file),
                        num_bytes=shard.size,
                        num_samples=len(index.sample_ids),
                        num_tokens=index.num_tokens,
                        num_rows=index.num_rows,
                        sample_ranges=sample_ranges(index.sample_ids),
                        writer=tag,
                    )
                )
                done.update(index.sample_ids)
                notes.append(f"adopted shard {file.name} that an interrupted writer finished but did not record")
            if adopted:
                _record(path, manifest, adopted)
    finally:
        for lock in dead.values():
            lock.release()
    return notes


def _holds_shards(path: Path) -> bool:
    """Any file in the store's shard directory (a committed shard, or a crashed writer's leftover)."""
    shard_dir = Path(path) / SHARD_DIR
    return shard_dir.is_dir() and any(entry.is_file() for entry in shard_dir.rglob("*"))


def stored_compute_dtype(path: Path) -> str | None:
    """The compute dtype of the states a store at `path` already holds; None where there is no store there or it
    holds no shard yet (a resume takes this dtype for `auto`)."""
    path = Path(path)
    if not (path / MANIFEST_NAME).is_file() or not _holds_shards(path):
        return None
    try:
        return read_manifest(path, StoreManifest).compute_dtype
    except (DraftsmithError, OSError, ValueError):
        return None  # not a store (create_or_resume says so in its own words)


def create_or_resume(
    path: Path,
    spec: StoreSpec,
    *,
    worker: str | tuple[int, int] = "0/1",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    backend_info: dict[str, JsonValue] | None = None,
) -> StoreWriter:
    """Open a store for writing as worker `i/n`: create it, or resume it after checking it holds the same kind of states.

    Refuses (DraftsmithError) a store made for another target / prepared set / layers / dtype / backend, a
    directory that is something else, an unwritable directory, and a second live writer with the same `worker`.
    Leftovers of crashed writers are cleaned up first (see `_recover`); `writer.recovered` lists what was done.
    """
    path = Path(path)
    i, n = parse_shard(worker) if isinstance(worker, str) else worker
    tag = f"s{i}of{n}"  # names this writer's shards and lock
    try:
        if path.exists() and not path.is_dir():
            raise DraftsmithError(f"{path}: exists and is not a directory; choose another --output")
        if path.is_dir() and any(path.iterdir()) and not (path / MANIFEST_NAME).is_file():
            raise DraftsmithError(
                f"{path}: directory is not empty and is not a hidden-state store; choose another --output"
            )
        (path / SHARD_DIR).mkdir(parents=True, exist_ok=True)
        (path / LOCK_DIR).mkdir(exist_ok=True)
        lock = TryLock(path / LOCK_DIR / f"{tag}.lock")
        acquired = lock.try_acquire()
    except OSError as err:
        raise _explain_os_error(path, err) from None
    if not acquired:
        raise DraftsmithError(
            f"{path}: another process is already writing worker {worker} of this store; wait for "
            "it, or give this one a different --shard"
        )
    try:
        with file_lock(path / LOCK_DIR / "manifest.lock"):
            fresh = not (path / MANIFEST_NAME).is_file()
            if not fresh:
                data = read_manifest_json(path)
                if data.get("kind") != "store":
                    raise DraftsmithError(
                        f"{path}: is a {data.get('kind')!r} artefact, not a hidden-state store; choose another --output"
                    )
                diff = read_manifest(path, StoreManifest).spec().mismatch(spec)
                # only the compute dtype differs and nothing is computed yet (an engine that could not run in the
                # first dtype fell back to another before its first sample): the store takes the new dtype
                fresh = bool(diff and diff.startswith("compute_dtype") and not _holds_shards(path))
                if diff and not fresh:
                    raise DraftsmithError(
                        f"{path}: existing store was made differently ({diff.replace(' != ', ' there, asked for ')}); "
                        "use another --output, or the options it was made with, to resume it"
                    )
            if fresh:
                write_manifest(path, StoreManifest(**spec.model_dump(), backend_info=dict(backend_info or {})))
        notes = _recover(path, spec, tag)
        writer = StoreWriter(path, spec, tag, lock, shard_bytes, backend_info)
    except OSError as err:
        lock.release()
        raise _explain_os_error(path, err) from None
    except BaseException:
        lock.release()
        raise
    writer.recovered = notes
    return writer
