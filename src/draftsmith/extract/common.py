"""What every extraction backend shares: checking inputs, choosing this worker's samples, batching by length,
resuming, a background store writer, the progress bar and the summary. Nothing here knows about an engine.

A backend's `run(cfg)` reads like this::

    plan = common.plan_extraction(cfg)                       # prepared set + target checked, layer ids, my samples
    spec = common.store_spec(plan, backend="vllm", compute_dtype="bfloat16")
    with common.open_writer(plan, spec) as writer:           # create or resume; refuses a store of another kind
        todo = common.pending_sample_ids(plan, writer)       # my samples minus those already in the store
        with common.BackgroundWriter(writer) as sink, common.progress_bar(...) as bar:
            for batch in ...: sink.submit([(sample_id, input_ids, loss_mask, hidden_states[T, L, H]), ...])
    return common.result(plan, writer, seconds, tokens=..., skipped=..., backend=..., work_seconds=...)
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from pydantic import BaseModel, JsonValue
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from draftsmith.config import (
    ExtractConfig,
    StageResult,
    parse_shard,
    save_resolved_config,
)
from draftsmith.core import sizing
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.layers import resolve_layer_ids
from draftsmith.core.manifest import TargetIdentity, read_manifest
from draftsmith.core.targets import resolve_target, target_identity
from draftsmith.extract import store as store_module
from draftsmith.extract.spool.chunks import free_bytes
from draftsmith.extract.store.codec import encode_hidden_states, encode_layers_fp8
from draftsmith.prepare.dataset import PreparedDataset, open_prepared


@dataclass
class ExtractionPlan:
    """The checked inputs of one extraction worker."""

    cfg: ExtractConfig
    dataset: PreparedDataset
    target_dir: Path
    target: TargetIdentity
    layer_ids: list[int]  # aux ids, then N
    sample_ids: list[int]  # this worker's slice of the prepared set
    worker: tuple[int, int]
    lengths: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0, np.int64))  # of the whole set

    @property
    def num_layers(self) -> int:
        return self.target.num_layers


MIN_SHARED = 256  # a shorter prefix is computed again: batching samples beats running one sample at a time


def chains(
    prefixes: tuple[np.ndarray, ...], lengths: np.ndarray, ids: Iterable[int]
) -> list[list[tuple[int, int, int]]]:
    """The samples `ids` in prefix order (`PreparedDataset.prefixes`), as runs in which each sample shares at least
    MIN_SHARED tokens with the one before it: (sample id, parent, shared), the first of a run (id, -1, 0). A sample
    keeps one token of its own (a duplicate's states are its last token's). Its parent is the run's first sample
    holding those `shared` tokens, so samples branching from one prefix depend on it, not on each other (vLLM runs
    them side by side)."""
    order, _, shared = prefixes
    keep = np.zeros(len(order), dtype=bool)
    keep[list(ids)] = True
    runs: list[list[tuple[int, int, int]]] = []
    back: list[int] = []  # per sample of the last run: the position of its parent
    common = 0  # the prefix the last kept sample shares with every sample since
    for i in order.tolist():
        common = min(common, int(shared[i]))
        if keep[i]:
            if runs and common >= MIN_SHARED:
                run, n = runs[-1], min(common, int(lengths[i]) - 1)
                p = len(run) - 1  # back over samples that share at least n with the ones after them
                while p > 0 and run[p][2] >= n:
                    p = back[p]
                run.append((i, run[p][0], n))
                back.append(p)
            else:
                runs.append([(i, -1, 0)])
                back = [0]
            common = 1 << 62
    return runs


def select_sample_ids(
    num_samples: int,
    shard: str | tuple[int, int],
    max_samples: int | None = None,
    prefixes: tuple[np.ndarray, ...] | None = None,
    lengths: np.ndarray | None = None,
) -> list[int]:
    """Worker i of n takes every n-th sample id starting at i, among the first `max_samples`; with `prefixes`, every
    n-th run of `chains` (cut into n pieces where longer), so a worker stores the prefixes its samples share."""
    i, n = parse_shard(shard) if isinstance(shard, str) else shard
    total = num_samples if max_samples is None else min(num_samples, max_samples)
    if prefixes is None or lengths is None:
        return list(range(i, total, n))
    cap = -(-total // n)
    pieces = [
        [s[0] for s in run[a : a + cap]]
        for run in chains(prefixes, lengths, range(total))
        for a in range(0, len(run), cap)
    ]
    return sorted(k for piece in sorted(pieces, key=min)[i::n] for k in piece)


def plan_extraction(cfg: ExtractConfig) -> ExtractionPlan:
    """Open the prepared set, find the target and check they belong together; pick this worker's samples."""
    dataset = open_prepared(cfg.prepared)
    made_for = dataset.manifest.target
    if cfg.target is not None:
        target_dir = resolve_target(cfg.target)
    else:
        target_dir = Path(made_for.path)
        if not (target_dir / "config.json").is_file():
            raise DraftsmithError(
                f"{cfg.prepared}: was made for target {made_for.path}, which is no longer there; "
                "pass --target with that model's new location"
            )
    identity = target_identity(target_dir)
    diff = made_for.mismatch(identity)
    if diff:
        raise DraftsmithError(
            f"{cfg.prepared}: was prepared for another target or tokenizer than {target_dir} "
            f"({diff}); run `draftsmith prepare --target {target_dir}` or pass the --target it was "
            "made for"
        )
    layer_ids = resolve_layer_ids(cfg.aux_layer_ids, identity.num_layers)
    lengths = np.asarray(dataset.lengths, dtype=np.int64)
    return ExtractionPlan(
        cfg=cfg,
        dataset=dataset,
        target_dir=target_dir,
        target=identity,
        layer_ids=layer_ids,
        sample_ids=select_sample_ids(len(dataset), cfg.shard, cfg.max_samples, dataset.prefixes, lengths),
        worker=parse_shard(cfg.shard),
        lengths=lengths,
    )


