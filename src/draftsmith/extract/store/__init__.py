"""The hidden-state store: the target's kept layers per token, sharded; the only module that reads or writes it.

On disk (see docs/formats.md, "Hidden-state store")::

    manifest.json                         StoreManifest (kind "store"): target, prepared set, layer ids, dtype,
                                          counts, and every shard with its sha256, size and sample-id ranges
    config.yaml                           the resolved ExtractConfig of the last run that wrote here
    shards/part-s0of1-000000.safetensors  hidden_states [T, L, H] (bf16, or fp8 e4m3 + hidden_scales [T, L] f32),
                                          input_ids int32 [T], loss_mask bool [T], offsets int64 [S+1],
                                          sample_ids int64 [S]
    .locks/                               one lock file per writer (advisory flock; never data)

Writing is crash-safe at every instant: a shard is written to a temp file, fsynced, renamed into `shards/`, and
only then added to the manifest (itself replaced atomically, under a lock, so several writer processes may fill
one store). A shard file that exists but is not in the manifest is what a crash between those two steps leaves:
the next writer adopts it when it is whole and belongs to this store, and deletes it otherwise. A sample is in
the store exactly when its shard is in the manifest, so a resumed run skips exactly those (`done_sample_ids`).

Reading memory-maps the shards: `store[i]` is a view into the page cache when the asked dtype is the storage
dtype (bf16), and one conversion otherwise. Samples are ordered by sample id, whatever shard holds them.
"""

from __future__ import annotations

import builtins
import collections
import collections.abc
import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import struct
from pathlib import Path
from typing import Any, Literal, Sequence

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import atomic_dir, atomic_path, file_lock, sha256_bytes, sha256_file
from draftsmith.core.manifest import (
    MANIFEST_NAME,
    Manifest,
    TargetIdentity,
    read_manifest,
    read_manifest_json,
    write_manifest,
)

StorageDtype = Literal["bf16", "fp8"]
FORMAT_NAME = "draftsmith-store"
FORMAT_VERSION = 1
SHARD_DIR = "shards"
LOCK_DIR = ".locks"
DEFAULT_SHARD_BYTES = 256 << 20
FP8_MAX = 448.0  # largest finite float8_e4m3fn value

_TORCH_STORAGE = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
# safetensors dtype name -> (numpy dtype to map the bytes with, torch dtype to view them as)
_ST_DTYPES: dict[str, tuple[Any, torch.dtype]] = {
    "BF16": (np.int16, torch.bfloat16), "F8_E4M3": (np.uint8, torch.float8_e4m3fn), "F32": (np.float32, torch.float32),
    "I32": (np.int32, torch.int32), "I64": (np.int64, torch.int64), "BOOL": (np.bool_, torch.bool),
}
_SHARD_NAME = re.compile(r"^part-(?P<tag>[A-Za-z0-9_.-]+)-(?P<seq>\d{6,})\.safetensors$")


# --------------------------------------------------------------------------------------------------- manifest


class PreparedRef(BaseModel):
    """Which prepared set a store's samples come from: sample ids index into it."""

    model_config = ConfigDict(extra="forbid")

    path: str
    fingerprint: str = Field(description="sha256 over the prepared set's shard checksums, target and template")
    num_samples: int
    chat_template_hash: str = ""


