"""Checking a store end to end (`draftsmith store verify`): checksums, structure, counts, orphans, NaN/Inf states;
and repairing it by dropping damaged shards, so that extract recomputes exactly their samples."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel, Field

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import file_lock, sha256_file
from draftsmith.core.manifest import read_manifest, write_manifest
from draftsmith.core.tensorfile import TensorFile
from draftsmith.extract.store import shards
from draftsmith.extract.store.schema import (
    LOCK_DIR,
    SHARD_DIR,
    StorageDtype,
    StoreManifest,
    read_store_manifest,
)


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
        head = (
            f"[bold]{self.path}[/]: {self.num_shards} shards, {self.num_samples} samples, {self.num_tokens} tokens "
            f"- " + ("[green]OK[/]" if self.ok else "[red]PROBLEMS[/]")
        )
        lines = [head] + [f"  [red]x[/] {p}" for p in self.problems]
        if self.nonfinite_tokens:
            shown = ", ".join(map(str, self.nonfinite_samples[:20]))
            lines.append(
                f"  [red]x[/] {self.nonfinite_tokens} tokens with NaN/Inf hidden states in samples {shown}"
                + (" ..." if len(self.nonfinite_samples) > 20 else "")
            )
        lines += [
            f"  [yellow]![/] orphan file {o} (not in the manifest; a later extract adopts or removes it)"
            for o in self.orphans
        ]
        lines += [f"  [yellow]repaired:[/] {r}" for r in self.repaired]
        return "\n".join(lines)


def _nonfinite_rows(shard: TensorFile, dtype: StorageDtype, num_rows: int, chunk: int = 4096) -> np.ndarray:
    """Per row of states (a token's, or a shared prefix's token's once): does any kept layer hold a NaN/Inf?"""
    bad = np.zeros(num_rows, dtype=bool)
    for a in range(0, num_rows, chunk):
        b = min(num_rows, a + chunk)
        data = shard.rows("hidden_states", a, b)
        if dtype == "fp8":
            rows = ~torch.isfinite(data.to(torch.float32)).all(dim=(1, 2))
            rows |= ~torch.isfinite(shard.rows("hidden_scales", a, b)).all(dim=1)
        else:
            rows = ~torch.isfinite(data).all(dim=(1, 2))
        bad[a:b] = rows.numpy()
    return bad


def _orphaned_children(good: dict[str, shards.ShardIndex], report: VerifyReport) -> None:
    """A shard holding a sample whose prefix's sample is in no good shard is bad too (and so on, down the chains)."""
    while True:
        present = {i for index in good.values() for i in index.sample_ids}
        orphans = {f: p for f, ix in good.items() for p in ix.parents.tolist() if p >= 0 and p not in present}
        if not orphans:
            return
        for file, parent in orphans.items():
            report.problems.append(f"{file}: holds samples sharing the states of sample {parent}, which is lost")
            report.bad_shards.append(file)
            del good[file]


def verify_store(path: Path, *, nonfinite: bool = True, repair: bool = False) -> VerifyReport:  # noqa: C901 - one check per way a shard can be damaged
    """Re-hash every shard, re-check the manifest's counts and ranges, find NaN/Inf tokens.

    `repair=True` removes damaged or missing shards from the manifest (and deletes their files), so that running
    extract again recomputes exactly their samples.
    """
    path = Path(path)
    manifest = read_store_manifest(path)
    spec = manifest.spec()
    report = VerifyReport(path=str(path), num_shards=len(manifest.shards))
    seen: dict[int, str] = {}
    good: dict[str, shards.ShardIndex] = {}
    for info in manifest.shards:
        file = path / info.file
        try:
            if not file.is_file():
                raise DraftsmithError(f"{info.file}: missing")
            if sha256_file(file) != info.sha256:
                raise DraftsmithError(f"{info.file}: sha256 does not match the manifest (damaged or replaced)")
            shard, index = shards.open_shard(file, spec, info.num_bytes)
            ids, tokens = index.sample_ids, index.num_tokens
            if not info.describes(ids, tokens):
                shard.close()
                raise DraftsmithError(
                    f"{info.file}: holds {len(ids)} samples / {tokens} tokens, manifest says "
                    f"{info.num_samples} / {info.num_tokens} with other sample ids"
                )
        except DraftsmithError as err:
            report.problems.append(str(err).replace(str(path) + "/", ""))
            report.bad_shards.append(info.file)
            continue
        good[info.file] = index
        for i in ids:
            if i in seen:
                report.problems.append(f"sample {i} is in both {seen[i]} and {info.file}")
            seen[i] = info.file
        report.num_samples += len(ids)
        report.num_tokens += tokens
        if nonfinite:
            rows = _nonfinite_rows(shard, manifest.dtype, int(index.rows[-1]))
            if rows.any():
                per_sample = np.diff(np.concatenate([[0], np.cumsum(rows)])[index.rows])
                report.nonfinite_tokens += int(rows.sum())
                report.nonfinite_samples += [ids[k] for k in np.nonzero(per_sample)[0]]
        shard.close()
    _orphaned_children(good, report)
    if not report.bad_shards and (
        manifest.num_samples != report.num_samples or manifest.num_tokens != report.num_tokens
    ):
        report.problems.append(
            f"manifest totals {manifest.num_samples} samples / {manifest.num_tokens} tokens, shards "
            f"hold {report.num_samples} / {report.num_tokens}"
        )
    listed = {Path(s.file).name for s in manifest.shards}
    if (path / SHARD_DIR).is_dir():
        report.orphans = sorted(
            p.name for p in (path / SHARD_DIR).iterdir() if p.name not in listed and p.name.endswith(".safetensors")
        )
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
