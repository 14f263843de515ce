"""Attention kernels of the EAGLE-3 draft: training-time test (TTT), its explicit-mask reference, and decoding.

At TTT step k the query at position t attends causally to the step-0 keys s <= t and to its own keys of steps 1..k
at position t (the draft's own chain); see unrolled.py for the alignment. `ttt_attention` is what training runs,
`naive_ttt_attention` the explicit-mask reference it is tested against, `cached_attention` what decoding runs.

Memory is linear in T, forward and backward: no [T, T] tensor is kept. Step k > 0 splits the softmax in two parts
and merges them exactly through their log-sum-exps:

    o0, lse0 = causal attention over the step-0 keys        # fused kernel with a differentiable LSE
    s_j      = q_t . k_j[t] * scale,  j = 1..k             # one score per diagonal key
    L        = logsumexp(lse0, s_1, ..., s_k)
    out      = exp(lse0 - L) * o0 + sum_j exp(s_j - L) * v_j[t]

The causal part runs through `flex_attention` (compiled, a causal block mask) on CUDA, or through
`ChunkedCausalAttention`, a flash-attention-style autograd Function over query chunks, everywhere else (the CPU
SDPA kernels return no differentiable LSE, and flex_attention has no CPU backward). `train --attention-kernel
chunked` (or `flex`) overrides the choice.

A tree-packed batch (train/packing.py: a conversation's samples in one sequence, each sharing its ancestors' rows)
narrows "s <= t" to the rows a query's own sample holds: `Tree` says which, and every step's causal part then runs
through the chunked kernel with that mask (step 0 too).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

try:  # torch >= 2.9 spells the LSE request AuxRequest; older ones return_lse=True
    from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention
except ImportError:  # pragma: no cover - depends on the torch build
    try:
        from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

        AuxRequest = None  # type: ignore[assignment, misc]  # torch < 2.9
    except ImportError:
        flex_attention = BlockMask = AuxRequest = create_block_mask = None  # type: ignore[assignment, misc]  # no flex

# Query rows per chunk of ChunkedCausalAttention: each chunk holds a few [B, Hq, CHUNK, T] fp32 score buffers.
# benchmarks/ttt_memory.py --sweep-chunk, CPU: 32..64 fastest at the default target's shapes and at the 8B-shaped
# draft's (T 1024..4096); 256 and more up to 2.5x slower (buffers out of cache), 16 slower again (per-op cost).
CHUNK = 64
KERNELS = ("auto", "flex", "chunked")


@dataclass
class Tree:
    """Which rows of a tree-packed sequence a query sees (train/packing.py builds it on the host): query row r (of
    segment segment[r]) sees key row j <= r when visible[segment[r], j]. `positions` are the rows' positions in their
    samples (RoPE). The host keeps its own copy of segment and visible: the keys a chunk of queries reads are known
    without a device sync."""

    positions: torch.Tensor  # [N] int64
    segment: torch.Tensor  # [N] int64: the segment (a sample's own rows) each row belongs to
    visible: torch.Tensor  # [S, N] bool: the rows of its ancestors a segment reads, and its own rows
    host: tuple[np.ndarray, np.ndarray]  # (segment, visible) as numpy arrays
    _keys: dict[tuple[int, int], tuple[torch.Tensor, list[tuple[int, int]]]] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, positions: np.ndarray, segment: np.ndarray, visible: np.ndarray) -> Tree:
        return cls(
            torch.from_numpy(positions), torch.from_numpy(segment), torch.from_numpy(visible), (segment, visible)
        )

    def keys(self, r0: int, r1: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """The key rows any of query rows r0..r1-1 sees, on the tree's device (ascending), and as runs [a, b) of
        consecutive rows (a sample's prefix: a few, one per ancestor that lends it rows): a chunk reads those alone.
        Computed once per chunk on the host."""
        got = self._keys.get((r0, r1))
        if got is None:
            segment, visible = self.host
            cols = np.flatnonzero(visible[np.unique(segment[r0:r1]), :r1].any(0))
            cut = np.flatnonzero(np.diff(cols) != 1) + 1
            runs = [(int(a[0]), int(a[-1]) + 1) for a in np.split(cols, cut) if len(a)]
            got = self._keys[(r0, r1)] = (torch.from_numpy(cols).to(self.visible.device), runs)
        return got

    def within(self, r0: int, r1: int) -> bool:
        """Whether query rows r0..r1-1 are of one segment (so each sees every key `keys` lists up to itself)."""
        segment = self.host[0]
        return bool(segment[r0] == segment[r1 - 1])

    def mask(self, r0: int, r1: int, cols: torch.Tensor | None = None) -> torch.Tensor:
        """[r1 - r0, len(cols)] bool: what query rows r0..r1-1 see of key rows `cols` (all of 0..r1-1 by default),
        causal and tree."""
        device = self.visible.device
        cols = torch.arange(r1, device=device) if cols is None else cols
        causal = cols[None, :] <= torch.arange(r0, r1, device=device)[:, None]
        return causal & self.visible.index_select(1, cols)[self.segment[r0:r1]]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Tree:
        return Tree(fn(self.positions), fn(self.segment), fn(self.visible), self.host)


def ttt_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    *,
    kernel: str | None = None,
    tree: Tree | None = None,
) -> torch.Tensor:
    """Training-time-test attention, memory-linear in T (forward and backward).

    q [B, Hq, T, D] is step k = len(keys) - 1. keys/values[j] [B, Hkv, T, D] are the keys of step j (Hq a multiple
    of Hkv). Query t attends causally to step-0 keys s <= t, and to the keys of steps 1..k at its own position t.
    kernel: "flex" (CUDA), "chunked" (anywhere) or "auto" (default; `train --attention-kernel`): how the causal
    part runs; step 0 is plain causal SDPA either way. `tree` (B = 1): the causal part sees only the rows of the
    query's own sample, through the chunked kernel at every step.
    """
    hq, d = q.shape[1], q.shape[3]
    hkv = keys[0].shape[1]
    if len(keys) == 1 and tree is None:
        return F.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True, enable_gqa=hq != hkv)
    kernel = kernel or "auto"
    if kernel not in KERNELS:
        raise ValueError(f"TTT attention kernel {kernel!r}: expected one of {KERNELS}")
    if tree is not None:  # the tree's mask runs in the chunked kernel, on every device
        kernel = "chunked"
    elif kernel == "auto":
        kernel = "flex" if q.is_cuda and flex_attention is not None else "chunked"
    # Under autocast every input goes to the autocast dtype (SDPA does the same); LSEs and weights stay fp32.
    device_type = q.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = functools.reduce(torch.promote_types, [x.dtype for x in (q, *keys, *values)])
    q = q.to(dtype)
    keys, values = [k.to(dtype) for k in keys], [v.to(dtype) for v in values]
    scale = 1.0 / math.sqrt(d)
    with torch.autocast(device_type, enabled=False):
        if kernel == "flex":
            o0, lse0 = flex_causal_attention(q, keys[0], values[0], scale)
        else:
            o0, lse0 = chunked_causal_attention(q, keys[0], values[0], scale, tree=tree)
        if len(keys) == 1:
            return o0
        return merge_diagonal(q, o0, lse0, keys[1:], values[1:], scale)


def merge_diagonal(
    q: torch.Tensor,
    o0: torch.Tensor,
    lse0: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """Add the diagonal keys to a causal attention's output, exactly: q [B, Hq, T, D]; o0 [B, Hq, T, D] and its
    lse0 [B, Hq, T] (fp32, differentiable); keys/values[j] [B, Hkv, T, D], one score each per query position."""
    b, hq, t, d = q.shape
    hkv = keys[0].shape[1]
    g = hq // hkv
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 under bf16, fp64 stays fp64
    qg = q.view(b, hkv, g, t, d)  # grouped query heads share one kv head, no copy of K/V
    lse0 = lse0.view(b, hkv, g, t).to(acc)
    # One score per (query, diagonal key): the product is a temporary, only q and k are kept for backward.
    scores = [(qg * k[:, :, None]).sum(-1, dtype=acc) * scale for k in keys]  # k x [B, Hkv, g, T]
    lse = torch.logsumexp(torch.stack([lse0, *scores], dim=-1), dim=-1)  # [B, Hkv, g, T]
    out = o0.view(b, hkv, g, t, d) * torch.exp(lse0 - lse)[..., None]  # promotes to fp32; keeps o0 as it is
    for s, v in zip(scores, values, strict=False):
        out = out + torch.exp(s - lse)[..., None] * v[:, :, None]  # [B, Hkv, g, T, D]
    return out.to(q.dtype).view(b, hq, t, d)


# ---------------------------------------------------------------------------------------------- causal + LSE, CUDA


def _causal(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    return q_idx >= kv_idx


@functools.lru_cache(maxsize=64)
def causal_block_mask(t: int, device: str, block: int = 128) -> BlockMask:
    """The causal BlockMask of create_block_mask(causal, None, None, t, t), built from its [T/128, T/128] block
    layout: create_block_mask would evaluate the mask over [T, T] (or compile that)."""
    n = -(-t // block)
    i = torch.arange(n, device=device)
    partial = i[:, None] == i[None, :]  # [n, n] q block x kv block: the diagonal blocks need the mask
    full = i[:, None] > i[None, :]  # below it every pair is causal
    if t % block:  # the last q block has padding rows: create_block_mask counts its blocks as partial
        partial[-1] |= full[-1]
        full[-1] = False

    def ordered(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per q block: how many kv blocks, and their indices first (ascending), then the rest."""
        order = torch.argsort(m.to(torch.int8), dim=-1, descending=True, stable=True)
        return m.sum(-1, dtype=torch.int32)[None, None], order.to(torch.int32)[None, None]

    # (kv_num_blocks, kv_indices) of the partial blocks, then (full_kv_num_blocks, full_kv_indices)
    return BlockMask.from_kv_blocks(
        *ordered(partial), *ordered(full), BLOCK_SIZE=block, mask_mod=_causal, seq_lengths=(t, t)
    )


FLEX_BUCKET = 256  # the compiled flex kernel's sequence lengths are multiples of this (two 128-blocks at least)


@functools.cache
def _compiled_flex_attention() -> Any:  # torch.compile(flex_attention): no Callable spells its overloads
    # Compiled, flex_attention runs fused Triton kernels (forward and backward, LSE gradient included); eager it
    # would materialise the scores. Automatic dynamic shapes: a second sequence length recompiles once, dynamic.
    return torch.compile(flex_attention)


def flex_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, compiled: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention through flex_attention: (out [B, Hq, T, D], lse [B, Hq, T] fp32), both differentiable.
    compiled=False runs eager (tests: forward only on CPU, where flex_attention has no backward)."""
    if flex_attention is None:
        raise RuntimeError("this torch has no torch.nn.attention.flex_attention; train with --attention-kernel chunked")
    t = q.shape[2]
    # Every micro-batch has its own padded length: rounded up to FLEX_BUCKET (zeros after the last position, which
    # causal attention never lets a real position see), the compiled kernel meets a few shapes, not one per batch.
    padded = -(-t // FLEX_BUCKET) * FLEX_BUCKET
    if padded != t:
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, padded - t)) for x in (q, k, v))
    fn = _compiled_flex_attention() if compiled else flex_attention
    kwargs = dict(block_mask=causal_block_mask(padded, str(q.device)), scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    if AuxRequest is not None:
        out, aux = fn(q, k, v, return_aux=AuxRequest(lse=True), **kwargs)
        lse = aux.lse
    else:
        out, lse = fn(q, k, v, return_lse=True, **kwargs)
    return out[:, :, :t], lse[:, :, :t]


# ---------------------------------------------------------------------------------------------- causal + LSE, chunked


def chunked_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, chunk: int | None = None, tree: Tree | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention by query chunks: (out [B, Hq, T, D] in q's dtype, lse [B, Hq, T] fp32 or fp64), both
    differentiable; memory linear in T (a chunk's scores are the only [*, T] buffers, forward and backward).
    `tree`: masked further to the rows of each query's own sample."""
    return ChunkedCausalAttention.apply(q, k, v, scale, chunk or CHUNK, tree)


class ChunkedCausalAttention(torch.autograd.Function):
    """Flash-attention style in plain PyTorch: the forward keeps only the output and the LSE of each query; the
    backward recomputes each chunk's probabilities from q, k and the LSE.

    Chunk [c0, c1) of queries sees keys [0, c1) only (causal), so about half of the [T, T] work is skipped (a tree's
    chunk: only the keys its rows' samples hold, `Tree.keys`). The g query heads of a kv head are stacked along the
    rows: one batched matmul per chunk, K/V never repeated. Scores come out of the matmul in the input dtype (bf16
    like the dense kernel it replaces), softmax, LSE and the dk/dv accumulators are fp32 (fp64 stays fp64).
    """

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, chunk: int, tree: Tree | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, hq, t, d = q.shape
        hkv = k.shape[1]
        g = hq // hkv
        acc = torch.promote_types(q.dtype, torch.float32)
        qg = q.view(b, hkv, g, t, d)
        out = q.new_empty(b, hkv, g, t, d)
        lse = torch.empty(b, hkv, g, t, dtype=acc, device=q.device)
        for c0 in range(0, t, chunk):
            c1 = min(c0 + chunk, t)
            n = c1 - c0
            p, _, _, v_c, _ = _chunk_scores(qg, k, v, c0, c1, scale, acc, tree)  # [B, Hkv, g, C, M]
            m = p.amax(-1, keepdim=True)
            p.sub_(m).exp_()  # unnormalised: the division goes to the [C, D] output instead
            z = p.sum(-1, keepdim=True)
            lse[:, :, :, c0:c1] = (m + z.log()).squeeze(-1)
            o = torch.matmul(p.to(q.dtype).view(b, hkv, g * n, -1), v_c)  # [B, Hkv, g*C, D]
            out[:, :, :, c0:c1] = (o.view(b, hkv, g, n, d).to(acc) / z).to(q.dtype)
        out, lse = out.view(b, hq, t, d), lse.view(b, hq, t)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.chunk, ctx.tree = scale, chunk, tree
        return out, lse

    @staticmethod
    def backward(
        ctx: Any, grad_out: torch.Tensor, grad_lse: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None, None]:
        q, k, v, out, lse = ctx.saved_tensors
        scale, chunk, tree = ctx.scale, ctx.chunk, ctx.tree
        b, hq, t, d = q.shape
        hkv = k.shape[1]
        g = hq // hkv
        acc = lse.dtype
        qg = q.view(b, hkv, g, t, d)
        do = grad_out.to(q.dtype).reshape(b, hkv, g, t, d)
        # dS = P * (dP - delta): delta = rowsum(dO * O) from the output, minus the LSE's own gradient (dL/dS = P).
        delta = (grad_out.to(acc) * out.to(acc)).sum(-1) - grad_lse.to(acc)
        delta = delta.view(b, hkv, g, t, 1)
        lse = lse.view(b, hkv, g, t, 1)
        dq = torch.empty(b, hkv, g, t, d, dtype=q.dtype, device=q.device)
        dk = torch.zeros(b, hkv, t, d, dtype=acc, device=q.device)
        dv = torch.zeros(b, hkv, t, d, dtype=acc, device=q.device)
        for c0 in range(0, t, chunk):
            c1 = min(c0 + chunk, t)
            n = c1 - c0
            p, q_c, k_c, v_c, runs = _chunk_scores(qg, k, v, c0, c1, scale, acc, tree)
            p.sub_(lse[:, :, :, c0:c1]).exp_()  # the forward's probabilities, [B, Hkv, g, C, M]
            do_c = do[:, :, :, c0:c1].reshape(b, hkv, g * n, d)
            p_rows = p.to(q.dtype).view(b, hkv, g * n, -1)
            ds = torch.matmul(do_c, v_c.transpose(-1, -2)).view(p.shape).to(acc)  # dP
            ds.sub_(delta[:, :, :, c0:c1]).mul_(p)
            ds_rows = ds.to(q.dtype).view(b, hkv, g * n, -1)
            dq[:, :, :, c0:c1] = (torch.matmul(ds_rows, k_c) * scale).view(b, hkv, g, n, d)
            dv_c = torch.matmul(p_rows.transpose(-1, -2), do_c)  # [B, Hkv, M, D]
            dk_c = torch.matmul(ds_rows.transpose(-1, -2), q_c)  # q_c carries the scale
            at = 0
            for a, z in runs:  # the keys' gradients back to their rows
                dv[:, :, a:z] += dv_c[:, :, at : at + z - a]
                dk[:, :, a:z] += dk_c[:, :, at : at + z - a]
                at += z - a
        return dq.view(b, hq, t, d), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _chunk_scores(  # noqa: PLR0913 - the tensors, the chunk, and how it is scored
    qg: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    c0: int,
    c1: int,
    scale: float,
    acc: torch.dtype,
    tree: Tree | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """Query rows [c0, c1) against the keys they may see, M of them: [0, c1), or a tree's `keys`: (scaled, masked
    scores [B, Hkv, g, C, M] in `acc`, the scaled query rows [B, Hkv, g*C, D], those keys and values [B, Hkv, M, D],
    and where they are: runs [a, b) of key rows)."""
    b, hkv, g, _, d = qg.shape
    n = c1 - c0
    q_c = qg[:, :, :, c0:c1].reshape(b, hkv, g * n, d) * scale  # the scale on [C, D] rather than on [C, T]
    cols, runs = (None, [(0, c1)]) if tree is None else tree.keys(c0, c1)
    k_c, v_c = (
        torch.cat([x[:, :, a:z] for a, z in runs], dim=2) if len(runs) > 1 else x[:, :, runs[0][0] : runs[0][1]]
        for x in (k, v)
    )
    s = torch.matmul(q_c, k_c.transpose(-1, -2)).view(b, hkv, g, n, -1).to(acc)
    if tree is None or tree.within(c0, c1):  # every row sees every key but those of the chunk's own later rows
        # The chunk's own rows are the last n keys: key c0 + j is masked for query c0 + i when j > i.
        future = torch.ones(n, n, dtype=torch.bool, device=qg.device).triu_(1)
        s[..., -n:].masked_fill_(future, float("-inf"))
    else:
        s.masked_fill_(~tree.mask(c0, c1, cols), float("-inf"))
    return s, q_c, k_c, v_c, runs


# ---------------------------------------------------------------------------------------------- the KV cache


class KVCache:
    """Keys/values of each layer: one (k, v) per TTT step ("ttt"/"naive": `append`), or one entry growing along the
    positions ("decode", a block drafter's context: `extend`, cut back by `crop`).

    A plain object (not a list) on purpose: wrappers such as FSDP2 rebuild list/tuple arguments of a wrapped
    layer's forward, which would silently drop what the layer appends.
    """

    def __init__(self, num_layers: int, kernel: str = "auto", tree: Tree | None = None):
        self._layers: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(num_layers)]
        self.kernel = kernel  # the TTT attention's ("auto", "flex", "chunked": `ttt_attention`), --attention-kernel
        self.tree = tree  # a tree-packed batch's mask (`ttt_attention`)

    def steps(self, layer: int) -> int:
        """The entries layer `layer` holds (TTT: the steps run)."""
        return len(self._layers[layer])

    def entries(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Layer `layer`'s (k, v) entries, oldest first (a copy of the list; the same tensors)."""
        return list(self._layers[layer])

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One more entry (a TTT step's k, v) -> the layer's keys and values, one per entry."""
        entries = self._layers[layer]
        entries.append((k, v))
        return [e[0] for e in entries], [e[1] for e in entries]

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions k, v [B, Hkv, T, D] after the layer's decode entry -> the whole entry."""
        entries = self._layers[layer]
        if entries:
            k, v = torch.cat((entries[0][0], k), dim=2), torch.cat((entries[0][1], v), dim=2)
            entries[0] = (k, v)
        else:
            entries.append((k, v))
        return k, v

    def context(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's decode entry (k, v)."""
        return [entries[0] for entries in self._layers]

    def crop(self, length: int) -> None:
        """Forget every decode entry's positions from `length` on."""
        for entries in self._layers:
            if entries:
                k, v = entries[0]
                entries[0] = (k[:, :, :length], v[:, :, :length])

    def fork(self, layer: int, entries: list[tuple[torch.Tensor, torch.Tensor]]) -> KVCache:
        """A private cache of as many layers, layer `layer` holding `entries` (a checkpointed layer call's)."""
        private = KVCache(len(self._layers), self.kernel, self.tree)
        private._layers[layer] = list(entries)
        return private


# ---------------------------------------------------------------------------------------------- reference, decoding


def naive_ttt_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], tree: Tree | None = None
) -> torch.Tensor:
    """Reference: every step's keys side by side, masked by an explicit [T, T*(k+1)] mask (tests, benchmark)."""
    hq, t = q.shape[1:3]
    hkv = keys[0].shape[1]
    k_all = torch.cat(keys, dim=2).repeat_interleave(hq // hkv, dim=1)  # [B, Hq, T*(k+1), D]
    v_all = torch.cat(values, dim=2).repeat_interleave(hq // hkv, dim=1)
    idx = torch.arange(t, device=q.device)
    causal = idx[None, :] <= idx[:, None] if tree is None else tree.mask(0, t)  # [T, T]
    diagonal = idx[None, :] == idx[:, None]
    mask = torch.cat([causal] + [diagonal] * (len(keys) - 1), dim=1)  # [T, T*(k+1)]
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Decoding: the S new queries are the last S positions of the K/V (past + new); causal with that offset."""
    s, total = q.shape[2], k.shape[2]
    mask = torch.ones(s, total, dtype=torch.bool, device=q.device).tril_(diagonal=total - s)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


# ---------------------------------------------------------------------------------------------- DFlash blocks

# Block queries per chunk of `block_attention` (whole blocks: a chunk holds max(1, BLOCK_CHUNK // S) anchors).
BLOCK_CHUNK = 64


def anchor_chunks(num_anchors: int, block_size: int) -> list[tuple[int, int]]:
    """The anchor ranges [a0, a1) `block_attention` runs one at a time."""
    step = max(1, BLOCK_CHUNK // block_size)
    return [(a0, min(a0 + step, num_anchors)) for a0 in range(0, num_anchors, step)]


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_context: torch.Tensor,
    v_context: torch.Tensor,
    limits: torch.Tensor,
    chunk_limits: list[int],
    *,
    kernel: str | None = None,
) -> torch.Tensor:
    """DFlash training attention, memory-linear in the context and the anchors (forward and backward).

    q [B, Hq, A*S, D] and the block's k / v [B, Hkv, A*S, D] hold A blocks of S positions, block a at rows
    a*S .. a*S+S-1; k_context / v_context [B, Hkv, T, D]; limits [B, A]: block a sees context keys s < limits[b, a]
    (its anchor position) and every key of its own block, in any order. kernel (as `ttt_attention`'s, default
    auto): "flex" (CUDA: `flex_block_attention`, fused) or "chunked": per chunk of
    `anchor_chunks(A, S)` (chunk_limits: its largest limit over the batch, known on the host: no sync) one masked
    SDPA over [its context prefix, its blocks' keys], recomputed in the backward (checkpointed) so only the chunk's
    scores ever exist.
    """
    kernel = kernel or "auto"
    if kernel not in KERNELS:
        raise ValueError(f"TTT attention kernel {kernel!r}: expected one of {KERNELS}")
    if kernel == "flex" or (kernel == "auto" and q.is_cuda and flex_attention is not None):
        return flex_block_attention(q, k, v, k_context, v_context, limits)
    return chunked_block_attention(q, k, v, k_context, v_context, limits, chunk_limits)


def chunked_block_attention(  # noqa: PLR0913 - block_attention's tensors, and a tree-packed batch's mask
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_context: torch.Tensor,
    v_context: torch.Tensor,
    limits: torch.Tensor,
    chunk_limits: list[int],
    tree: Tree | None = None,
) -> torch.Tensor:
    """`block_attention`'s chunked kernel. `tree` (B = 1, a tree-packed batch): limits are the anchors' rows, and a
    block sees only the context rows its anchor's sample holds."""
    b, hq, rows, d = q.shape
    num_anchors = limits.shape[1]
    s = rows // num_anchors
    device_type = q.device.type
    if torch.is_autocast_enabled(device_type):  # SDPA would cast each chunk; the checkpoints then keep half the bytes
        dtype = torch.get_autocast_dtype(device_type)
        q, k, v, k_context, v_context = (x.to(dtype) for x in (q, k, v, k_context, v_context))
    outs = []
    for (a0, a1), kmax in zip(anchor_chunks(num_anchors, s), chunk_limits, strict=False):
        block = slice(a0 * s, a1 * s)
        context = (k_context[:, :, :kmax], v_context[:, :, :kmax], limits[:, a0:a1])
        args = (q[:, :, block], k[:, :, block], v[:, :, block], *context)
        if torch.is_grad_enabled() and q.requires_grad:
            outs.append(checkpoint(naive_block_attention, *args, tree=tree, use_reentrant=False))
        else:
            outs.append(naive_block_attention(*args, tree=tree))
    return torch.cat(outs, dim=2)


def flex_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    limits: torch.Tensor,
    compiled: bool = True,
) -> torch.Tensor:
    """`block_attention` through flex_attention (CUDA: fused kernels, forward and backward): the queries against
    [context, every block] with the mask as a mask_mod. Its BlockMask is built by create_block_mask over the
    [A*S, T + A*S] grid at 128 x 128 granularity (block-sparse: a block's context prefix and its own tile).
    compiled=False runs eager (tests, on a CPU)."""
    if flex_attention is None:
        raise RuntimeError("this torch has no torch.nn.attention.flex_attention; train with --attention-kernel chunked")
    b, _, rows, _ = q.shape
    t, s = kc.shape[2], rows // limits.shape[1]

    def visible(bi: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, kvi: torch.Tensor) -> torch.Tensor:
        block = qi // s
        return torch.where(kvi < t, kvi < limits[bi, block], (kvi - t) // s == block)

    mask = create_block_mask(visible, b, None, rows, t + rows, device=str(q.device))
    fn = _compiled_flex_attention() if compiled else flex_attention
    return fn(
        q, torch.cat((kc, k), dim=2), torch.cat((vc, v), dim=2), block_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
    )


def naive_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    limits: torch.Tensor,
    tree: Tree | None = None,
) -> torch.Tensor:
    """Reference for `block_attention` (and its chunked kernel, a chunk at a time): c blocks of S queries against
    [the context kc / vc, their own blocks' keys], by one masked SDPA (an explicit [c*S, T + c*S] mask)."""
    b, _, rows, _ = q.shape
    c, kmax = limits.shape[1], kc.shape[2]
    s = rows // c
    block_of = torch.arange(rows, device=q.device) // s  # [c*S] the block of each query / block key
    context = torch.arange(kmax, device=q.device)[None, None, :] < limits[:, block_of, None]  # [B, c*S, kmax]
    if tree is not None:  # the rows the anchor's sample holds
        context = context & tree.visible[tree.segment[limits]][:, block_of, :kmax]
    own = (block_of[:, None] == block_of[None, :]).expand(b, rows, rows)  # [B, c*S, c*S]
    mask = torch.cat((context, own), dim=-1)[:, None]  # [B, 1, c*S, kmax + c*S]
    return F.scaled_dot_product_attention(
        q, torch.cat((kc, k), dim=2), torch.cat((vc, v), dim=2), attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
    )


def full_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_context: torch.Tensor, v_context: torch.Tensor
) -> torch.Tensor:
    """Decoding a DFlash round: the block's queries see every cached context key and the whole block."""
    return F.scaled_dot_product_attention(
        q, torch.cat((k_context, k), dim=2), torch.cat((v_context, v), dim=2), enable_gqa=q.shape[1] != k.shape[1]
    )