def store_spec(plan: ExtractionPlan, *, backend: str, compute_dtype: str) -> store_module.StoreSpec:
    return store_module.StoreSpec(
        target=plan.target,
        prepared=store_module.prepared_ref(plan.dataset),
        layer_ids=plan.layer_ids,
        hidden_size=plan.target.hidden_size,
        dtype=plan.cfg.dtype,
        backend=backend,
        compute_dtype=compute_dtype,
    )


def open_writer(
    plan: ExtractionPlan, spec: store_module.StoreSpec, backend_info: dict[str, JsonValue] | None = None
) -> store_module.StoreWriter:
    """Create or resume the output store as this worker; then save the resolved config beside it."""
    writer = store_module.create_or_resume(
        plan.cfg.output,
        spec,
        worker=plan.worker,
        shard_bytes=int(plan.cfg.shard_size_mb * (1 << 20)),
        backend_info=backend_info,
    )
    try:
        save_resolved_config(plan.cfg, plan.cfg.output)
    except BaseException:
        writer.abort()
        raise
    return writer


def pending_sample_ids(plan: ExtractionPlan, writer: store_module.StoreWriter) -> list[int]:
    done = writer.done_sample_ids()
    return [i for i in plan.sample_ids if i not in done]


def check_disk_space(
    plan: ExtractionPlan, spec: store_module.StoreSpec, sample_ids: Sequence[int], shared: int = 0
) -> int:
    """Refuse, in one line and before any engine starts, a store the output's disk cannot hold; returns the bytes
    the pending samples will take (core/sizing.py), `shared` of their tokens' states stored by their prefixes."""
    tokens = int(sum(int(plan.lengths[i]) for i in sample_ids)) - shared
    needed = sizing.store_bytes(tokens, spec.hidden_size, len(spec.layer_ids), spec.dtype, samples=len(sample_ids))
    sizing.check_disk(
        needed,
        free_bytes(Path(plan.cfg.output).resolve()),
        where=f"--output {plan.cfg.output}",
        what=(
            f"the store of {len(sample_ids):,} samples ({tokens:,} tokens x {len(spec.layer_ids)} "
            f"layers x {spec.hidden_size} in {spec.dtype})"
        ),
    )
    return needed


