"""TTT attention: the memory-linear kernels against explicit-mask references (values and gradients), their memory
shape (no [T, T] tensor, forward or backward), autocast, and activation checkpointing of a TTT step's layer call."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
from torch.utils._python_dispatch import TorchDispatchMode

from draftsmith.methods import attention
from draftsmith.methods.attention import (
    KVCache,
    chunked_causal_attention,
    flex_causal_attention,
    naive_ttt_attention,
    ttt_attention,
)
from draftsmith.methods.eagle3.modeling import DecoderLayer, ttt_layer_call

F64 = dict(atol=1e-10, rtol=1e-10)


def _explicit_reference(q, keys, values):
    """Independent reference: score every (query, key of any step) pair, mask, softmax, one query row at a time."""
    hq, t, d = q.shape[1:]
    g = hq // keys[0].shape[1]
    out = torch.zeros_like(q)
    for i in range(t):
        ks, vs = [keys[0][:, :, : i + 1]], [values[0][:, :, : i + 1]]
        ks += [k[:, :, i : i + 1] for k in keys[1:]]
        vs += [v[:, :, i : i + 1] for v in values[1:]]
        k_i = torch.cat(ks, 2).repeat_interleave(g, 1)
        v_i = torch.cat(vs, 2).repeat_interleave(g, 1)
        p = torch.softmax(q[:, :, i : i + 1] @ k_i.transpose(-1, -2) / d**0.5, -1)
        out[:, :, i : i + 1] = p @ v_i
    return out


def _inputs(b, hq, hkv, t, d, steps, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def leaf(h):
        return torch.randn(b, h, t, d, dtype=dtype, generator=gen).requires_grad_()

    return leaf(hq), [leaf(hkv) for _ in range(steps)], [leaf(hkv) for _ in range(steps)]


def _grads(out, w, inputs):
    return torch.autograd.grad((out * w).sum(), inputs)


# ---------------------------------------------------------------------------------------------- equality


@pytest.mark.parametrize(
    "b,hq,hkv,t,d,steps,chunk",
    [
        (1, 1, 1, 1, 8, 1, 16),  # a single position, step 0 only
        (2, 4, 2, 5, 8, 2, 16),  # T below one chunk
        (2, 4, 2, 17, 8, 4, 16),  # T = chunk + 1
        (1, 3, 3, 40, 16, 3, 16),  # GQA g = 1, T not a multiple of the chunk
        (2, 8, 2, 33, 8, 7, 8),  # g = 4, seven TTT steps
        (1, 6, 2, 64, 8, 5, 32),  # T a multiple of the chunk
    ],
)
def test_ttt_attention_equals_the_explicit_references_in_float64(monkeypatch, b, hq, hkv, t, d, steps, chunk):
    monkeypatch.setattr(attention, "CHUNK", chunk)
    q, keys, values = _inputs(b, hq, hkv, t, d, steps, seed=t * 10 + steps)
    ours = ttt_attention(q, keys, values, kernel="chunked")
    ref = _explicit_reference(q, keys, values)
    naive = naive_ttt_attention(q, keys, values)
    torch.testing.assert_close(ours, ref, **F64)
    torch.testing.assert_close(naive, ref, **F64)
    w = torch.randn(ours.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    inputs = [q, *keys, *values]
    for name, a, r in zip(
        ["q"] + [f"k{j}" for j in range(steps)] + [f"v{j}" for j in range(steps)],
        _grads(ours, w, inputs),
        _grads(ref, w, inputs),
        strict=False,
    ):
        torch.testing.assert_close(a, r, **F64, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("b,hq,hkv,t,d,steps", [(1, 4, 1, 300, 16, 3), (2, 6, 3, 77, 32, 7), (1, 2, 2, 256, 8, 2)])
def test_ttt_attention_equals_the_mask_reference_in_float32(b, hq, hkv, t, d, steps):
    """The default chunk size (128 or 256: T = 300 spans several chunks and is not a multiple of one)."""
    q, keys, values = _inputs(b, hq, hkv, t, d, steps, dtype=torch.float32, seed=t)
    ours = ttt_attention(q, keys, values)
    ref = naive_ttt_attention(q, keys, values)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)
    w = torch.randn(ours.shape, generator=torch.Generator().manual_seed(2))
    inputs = [q, *keys, *values]
    for a, r in zip(_grads(ours, w, inputs), _grads(ref, w, inputs), strict=False):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-4)


def test_chunked_causal_attention_gradcheck_out_and_lse():
    """Numerical gradients of both outputs: the LSE's own gradient is what the diagonal merge relies on."""
    q, (k,), (v,) = _inputs(1, 2, 1, 7, 3, 1)
    fn = lambda q, k, v: chunked_causal_attention(q, k, v, 0.7, chunk=3)
    assert torch.autograd.gradcheck(fn, (q, k, v))
    out, lse = fn(q, k, v)
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.7
    scores = scores.masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(lse, scores.logsumexp(-1), **F64)
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ v.repeat_interleave(2, 1), **F64)


