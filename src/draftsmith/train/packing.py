"""Tree-packed batches: samples that share a prefix (a conversation's generations, conversations on one system prompt:
the store's parents, extract/common.py) trained in one sequence, each shared row once, for every method.

Layout. A batch is one sequence (B = 1) of segments in the sampler's order, a parent before its children. Segment i
holds sample i's positions start_i .. T_i-1: start_i = 0 for a sample whose parent is not in the batch, else
max(0, shared_i - margin). The unrolled objective's margin is its TTT steps: a sample's steps at the last `margin`
positions of its shared prefix read its own next tokens (unrolled.py: step k at t reads x_{t+k+1}), so those rows are
its own. The block objective's is 0: a block reads its context's states, its anchor's token and its targets' states,
all the same in an ancestor's rows (blocks.py).
Positions before start_i are read from its ancestors: walking up from i, ancestor a lends its positions
[start_a, cut), cut the smallest start met on the way. A row keeps its sample position (RoPE); a query sees its own
segment's earlier rows and the rows its ancestors lend it (`attention.Tree`), so every row computes what it computes
in its own sample, and a TTT score of sample i at a position before start_i is taken at the ancestor's row, which holds
the same value: the tokens it reads (up to t+k+1 < start_i + margin <= shared_i) are the same in both. A block of
sample i sees the context rows before its anchor's row that sample i holds. The loss, its gradients and the metrics
are the per-sample layout's (tests/test_packing.py, fp64); the draft runs over distinct rows (plus `margin` per
branch) instead of one context per generation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from draftsmith.extract.store import HiddenStateStore
from draftsmith.methods.attention import Tree
from draftsmith.methods.objective import Draw, Steps
from draftsmith.train.batches import Batch, LayerSubset, Sampling, TokenBudgetSampler
from draftsmith.train.blocks import sample_blocks
from draftsmith.train.objective import Rows
from draftsmith.train.unrolled import sample_steps


def batch_parents(ids: Sequence[int], parent_of: np.ndarray) -> list[int]:
    """parents[j]: the batch position of ids[j]'s parent, -1 when it is not earlier in the batch."""
    where: dict[int, int] = {}
    parents = []
    for j, i in enumerate(ids):
        parents.append(where.get(int(parent_of[i]), -1))
        where[int(i)] = j
    return parents


def segment_starts(parents: Sequence[int], shared: Sequence[int], margin: int) -> list[int]:
    """Each segment's first position: 0 without a parent in the batch, else `margin` before its shared prefix ends."""
    return [0 if p < 0 else max(0, int(s) - margin) for p, s in zip(parents, shared, strict=True)]


@dataclass
class Layout:
    rows: list[np.ndarray]  # per sample, the packed row holding each of its positions [T_i]
    tree: Tree
    num_rows: int


def layout(lengths: Sequence[int], parents: Sequence[int], starts: Sequence[int]) -> Layout:
    """Where each sample's positions sit in the packed sequence (see the module docstring)."""
    own = [int(n) - int(s) for n, s in zip(lengths, starts, strict=True)]
    bases = np.concatenate(([0], np.cumsum(own))).astype(np.int64)
    total = int(bases[-1])
    visible = np.zeros((len(own), total), dtype=bool)
    rows = []
    for i, (n, start) in enumerate(zip(lengths, starts, strict=True)):
        where = np.empty(int(n), dtype=np.int64)
        where[start:] = bases[i] + np.arange(own[i])
        visible[i, bases[i] : bases[i + 1]] = True
        cut, a = int(start), parents[i]
        while cut > 0:  # a root starts at 0, so an ancestor lends the rest
            lo = int(starts[a])
            if lo < cut:
                where[lo:cut] = bases[a] + np.arange(cut - lo)
                visible[i, bases[a] : bases[a] + cut - lo] = True
                cut = lo
            a = parents[a]
        rows.append(where)
    positions = np.concatenate([np.arange(s, n) for n, s in zip(lengths, starts, strict=True)]).astype(np.int64)
    segment = np.repeat(np.arange(len(own), dtype=np.int64), own)
    return Layout(rows, Tree.of(positions, segment, visible), total)


def margin(draw: Draw, ttt_steps: int) -> int:
    """The positions of a shared prefix a sample holds again (see the module docstring)."""
    return ttt_steps if isinstance(draw, Steps) else 0