class StoreSpec(BaseModel):
    """Everything two writers must agree on to put hidden states into one store."""

    model_config = ConfigDict(extra="forbid")

    target: TargetIdentity
    prepared: PreparedRef | None = None
    layer_ids: list[int] = Field(description="vLLM convention: aux layer ids, then N (the last layer, un-normalised)")
    hidden_size: int
    dtype: StorageDtype = "bf16"
    backend: str = Field("hf", description="engine that computed the states: hf or vllm")
    compute_dtype: str = Field("float32", description="dtype the target ran in (float32, bfloat16, ...)")

    def mismatch(self, other: "StoreSpec") -> str | None:
        """The first difference that makes states incompatible (paths alone may differ), or None."""
        diff = self.target.mismatch(other.target)
        if diff:
            return f"target {diff}"
        if (self.prepared is None) != (other.prepared is None) or (
                self.prepared and other.prepared and self.prepared.fingerprint != other.prepared.fingerprint):
            a = self.prepared.path if self.prepared else None
            b = other.prepared.path if other.prepared else None
            return f"prepared set {a!r} != {b!r} (different contents)"
        for name in ("layer_ids", "hidden_size", "dtype", "backend", "compute_dtype"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                return f"{name} {a!r} != {b!r}"
        return None

    def fingerprint(self) -> str:
        """Hash of the compatibility-relevant fields (written into every shard's metadata)."""
        data = self.model_dump(mode="json")
        data["target"] = {k: v for k, v in data["target"].items() if k not in ("path", "architecture")}
        if data["prepared"]:
            data["prepared"] = data["prepared"]["fingerprint"]
        return sha256_bytes(json.dumps(data, sort_keys=True).encode())

    @property
    def aux_layer_ids(self) -> list[int]:
        return list(self.layer_ids[:-1])


class ShardInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    file: str = Field(description="path relative to the store directory")
    sha256: str
    num_bytes: int
    num_samples: int
    num_tokens: int
    sample_ranges: list[tuple[int, int]] = Field(description="sorted half-open [start, end) runs of sample ids")
    writer: str = Field("", description="tag of the writer that produced it (e.g. s0of4)")


class StoreManifest(StoreSpec, Manifest):
    """A store: what it holds (StoreSpec fields), how much, and where (shards)."""

    kind: str = "store"
    format_version: int = FORMAT_VERSION
    num_samples: int = 0
    num_tokens: int = 0
    shards: list[ShardInfo] = Field(default_factory=list)
    backend_info: dict[str, Any] = Field(default_factory=dict, description="engine details (not compared)")

    def spec(self) -> StoreSpec:
        return StoreSpec.model_validate(self.model_dump(include=set(StoreSpec.model_fields)))

    def sample_ids(self) -> set[int]:
        return {i for s in self.shards for a, b in s.sample_ranges for i in range(a, b)}


def prepared_ref(dataset: Any) -> PreparedRef:
    """Identity of a prepared set (a `draftsmith.prepare.dataset.PreparedDataset`) that survives copying it elsewhere."""
    m = dataset.manifest
    data = {"shards": [s.sha256 for s in m.shards], "num_samples": m.num_samples,
            "target": m.target.config_hash, "tokenizer": m.target.tokenizer_hash,
            "chat_template_hash": getattr(m, "chat_template_hash", "")}
    return PreparedRef(path=str(Path(dataset.path).resolve()), fingerprint=sha256_bytes(json.dumps(data).encode()),
                       num_samples=m.num_samples, chat_template_hash=getattr(m, "chat_template_hash", ""))


def _ranges(ids: Sequence[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for i in sorted(int(x) for x in ids):
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


# --------------------------------------------------------------------------------------------------- encoding


def encode_hidden_states(x: torch.Tensor, dtype: StorageDtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[..., H] float -> (storage tensor, per-row scale [...] f32 for fp8, else None), on x's device.

    fp8: each (token, layer) row is scaled so its largest magnitude maps to 448 (e4m3's max), then rounded to
    e4m3 (3 mantissa bits: relative error <= 2^-4 for normal values, absolute <= 2^-10 * scale below 2^-6).
    A non-finite row keeps a non-finite scale, so `verify` still finds it.
    """
    if dtype == "bf16":
        return x.to(torch.bfloat16), None
    if dtype != "fp8":
        raise ValueError(f"unknown storage dtype {dtype!r}")
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / FP8_MAX)
    q = (xf / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def decode_hidden_states(data: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `encode_hidden_states`, returning `dtype` (no copy when bf16 is stored and asked for)."""
    if scales is None:
        return data if data.dtype == dtype else data.to(dtype)
    return (data.to(torch.float32) * scales.unsqueeze(-1)).to(dtype)


# --------------------------------------------------------------------------------------------------- shard files


def _write_file(path: Path, data: bytes | memoryview) -> None:
    """Write all of `data` to `path` (one place, so tests can simulate a full disk)."""
    with builtins.open(path, "wb") as f:
        f.write(data)


class _ShardFile:
    """A safetensors shard opened by hand: header parsed once, small tensors read, big ones memory-mapped."""

    def __init__(self, path: Path, expected_bytes: int | None = None):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with builtins.open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise ValueError("shorter than a safetensors header")
                (header_len,) = struct.unpack("<Q", head)
                if header_len > min(size - 8, 100_000_000):
                    raise ValueError("header length out of range")
                header = json.loads(f.read(header_len))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
            metadata = header.pop("__metadata__", None) or {}
            for name, info in header.items():
                if not (isinstance(info, dict) and isinstance(info.get("shape"), list)
                        and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2):
                    raise ValueError(f"bad header entry {name!r}")
        except FileNotFoundError:
            raise DraftsmithError(f"{self.path}: shard file is missing; run `draftsmith store verify --repair` "
                                  "and extract again to recompute its samples") from None
        except (OSError, ValueError, TypeError, AttributeError, UnicodeDecodeError) as err:
            raise DraftsmithError(f"{self.path}: not a readable shard ({err}); run `draftsmith store verify --repair` "
                                  "and extract again to recompute its samples") from None
        self.size = size
        self.base = 8 + header_len
        self.metadata: dict[str, str] = metadata if isinstance(metadata, dict) else {}
        self.header: dict[str, dict] = header
        end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
        if self.base + end != size or (expected_bytes is not None and size != expected_bytes):
            want = expected_bytes if expected_bytes is not None else self.base + end
            raise DraftsmithError(f"{self.path}: {size} bytes, expected {want} (truncated or replaced shard); run "
                                  "`draftsmith store verify --repair` and extract again to recompute its samples")
        self._mmap: np.memmap | None = None

    def _spec(self, name: str) -> tuple[int, int, tuple[int, ...], Any, torch.dtype]:
        info = self.header.get(name)
        if info is None or info.get("dtype") not in _ST_DTYPES:
            raise DraftsmithError(f"{self.path}: tensor {name!r} missing or of an unknown dtype (damaged shard)")
        start, end = (int(v) for v in info["data_offsets"])
        np_dtype, torch_dtype = _ST_DTYPES[info["dtype"]]
        shape = tuple(int(d) for d in info["shape"])
        if end - start != int(np.prod(shape, dtype=np.int64)) * np.dtype(np_dtype).itemsize:
            raise DraftsmithError(f"{self.path}: tensor {name!r} size does not match its shape (damaged shard)")
        return start, end, shape, np_dtype, torch_dtype

    def has(self, name: str) -> bool:
        return name in self.header

    def read(self, name: str) -> torch.Tensor:
        """A small tensor, read into memory (no mapping kept)."""
        start, end, shape, np_dtype, torch_dtype = self._spec(name)
        with builtins.open(self.path, "rb") as f:
            f.seek(self.base + start)
            raw = f.read(end - start)
        arr = np.frombuffer(raw, dtype=np_dtype).copy().reshape(shape)
        return torch.from_numpy(arr).view(torch_dtype)

    def view(self, name: str, first: int, last: int) -> torch.Tensor:
        """Rows first..last-1 of a tensor as a zero-copy view of the memory-mapped file."""
        start, _end, shape, np_dtype, torch_dtype = self._spec(name)
        if self._mmap is None:
            # copy-on-write mapping: readable without copying, and torch gets a writable buffer (no warning)
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="c")
        row = int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(np_dtype).itemsize
        a = self.base + start + first * row
        arr = self._mmap[a:a + (last - first) * row].view(np_dtype).reshape((last - first, *shape[1:]))
        return torch.from_numpy(arr).view(torch_dtype)

    def close(self) -> None:
        self._mmap = None


def _shard_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)


# --------------------------------------------------------------------------------------------------- writing


class _WriterLock:
    """A non-blocking exclusive flock on `.locks/<tag>.lock`, held while a writer lives."""

    def __init__(self, store: Path, tag: str):
        self.path = store / LOCK_DIR / f"{tag}.lock"
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


def _os_error(path: Path, err: OSError) -> DraftsmithError:
    if err.errno == errno.ENOSPC:
        return DraftsmithError(f"{path}: no space left on device; free disk space and run the same command again "
                               "to resume")
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return DraftsmithError(f"{path}: cannot write here ({os.strerror(err.errno)}); choose a writable --output")
    return DraftsmithError(f"{path}: {err.strerror or err}")


def worker_tag(shard: str | tuple[int, int]) -> str:
    """'i/n' or (i, n) -> the tag that names a writer's shards and lock ('s1of4')."""
    if isinstance(shard, str):
        from draftsmith.config import parse_shard

        shard = parse_shard(shard)
    return f"s{shard[0]}of{shard[1]}"


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

    def __init__(self, path: Path, spec: StoreSpec, tag: str, lock: _WriterLock, shard_bytes: int,
                 backend_info: dict[str, Any] | None = None):
        self.path = Path(path)
        self.spec = spec
        self.tag = tag
        self.shard_bytes = int(shard_bytes)
        self.backend_info = dict(backend_info or {})
        self._lock = lock
        self._buffer: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
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

    @property
    def buffered_samples(self) -> int:
        return len(self._buffer)

    def _first_free_seq(self) -> int:
        seqs = [-1]
        for p in (self.path / SHARD_DIR).iterdir():
            m = _SHARD_NAME.match(p.name)
            if m and m["tag"] == self.tag:
                seqs.append(int(m["seq"]))
        return max(seqs) + 1

    # -- adding
    def add(self, sample_id: int, input_ids: torch.Tensor, loss_mask: torch.Tensor, hidden_states: torch.Tensor,
            scales: torch.Tensor | None = None, *, flush_if_full: bool = True) -> None:
        """Buffer one sample: input_ids [T], loss_mask [T], hidden_states [T, L, H] (layers in `spec.layer_ids` order).

        hidden_states may be any float dtype on any device (encoded here to the storage dtype), or already encoded
        (bf16; or float8_e4m3fn with its `scales` [T, L] from `encode_hidden_states`).
        """
        if self.closed:
            raise RuntimeError("StoreWriter is closed")
        sample_id = int(sample_id)
        if sample_id in self._buffered_ids or sample_id in self._done:
            raise ValueError(f"sample {sample_id} is already in store {self.path}; skip done_sample_ids()")
        if self.spec.prepared is not None and not 0 <= sample_id < self.spec.prepared.num_samples:
            raise ValueError(f"sample id {sample_id} outside the prepared set's {self.spec.prepared.num_samples}")
        T = int(input_ids.shape[0])
        L, H = len(self.spec.layer_ids), self.spec.hidden_size
        if input_ids.ndim != 1 or loss_mask.shape != input_ids.shape or tuple(hidden_states.shape) != (T, L, H):
            raise ValueError(f"sample {sample_id}: expected input_ids [T], loss_mask [T], hidden_states [T, {L}, {H}]; "
                             f"got {tuple(input_ids.shape)}, {tuple(loss_mask.shape)}, {tuple(hidden_states.shape)}")
        if T == 0:
            raise ValueError(f"sample {sample_id}: no tokens")
        storage = _TORCH_STORAGE[self.spec.dtype]
        if hidden_states.dtype == storage and (self.spec.dtype == "bf16" or scales is not None):
            data = hidden_states
        else:
            data, scales = encode_hidden_states(hidden_states, self.spec.dtype)
        data = data.detach().to("cpu").contiguous()
        scales = None if scales is None else scales.detach().to("cpu", torch.float32).contiguous()
        ids = input_ids.detach().to("cpu", torch.int32)
        mask = loss_mask.detach().to("cpu", torch.bool)
        self._buffer.append((sample_id, ids, mask, data, scales))
        self._buffered_ids.add(sample_id)
        self._buffered_bytes += data.numel() * data.element_size() + (0 if scales is None else scales.numel() * 4) + T * 5
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
        lengths = torch.tensor([b[1].shape[0] for b in buffer], dtype=torch.int64)
        offsets = torch.zeros(len(buffer) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        tensors = {
            "hidden_states": torch.cat([b[3] for b in buffer]),
            "input_ids": torch.cat([b[1] for b in buffer]),
            "loss_mask": torch.cat([b[2] for b in buffer]),
            "offsets": offsets,
            "sample_ids": sample_ids,
        }
        if self.spec.dtype == "fp8":
            tensors["hidden_scales"] = torch.cat([b[4] for b in buffer])
        data = _shard_bytes(tensors, _shard_metadata(self.spec))
        name = f"part-{self.tag}-{self._next_seq:06d}.safetensors"
        final = self.path / SHARD_DIR / name
        with atomic_path(final) as tmp:
            _write_file(tmp, data)
        self._next_seq += 1
        info = ShardInfo(file=f"{SHARD_DIR}/{name}", sha256=sha256_bytes(data), num_bytes=len(data),
                         num_samples=len(buffer), num_tokens=int(offsets[-1]),
                         sample_ranges=_ranges(sample_ids.tolist()), writer=self.tag)
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

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _shard_metadata(spec: StoreSpec) -> dict[str, str]:
    return {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "spec_fingerprint": spec.fingerprint(),
            "dtype": spec.dtype, "layer_ids": ",".join(map(str, spec.layer_ids)), "hidden_size": str(spec.hidden_size)}


def _add_shards(path: Path, infos: list[ShardInfo], backend_info: dict[str, Any] | None = None) -> None:
    """Append shards to the manifest under the store lock (readers see the old or the new manifest, never half)."""
    with file_lock(path / LOCK_DIR / "manifest.lock"):
        manifest = read_manifest(path, StoreManifest)
        manifest.shards.extend(infos)
        manifest.num_samples += sum(i.num_samples for i in infos)
        manifest.num_tokens += sum(i.num_tokens for i in infos)
        if backend_info:
            manifest.backend_info.update(backend_info)
        write_manifest(path, manifest)


def _check_shard_file(shard: _ShardFile, spec: StoreSpec) -> tuple[list[int], int]:
    """Structure of a shard against a spec: (sample ids, token count), or DraftsmithError."""
    if shard.metadata.get("format") != FORMAT_NAME or shard.metadata.get("spec_fingerprint") != spec.fingerprint():
        raise DraftsmithError(f"{shard.path}: not a shard of this store (different target, layers, dtype or data)")
    offsets = shard.read("offsets")
    sample_ids = shard.read("sample_ids")
    S, T = len(sample_ids), int(offsets[-1]) if len(offsets) else -1
    L, H = len(spec.layer_ids), spec.hidden_size
    expect = {"hidden_states": (T, L, H), "input_ids": (T,), "loss_mask": (T,), "offsets": (S + 1,)}
    if spec.dtype == "fp8":
        expect["hidden_scales"] = (T, L)
    for name, shape in expect.items():
        if shard._spec(name)[2] != shape:
            raise DraftsmithError(f"{shard.path}: tensor {name!r} has shape {shard._spec(name)[2]}, expected {shape} "
                                  "(damaged shard)")
    if S == 0 or int(offsets[0]) != 0 or bool((offsets[1:] <= offsets[:-1]).any()):
        raise DraftsmithError(f"{shard.path}: offsets are not increasing from 0 (damaged shard)")
    ids = sample_ids.tolist()
    if len(set(ids)) != len(ids):
        raise DraftsmithError(f"{shard.path}: a sample id appears twice (damaged shard)")
    return ids, T


def _recover(path: Path, spec: StoreSpec, own_tag: str) -> list[str]:
    """Clean up after crashed writers (never a live one): drop temp files, adopt or delete orphan shards."""
    notes: list[str] = []
    shard_dir = path / SHARD_DIR
    live: set[str] = set()
    dead: dict[str, _WriterLock] = {}
    for lock_file in sorted((path / LOCK_DIR).glob("*.lock")):
        tag = lock_file.stem
        if tag == "manifest" or tag == own_tag:
            continue
        lock = _WriterLock(path, tag)
        if lock.try_acquire():
            dead[tag] = lock
        else:
            live.add(tag)
    try:
        def owner(name: str) -> str | None:
            m = _SHARD_NAME.match(name.lstrip(".").split(".safetensors")[0] + ".safetensors")
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
                    shard = _ShardFile(file)
                    ids, tokens = _check_shard_file(shard, spec)
                    if done.intersection(ids):
                        raise DraftsmithError("its samples are already in the store")
                except DraftsmithError as err:
                    file.unlink()
                    notes.append(f"removed orphan shard {file.name} left by an interrupted writer ({err})")
                    continue
                adopted.append(ShardInfo(file=f"{SHARD_DIR}/{file.name}", sha256=sha256_file(file),
                                         num_bytes=shard.size, num_samples=len(ids), num_tokens=tokens,
                                         sample_ranges=_ranges(ids), writer=tag))
                done.update(ids)
                notes.append(f"adopted shard {file.name} that an interrupted writer finished but did not record")
            if adopted:
                manifest.shards.extend(adopted)
                manifest.num_samples += sum(a.num_samples for a in adopted)
                manifest.num_tokens += sum(a.num_tokens for a in adopted)
                write_manifest(path, manifest)
    finally:
        for lock in dead.values():
            lock.release()
    return notes


def create_or_resume(path: Path, spec: StoreSpec, *, worker: str | tuple[int, int] = "0/1",
                     shard_bytes: int = DEFAULT_SHARD_BYTES, backend_info: dict[str, Any] | None = None) -> StoreWriter:
    """Open a store for writing as worker `i/n`: create it, or resume it after checking it holds the same kind of states.

    Refuses (DraftsmithError) a store made for another target / prepared set / layers / dtype / backend, a
    directory that is something else, an unwritable directory, and a second live writer with the same `worker`.
    Leftovers of crashed writers are cleaned up first (see `_recover`); `writer.recovered` lists what was done.
    """
    path = Path(path)
    tag = worker_tag(worker)
    try:
        if path.exists() and not path.is_dir():
            raise DraftsmithError(f"{path}: exists and is not a directory; choose another --output")
        if path.is_dir() and any(path.iterdir()) and not (path / MANIFEST_NAME).is_file():
            raise DraftsmithError(f"{path}: directory is not empty and is not a hidden-state store; choose another "
                                  "--output")
        (path / SHARD_DIR).mkdir(parents=True, exist_ok=True)
        (path / LOCK_DIR).mkdir(exist_ok=True)
        lock = _WriterLock(path, tag)
        acquired = lock.try_acquire()
    except OSError as err:
        raise _os_error(path, err) from None
    if not acquired:
        raise DraftsmithError(f"{path}: another process is already writing worker {worker} of this store; wait for "
                              "it, or give this one a different --shard")
    try:
        with file_lock(path / LOCK_DIR / "manifest.lock"):
            if (path / MANIFEST_NAME).is_file():
                data = read_manifest_json(path)
                if data.get("kind") != "store":
                    raise DraftsmithError(f"{path}: is a {data.get('kind')!r} artefact, not a hidden-state store; "
                                          "choose another --output")
                existing = read_manifest(path, StoreManifest)
                diff = existing.spec().mismatch(spec)
                if diff:
                    raise DraftsmithError(
                        f"{path}: existing store was made differently ({diff.replace(' != ', ' there, asked for ')}); "
                        "use another --output, or the options it was made with, to resume it")
            else:
                write_manifest(path, StoreManifest(**spec.model_dump(), backend_info=dict(backend_info or {})))
        notes = _recover(path, spec, tag)
        writer = StoreWriter(path, spec, tag, lock, shard_bytes, backend_info)
    except OSError as err:
        lock.release()
        raise _os_error(path, err) from None
    except BaseException:
        lock.release()
        raise
    writer.recovered = notes
    return writer


# --------------------------------------------------------------------------------------------------- reading


class HiddenStateStore(collections.abc.Sequence):
    """Random access to a store, samples in sample-id order.

    `store[i]` -> {"input_ids": LongTensor[T], "loss_mask": BoolTensor[T], "hidden_states": Tensor[T, L, H] in
    `dtype`, "sample_id": int}. `lengths` / `sample_ids` are numpy int64 arrays read without touching any state.
    """

    _MAX_OPEN = 64  # memory maps kept open at once (least recently used closed first)

    def __init__(self, path: Path, manifest: StoreManifest, dtype: torch.dtype = torch.float32):
        self.path = Path(path)
        self.manifest = manifest
        self.dtype = dtype
        shards: list[_ShardFile] = []
        ids, owner, local, lengths = [], [], [], []
        for k, info in enumerate(manifest.shards):
            shard = _ShardFile(self.path / info.file, expected_bytes=info.num_bytes)
            sample_ids, tokens = _check_shard_file(shard, manifest.spec())
            if len(sample_ids) != info.num_samples or tokens != info.num_tokens or _ranges(sample_ids) != [
                    tuple(r) for r in info.sample_ranges]:
                raise DraftsmithError(f"{shard.path}: holds other samples than the manifest says (damaged store); "
                                      "run `draftsmith store verify --repair` and extract again")
            offsets = shard.read("offsets").numpy()
            shard.offsets = offsets  # type: ignore[attr-defined]
            shards.append(shard)
            ids.extend(sample_ids)
            owner.extend([k] * len(sample_ids))
            local.extend(range(len(sample_ids)))
            lengths.append(np.diff(offsets))
        order = np.argsort(np.asarray(ids, dtype=np.int64), kind="stable")
        self.sample_ids = np.asarray(ids, dtype=np.int64)[order]
        if len(self.sample_ids) and bool((np.diff(self.sample_ids) == 0).any()):
            dup = int(self.sample_ids[:-1][np.diff(self.sample_ids) == 0][0])
            raise DraftsmithError(f"{self.path}: sample {dup} is in two shards (damaged store); run "
                                  "`draftsmith store verify --repair`")
        self.lengths = (np.concatenate(lengths).astype(np.int64) if lengths else np.zeros(0, np.int64))[order]
        self._owner = np.asarray(owner, dtype=np.int64)[order]
        self._local = np.asarray(local, dtype=np.int64)[order]
        self._shards = shards
        self._open: collections.OrderedDict[int, None] = collections.OrderedDict()
        if len(self.sample_ids) != manifest.num_samples or int(self.lengths.sum()) != manifest.num_tokens:
            raise DraftsmithError(f"{self.path}/{MANIFEST_NAME}: totals do not match its shards (damaged manifest)")

    @property
    def layer_ids(self) -> list[int]:
        return list(self.manifest.layer_ids)

    @property
    def aux_layer_ids(self) -> list[int]:
        return list(self.manifest.layer_ids[:-1])

    @property
    def num_tokens(self) -> int:
        return self.manifest.num_tokens

    def __len__(self) -> int:
        return len(self.sample_ids)

    def index_of(self, sample_id: int) -> int:
        """Position of a sample id in this store (KeyError when absent)."""
        k = int(np.searchsorted(self.sample_ids, sample_id))
        if k == len(self.sample_ids) or int(self.sample_ids[k]) != sample_id:
            raise KeyError(f"sample {sample_id} is not in store {self.path}")
        return k

    def _shard(self, k: int) -> _ShardFile:
        self._open[k] = None
        self._open.move_to_end(k)
        while len(self._open) > self._MAX_OPEN:
            old, _ = self._open.popitem(last=False)
            self._shards[old].close()
        return self._shards[k]

    def __getitem__(self, i: int) -> dict:  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]  # type: ignore[return-value]
        i = int(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a store of {len(self)} samples")
        shard = self._shard(int(self._owner[i]))
        j = int(self._local[i])
        a, b = int(shard.offsets[j]), int(shard.offsets[j + 1])  # type: ignore[attr-defined]
        data = shard.view("hidden_states", a, b)
        scales = shard.view("hidden_scales", a, b) if self.manifest.dtype == "fp8" else None
        return {
            "input_ids": shard.view("input_ids", a, b).long(),
            "loss_mask": shard.view("loss_mask", a, b),
            "hidden_states": decode_hidden_states(data, scales, self.dtype),
            "sample_id": int(self.sample_ids[i]),
        }

    def verify(self, nonfinite: bool = True) -> "VerifyReport":
        return verify_store(self.path, nonfinite=nonfinite)

    # Memory maps do not pickle (DataLoader workers): drop them; they re-open on first use.
    def __getstate__(self) -> dict:
        for shard in self._shards:
            shard.close()
        state = self.__dict__.copy()
        state["_open"] = collections.OrderedDict()
        return state

    def __repr__(self) -> str:
        m = self.manifest
        return (f"HiddenStateStore({str(self.path)!r}, samples={m.num_samples}, tokens={m.num_tokens}, "
                f"layer_ids={m.layer_ids}, dtype={m.dtype}, shards={len(m.shards)})")


def open(path: Path, dtype: torch.dtype = torch.float32) -> HiddenStateStore:  # noqa: A001 - draftsmith.store.open
    """Open a store for reading; hidden states come back as `dtype`. Cheap checks only (sizes, headers, counts)."""
    path = Path(path)
    if not path.is_dir():
        raise DraftsmithError(f"{path}: hidden-state store does not exist; run `draftsmith extract` first")
    if not (path / MANIFEST_NAME).is_file():
        raise DraftsmithError(f"{path}: not a hidden-state store (no {MANIFEST_NAME}); point at the output of "
                              "`draftsmith extract`")
    return HiddenStateStore(path, read_manifest(path, StoreManifest), dtype)


# --------------------------------------------------------------------------------------------------- verify, merge


class VerifyReport(BaseModel):
    """What `verify_store` found. `ok` is False on any damage or any non-finite token."""

    path: str
    ok: bool = True
    num_shards: int = 0
    num_samples: int = 0
    num_tokens: int = 0
    problems: list[str] = Field(default_factory=list)
    bad_shards: list[str] = Field(default_factory=list)
    orphans: list[str] = Field(default_factory=list)
    nonfinite_tokens: int = 0
    nonfinite_samples: list[int] = Field(default_factory=list, description="sample ids with a NaN/Inf state")
    repaired: list[str] = Field(default_factory=list)

    def __rich__(self) -> str:
        head = (f"[bold]{self.path}[/]: {self.num_shards} shards, {self.num_samples} samples, {self.num_tokens} tokens "
                f"- " + ("[green]OK[/]" if self.ok else "[red]PROBLEMS[/]"))
        lines = [head] + [f"  [red]x[/] {p}" for p in self.problems]
        if self.nonfinite_tokens:
            shown = ", ".join(map(str, self.nonfinite_samples[:20]))
            lines.append(f"  [red]x[/] {self.nonfinite_tokens} tokens with NaN/Inf hidden states in samples {shown}"
                         + (" ..." if len(self.nonfinite_samples) > 20 else ""))
        lines += [f"  [yellow]![/] orphan file {o} (not in the manifest; a later extract adopts or removes it)"
                  for o in self.orphans]
        lines += [f"  [yellow]repaired:[/] {r}" for r in self.repaired]
        return "\n".join(lines)


def _nonfinite_rows(shard: _ShardFile, dtype: StorageDtype, tokens: int, chunk: int = 4096) -> np.ndarray:
    """Per token: does any kept layer hold a NaN/Inf?"""
    bad = np.zeros(tokens, dtype=bool)
    for a in range(0, tokens, chunk):
        b = min(tokens, a + chunk)
        data = shard.view("hidden_states", a, b)
        if dtype == "fp8":
            rows = ~torch.isfinite(data.to(torch.float32)).all(dim=(1, 2))
            rows |= ~torch.isfinite(shard.view("hidden_scales", a, b)).all(dim=1)
        else:
            rows = ~torch.isfinite(data).all(dim=(1, 2))
        bad[a:b] = rows.numpy()
    shard.close()
    return bad


def verify_store(path: Path, *, nonfinite: bool = True, repair: bool = False) -> VerifyReport:
    """Re-hash every shard, re-check the manifest's counts and ranges, find NaN/Inf tokens.

    `repair=True` removes damaged or missing shards from the manifest (and deletes their files), so that running
    extract again recomputes exactly their samples.
    """
    path = Path(path)
    if not (path / MANIFEST_NAME).is_file():
        raise DraftsmithError(f"{path}: not a hidden-state store (no {MANIFEST_NAME})")
    manifest = read_manifest(path, StoreManifest)
    spec = manifest.spec()
    report = VerifyReport(path=str(path), num_shards=len(manifest.shards))
    seen: dict[int, str] = {}
    good: list[ShardInfo] = []
    for info in manifest.shards:
        file = path / info.file
        try:
            if not file.is_file():
                raise DraftsmithError(f"{info.file}: missing")
            if sha256_file(file) != info.sha256:
                raise DraftsmithError(f"{info.file}: sha256 does not match the manifest (damaged or replaced)")
            shard = _ShardFile(file, expected_bytes=info.num_bytes)
            ids, tokens = _check_shard_file(shard, spec)
            if len(ids) != info.num_samples or tokens != info.num_tokens or _ranges(ids) != [
                    tuple(r) for r in info.sample_ranges]:
                raise DraftsmithError(f"{info.file}: holds {len(ids)} samples / {tokens} tokens, manifest says "
                                      f"{info.num_samples} / {info.num_tokens} with other sample ids")
        except DraftsmithError as err:
            report.problems.append(str(err).replace(str(path) + "/", ""))
            report.bad_shards.append(info.file)
            continue
        for i in ids:
            if i in seen:
                report.problems.append(f"sample {i} is in both {seen[i]} and {info.file}")
            seen[i] = info.file
        good.append(info)
        report.num_samples += len(ids)
        report.num_tokens += tokens
        if nonfinite:
            rows = _nonfinite_rows(shard, manifest.dtype, tokens)
            if rows.any():
                offsets = shard.read("offsets").numpy()
                per_sample = np.add.reduceat(rows, offsets[:-1]) if len(rows) else np.zeros(0)
                report.nonfinite_tokens += int(rows.sum())
                report.nonfinite_samples += [ids[k] for k in np.nonzero(per_sample)[0]]
    if not report.bad_shards and (manifest.num_samples != report.num_samples or manifest.num_tokens != report.num_tokens):
        report.problems.append(f"manifest totals {manifest.num_samples} samples / {manifest.num_tokens} tokens, shards "
                               f"hold {report.num_samples} / {report.num_tokens}")
    listed = {Path(s.file).name for s in manifest.shards}
    if (path / SHARD_DIR).is_dir():
        report.orphans = sorted(p.name for p in (path / SHARD_DIR).iterdir()
                                if p.name not in listed and p.name.endswith(".safetensors"))
    report.nonfinite_samples.sort()
    if repair and (report.bad_shards or report.problems):
        with file_lock(path / LOCK_DIR / "manifest.lock"):
            current = read_manifest(path, StoreManifest)
            keep = [s for s in current.shards if s.file not in report.bad_shards]
            current.shards = keep
            current.num_samples = sum(s.num_samples for s in keep)
            current.num_tokens = sum(s.num_tokens for s in keep)
            write_manifest(path, current)
        for bad in report.bad_shards:
            (path / bad).unlink(missing_ok=True)
            report.repaired.append(f"dropped {bad}; run extract again on this store to recompute its samples")
    report.ok = not report.problems and report.nonfinite_tokens == 0
    return report


def merge_stores(inputs: Sequence[Path], output: Path, *, link: bool = True) -> HiddenStateStore:
    """Join stores of the same kind (e.g. written by `extract --shard i/n` workers) into a new store at `output`.

    Shard files are hard-linked when possible (they are never modified in place) and copied otherwise; copies are
    checked against the recorded sha256. Refuses stores of different targets / prepared sets / layers / dtype,
    and overlapping sample ids. The merged store is built beside `output` and renamed into place when complete.
    """
    inputs = [Path(p) for p in inputs]
    output = Path(output)
    if not inputs:
        raise DraftsmithError("store merge: give at least one input store")
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise DraftsmithError(f"{output}: already exists; merge into a new directory")
    if output.resolve() in {p.resolve() for p in inputs}:
        raise DraftsmithError(f"{output}: is also an input; merge into a new directory")
    manifests = []
    for p in inputs:
        if not (p / MANIFEST_NAME).is_file():
            raise DraftsmithError(f"{p}: not a hidden-state store (no {MANIFEST_NAME})")
        manifests.append(read_manifest(p, StoreManifest))
    first = manifests[0]
    for p, m in zip(inputs[1:], manifests[1:]):
        diff = first.spec().mismatch(m.spec())
        if diff:
            raise DraftsmithError(f"{p}: cannot merge with {inputs[0]}: {diff}")
    owner: dict[int, Path] = {}
    for p, m in zip(inputs, manifests):
        for i in sorted(m.sample_ids()):
            if i in owner:
                raise DraftsmithError(f"{p}: sample {i} is also in {owner[i]}; stores to merge must hold disjoint "
                                      "samples (use the same --shard i/n split for every worker)")
            owner[i] = p
    shards: list[ShardInfo] = []
    try:
        with atomic_dir(output) as tmp:
            (tmp / SHARD_DIR).mkdir()
            (tmp / LOCK_DIR).mkdir()
            for k, (p, m) in enumerate(zip(inputs, manifests)):
                for info in m.shards:
                    src = p / info.file
                    name = f"part-merged{k}-{len(shards):06d}.safetensors"
                    dst = tmp / SHARD_DIR / name
                    if not src.is_file() or src.stat().st_size != info.num_bytes:
                        raise DraftsmithError(f"{src}: missing or of the wrong size; run `draftsmith store verify` on {p}")
                    linked = False
                    if link:
                        with contextlib.suppress(OSError):
                            os.link(src, dst)
                            linked = True
                    if not linked:
                        shutil.copyfile(src, dst)
                        if sha256_file(dst) != info.sha256:
                            raise DraftsmithError(f"{src}: sha256 does not match its manifest (damaged shard); run "
                                                  f"`draftsmith store verify --repair` on {p}")
                    shards.append(info.model_copy(update={"file": f"{SHARD_DIR}/{name}"}))
            merged = StoreManifest(**first.spec().model_dump(), shards=shards,
                                   num_samples=sum(s.num_samples for s in shards),
                                   num_tokens=sum(s.num_tokens for s in shards),
                                   backend_info={**first.backend_info, "merged_from": [str(p) for p in inputs]})
            write_manifest(tmp, merged)
    except OSError as err:
        raise _os_error(output, err) from None
    return open(output)


def bytes_per_token(spec_or_manifest: StoreSpec) -> float:
    """Storage bytes of one token's states (both dtypes; ids, mask and offsets excluded)."""
    L, H = len(spec_or_manifest.layer_ids), spec_or_manifest.hidden_size
    return float(L * H * 2) if spec_or_manifest.dtype == "bf16" else float(L * H + 4 * L)


__all__ = ["StoreSpec", "StoreManifest", "ShardInfo", "PreparedRef", "StoreWriter", "HiddenStateStore", "VerifyReport",
           "create_or_resume", "open", "verify_store", "merge_stores", "prepared_ref", "encode_hidden_states",
           "decode_hidden_states", "worker_tag", "bytes_per_token", "builtins"]
