"""Where training batches come from: a token-budget sampler, a torch DataLoader over it, and the two feature sources.

Offline: the hidden-state store already holds the aux layers and layer N for every sample; it is read in its storage
dtype (bf16, or fp8 with per-row scales) as views of the shard files, padded once by `collate` (which also builds
the batch's `StepIndex` on the host) and decoded only on the device (`Batch.features`). Online: the target runs
inside the trainer (transformers) and the same layers are captured with forward hooks
(`draftsmith.core.capture.capture_hidden_states`); nothing touches the disk. Both produce the same `Batch`.

The DataLoader's sampler (`EpochPlan`) yields one key per micro-batch, epoch after epoch from a resume position;
its workers (`--num-workers`) read and collate ahead, into pinned memory on CUDA.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from draftsmith.core.capture import capture_hidden_states
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.tensorfile import Samples
from draftsmith.extract.store import HiddenStateStore, decode_hidden_states
from draftsmith.methods.objective import ALL_STEPS, Anchors, Draw
from draftsmith.train.blocks import block_index
from draftsmith.train.objective import Rows
from draftsmith.train.unrolled import step_index


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] int64, right-padded with 0
    loss_mask: torch.Tensor  # [B, T] bool, False on padding
    hidden_states: torch.Tensor | None  # [B, T, L, H] aux layers then layer N, as stored (None until the online
    #                                     target ran)
    hidden_scales: torch.Tensor | None  # [B, T, L] float32: fp8 stores' per-row scales, else None
    index: Rows  # the rows each TTT step (DFlash: block position) reads, built on the host by the objective
    sample_ids: list[int]
    lengths: list[int]
    epoch: int = 0  # where the sampler put it: epoch, optimizer step in the epoch, the epoch's last step
    position: int = 0
    last: bool = False

    @property
    def num_tokens(self) -> int:
        return int(sum(self.lengths))

    def _tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        hs, sc = self.hidden_states, self.hidden_scales
        return replace(
            self,
            input_ids=fn(self.input_ids),
            loss_mask=fn(self.loss_mask),
            hidden_states=None if hs is None else fn(hs),
            hidden_scales=None if sc is None else fn(sc),
            index=self.index.map(fn),
        )

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return self._tensors(lambda x: x.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:  # the DataLoader's pin-memory thread calls this
        return self._tensors(torch.Tensor.pin_memory)

    def features(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux layers concatenated in id order [B, T, (L-1) * H], layer N [B, T, H]) in `dtype`, decoded on the
        batch's device."""
        hs, sc = self.hidden_states, self.hidden_scales
        assert hs is not None  # filled in (online: by the source) before the states are read
        b, t, layers, h = hs.shape
        aux = decode_hidden_states(hs[:, :, :-1], None if sc is None else sc[:, :, :-1], dtype)
        last = decode_hidden_states(hs[:, :, -1], None if sc is None else sc[:, :, -1], dtype)
        return aux.reshape(b, t, (layers - 1) * h), last

    def finite(self) -> torch.Tensor:
        """[B] bool on the device (no host sync): the sample's stored hidden states hold no NaN/Inf (an fp8 row
        with a non-finite value has a non-finite scale)."""
        x = self.hidden_scales if self.hidden_scales is not None else self.hidden_states
        assert x is not None  # filled in before the states are read
        return torch.isfinite(x).flatten(1).all(1)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """fp8 tensors are copied and zeroed as bytes (not every fp8 kernel exists on every device)."""
    return x.view(torch.uint8) if x.dtype.itemsize == 1 and x.is_floating_point() else x


@dataclass(frozen=True)
class Sampling:
    """What a batch's index draws, as its method draws it (`DraftMethod.sampling`, methods/objective.py), and so the
    objective that scores it: the unrolled one's steps (every one, or P-EAGLE's COD), or the block one's anchors."""

    draw: Draw = ALL_STEPS

    def index(self, loss_mask: np.ndarray, ttt_steps: int, sample_ids: Sequence[int] = (), epoch: int = 0) -> Rows:
        if isinstance(self.draw, Anchors):  # `ttt_steps` aside: a block's proposals are its rows
            return block_index(loss_mask, self.draw, sample_ids, epoch)
        return step_index(loss_mask, ttt_steps, self.draw.cod, sample_ids, epoch)

    def for_evaluation(self) -> Sampling:
        """What an evaluation draws: every anchor at every depth; the same blocks every time (epoch 0)."""
        return self if isinstance(self.draw, Anchors) else EVERY_STEP


