"""A store's shard files: their names, their bytes, and checking one against a store's spec.

A shard is a safetensors file holding many samples, concatenated (docs/formats.md, "Hidden-state store")::

    hidden_states  [T, L, H]  BF16, or F8_E4M3 with hidden_scales [T, L] F32
    input_ids      [T]        I32
    loss_mask      [T]        BOOL
    offsets        [S + 1]    I64   sample j is rows offsets[j]:offsets[j+1]
    sample_ids     [S]        I64
    __metadata__              format, format_version, spec_fingerprint, dtype, layer_ids, hidden_size

Files are read through `draftsmith.core.tensorfile.TensorFile`; every shard bytes are written through `_write_file`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from safetensors.torch import save

from draftsmith.core.tensorfile import TensorFile
from draftsmith.extract.store.codec import SAFETENSORS_DTYPES
from draftsmith.extract.store.schema import FORMAT_NAME, FORMAT_VERSION, StoreSpec

SHARD_NAME = re.compile(r"^part-(?P<tag>[A-Za-z0-9_.-]+)-(?P<seq>\d{6,})\.safetensors$")
REMEDY = "run `draftsmith store verify --repair` and extract again to recompute its samples"


def shard_name(tag: str, seq: int) -> str:
    return f"part-{tag}-{seq:06d}.safetensors"


def _write_file(path: Path, data: bytes | memoryview) -> None:
    """Write all of `data` to `path`: the one place shard bytes reach the disk (tests simulate a full disk here)."""
    with open(path, "wb") as f:
        f.write(data)


def shard_metadata(spec: StoreSpec) -> dict[str, str]:
    return {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "spec_fingerprint": spec.fingerprint(),
            "dtype": spec.dtype, "layer_ids": ",".join(map(str, spec.layer_ids)), "hidden_size": str(spec.hidden_size)}


def shard_bytes(tensors: dict[str, torch.Tensor], spec: StoreSpec) -> bytes:
    """The safetensors file of one shard (tensors as in the module docstring), with the spec's metadata."""
    return save({k: v.contiguous() for k, v in tensors.items()}, metadata=shard_metadata(spec))


def open_shard(path: Path, expected_bytes: int | None = None, sha256: str | None = None) -> TensorFile:
    """A shard file, header checked (`expected_bytes`: its size in the manifest; `sha256`: its checksum there,
    checked on the first read of its data in a process); DraftsmithError when damaged."""
    return TensorFile(path, REMEDY, what="shard file", expected_bytes=expected_bytes, sha256=sha256)


class ShardIndex(NamedTuple):
    """What a checked shard holds: its sample ids (in its own order) and their row offsets."""

    sample_ids: list[int]
    offsets: np.ndarray  # int64 [S + 1]

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])


def check_shard(shard: TensorFile, spec: StoreSpec) -> ShardIndex:
    """Structure of a shard against a spec (metadata, dtypes, shapes, offsets, sample ids), or DraftsmithError."""
    if shard.metadata.get("format") != FORMAT_NAME or shard.metadata.get("spec_fingerprint") != spec.fingerprint():
        raise shard.error("not a shard of this store (different target, layers, dtype or data)")
    (S,) = shard.expect("sample_ids", "I64", (None,))
    shard.expect("offsets", "I64", (S + 1,))
    offsets = shard.read("offsets", verify=False).numpy()  # the index: the data's sha256 waits for its first read
    if S == 0 or int(offsets[0]) != 0 or bool((offsets[1:] <= offsets[:-1]).any()):
        raise shard.error("offsets are not increasing from 0 (damaged shard file)")
    T, L, H = int(offsets[-1]), len(spec.layer_ids), spec.hidden_size
    shard.expect("hidden_states", SAFETENSORS_DTYPES[spec.dtype], (T, L, H))
    if spec.dtype == "fp8":
        shard.expect("hidden_scales", "F32", (T, L))
    shard.expect("input_ids", "I32", (T,))
    shard.expect("loss_mask", "BOOL", (T,))
    ids = shard.read("sample_ids", verify=False).tolist()
    if len(set(ids)) != len(ids):
        raise shard.error("a sample id appears twice (damaged shard file)")
    return ShardIndex(ids, offsets)