@pytest.mark.skipif(attention.flex_attention is None, reason="no flex_attention in this torch")
def test_flex_causal_attention_forward_matches_the_chunked_kernel():
    """The CUDA path's causal part (eager here, forward only: flex_attention has no CPU backward): same output,
    same natural-log LSE over [B, Hq, T] as the chunked kernel."""
    q, (k,), (v,) = _inputs(2, 6, 2, 45, 16, 1)
    q, k, v = q.detach(), k.detach(), v.detach()
    out, lse = flex_causal_attention(q, k, v, 0.25, compiled=False)
    ref_out, ref_lse = chunked_causal_attention(q, k, v, 0.25, chunk=16)
    torch.testing.assert_close(out, ref_out, **F64)
    torch.testing.assert_close(lse, ref_lse, **F64)


@pytest.mark.skipif(attention.flex_attention is None, reason="no flex_attention in this torch")
@pytest.mark.parametrize("t", [1, 5, 128, 129, 300, 1024, 1100])
def test_causal_block_mask_equals_create_block_mask(t):
    ours = attention.causal_block_mask(t, "cpu")
    ref = flex_module.create_block_mask(lambda b, h, q, k: q >= k, None, None, t, t, device="cpu")
    assert ours.seq_lengths == ref.seq_lengths and ours.BLOCK_SIZE == ref.BLOCK_SIZE
    for field in (
        "kv_num_blocks",
        "kv_indices",
        "full_kv_num_blocks",
        "full_kv_indices",
        "q_num_blocks",
        "q_indices",
        "full_q_num_blocks",
        "full_q_indices",
    ):
        assert torch.equal(getattr(ours, field), getattr(ref, field)), field