def plan_batches(sample_ids: Sequence[int], lengths: np.ndarray, token_budget: int) -> list[list[int]]:
    """Longest first, then greedily as many as fit `token_budget` padded tokens (a longer sample goes alone).

    The plan depends only on the ids and lengths, so a resumed run (see `pending_batches`) forms the very same
    batches and computes bit-identical states.
    """
    order = sorted(sample_ids, key=lambda i: (-int(lengths[i]), i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * int(lengths[batches[-1][0]]) <= token_budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def pending_batches(batches: list[list[int]], done: set[int]) -> list[list[int]]:
    """The batch plan minus samples already stored (whole batches disappear; a partial one shrinks)."""
    out = [[i for i in b if i not in done] for b in batches]
    return [b for b in out if b]


def check_finite(writer: store_module.StoreWriter, item: tuple) -> None:
    """Stop at a sample whose hidden states hold a NaN/Inf, naming it and its layers (an fp8 item: its scales, which
    are non-finite exactly when a value was); the samples before it stay stored and the run resumes after a fix."""
    values = item[4] if len(item) > 4 and item[4] is not None else item[3]
    finite = torch.isfinite(values.float() if values.dtype.itemsize == 1 else values)
    if bool(finite.all()):
        return
    per_layer = finite.reshape(finite.shape[0], finite.shape[1], -1).all(dim=2).all(dim=0).tolist()
    layers = [layer for layer, ok in zip(writer.spec.layer_ids, per_layer, strict=False) if not ok]
    raise DraftsmithError(
        f"{writer.path}: sample {int(item[0])} has NaN/Inf hidden states (layer ids {layers}); "
        "the store keeps what was written before it. Check the target's weights or try "
        "--compute-dtype float32, then run the same command again to resume"
    )


class HostStates(NamedTuple):
    """Captured states [T, L, H] as they crossed to the host: the storage dtype's bytes where they were encoded
    before the copy (fp8, with `scales` [T, L]), else the states' own dtype; `ready` waits for an asynchronous
    copy (a CUDA event's synchronize), None when the bytes are there already."""

    data: torch.Tensor
    scales: torch.Tensor | None = None
    ready: Callable[[], object] | None = None


_copy_streams: dict[torch.device, torch.cuda.Stream] = {}


def to_host(layers: Sequence[torch.Tensor], storage: str) -> HostStates:
    """Captured layers (each [..., H]: [T, H] from an engine, [B, T, H] from a padded batch; one device; an engine
    may reuse their memory after this returns) into one HostStates [..., L, H] for a store of `storage` dtype
    ("fp8" or "bf16").

    On the CPU this is the copy out of the engine's buffers, and for fp8 the encoding too, in one pass
    (`encode_layers_fp8`). On a GPU the layers are stacked and, for fp8, encoded there (half the bytes cross),
    then copied into pinned host memory on a side stream without waiting: the next forward runs while they
    cross, and the writer's thread waits on `ready` before it reads them."""
    device = layers[0].device
    data, scales = encode_layers_fp8(list(layers)) if storage == "fp8" else (torch.stack(list(layers), dim=-2), None)
    if device.type != "cuda":
        return HostStates(data, scales)
    data = data if scales is not None else data.to(torch.bfloat16)
    stream = _copy_streams.setdefault(device, torch.cuda.Stream(device))
    stream.wait_stream(torch.cuda.current_stream(device))  # the states are complete before they are copied
    host_data = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
    host_scales = None if scales is None else torch.empty(scales.shape, dtype=scales.dtype, pin_memory=True)
    with torch.cuda.stream(stream):
        for src, dst in ((data, host_data), (scales, host_scales)):
            if src is not None and dst is not None:  # scales: both or neither
                dst.copy_(src, non_blocking=True)
                src.record_stream(stream)  # the caching allocator keeps them until the copy is done
        event = torch.cuda.Event()
        event.record(stream)
    return HostStates(host_data, host_scales, event.synchronize)


def _joined(writer: store_module.StoreWriter, item: tuple) -> tuple:
    """An item as the writer stores it. Its states may be a list of HostStates (a request whose prefill ran in
    several steps): they are joined here, in the writer's thread. An fp8 store's states that crossed unencoded are
    encoded here, once: check_finite then reads its scales (a row's scale is non-finite exactly when a value of it
    is) instead of every value, and the writer stores it as it is."""
    if isinstance(item[3], list):
        parts, one = item[3], len(item[3]) == 1
        data = parts[0].data if one else torch.cat([p.data for p in parts])
        scales = parts[0].scales if one or parts[0].scales is None else torch.cat([p.scales for p in parts])
        item = (*item[:3], data, scales, *item[5:])
    if writer.spec.dtype != "fp8" or (len(item) > 4 and item[4] is not None):
        return item
    data, scales = encode_hidden_states(item[3], "fp8")
    return (*item[:3], data, scales, *item[5:])  # (..., parent, shared) of a sample sharing a prefix


class BackgroundWriter:
    """Feeds a StoreWriter from a thread, so disk writes overlap the next forward pass.

    `submit(items, ready=None)` queues a batch of (sample_id, input_ids, loss_mask, hidden_states[T, L, H]),
    (..., hidden_states, scales) or (..., [HostStates, ...]); `ready` (e.g. a CUDA event's `synchronize`), and each
    HostStates' own, is called in the thread before the tensors are read. A shard is written only between submitted
    batches. An error in the thread (full disk, a sample with NaN/Inf states: `check_finite`) is raised again in the
    caller's thread at the next `submit` or at exit.
    """

    def __init__(self, writer: store_module.StoreWriter, max_pending: int = 2):
        self.writer = writer
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="draftsmith-store-writer", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if self._error is not None:
                continue
            items, ready = job
            try:
                if ready is not None:
                    ready()
                for item in items:
                    for part in item[3] if isinstance(item[3], list) else []:
                        if part.ready is not None:
                            part.ready()
                    item = _joined(self.writer, item)
                    check_finite(self.writer, item)
                    self.writer.add(*item, flush_if_full=False)
                self.writer.maybe_flush()
            except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
                self._error = err

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def submit(self, items: list[tuple], ready: Callable[[], object] | None = None) -> None:
        self._raise()
        self._queue.put((items, ready))

    def close(self) -> None:
        """Wait for everything queued to be handed to the writer (it still needs its own close/flush)."""
        self._queue.put(None)
        self._thread.join()
        self._raise()

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            with contextlib.suppress(Exception):
                self._error = self._error or RuntimeError("aborted")  # drop what is queued
                self._queue.put(None)
                self._thread.join()


def stage_line(stage: str) -> Callable[[str], None]:
    """`say(line)`: one line on stderr, prefixed with the stage's name."""
    return lambda line: print(f"{stage}: {line}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def progress_bar(
    total_tokens: int, description: str = "extract", enabled: bool = True
) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on stderr counting tokens, with tokens/s and ETA; yields `advance(tokens)`."""
    if not enabled:
        yield lambda n: None
        return

    class TokensPerSecond(ProgressColumn):
        def render(self, task) -> Text:
            speed = task.finished_speed or task.speed
            return Text(f"{speed:,.0f} tok/s" if speed else "- tok/s", style="progress.data.speed")

    columns = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        TokensPerSecond(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, console=Console(stderr=True), transient=False, speed_estimate_period=60) as progress:
        task = progress.add_task(description, total=total_tokens)
        yield lambda n: progress.advance(task, n)


class ExtractResult(BaseModel):
    """What one extraction run did, and what the store holds after it."""

    samples_this_run: int
    samples_already_stored: int
    tokens_this_run: int
    seconds: float  # the whole run
    work_seconds: float  # the extraction itself (engine start-up excluded): tokens/s counts these
    store_samples: int
    store_tokens: int
    store_bytes: int
    layer_ids: list[int]
    dtype: str
    worker: tuple[int, int]  # this worker is i of n
    backend: str  # which engine computed the states, on what
    engine_start_s: float | None = None
    recovered: list[str] = []  # what opening the store cleaned up or adopted

    def summary(self) -> dict[str, str | int | float]:
        """The table the CLI prints."""
        summary: dict[str, str | int | float] = {
            "samples this run": self.samples_this_run,
            "samples already stored": self.samples_already_stored,
            "tokens this run": self.tokens_this_run,
            "tokens/s": round(self.tokens_this_run / self.work_seconds, 1) if self.work_seconds > 0 else 0.0,
            "time (s)": round(self.seconds, 1),
            "extraction time (s)": round(self.work_seconds, 1),
            "store samples": self.store_samples,
            "store tokens": self.store_tokens,
            "bytes per token": round(self.store_bytes / self.store_tokens, 1) if self.store_tokens else 0.0,
            "layer ids": ",".join(map(str, self.layer_ids)),
            "dtype": self.dtype,
            "worker": f"{self.worker[0]}/{self.worker[1]}",
            "backend": self.backend,
        }
        if self.engine_start_s is not None:
            summary["engine start (s)"] = round(self.engine_start_s, 1)
        if self.recovered:
            summary["recovered"] = "; ".join(self.recovered)
        return summary


def result(
    plan: ExtractionPlan,
    writer: store_module.StoreWriter,
    seconds: float,
    *,
    tokens: int,
    skipped: int,
    backend: str,
    work_seconds: float | None = None,
    engine_start_s: float | None = None,
) -> StageResult[ExtractResult]:
    """The stage's result: this run's work and the store's totals."""
    manifest = read_manifest(plan.cfg.output, store_module.StoreManifest)
    done = ExtractResult(
        samples_this_run=writer.samples_written,
        samples_already_stored=skipped,
        tokens_this_run=tokens,
        seconds=seconds,
        work_seconds=seconds if work_seconds is None else work_seconds,
        store_samples=manifest.num_samples,
        store_tokens=manifest.num_tokens,
        store_bytes=sum(s.num_bytes for s in manifest.shards),
        layer_ids=manifest.layer_ids,
        dtype=manifest.dtype,
        worker=plan.worker,
        backend=backend,
        engine_start_s=engine_start_s,
        recovered=writer.recovered,
    )
    return StageResult(stage="extract", output=Path(plan.cfg.output), result=done, summary=done.summary())


class Timer:
    """Wall-clock seconds of a `with` block (0 until it has run)."""

    def __init__(self) -> None:
        self.start = 0.0
        self.seconds = 0.0

    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start
