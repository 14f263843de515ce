"""A store's shard files: their names, their bytes, and checking one against a store's spec.

A shard is a safetensors file holding many samples, concatenated (docs/formats.md, "Hidden-state store")::

    hidden_states  [T, L, H]  BF16, or F8_E4M3 with hidden_scales [T, L] F32
    input_ids      [T]        I32
    loss_mask      [T]        BOOL
    offsets        [S + 1]    I64   sample j is rows offsets[j]:offsets[j+1]
    sample_ids     [S]        I64
    __metadata__              format, format_version, spec_fingerprint, dtype, layer_ids, hidden_size

A shard whose samples share prefixes (extract's prefix chains) stores each sample's ids and states from its first
token not shared with its parent on: input_ids and hidden_states have R rows, sample j's rows
row_offsets[j]:row_offsets[j+1], and its first prefix_shared[j] are those of sample prefix_parents[j] (in any shard
of the store); loss_mask stays whole (T)::

    row_offsets    [S + 1]    I64
    prefix_parents [S]        I64   a sample id; -1 where prefix_shared is 0
    prefix_shared  [S]        I64

Files are read through `draftsmith.core.tensorfile.TensorFile`; every shard's bytes are written through
`_write_file`, straight from the tensors' memory (no bytes object of the whole shard), hashed as they are written.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from draftsmith.core.tensorfile import TensorFile
from draftsmith.extract.store.codec import SAFETENSORS_DTYPES
from draftsmith.extract.store.schema import FORMAT_NAME, FORMAT_VERSION, StoreSpec

SHARD_NAME = re.compile(r"^part-(?P<tag>[A-Za-z0-9_.-]+)-(?P<seq>\d{6,})\.safetensors$")
REMEDY = "run `draftsmith store verify --repair` and extract again to recompute its samples"


def shard_name(tag: str, seq: int) -> str:
    return f"part-{tag}-{seq:06d}.safetensors"


def _write_file(path: Path, pieces: Iterable[bytes | memoryview]) -> tuple[str, int]:
    """Write `pieces` one after another to `path`: the one place shard bytes reach the disk (tests simulate a full
    disk here). Returns the file's sha256 and size; each piece is hashed in a second thread while it is written
    (hashlib and the write both release the GIL), so the hash costs no time beside the write."""
    digest, size = hashlib.sha256(), 0
    with open(path, "wb") as f, ThreadPoolExecutor(1, thread_name_prefix="draftsmith-shard-hash") as hasher:
        hashing = None
        for piece in pieces:
            if hashing is not None:
                hashing.result()
            hashing = hasher.submit(digest.update, piece)
            f.write(piece)
            size += len(piece)
        if hashing is not None:
            hashing.result()
    return digest.hexdigest(), size


def shard_metadata(spec: StoreSpec) -> dict[str, str]:
    return {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "spec_fingerprint": spec.fingerprint(),
        "dtype": spec.dtype,
        "layer_ids": ",".join(map(str, spec.layer_ids)),
        "hidden_size": str(spec.hidden_size),
    }


# safetensors' dtype names and the order its writer lays tensors out in (its Dtype enum, largest first, then name)
_DTYPES = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int16: "I16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
}
_ORDER = list(_DTYPES.values())


def write_shard(path: Path, tensors: dict[str, torch.Tensor | list[torch.Tensor]], spec: StoreSpec) -> tuple[str, int]:
    """Write one shard (tensors as in the module docstring, on the CPU; a list stands for its parts concatenated on
    the first axis, written one after another rather than joined in memory) as a safetensors file at `path`, with
    the spec's metadata, laid out as `safetensors.torch.save` lays it out; returns (sha256, size in bytes)."""
    parts = {name: value if isinstance(value, list) else [value] for name, value in tensors.items()}
    ordered = sorted(parts.items(), key=lambda kv: (-_ORDER.index(_DTYPES[kv[1][0].dtype]), kv[0]))
    header: dict[str, object] = {"__metadata__": shard_metadata(spec)}
    views: list[memoryview] = []
    offset = 0
    for name, pieces in ordered:
        first = pieces[0]
        shape = [sum(int(p.shape[0]) for p in pieces), *first.shape[1:]] if first.dim() else []
        start = offset
        for piece in pieces:
            views.append(piece.detach().contiguous().view(-1).view(torch.uint8).numpy().data)
            offset += len(views[-1])
        header[name] = {"dtype": _DTYPES[first.dtype], "shape": shape, "data_offsets": [start, offset]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return _write_file(path, [struct.pack("<Q", len(text)) + text, *views])


class ShardIndex(NamedTuple):
    """What a checked shard holds: its sample ids (in its own order), their token offsets, their own states' row
    offsets, and the prefix each shares (parent sample id or -1, shared tokens)."""

    sample_ids: list[int]
    offsets: np.ndarray  # int64 [S + 1]
    rows: np.ndarray  # int64 [S + 1]: `offsets` where nothing is shared
    parents: np.ndarray  # int64 [S]
    shared: np.ndarray  # int64 [S]

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def num_rows(self) -> int | None:
        """Rows of states where a sample shares a prefix (ShardInfo.num_rows), else None."""
        return int(self.rows[-1]) if self.shared.any() else None


def check_shard(shard: TensorFile, spec: StoreSpec) -> ShardIndex:
    """Structure of a shard against a spec (metadata, dtypes, shapes, offsets, sample ids), or DraftsmithError."""
    if shard.metadata.get("format") != FORMAT_NAME or shard.metadata.get("spec_fingerprint") != spec.fingerprint():
        raise shard.error("not a shard of this store (different target, layers, dtype or data)")
    (S,) = shard.expect("sample_ids", "I64", (None,))
    shard.expect("offsets", "I64", (S + 1,))
    offsets = shard.read("offsets", verify=False).numpy()  # the index: the data's sha256 waits for its first read
    if S == 0 or int(offsets[0]) != 0 or bool((offsets[1:] <= offsets[:-1]).any()):
        raise shard.error("offsets are not increasing from 0 (damaged shard file)")
    rows, parents, shared = offsets, np.full(S, -1, np.int64), np.zeros(S, np.int64)
    if "row_offsets" in shard.tensors:
        names = ("row_offsets", "prefix_parents", "prefix_shared")
        for name, n in zip(names, (S + 1, S, S), strict=True):
            shard.expect(name, "I64", (n,))
        rows, parents, shared = (shard.read(name, verify=False).numpy() for name in names)
        own = np.diff(rows)
        if (
            int(rows[0]) != 0
            or (own <= 0).any()
            or (shared < 0).any()
            or (own + shared != np.diff(offsets)).any()
            or ((parents < 0) != (shared == 0)).any()
        ):
            raise shard.error("row offsets do not match the shared prefixes (damaged shard file)")
    T, R, L, H = int(offsets[-1]), int(rows[-1]), len(spec.layer_ids), spec.hidden_size
    shard.expect("hidden_states", SAFETENSORS_DTYPES[spec.dtype], (R, L, H))
    if spec.dtype == "fp8":
        shard.expect("hidden_scales", "F32", (R, L))
    shard.expect("input_ids", "I32", (R,))
    shard.expect("loss_mask", "BOOL", (T,))
    ids = shard.read("sample_ids", verify=False).tolist()
    if len(set(ids)) != len(ids):
        raise shard.error("a sample id appears twice (damaged shard file)")
    return ShardIndex(ids, offsets, rows, parents, shared)


def open_shard(
    path: Path, spec: StoreSpec, expected_bytes: int | None = None, sha256: str | None = None
) -> tuple[TensorFile, ShardIndex]:
    """A shard file and what it holds, checked against `spec` (`check_shard`; `expected_bytes`: its size in the
    manifest; `sha256`: its checksum there, checked on the first read of its data in a process); DraftsmithError
    when damaged, the file closed again."""
    shard = TensorFile(path, REMEDY, what="shard file", expected_bytes=expected_bytes, sha256=sha256)
    try:
        return shard, check_shard(shard, spec)
    except BaseException:
        shard.close()
        raise
