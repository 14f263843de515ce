"""The hidden-state store: the target's kept layers per token, sharded; the only package that reads or writes it.

On disk (see docs/formats.md, "Hidden-state store")::

    manifest.json                         StoreManifest (kind "store"): target, prepared set, layer ids, dtype,
                                          counts, and every shard with its sha256, size and sample-id ranges
    config.yaml                           the resolved ExtractConfig of the last run that wrote here
    shards/part-s0of1-000000.safetensors  the states and their samples' ids, masks and offsets (shards.py)
    .locks/                               one lock file per writer (advisory flock; never data)

The modules, each on one idea: `schema` (spec, manifest, shard records), `codec` (bf16 / fp8 encoding),
`shards` (a shard file's bytes and checks), `writer` (crash-safe writers, several processes into one store,
recovery after crashes), `reader` (`open`, `HiddenStateStore`), `verify` (verify and repair), `merge`.
Shard files are read through `draftsmith.core.tensorfile`, as the prepared set's are.
"""

from __future__ import annotations

from draftsmith.core.manifest import read_manifest
from draftsmith.extract.store.codec import (
    FP8_MAX,
    decode_hidden_states,
    encode_hidden_states,
)
from draftsmith.extract.store.merge import absorb_store, merge_stores
from draftsmith.extract.store.reader import HiddenStateStore, open
from draftsmith.extract.store.schema import (
    PreparedRef,
    StoreManifest,
    StoreSpec,
    bytes_per_token,
    prepared_ref,
)
from draftsmith.extract.store.verify import verify_store
from draftsmith.extract.store.writer import StoreWriter, create_or_resume, stored_compute_dtype

__all__ = [
    "StoreSpec",
    "StoreManifest",
    "PreparedRef",
    "StoreWriter",
    "HiddenStateStore",
    "create_or_resume",
    "stored_compute_dtype",
    "open",
    "verify_store",
    "merge_stores",
    "absorb_store",
    "prepared_ref",
    "encode_hidden_states",
    "decode_hidden_states",
    "bytes_per_token",
    "FP8_MAX",
    "read_manifest",
]