class TreeSampler(TokenBudgetSampler):
    """`TokenBudgetSampler`'s batches, tree-packed: each epoch shuffles the trees (a sample of the split without a
    parent in it, and its descendants in it, parents first) and packs them in that order into batches of at most
    `token_budget` packed rows; a tree too big for one batch goes on in the next, its first sample there whole, or
    after its parent as context when that is a branch point (`batches`). A batch is a pure function of (seed,
    epoch), as `TokenBudgetSampler`'s."""

    def __init__(  # noqa: PLR0913 - TokenBudgetSampler's settings and the store's prefixes
        self,
        indices: Sequence[int],
        lengths: np.ndarray,
        prefixes: tuple[np.ndarray, np.ndarray],
        margin: int,
        token_budget: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ):
        super().__init__(indices, lengths, token_budget, seed, rank, world_size)
        self.parent_of, self.shared, self.margin = prefixes[0], prefixes[1], margin
        members = set(self.indices.tolist())
        children: dict[int, list[int]] = {}
        roots = []
        for i in self.indices.tolist():
            p = int(self.parent_of[i])
            if p in members:
                children.setdefault(p, []).append(i)
            else:
                roots.append(i)
        self.trees: list[list[int]] = []
        for root in roots:
            order, todo = [], [root]
            while todo:  # depth first: a conversation's generations one after another
                i = todo.pop()
                order.append(i)
                todo.extend(sorted(children.get(i, []), reverse=True))
            self.trees.append(order)
        counts = np.bincount(self.parent_of[self.indices][self.parent_of[self.indices] >= 0], minlength=len(lengths))
        self.branches = set(np.flatnonzero(counts > 1).tolist())  # samples several samples of the split extend

    def _rows(self, i: int, placed: set[int]) -> int:
        """The rows sample i adds to a batch holding `placed`."""
        n = int(self.lengths[i])
        return n - max(0, int(self.shared[i]) - self.margin) if int(self.parent_of[i]) in placed else n

    def batches(self, epoch: int) -> list[list[int]]:
        """As `TokenBudgetSampler.batches`; an entry ~p (negative) is sample p as context only: a branch point that
        is in an earlier batch, put before the first of its children in this one so they share its rows
        (unsupervised here)."""
        rng = np.random.default_rng([self.seed, epoch])
        batches: list[list[int]] = []
        current: list[int] = []
        placed: set[int] = set()
        used = 0
        for t in rng.permutation(len(self.trees)).tolist():
            for i in self.trees[t]:
                p = int(self.parent_of[i])
                context = [p] if p in self.branches and p not in placed else []
                rows = sum(self._rows(c, placed) for c in context) + self._rows(i, placed | set(context))
                if current and used + rows > self.token_budget:
                    batches.append(current)
                    current, placed, used = [], set(), 0
                    rows = sum(self._rows(c, placed) for c in context) + self._rows(i, set(context))
                    if rows > self.token_budget:  # no room for the context: the sample whole
                        context, rows = [], int(self.lengths[i])
                current += [~c for c in context] + [i]
                placed.update([*context, i])
                used += rows
        if current:
            batches.append(current)
        usable = len(batches) // self.world_size * self.world_size
        return batches[self.rank : usable : self.world_size]

    def collate(  # a tree sampler plans a store's batches only (setup.train_sampler)
        self,
        dataset: HiddenStateStore | LayerSubset,  # type: ignore[override]  # narrower than a padded sampler's
        ids: Sequence[int],
        ttt_steps: int,
        sampling: Sampling,
        epoch: int,
    ) -> Batch:
        """The samples `ids` (a batch of `batches`) in one tree-packed sequence, indexed for its method's objective;
        a context entry (~p) is read and attended to, never scored."""
        real = [i if i >= 0 else ~i for i in ids]
        parents = batch_parents(real, self.parent_of)
        starts = segment_starts(parents, [int(self.shared[i]) for i in real], self.margin)
        items = [dataset.sample(int(i), start) for i, start in zip(real, starts, strict=True)]
        lengths = [int(it["input_ids"].shape[0]) for it in items]
        where = layout(lengths, parents, starts)
        own = [
            {k: (v[s:] if k in ("input_ids", "loss_mask") else v) for k, v in it.items()}
            for it, s in zip(items, starts, strict=True)
        ]
        packed = {
            key: torch.cat([it[key] for it in own])[None] if key in own[0] else None
            for key in ("input_ids", "loss_mask", "hidden_states", "hidden_scales")
        }
        masks = [it["loss_mask"].bool().numpy() & (i >= 0) for it, i in zip(items, ids, strict=True)]
        sample_ids = [int(it["sample_id"]) for it in items]
        draw = sampling.draw
        if isinstance(draw, Steps):
            index: Rows = sample_steps(
                masks, where.rows, where.num_rows, ttt_steps, draw.cod, sample_ids, epoch, where.tree
            )
        else:
            index = sample_blocks(masks, where.rows, (1, where.num_rows), draw, sample_ids, epoch, where.tree)
        input_ids, loss_mask = packed["input_ids"], packed["loss_mask"]
        assert input_ids is not None and loss_mask is not None  # every sample has both
        return Batch(
            input_ids.long(),
            loss_mask.bool(),
            packed["hidden_states"],
            packed["hidden_scales"],
            index,
            [s for s, i in zip(sample_ids, ids, strict=True) if i >= 0],  # the samples it supervises
            [n for n, i in zip(lengths, ids, strict=True) if i >= 0],
        )