@pytest.mark.skipif(attention.flex_attention is None, reason="no flex_attention in this torch")
def test_flex_path_end_to_end_with_eager_flex_backward(monkeypatch):
    """The whole "flex" path, backward included, through eager flex_attention's reference backward (CPU refuses it
    unless its device check is lifted): flex's LSE gradient and the merge agree with the explicit reference."""
    if not hasattr(flex_module, "_validate_device"):
        pytest.skip("this torch checks devices elsewhere")
    monkeypatch.setattr(flex_module, "_validate_device", lambda *a: None)
    monkeypatch.setattr(attention, "_compiled_flex_attention", lambda: flex_module.flex_attention)
    q, keys, values = _inputs(1, 4, 2, 21, 8, 3, seed=5)
    ours = ttt_attention(q, keys, values, kernel="flex")
    ref = _explicit_reference(q, keys, values)
    torch.testing.assert_close(ours, ref, **F64)
    w = torch.randn(ours.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    inputs = [q, *keys, *values]
    for a, r in zip(_grads(ours, w, inputs), _grads(ref, w, inputs), strict=False):
        torch.testing.assert_close(a, r, **F64)


def test_the_compiled_flex_path_compiles_at_most_twice_over_many_sequence_lengths(monkeypatch):
    """Each micro-batch has a new padded length T: our call (its block mask per T, its options) must not make dynamo
    compile a graph per length (past its cache limit, eager flex would materialise [B, H, T, T]). Counted on a
    backend that compiles flex here (aot_eager, forward: CPU has no flex backward); guards are the backend's own."""
    import random

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(flex_module.flex_attention, backend="aot_eager")
    monkeypatch.setattr(attention, "_compiled_flex_attention", lambda: compiled)
    rng = random.Random(0)
    lengths = [rng.randint(40, 700) for _ in range(24)]
    assert len(set(lengths)) > 20
    for t in lengths:
        q, k, v = torch.randn(1, 4, t, 16), torch.randn(1, 2, t, 16), torch.randn(1, 2, t, 16)
        out, lse = flex_causal_attention(q, k, v, 0.25)
        assert out.shape == (1, 4, t, 16) and lse.shape == (1, 4, t)
    assert 1 <= counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    torch._dynamo.reset()


def test_unknown_kernel_is_refused():
    q, keys, values = _inputs(1, 2, 2, 4, 4, 2)
    with pytest.raises(ValueError, match="kernel"):
        ttt_attention(q, keys, values, kernel="dense")


# ---------------------------------------------------------------------------------------------- memory shape


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op returns (forward and backward ops both pass through the dispatcher)."""

    def __init__(self):
        super().__init__()
        self.largest, self.calls = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out


@pytest.mark.parametrize("kernel", ["chunked", "naive"])
def test_no_op_makes_a_t_by_t_tensor_forward_or_backward(monkeypatch, kernel):
    """Steps 1..3 (no SDPA): with a chunk of 32 rows the largest tensor is one chunk's scores, [B, Hq, 32, T], an
    eighth of [T, T] here; the explicit-mask reference (the control) makes [T, T*(k+1)] ones."""
    monkeypatch.setattr(attention, "CHUNK", 32)
    b, hq, t = 1, 4, 256
    q, keys, values = _inputs(b, hq, 2, t, 8, 4, dtype=torch.float32)
    fn = naive_ttt_attention if kernel == "naive" else ttt_attention
    with _LargestTensor() as mode:
        outs = [fn(q, keys[: k + 1], values[: k + 1]) for k in range(1, 4)]
        forward_calls = mode.calls
        sum(o.sum() for o in outs).backward()
    assert mode.calls > forward_calls + 20  # the mode saw the backward's ops too
    if kernel == "naive":
        assert mode.largest >= t * t  # the [T, T*(k+1)] mask at least
    else:
        assert mode.largest <= b * hq * 32 * t


def _saved_bytes(fn) -> int:
    total = 0

    def pack(x):
        nonlocal total
        total += x.numel() * x.element_size()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn()
    return total


def test_what_backward_keeps_grows_linearly_in_t():
    """Saved for backward by all seven steps: doubling T doubles it (the [T, T] scores of the dense kernel would
    quadruple it)."""

    def saved(t):
        q, keys, values = _inputs(1, 4, 2, t, 16, 7, dtype=torch.float32)
        return _saved_bytes(lambda: [ttt_attention(q, keys[: k + 1], values[: k + 1]) for k in range(7)])

    small, large = saved(64), saved(128)
    assert 1.9 < large / small < 2.1, (small, large)


# ---------------------------------------------------------------------------------------------- autocast


def test_bf16_autocast_matches_the_float32_reference():
    """Mixed inputs as the model makes them under autocast (q, k fp32 after RoPE, v bf16): computed in bf16 with an
    fp32 softmax/LSE, output and gradients are within bf16 rounding of the fp32 reference."""
    q, keys, values = _inputs(1, 4, 2, 70, 16, 4, dtype=torch.float32, seed=9)
    values = [v.detach().bfloat16().requires_grad_() for v in values]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = ttt_attention(q, keys, values)
    assert ours.dtype == torch.bfloat16
    values32 = [v.detach().float().requires_grad_() for v in values]
    ref = naive_ttt_attention(q, keys, values32)
    torch.testing.assert_close(ours.float(), ref, atol=3e-2, rtol=3e-2)
    w = torch.randn(ours.shape, generator=torch.Generator().manual_seed(4))
    got = _grads(ours.float(), w, [q, *keys, *values])
    want = _grads(ref, w, [q, *keys, *values32])
    assert got[0].dtype == torch.float32 and got[-1].dtype == torch.bfloat16  # each leaf's own dtype
    for a, r in zip(got, want, strict=False):
        torch.testing.assert_close(a.float(), r, atol=5e-2, rtol=5e-2)


def _cuda_leaf(x):
    return x.detach().cuda().requires_grad_()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernel", ["flex", "chunked"])
@pytest.mark.parametrize("t", [200, 1024])
def test_cuda_kernels_match_the_reference(kernel, t):
    """On the GPU: fp32 within float32 tolerance (values and gradients), and bf16 autocast within bf16 rounding."""
    q, keys, values = _inputs(1, 8, 2, t, 64, 4, dtype=torch.float32, seed=t)
    q, keys, values = _cuda_leaf(q), [_cuda_leaf(k) for k in keys], [_cuda_leaf(v) for v in values]
    ours = ttt_attention(q, keys, values, kernel=kernel)
    ref = naive_ttt_attention(q, keys, values)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-3)
    w = torch.randn_like(ours)
    inputs = [q, *keys, *values]
    for a, r in zip(_grads(ours, w, inputs), _grads(ref, w, inputs), strict=False):
        torch.testing.assert_close(a, r, atol=1e-4, rtol=1e-3)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        low = ttt_attention(q, keys, values, kernel=kernel)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), ref, atol=3e-2, rtol=3e-2)
    for a, r in zip(_grads(low.float(), w, inputs), _grads(ref, w, inputs), strict=False):
        torch.testing.assert_close(a, r, atol=5e-2, rtol=5e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_flex_stays_fused_across_many_sequence_lengths():
    """Batches change T every step. After a dozen distinct lengths (past torch.compile's recompile limit, were
    each one a recompile) the flex path still runs fused: its peak stays under one bf16 [Hq, T, T] score tensor,
    which a fallback to eager flex_attention would exceed (it materialises fp32 scores)."""
    heads, last = 8, 4096

    def run(t):
        q, keys, values = _inputs(1, heads, 2, t, 64, 3, dtype=torch.bfloat16, seed=t)
        q, keys, values = _cuda_leaf(q), [_cuda_leaf(k) for k in keys], [_cuda_leaf(v) for v in values]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ttt_attention(q, keys, values, kernel="flex").float().sum().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    for t in (100, 130, 257, 400, 513, 640, 777, 900, 1000, 1500, 2047, 3000):
        run(t)
    assert run(last) < heads * last * last * 2


# ---------------------------------------------------------------------------------------------- checkpointing


def _layers(num_layers=2, hidden=32, heads=4, kv_heads=2):
    """Real decoder layers; only the fields they read (so the test does not follow the spec's other fields)."""
    spec = SimpleNamespace(
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        rms_norm_eps=1e-5,
        attention_bias=False,
        mlp_bias=False,
    )
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(DecoderLayer(spec, i) for i in range(num_layers)).double()
    for p in layers.parameters():
        p.data.normal_(0, 0.2)
    return layers


def _unroll(layers, embeds, hidden, steps, checkpointed):
    """A TTT unroll as the draft runs it: every step through every layer, one shared cache; returns the loss."""
    b, t, h = hidden.shape
    d = layers[0].self_attn.head_dim
    angles = torch.arange(t, dtype=torch.float64)[:, None] / 10 ** (torch.arange(d // 2) / d)  # [T, D/2]
    cache = KVCache(len(layers))
    loss = hidden.new_zeros(())
    for k in range(steps):
        emb = torch.cat((angles + k, angles + k), -1)[None].expand(b, t, d)
        cos, sin = emb.cos(), emb.sin()
        for layer in layers:
            hidden = ttt_layer_call(layer, embeds[k], hidden, cos, sin, cache, "ttt", checkpointed=checkpointed)
        loss = loss + (hidden * torch.linspace(-1, 1, h, dtype=hidden.dtype)).square().mean()
    return loss, cache


def test_checkpointed_ttt_steps_give_the_same_loss_and_gradients_and_keep_less():
    layers = _layers()
    gen = torch.Generator().manual_seed(4)
    embeds = [torch.randn(2, 9, 32, dtype=torch.float64, generator=gen) for _ in range(4)]
    hidden0 = torch.randn(2, 9, 32, dtype=torch.float64, generator=gen, requires_grad=True)
    calls = []
    hooks = [layer.register_forward_pre_hook(lambda m, a: calls.append(m.layer_idx)) for layer in layers]
    results, saved = {}, {}
    for checkpointed in (False, True):
        calls.clear()
        layers.zero_grad()
        hidden0.grad = None
        box = {}

        def forward(box=box, checkpointed=checkpointed):
            box["loss"], box["cache"] = _unroll(layers, embeds, hidden0, 4, checkpointed)

        saved[checkpointed] = _saved_bytes(forward)
        forward_calls = len(calls)
        box["loss"].backward()
        assert [box["cache"].steps(i) for i in range(2)] == [4, 4]  # one (k, v) per step, never more
        results[checkpointed] = (
            box["loss"].detach(),
            hidden0.grad.clone(),
            {n: p.grad.clone() for n, p in layers.named_parameters()},
        )
        # plain: each layer runs once per step; checkpointed: once more in the backward (the recomputation)
        assert (forward_calls, len(calls)) == ((8, 8) if not checkpointed else (8, 16))
    for h in hooks:
        h.remove()
    (loss_a, g_a, p_a), (loss_b, g_b, p_b) = results[False], results[True]
    torch.testing.assert_close(loss_b, loss_a, **F64)
    torch.testing.assert_close(g_b, g_a, **F64)
    for name in p_a:
        torch.testing.assert_close(p_b[name], p_a[name], **F64, msg=lambda m, name=name: f"{name}: {m}")
    assert saved[True] < 0.5 * saved[False], saved


def test_checkpointing_is_a_plain_call_without_grad():
    layers = _layers(num_layers=1)
    embeds = [torch.randn(1, 5, 32, dtype=torch.float64)] * 2
    hidden = torch.randn(1, 5, 32, dtype=torch.float64)
    with torch.no_grad():
        plain, _ = _unroll(layers, embeds, hidden, 2, checkpointed=False)
        ckpt, cache = _unroll(layers, embeds, hidden, 2, checkpointed=True)
    torch.testing.assert_close(ckpt, plain, **F64)
    assert cache.steps(0) == 2
