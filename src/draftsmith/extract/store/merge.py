"""Joining stores of the same kind (`draftsmith store merge`), e.g. those of `extract --shard i/n` workers."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import _explain_os_error, atomic_dir, sha256_file
from draftsmith.core.manifest import read_manifest, write_manifest
from draftsmith.extract.store import reader
from draftsmith.extract.store.reader import HiddenStateStore
from draftsmith.extract.store.schema import (
    LOCK_DIR,
    SHARD_DIR,
    ShardInfo,
    StoreManifest,
    read_store_manifest,
)
from draftsmith.extract.store.shards import shard_name
from draftsmith.extract.store.writer import _add_shards, create_or_resume


def _place(src: Path, dst: Path, info: ShardInfo, store: Path, link: bool) -> None:
    """A shard file of `store` at `dst`: hard-linked when possible (shards are never modified in place), else copied
    and checked against its recorded sha256."""
    if not src.is_file() or src.stat().st_size != info.num_bytes:
        raise DraftsmithError(f"{src}: missing or of the wrong size; run `draftsmith store verify` on {store}")
    if link:
        with contextlib.suppress(OSError):
            os.link(src, dst)
            return
    shutil.copyfile(src, dst)
    if sha256_file(dst) != info.sha256:
        raise DraftsmithError(
            f"{src}: sha256 does not match its manifest (damaged shard); run "
            f"`draftsmith store verify --repair` on {store}"
        )


def merge_stores(inputs: Sequence[Path], output: Path, *, link: bool = True) -> HiddenStateStore:  # noqa: C901 - one check per way two stores can disagree
    """Join stores of the same kind (e.g. written by `extract --shard i/n` workers) into a new store at `output`,
    their shard files placed by `_place`. Refuses stores of different targets / prepared sets / layers / dtype,
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
    manifests = [read_store_manifest(p) for p in inputs]
    first = manifests[0]
    for p, m in zip(inputs[1:], manifests[1:], strict=False):
        diff = first.spec().mismatch(m.spec())
        if diff:
            raise DraftsmithError(f"{p}: cannot merge with {inputs[0]}: {diff}")
    owner: dict[int, Path] = {}
    for p, m in zip(inputs, manifests, strict=False):
        for i in sorted(m.sample_ids()):
            if i in owner:
                raise DraftsmithError(
                    f"{p}: sample {i} is also in {owner[i]}; stores to merge must hold disjoint "
                    "samples (use the same --shard i/n split for every worker)"
                )
            owner[i] = p
    shards: list[ShardInfo] = []
    try:
        with atomic_dir(output) as tmp:
            (tmp / SHARD_DIR).mkdir()
            (tmp / LOCK_DIR).mkdir()
            for k, (p, m) in enumerate(zip(inputs, manifests, strict=False)):
                for info in m.shards:
                    name = shard_name(f"merged{k}", len(shards))
                    _place(p / info.file, tmp / SHARD_DIR / name, info, p, link)
                    shards.append(info.model_copy(update={"file": f"{SHARD_DIR}/{name}"}))
            merged = StoreManifest(
                **first.spec().model_dump(),
                shards=shards,
                num_samples=sum(s.num_samples for s in shards),
                num_tokens=sum(s.num_tokens for s in shards),
                backend_info={**first.backend_info, "merged_from": [str(p) for p in inputs]},
            )
            write_manifest(tmp, merged)
    except OSError as err:
        raise _explain_os_error(output, err) from None
    return reader.open(output)


def absorb_store(store: Path, part: Path, tag: str) -> int:
    """Add the samples of store `part` (an online spool chunk) that `store` lacks to `store`, created with the part's
    spec when new: its shard files hard-linked (or copied), named after `tag`, then recorded in the manifest, so a
    crash in between leaves an orphan the next writer adopts. Returns the samples added."""
    manifest = read_manifest(part, StoreManifest)
    writer = create_or_resume(store, manifest.spec(), backend_info=manifest.backend_info)
    try:
        done, added = writer.done_sample_ids(), []
        for k, info in enumerate(manifest.shards):
            if any(i in done for a, b in info.sample_ranges for i in range(a, b)):
                continue
            name = shard_name(tag, k)
            dst = Path(store) / SHARD_DIR / name
            dst.unlink(missing_ok=True)
            _place(Path(part) / info.file, dst, info, Path(part), link=True)
            added.append(info.model_copy(update={"file": f"{SHARD_DIR}/{name}", "writer": tag}))
        if added:
            _add_shards(Path(store), added)
    except OSError as err:
        raise _explain_os_error(Path(store), err) from None
    finally:
        writer.close()
    return sum(i.num_samples for i in added)
