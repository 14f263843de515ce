"""Reading a store: random access to its samples, in sample-id order, in float32, bf16 or the storage dtype.

`open` checks cheaply (every shard present with its recorded size, headers, dtypes, shapes, sample ids and counts
against the manifest); a shard's sha256 is checked on the first read of its data in a process (a flipped byte is
refused naming the shard, and reading stays a view of the page cache after that); `verify_store` checks all of it.
The reader is plain data (the manifest, a few numpy index arrays and one `TensorFile` per shard), so it pickles
into DataLoader workers; each process opens the shard files itself on first read (draftsmith.core.tensorfile).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.manifest import MANIFEST_NAME
from draftsmith.core.tensorfile import Samples, TensorFile
from draftsmith.extract.store import shards
from draftsmith.extract.store.codec import TORCH_DTYPES, decode_hidden_states
from draftsmith.extract.store.schema import StoreManifest, read_store_manifest
from draftsmith.extract.store.verify import VerifyReport, verify_store


class HiddenStateStore(Samples):
    """Random access to a store, samples in sample-id order.

    `store[i]` -> {"input_ids": LongTensor[T], "loss_mask": BoolTensor[T], "hidden_states": Tensor[T, L, H],
    "sample_id": int}. hidden_states come as `dtype`; with `dtype=None` as stored (`storage_dtype`: bf16, or
    float8_e4m3fn with its per-row scales as "hidden_scales": f32 [T, L]; `decode_hidden_states` turns them into
    floats on any device). Tensors in the storage dtype are views of the shard files: copy before changing them.
    `lengths` / `sample_ids` are numpy int64 arrays read without touching any state. A sample that shares a prefix
    with another (shards.py) is read whole: its parent's first rows, then its own.
    """

    what = "a store"

    def __init__(self, path: Path, manifest: StoreManifest, dtype: torch.dtype | None = torch.float32):
        self.path = Path(path)
        self.manifest = manifest
        self.dtype = dtype
        spec = manifest.spec()
        self._shards: list[TensorFile] = []
        ids, owner, starts, lengths, rows, parents, shared = [], [], [], [], [], [], []
        for k, info in enumerate(manifest.shards):
            shard, index = shards.open_shard(self.path / info.file, spec, info.num_bytes, info.sha256)
            if not info.describes(index.sample_ids, index.num_tokens):
                raise shard.error("holds other samples than the manifest says (damaged store)")
            self._shards.append(shard)
            ids.extend(index.sample_ids)
            owner.append(np.full(len(index.sample_ids), k, dtype=np.int64))
            starts.append(index.offsets[:-1])
            lengths.append(np.diff(index.offsets))
            rows.append(index.rows[:-1])
            parents.append(index.parents)
            shared.append(index.shared)
        order = np.argsort(np.asarray(ids, dtype=np.int64), kind="stable")
        self.sample_ids = np.asarray(ids, dtype=np.int64)[order]
        if len(self.sample_ids) and bool((np.diff(self.sample_ids) == 0).any()):
            dup = int(self.sample_ids[:-1][np.diff(self.sample_ids) == 0][0])
            raise DraftsmithError(
                f"{self.path}: sample {dup} is in two shards (damaged store); run `draftsmith store verify --repair`"
            )

        def joined(parts: list[np.ndarray]) -> np.ndarray:
            return (np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64))[order]

        self.lengths = joined(lengths)
        self._owner = joined(owner)  # which shard holds sample i
        self._start = joined(starts)  # its first token there
        self._row, self._parent, self._shared = joined(rows), joined(parents), joined(shared)  # its own states
        orphans = np.setdiff1d(self._parent[self._parent >= 0], self.sample_ids)
        if len(orphans):
            raise DraftsmithError(
                f"{self.path}: sample {int(orphans[0])}, whose states others share, is not in the store (damaged "
                "store); run `draftsmith store verify --repair` and extract again"
            )
        if len(self.sample_ids) != manifest.num_samples or int(self.lengths.sum()) != manifest.num_tokens:
            raise DraftsmithError(
                f"{self.path}/{MANIFEST_NAME}: totals do not match its shards (damaged manifest); "
                "run `draftsmith store verify --repair`"
            )

    @property
    def layer_ids(self) -> list[int]:
        return list(self.manifest.layer_ids)

    @property
    def aux_layer_ids(self) -> list[int]:
        return list(self.manifest.layer_ids[:-1])

    @property
    def num_tokens(self) -> int:
        return self.manifest.num_tokens

    @property
    def storage_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.manifest.dtype]

    def __len__(self) -> int:
        return len(self.sample_ids)

    def index_of(self, sample_id: int) -> int:
        """Position of a sample id in this store (KeyError when absent)."""
        k = int(np.searchsorted(self.sample_ids, sample_id))
        if k == len(self.sample_ids) or int(self.sample_ids[k]) != sample_id:
            raise KeyError(f"sample {sample_id} is not in store {self.path}")
        return k

    def prefixes(self) -> tuple[np.ndarray, np.ndarray]:
        """(parent [N]: the position of the sample whose first rows each sample shares, -1 for none; shared [N]: how
        many), in this store's sample order."""
        parent = np.full(len(self), -1, dtype=np.int64)
        has = self._parent >= 0
        parent[has] = np.searchsorted(self.sample_ids, self._parent[has])
        return parent, np.where(has, self._shared, 0)

    def sample(self, i: int, start: int = 0) -> dict:
        """Sample i; with `start`, its hidden states (and scales) from position `start` on only (a tree-packed batch
        reads the rows before it from an ancestor: train/packing.py)."""
        a = int(self._start[i])
        rows = self._rows(i, start)
        data, scales = rows["hidden_states"], rows.get("hidden_scales")
        item = {
            "input_ids": rows["input_ids"].long(),
            "loss_mask": self._shards[self._owner[i]].rows("loss_mask", a, a + int(self.lengths[i])),
            "hidden_states": data if self.dtype is None else decode_hidden_states(data, scales, self.dtype),
            "sample_id": int(self.sample_ids[i]),
        }
        if self.dtype is None and scales is not None:
            item["hidden_scales"] = scales
        return item

    def _rows(self, i: int, start: int = 0) -> dict[str, torch.Tensor]:
        """Sample i's token ids and states (and fp8 scales) as stored, its prefix's from its ancestors' rows; states
        from position `start` on only."""
        states = ["hidden_states"] + (["hidden_scales"] if self.manifest.dtype == "fp8" else [])
        pieces: list[list[torch.Tensor]] = []
        k, stop = i, int(self.lengths[i])
        for _ in range(len(self)):  # a parent cycle (a damaged store) ends here
            row, shared = int(self._row[k]), int(self._shared[k])
            if stop > shared:  # its tokens shared..stop-1 are rows row.. of its shard
                shard, skip = self._shards[self._owner[k]], max(start - shared, 0)
                ids = shard.rows("input_ids", row, row + stop - shared)
                pieces.append([ids, *(shard.rows(n, row + skip, row + stop - shared) for n in states)])
                stop = shared
            if stop == 0:
                parts = [torch.cat(p[::-1]) if len(p) > 1 else p[0] for p in zip(*pieces, strict=True)]
                return dict(zip(["input_ids", *states], parts, strict=True))
            k = self.index_of(int(self._parent[k]))
        raise DraftsmithError(f"{self.path}: sample {int(self.sample_ids[i])}'s prefixes form a cycle (damaged store)")

    def verify(self, nonfinite: bool = True) -> VerifyReport:
        return verify_store(self.path, nonfinite=nonfinite)

    def __repr__(self) -> str:
        m = self.manifest
        return (
            f"HiddenStateStore({str(self.path)!r}, samples={m.num_samples}, tokens={m.num_tokens}, "
            f"layer_ids={m.layer_ids}, dtype={m.dtype}, shards={len(m.shards)})"
        )


def open(path: Path, dtype: torch.dtype | None = torch.float32) -> HiddenStateStore:  # noqa: A001 - store.open
    """Open a store for reading (cheap checks only: see the module); hidden states come back as `dtype`, or as
    stored with `dtype=None`."""
    path = Path(path)
    if not path.is_dir():
        raise DraftsmithError(f"{path}: hidden-state store does not exist; run `draftsmith extract` first")
    return HiddenStateStore(path, read_store_manifest(path, "; point at the output of `draftsmith extract`"), dtype)