EVERY_STEP = Sampling()  # EAGLE-3's, Eagle 3.1's, and every evaluation's of the unrolled objective


def collate(items: Sequence[dict], ttt_steps: int, sampling: Sampling = EVERY_STEP, epoch: int = 0) -> Batch:
    """Right-pad samples to the longest (causal attention never lets a real position see the padding) and build
    the batch's index as its method's objective samples it (`sampling` of epoch `epoch`: P-EAGLE's COD, a block
    method's `Anchors`).
    Hidden states keep the dtype they come in; one sample is not copied at all."""
    lengths = [int(it["input_ids"].shape[0]) for it in items]
    t = max(lengths)
    ids_, mask = (pad_rows(items, key, t) for key in ("input_ids", "loss_mask"))
    assert ids_ is not None and mask is not None  # every sample has both
    input_ids, loss_mask = ids_.to(torch.int64), mask.bool()
    hs, sc = (pad_rows(items, key, t, copy=False) for key in ("hidden_states", "hidden_scales"))
    ids = [int(it["sample_id"]) for it in items]
    index = sampling.index(loss_mask.numpy(), ttt_steps, ids, epoch)
    return Batch(input_ids, loss_mask, hs, sc, index, ids, lengths)


def pad_rows(items: Sequence[dict], key: str, t: int, copy: bool = True) -> torch.Tensor | None:
    """items[i][key] ([T_i, ...]) right-padded with zeros to [B, t, ...] in their own dtype (None when absent); one
    item is not copied unless `copy`."""
    if key not in items[0]:
        return None
    first = items[0][key]
    if len(items) == 1 and first.shape[0] == t and not copy:
        return first[None]
    out = torch.empty((len(items), t, *first.shape[1:]), dtype=first.dtype)
    for i, it in enumerate(items):
        n = int(it[key].shape[0])
        _bytes(out[i, :n]).copy_(_bytes(it[key]))
        _bytes(out[i, n:]).zero_()
    return out


# ---------------------------------------------------------------------------------------------- sampling


