"""What a store is: the spec two writers must agree on, the manifest, the shard records, and the layout's names."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import sha256_bytes
from draftsmith.core.manifest import MANIFEST_NAME, Manifest, TargetIdentity, read_manifest

if TYPE_CHECKING:
    from draftsmith.prepare.dataset import PreparedDataset

StorageDtype = Literal["bf16", "fp8"]
FORMAT_NAME = "draftsmith-store"
FORMAT_VERSION = 1
SHARD_DIR = "shards"
LOCK_DIR = ".locks"
DEFAULT_SHARD_BYTES = 256 << 20


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

    def mismatch(self, other: StoreSpec) -> str | None:
        """The first difference that makes states incompatible (paths alone may differ), or None."""
        diff = self.target.mismatch(other.target)
        if diff:
            return f"target {diff}"
        if (self.prepared is None) != (other.prepared is None) or (
            self.prepared and other.prepared and self.prepared.fingerprint != other.prepared.fingerprint
        ):
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
    num_rows: int | None = Field(None, description="rows of states where samples share prefixes; None: num_tokens")
    sample_ranges: list[tuple[int, int]] = Field(description="sorted half-open [start, end) runs of sample ids")
    writer: str = Field("", description="tag of the writer that produced it (e.g. s0of4)")

    def describes(self, ids: list[int], num_tokens: int) -> bool:
        """The shard holds what this record says: these sample ids and tokens."""
        ranges = [tuple(r) for r in self.sample_ranges]
        return len(ids) == self.num_samples and num_tokens == self.num_tokens and sample_ranges(ids) == ranges


class StoreManifest(StoreSpec, Manifest):
    """A store: what it holds (StoreSpec fields), how much, and where (shards)."""

    kind: str = "store"
    format_version: int = FORMAT_VERSION
    num_samples: int = 0
    num_tokens: int = 0
    shards: list[ShardInfo] = Field(default_factory=list)
    backend_info: dict[str, JsonValue] = Field(default_factory=dict, description="engine details (not compared)")

    def spec(self) -> StoreSpec:
        return StoreSpec.model_validate(self.model_dump(include=set(StoreSpec.model_fields)))

    def sample_ids(self) -> set[int]:
        return {i for s in self.shards for a, b in s.sample_ranges for i in range(a, b)}


def read_store_manifest(path: Path, hint: str = "") -> StoreManifest:
    """The manifest of the store at `path`; one line (ending with `hint`) where it holds none."""
    if not (path / MANIFEST_NAME).is_file():
        raise DraftsmithError(f"{path}: not a hidden-state store (no {MANIFEST_NAME}){hint}")
    return read_manifest(path, StoreManifest)


def prepared_ref(dataset: PreparedDataset) -> PreparedRef:
    """Identity of a prepared set that survives copying it elsewhere."""
    m = dataset.manifest
    data = {
        "shards": [s.sha256 for s in m.shards],
        "num_samples": m.num_samples,
        "target": m.target.config_hash,
        "tokenizer": m.target.tokenizer_hash,
        "chat_template_hash": getattr(m, "chat_template_hash", ""),
    }
    return PreparedRef(
        path=str(Path(dataset.path).resolve()),
        fingerprint=sha256_bytes(json.dumps(data).encode()),
        num_samples=m.num_samples,
        chat_template_hash=getattr(m, "chat_template_hash", ""),
    )


def bytes_per_token(spec_or_manifest: StoreSpec) -> float:
    """Storage bytes of one token's states (both dtypes; ids, mask and offsets excluded)."""
    L, H = len(spec_or_manifest.layer_ids), spec_or_manifest.hidden_size
    return float(L * H * 2) if spec_or_manifest.dtype == "bf16" else float(L * H + 4 * L)


def sample_ranges(ids: Sequence[int]) -> list[tuple[int, int]]:
    """Sample ids -> sorted half-open [start, end) runs (the form `ShardInfo.sample_ranges` records)."""
    out: list[tuple[int, int]] = []
    for i in sorted(int(x) for x in ids):
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out