class TokenBudgetSampler:
    """Deterministic per-epoch batches of dataset indices, each at most `token_budget` tokens once padded.

    Each epoch: shuffle (seed, epoch), sort by length inside windows (little padding, still random), pack greedily,
    shuffle the batch order, keep a multiple of world_size and give rank r every world_size-th batch. Batches are a
    pure function of (seed, epoch), so a resumed run sees exactly the batches an uninterrupted one would.
    """

    WINDOW = 512  # samples sorted together

    def __init__(
        self,
        indices: Sequence[int],
        lengths: np.ndarray,
        token_budget: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
    ):
        self.indices = np.asarray(indices, dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.token_budget, self.seed, self.shuffle = token_budget, seed, shuffle
        self.rank, self.world_size = rank, world_size
        if len(self.indices) == 0:
            raise DraftsmithError(
                "the training data set is empty (no samples after the held-out split); "
                "add data or lower --eval-fraction"
            )
        too_long = self.indices[self.lengths[self.indices] > token_budget]
        if len(too_long):
            i = int(too_long[0])
            raise DraftsmithError(
                f"sample {i} has {int(self.lengths[i])} tokens, more than --token-budget {token_budget} "
                f"({len(too_long)} such samples); raise --token-budget to at least {int(self.lengths.max())} "
                "or prepare the data with a smaller --max-length"
            )

    def batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of epoch `epoch`."""
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(self.indices) if self.shuffle else self.indices.copy()
        batches: list[list[int]] = []
        for w in range(0, len(order), self.WINDOW):
            window = order[w : w + self.WINDOW]
            window = window[np.argsort(-self.lengths[window], kind="stable")]
            current: list[int] = []
            longest = 0
            for i in window.tolist():
                n = int(self.lengths[i])
                if current and (len(current) + 1) * max(longest, n) > self.token_budget:
                    batches.append(current)
                    current, longest = [], 0
                current.append(i)
                longest = max(longest, n)
            if current:
                batches.append(current)
        if self.shuffle:
            batches = [batches[j] for j in rng.permutation(len(batches))]
        usable = len(batches) // self.world_size * self.world_size
        return batches[self.rank : usable : self.world_size]

    def steps_in(self, epoch: int, grad_accum: int) -> int:
        """Optimizer steps of an epoch: its micro-batches in groups of grad_accum, a smaller rest dropped."""
        return len(self.batches(epoch)) // grad_accum

    def collate(
        self, dataset: Samples | LayerSubset, ids: Sequence[int], ttt_steps: int, sampling: Sampling, epoch: int
    ) -> Batch:
        """One of its batches, laid out as it plans them: samples right-padded (`collate`; packing.TreeSampler: one
        tree-packed sequence)."""
        return collate([dataset[i] for i in ids], ttt_steps, sampling, epoch)


@dataclass(frozen=True)
class MicroBatchKey:
    ids: tuple[int, ...]
    epoch: int
    position: int  # the optimizer step of the epoch
    last: bool  # the epoch's last step


class EpochPlan(Sampler):
    """The run's micro-batches from (epoch, position) on, epoch after epoch (`epochs` None: no end): grad_accum
    per optimizer step, each epoch's rest of fewer than grad_accum dropped."""

    def __init__(
        self, sampler: TokenBudgetSampler, grad_accum: int, epoch: int = 0, position: int = 0, epochs: int | None = None
    ):
        self.sampler, self.grad_accum, self.start, self.epochs = sampler, grad_accum, (epoch, position), epochs

    def __iter__(self) -> Iterator[MicroBatchKey]:
        (epoch, position), empty = self.start, 0
        while (self.epochs is None or epoch < self.epochs) and empty < 100:
            batches = self.sampler.batches(epoch)
            n = len(batches) // self.grad_accum
            empty = 0 if n else empty + 1
            for p in range(position, n):
                for j in range(self.grad_accum):
                    yield MicroBatchKey(tuple(batches[p * self.grad_accum + j]), epoch, p, p == n - 1)
            epoch, position = epoch + 1, 0


class MicroBatches(Dataset):
    """dataset + ttt_steps -> batches by MicroBatchKey, collated as their sampler lays them out (what the
    DataLoader's workers run)."""

    def __init__(
        self,
        dataset: Samples | LayerSubset,
        ttt_steps: int,
        sampler: TokenBudgetSampler,
        sampling: Sampling = EVERY_STEP,
    ):
        self.dataset, self.ttt_steps, self.sampler, self.sampling = dataset, ttt_steps, sampler, sampling

    def __getitem__(self, key: MicroBatchKey) -> Batch:
        batch = self.sampler.collate(self.dataset, key.ids, self.ttt_steps, self.sampling, key.epoch)
        return replace(batch, epoch=key.epoch, position=key.position, last=key.last)


def default_num_workers(device: torch.device, local_world_size: int = 1) -> int:
    """Loader processes per rank: a few on a GPU (the step must never wait for the data); none on a CPU, where
    reading and padding cost a few milliseconds a step and a worker would take a core from the matmuls."""
    if device.type != "cuda":
        return 0
    return max(1, min(4, (os.cpu_count() or 2) // max(1, local_world_size) - 1))


class TrainData:
    """The training and evaluation micro-batches, on the device (online: with the target's hidden states)."""

    def __init__(  # noqa: PLR0913 - one loader's settings, as TrainConfig names them
        self,
        dataset: Samples | LayerSubset,
        train: TokenBudgetSampler,
        evaluation: TokenBudgetSampler | None,
        ttt_steps: int,
        grad_accum: int,
        device: torch.device,
        num_workers: int,
        features: FeatureSource | None = None,
        sampling: Sampling = EVERY_STEP,
    ):
        self.dataset, self.train, self.evaluation, self.sampling = dataset, train, evaluation, sampling
        self.ttt_steps, self.grad_accum, self.device = ttt_steps, grad_accum, device
        self.num_workers = num_workers
        self.features = features if features is not None else FeatureSource()

    def steps(self, epoch: int, position: int, epochs: int | None) -> Generator[list[Batch], None, None]:
        """grad_accum micro-batches per optimizer step, from (epoch, position) on."""
        micro: list[Batch] = []
        for batch in self._loader(EpochPlan(self.train, self.grad_accum, epoch, position, epochs), self.sampling):
            micro.append(self._ready(batch))
            if len(micro) == self.grad_accum:
                yield micro
                micro = []

    def eval_batches(self) -> Iterator[Batch]:
        if self.evaluation is not None:
            for batch in self._loader(EpochPlan(self.evaluation, 1, epochs=1), self.sampling.for_evaluation()):
                yield self._ready(batch)

    def _ready(self, batch: Batch) -> Batch:
        return self.features(batch.to(self.device, non_blocking=True))

    def _loader(self, plan: EpochPlan, sampling: Sampling = EVERY_STEP) -> DataLoader:
        """Evaluation scores every anchor at every depth (no COD); DFlash's the same blocks every time (epoch 0)."""
        workers = self.num_workers
        return DataLoader(
            MicroBatches(self.dataset, self.ttt_steps, plan.sampler, sampling),
            sampler=plan,
            batch_size=None,
            num_workers=workers,
            pin_memory=self.device.type == "cuda",
            prefetch_factor=4 if workers else None,
            generator=torch.Generator().manual_seed(0),
        )


# ---------------------------------------------------------------------------------------------- feature sources


class FeatureSource:
    """Where a batch's hidden states come from: the store itself (offline: this base, the states came with the
    batch), the target run in the trainer (`OnlineSource`), or the vLLM engines' spool (`engine_source.EngineSource`).
    The trainer holds one and never asks which."""

    def __call__(self, batch: Batch) -> Batch:
        """`batch` (on the device) with its hidden states filled in."""
        return batch

    def metrics(self) -> dict:
        """What it reports beside the loss, for the log ({} when nothing)."""
        return {}

    def describe(self, metrics: dict) -> str:
        """Those metrics for the progress line ("" when there are none)."""
        return ""

    def summary(self) -> dict:
        """Its lines in the run's summary."""
        return {}

    def close(self, completed: bool) -> None:
        """The run ended (`completed`: normally)."""


class OnlineSource(FeatureSource):
    """Fills a batch's hidden states by running the target (the online mode of the trainer), in its dtype."""

    def __init__(self, target: nn.Module, layer_ids: Sequence[int]):
        self.target, self.layer_ids = target, list(layer_ids)

    def __call__(self, batch: Batch) -> Batch:
        # right-padded: causal attention keeps padding out of every real position, so no attention mask is needed
        hs = capture_hidden_states(self.target, batch.input_ids, None, self.layer_ids)
        return replace(batch, hidden_states=hs, hidden_scales=None)


class LayerSubset:
    """A hidden-state store read through some of its layers: item i's hidden_states (and fp8 scales) keep the
    layer positions `layers` only ([T, L', H]); everything else is the store's."""

    def __init__(self, store: HiddenStateStore, layers: Sequence[int]):
        self.store, self.layers = store, list(layers)

    def __len__(self) -> int:
        return len(self.store)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def __getitem__(self, i: int) -> dict:
        return self.sample(i)

    def sample(self, i: int, start: int = 0) -> dict:
        item = dict(self.store.sample(i, start) if start else self.store[i])
        for key in ("hidden_states", "hidden_scales"):
            if item.get(key) is not None:
                item[key] = item[key][:, self.layers]
        return item


def fetch(dataset: Samples | LayerSubset, ids: list[int], ttt_steps: int = 1) -> Batch:
    return collate([dataset[i] for i in ids], ttt_steps)


def token_counts(dataset: Samples | LayerSubset, indices: Sequence[int], vocab_size: int) -> np.ndarray:
    """Loss-masked token counts [vocab] of the samples `indices` (the training split), read from the samples."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    if isinstance(dataset, LayerSubset):  # the tokens alone: no hidden state sliced (read) for them
        dataset = dataset.store
    for a in range(0, len(indices), 4096):
        parts = []
        for i in indices[a : a + 4096]:
            item = dataset[int(i)]
            parts.append(item["input_ids"][item["loss_mask"].bool()].numpy())
        if parts:
            counts += np.bincount(np.concatenate(parts), minlength=vocab_size)[:vocab_size]
    return counts
