"""TTT: loss-mask alignment (the host-built StepIndex), the target distribution, the fused KL, loss normalisation
and metrics."""

from __future__ import annotations

import contextlib

import pytest
import torch

from draftsmith.core import targets
from draftsmith.methods.dflash.modeling import DFlashDraft
from draftsmith.methods.eagle3.modeling import Eagle3Draft
from draftsmith.methods.objective import Anchors
from draftsmith.methods.spec import DraftSpec
from draftsmith.train import blocks
from draftsmith.train.block_loss import BlockKL, KLOptions, TargetStates, block_kl, target_states
from draftsmith.train.blocks import block_index, dflash_hidden_states
from draftsmith.train.objective import (
    ACCEPT,
    CORRECT,
    COUNT,
    KL,
    REDUCE_ROWS,
    TargetDistribution,
    TargetHead,
    TargetKL,
    _top1_logsumexp,
    expected_acceptance,
    materialised,
    summarise,
    target_distribution,
    ttt_forward,
)
from draftsmith.train.unrolled import step_counts, step_index


def _tiny_draft(vocab=40, draft_vocab=16, hidden=32, layers=1, seed=0, every=2):
    cfg = DraftSpec(
        hidden_size=hidden,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        num_hidden_layers=layers,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        target_hidden_size=hidden,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        aux_layer_ids=[1, 2, 3],
    )
    draft = Eagle3Draft(cfg)
    draft.init_weights(seed)
    with torch.no_grad():
        draft.embed_tokens.weight.normal_(generator=torch.Generator().manual_seed(seed + 1))
    draft.set_draft_vocab(torch.arange(0, every * draft_vocab, every))
    return draft


def _random_probs(b, t, vocab_d, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(b, t, vocab_d, generator=gen, dtype=dtype) * 2, -1)


def _compact(probs: torch.Tensor, index, mass=0.9, argmax=None) -> TargetDistribution:
    """A [B, T, Vd] distribution at the index's needed rows (what TargetHead returns)."""
    p = probs.flatten(0, 1)[index.needed]
    n = p.shape[0]
    gen = torch.Generator().manual_seed(1)
    top = argmax.flatten()[index.needed] if argmax is not None else torch.randint(0, 40, (n,), generator=gen)
    return TargetDistribution(p, (p * p.log()).sum(-1), torch.full((n,), mass, dtype=p.dtype), top)


@pytest.mark.parametrize("layers", [1, 2])
def test_full_ttt_forward_matches_naive_reference(layers):
    draft = _tiny_draft(layers=layers).double()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 40, (2, 12), generator=gen)
    mask = torch.rand(2, 12, generator=gen) > 0.3
    aux = torch.randn(2, 12, 96, dtype=torch.float64, generator=gen)
    index = step_index(mask.numpy(), 5)
    target = _compact(_random_probs(2, 12, 16, dtype=torch.float64), index)
    results = {}
    for mode in ("ttt", "naive"):
        draft.zero_grad()
        out = ttt_forward(draft, ids, aux, target, index, ttt_steps=5, mode=mode)
        out.loss.backward()
        results[mode] = (out, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None})
    (a, ga), (b, gb) = results["ttt"], results["naive"]
    torch.testing.assert_close(a.loss, b.loss)
    torch.testing.assert_close(a.sums, b.sums)
    assert ga.keys() == gb.keys() and "fc.weight" in ga
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], msg=name)


def test_loss_mask_is_aligned_with_the_predicted_token_at_every_step():
    """Hand-built: tokens 100..111; assistant tokens are 105..108 and 111; step k at t reads x_{t+k+1}, is scored
    where x_{t+k+2} is an assistant token, and reads the target's p_{t+k+1}."""
    x = torch.arange(100, 112)[None]  # [1, 12]
    loss_mask = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 1]], dtype=torch.bool)
    index = step_index(loss_mask.numpy(), 6)
    assert index.needed.tolist() == [4, 5, 6, 7, 10]  # p_j is read where x_{j+1} is an assistant token
    for k in range(6):
        rows = index.scored[k].tolist()
        assert all(t < 12 - k - 2 for t in rows)
        predicted = [int(x[0, t + k + 2]) for t in rows]
        expected = [
            int(x[0, t + k + 2]) for t in range(12 - k - 2) if int(x[0, t + k + 2]) in (105, 106, 107, 108, 111)
        ]
        assert predicted == expected, k
        assert [int(index.needed[i]) for i in index.target[k]] == [t + k + 1 for t in rows], k
    assert index.counts.tolist() == [5, 5, 5, 5, 4, 3]
    assert step_counts(loss_mask, 6).tolist() == index.counts.tolist()


def test_step_index_rows_stay_inside_their_sample():
    mask = torch.rand(3, 9, generator=torch.Generator().manual_seed(2)) > 0.4
    mask[2, 5:] = False  # padding
    index = step_index(mask.numpy(), 4)
    for k in range(4):
        b, t = index.scored[k] // 9, index.scored[k] % 9
        assert bool(mask[b, t + k + 2].all())
        j = index.needed[index.target[k]]
        assert torch.equal(j // 9, b) and torch.equal(j % 9, t + k + 1)


def test_only_the_target_position_of_a_scored_token_reaches_the_loss():
    """x_6 is the only assistant token. Every step k predicts it from t = 4 - k towards p_5, so the loss depends on
    the target's distribution at position 5 only (an off-by-one would read p_4 or p_6)."""
    draft = _tiny_draft()
    ids = torch.randint(0, 40, (1, 10), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.zeros(1, 10, dtype=torch.bool)
    loss_mask[0, 6] = True
    aux = torch.randn(1, 10, 96, generator=torch.Generator().manual_seed(1))
    base = _random_probs(1, 10, 16)
    index = step_index(loss_mask.numpy(), 3)

    def loss_with(position):
        probs = base.clone()
        if position is not None:
            probs[0, position] = torch.softmax(torch.randn(16, generator=torch.Generator().manual_seed(9)), -1)
        with torch.no_grad():
            return ttt_forward(draft, ids, aux, _compact(probs, index), index, ttt_steps=3)

    ref = loss_with(None)
    assert ref.count.tolist() == [1, 1, 1]
    for j in range(10):
        changed = not torch.allclose(loss_with(j).loss, ref.loss)
        assert changed == (j == 5), j


def test_target_distribution_matches_the_target_model_and_is_chunk_invariant(tiny_target_dir):
    target = targets.load_target(tiny_target_dir)
    ids = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(0))
    captured = {}
    layers = targets.decoder_layers(target)
    hook = layers[-1].register_forward_hook(
        lambda m, a, o: captured.setdefault("h", o[0] if isinstance(o, tuple) else o)
    )
    with torch.no_grad():
        logits = target(ids).logits.flatten(0, 1)
    hook.remove()
    rows = captured["h"].flatten(0, 1)
    draft_ids = torch.arange(0, 300, 3)
    weight, norm = targets.lm_head(target).weight, targets.final_norm(target)
    dist = target_distribution(rows, norm, weight, weight[draft_ids])
    small = target_distribution(rows, norm, weight, weight[draft_ids], chunk_elements=500)
    expected = torch.softmax(logits[..., draft_ids], -1)
    torch.testing.assert_close(dist.probs, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(small.probs, dist.probs)
    assert torch.equal(dist.argmax, logits.argmax(-1))
    torch.testing.assert_close(dist.mass, torch.softmax(logits, -1)[..., draft_ids].sum(-1), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(dist.neg_entropy, (expected * expected.log()).sum(-1), atol=1e-5, rtol=1e-4)
    lean = target_distribution(rows, norm, weight, weight[draft_ids], full=False)
    assert lean.mass is None and lean.argmax is None
    assert torch.equal(lean.probs, dist.probs) and torch.equal(lean.neg_entropy, dist.neg_entropy)  # the loss's


def test_target_head_reads_the_needed_rows_only():
    gen = torch.Generator().manual_seed(11)
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[0, 5:] = True
    mask[1, 3:7] = True  # a second assistant turn ends mid-sample: positions after it are not needed
    index = step_index(mask.numpy(), 3)
    last = torch.randn(2, 12, 32, generator=gen)
    norm, weight, ids = torch.nn.RMSNorm(32), torch.randn(40, 32, generator=gen), torch.arange(0, 32, 2)
    head = TargetHead(norm, weight, ids)
    assert index.needed.tolist() == [4, 5, 6, 7, 8, 9, 10] + [12 + j for j in (2, 3, 4, 5)]
    part = head(last, index)
    nan_elsewhere = last.clone()
    nan_elsewhere.view(24, 32)[[j for j in range(24) if j not in index.needed.tolist()]] = float("nan")
    torch.testing.assert_close(head(nan_elsewhere, index).probs, part.probs)  # nothing else is read
    dense = torch.softmax(norm(last.flatten(0, 1)) @ weight[ids].T, -1)[index.needed]
    torch.testing.assert_close(part.probs, dense, atol=1e-6, rtol=1e-5)
    strided = torch.randn(2, 12, 4, 32, generator=gen)
    strided[:, :, -1] = last
    torch.testing.assert_close(head(strided[:, :, -1], index).probs, part.probs)  # a layer of [B, T, L, H]


def test_fused_kl_matches_log_softmax_and_its_gradient():
    gen = torch.Generator().manual_seed(4)
    z = torch.randn(7, 11, dtype=torch.float64, generator=gen, requires_grad=True)
    probs = torch.softmax(torch.randn(9, 11, dtype=torch.float64, generator=gen), -1)
    rows = torch.tensor([0, 3, 3, 8, 1, 2, 5])
    neg_ent = (probs * probs.log()).sum(-1)
    kl = TargetKL.apply(z, probs, rows, neg_ent)
    reference = (probs[rows] * (probs[rows].log() - torch.log_softmax(z, -1))).sum(-1)
    torch.testing.assert_close(kl, reference)
    assert torch.autograd.gradcheck(lambda z: TargetKL.apply(z, probs, rows, neg_ent), (z,))
    half = TargetKL.apply(z.detach().bfloat16().requires_grad_(), probs.float(), rows, neg_ent.float())
    assert half.dtype == torch.float32  # bf16 logits are summed in fp32


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_row_sliced_reductions_equal_the_whole_tensor_ones(dtype):
    """top-1, logsumexp, the fused KL with its gradient and the expected acceptance, computed REDUCE_ROWS rows at a
    time, equal the same quantities over the whole tensor -- over 2.5 slices, so the slice edges are crossed."""
    gen = torch.Generator().manual_seed(11)
    n, vd = REDUCE_ROWS * 2 + REDUCE_ROWS // 2, 37
    z = (3 * torch.randn(n, vd, generator=gen, dtype=torch.float64)).to(dtype)
    top, lse = _top1_logsumexp(z)
    wide = z.to(torch.promote_types(dtype, torch.float32))
    assert lse.dtype == wide.dtype and torch.equal(top, z.argmax(-1))
    torch.testing.assert_close(lse, torch.logsumexp(wide, -1))
    assert lse.std() > 0.1  # the rows differ: a slice mix-up would show
    probs = torch.softmax(torch.randn(n + 9, vd, generator=gen, dtype=torch.float64), -1).to(wide.dtype)
    rows = torch.randint(0, n + 9, (n,), generator=gen)
    neg_ent = (probs * probs.log()).sum(-1)
    mass = torch.rand(n + 9, generator=gen, dtype=torch.float64).to(wide.dtype)
    leaf = z.detach().requires_grad_()
    kl = TargetKL.apply(leaf, probs, rows, neg_ent, lse)
    reference = (probs[rows] * (probs[rows].log() - torch.log_softmax(wide, -1))).sum(-1)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype != torch.float64 else {}
    torch.testing.assert_close(kl, reference, **tol)
    assert reference.min() > 0.01
    weights = torch.rand(n, generator=gen, dtype=torch.float64).to(wide.dtype)
    (kl * weights).sum().backward()
    expected = ((torch.softmax(wide, -1) - probs[rows]) * weights[:, None]).to(dtype)
    torch.testing.assert_close(leaf.grad, expected, **tol)
    if dtype == torch.float64:
        fresh = leaf.detach().requires_grad_()
        assert torch.autograd.gradcheck(lambda x: TargetKL.apply(x, probs, rows, neg_ent), (fresh,))
    target = TargetDistribution(probs, neg_ent, mass, None)
    dense = torch.minimum(probs[rows] * mass[rows][:, None], torch.softmax(wide, -1)).sum()
    accept = expected_acceptance(z, lse, target, rows)
    assert accept.shape == (n,) and dense > 1
    torch.testing.assert_close(accept.double().sum(), dense.double(), **tol)


def test_a_bf16_target_head_keeps_its_weights_in_bf16_and_matches_autocast():
    gen = torch.Generator().manual_seed(12)
    norm = torch.nn.RMSNorm(32, eps=1e-5)
    weight, ids = torch.randn(90, 32, generator=gen), torch.arange(0, 90, 2)
    last, mask = torch.randn(2, 12, 32, generator=gen), torch.ones(2, 12, dtype=torch.bool)
    index = step_index(mask.numpy(), 2)
    fp32, bf16 = TargetHead(norm, weight, ids), TargetHead(norm, weight, ids, torch.bfloat16)
    assert bf16.weight.dtype == bf16.draft_weight.dtype == torch.bfloat16 and weight.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast rounds the fp32 weights the same way
        a, b = fp32(last.bfloat16(), index), bf16(last.bfloat16(), index)
    assert torch.equal(a.probs, b.probs) and torch.equal(a.argmax, b.argmax) and torch.equal(a.mass, b.mass)
    assert a.probs.dtype == torch.float32 and not torch.equal(a.probs, fp32(last, index).probs)


def test_kl_is_zero_and_acceptance_one_when_draft_equals_target():
    """With the target set to the draft's own distribution the KL is 0, top-1 agrees and sum min(p, q) is 1."""
    draft = _tiny_draft()
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 40, (1, 9), generator=gen)
    aux = torch.randn(1, 9, 96, generator=gen)
    mask = torch.ones(1, 9, dtype=torch.bool)
    with torch.no_grad():
        step0_ids = torch.nn.functional.pad(ids[:, 1:], (0, 1))
        logits, _ = draft(step0_ids, draft.fuse(aux), torch.arange(9)[None], mode="ttt")
    q = torch.softmax(logits, -1)  # step 0's q at t is trained towards p_{t+1}: shift by one
    probs = torch.cat((q[:, :1], q[:, :-1]), 1)
    top = probs.argmax(-1)
    index = step_index(mask.numpy(), 1)
    target = _compact(probs, index, mass=1.0, argmax=top + draft.d2t[top])
    out = ttt_forward(draft, ids, aux, target, index, ttt_steps=1)
    assert abs(out.loss.item()) < 1e-5
    assert out.sums[1, 0] == out.count[0] == 7
    torch.testing.assert_close(out.sums[2, 0], out.count[0], atol=1e-4, rtol=0)
    lean = ttt_forward(draft, ids, aux, target, index, ttt_steps=1, metrics=False)
    assert torch.equal(lean.loss, out.loss) and lean.sums[1:3].abs().sum() == 0  # no metrics, the same loss


def test_split_batches_with_a_shared_normaliser_give_the_combined_gradient():
    draft = _tiny_draft()
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 40, (4, 11), generator=gen)
    mask = torch.rand(4, 11, generator=gen) > 0.4
    aux = torch.randn(4, 11, 96, generator=gen)
    probs = _random_probs(4, 11, 16)

    def grads(parts):
        draft.zero_grad()
        norm = step_counts(mask, 3)
        for sl in parts:
            index = step_index(mask[sl].numpy(), 3)
            ttt_forward(draft, ids[sl], aux[sl], _compact(probs[sl], index), index, 3, normaliser=norm).loss.backward()
        return draft.fc.weight.grad.clone()

    torch.testing.assert_close(grads([slice(0, 4)]), grads([slice(0, 1), slice(1, 4)]), atol=1e-6, rtol=1e-5)


def test_summary_and_simulated_acceptance_length():
    s = summarise(
        kl_sum=torch.tensor([2.0, 4.0]),
        correct=torch.tensor([8.0, 5.0]),
        accept_sum=torch.tensor([9.0, 6.0]),
        count=torch.tensor([10.0, 10.0]),
        step_weight=0.5,
    )
    assert s["acc"] == [0.8, 0.5]
    assert s["acceptance_length"] == pytest.approx(1 + 0.8 + 0.8 * 0.5)
    assert s["loss"] == pytest.approx(0.2 + 0.5 * 0.4)
    assert s["accept"] == [0.9, 0.6]


@pytest.mark.parametrize("layers", [1, 2])
def test_mlp_on_live_rows_only_gives_the_same_loss_and_gradients(layers):
    draft = _tiny_draft(layers=layers).double()
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(0, 40, (3, 13), generator=gen)
    mask = torch.rand(3, 13, generator=gen) > 0.5
    mask[2, 8:] = False  # padding
    aux = torch.randn(3, 13, 96, dtype=torch.float64, generator=gen)
    index = step_index(mask.numpy(), 4)
    assert all(len(index.live[k]) < 39 for k in range(4))  # something is skipped
    assert all(set(index.scored[k].tolist()) <= set(index.live[k].tolist()) for k in range(4))
    target = _compact(_random_probs(3, 13, 16, dtype=torch.float64), index)
    results = []
    for live in (False, True):
        draft.zero_grad()
        out = ttt_forward(draft, ids, aux, target, index, ttt_steps=4, live_rows=live)
        out.loss.backward()
        results.append((out, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}))
    (a, ga), (b, gb) = results
    torch.testing.assert_close(b.loss, a.loss)
    torch.testing.assert_close(b.sums, a.sums)
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], msg=name)


def test_compiled_layers_make_a_fixed_number_of_graphs_over_many_lengths_and_match_eager(monkeypatch):
    """`--compile` compiles each decoder layer (dynamic shapes): micro-batches of ~24 lengths and 5 TTT steps in one
    process must not make a graph per length or per step (the cache list and the attention's per-length code stay
    outside the layer's graph), or dynamo recompiles every step until its limit sends the layer back to eager.
    Counted on the eager backend (it traces as inductor does, without generating code); the loss and gradients
    equal the uncompiled draft's."""
    import random

    from torch._dynamo.utils import counters

    rng = random.Random(0)
    lengths = [rng.randint(20, 90) for _ in range(24)]
    assert len(set(lengths)) > 18
    eager, compiled = _tiny_draft(layers=2), _tiny_draft(layers=2)
    torch._dynamo.reset()
    counters.clear()
    for layer in compiled.layers:
        layer.compile(dynamic=True, backend="eager")
    graphs = []
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)  # not a silent fall to eager
    for i, t in enumerate(lengths):
        gen = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 40, (1, t), generator=gen)
        mask = torch.rand(1, t, generator=gen) > 0.3
        aux = torch.randn(1, t, 96, generator=gen)
        index = step_index(mask.numpy(), 5)
        target = _compact(_random_probs(1, t, 16, seed=i), index)
        if i % 8 == 0:
            outs = []
            for draft in (eager, compiled):
                draft.zero_grad()
                out = ttt_forward(draft, ids, aux, target, index, ttt_steps=5)
                out.loss.backward()
                outs.append((out.loss, draft.fc.weight.grad.clone()))
            torch.testing.assert_close(outs[0], outs[1])
            assert outs[0][1].abs().sum() > 0
        else:
            ttt_forward(compiled, ids, aux, target, index, ttt_steps=5).loss.backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[-1] == graphs[1] <= 24, graphs  # the first two lengths make them all
    torch._dynamo.reset()


def test_the_attention_kernel_is_the_models_setting_not_the_environment(monkeypatch):
    """`train --attention-kernel` reaches the attention through TTTModel (no environment variable read on the hot
    path): an unknown kernel is refused there; chunked and auto give the same loss on the CPU."""
    from draftsmith.config import TrainConfig
    from draftsmith.train.objective import TTTModel

    assert TrainConfig(data="d", attention_kernel="chunked").attention_kernel == "chunked"
    draft = _tiny_draft(layers=2).double()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 40, (1, 12), generator=gen)
    aux = torch.randn(1, 12, 96, dtype=torch.float64, generator=gen)
    index = step_index((torch.rand(1, 12, generator=gen) > 0.3).numpy(), 3)
    target = _compact(_random_probs(1, 12, 16, dtype=torch.float64), index)
    monkeypatch.setenv("DRAFTSMITH_TTT_KERNEL", "flex")  # the old switch: read no more
    losses = [TTTModel(draft, kernel)(ids, aux, target, index, 3).loss for kernel in ("chunked", "auto")]
    torch.testing.assert_close(losses[0], losses[1])
    assert losses[0] > 0
    with pytest.raises(ValueError, match="TTT attention kernel 'dense'"):
        TTTModel(draft, "dense")(ids, aux, target, index, 3)


# ---------------------------------------------------------------------------------------------- DFlash over row slices


def _tiny_dflash(vocab=50, hidden=32, block=4, dtype=torch.float64) -> DFlashDraft:
    spec = DraftSpec(
        hidden_size=hidden,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        num_hidden_layers=2,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        target_hidden_size=hidden,
        vocab_size=vocab,
        draft_vocab_size=vocab,
        aux_layer_ids=[1, 2, 3],
        method="dflash",
        block_size=block,
        mask_token_id=7,
    )
    draft = DFlashDraft(spec)
    draft.init_weights(1)
    gen = torch.Generator().manual_seed(2)
    draft.set_target(torch.randn(vocab, hidden, generator=gen), torch.randn(vocab, hidden, generator=gen) * 0.5)
    with torch.no_grad():  # a trained-looking final norm (its gradient is compared too)
        draft.norm.weight.uniform_(0.5, 1.5, generator=gen)
    return draft.to(dtype)


def _dflash_problem(dtype):
    """A DFlash draft, a two-sample batch (one right-padded) with 40 blocks of 4 per sample and the target's head:
    the draft's own lm_head (as in training: both are the target's), with its final norm."""
    draft = _tiny_dflash(dtype=dtype)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 50, (2, 70), generator=gen)
    mask = torch.ones(2, 70, dtype=torch.bool)
    mask[1, 50:] = False
    index = block_index(mask.numpy(), Anchors(4, 40, 0), [0, 1])
    aux = torch.randn(2, 70, 96, dtype=dtype, generator=gen)
    last = torch.randn(2, 70, 32, dtype=dtype, generator=gen) * 2
    norm = torch.nn.RMSNorm(32, eps=1e-5, dtype=dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0, generator=gen)
    return draft, ids, aux, last, index, norm


@pytest.mark.parametrize("precision", ["fp64", "fp32", "bf16"])
def test_dflash_loss_over_row_slices_equals_the_unfused_loss_gradient_and_metrics(precision, monkeypatch):
    """ttt_forward on TargetHead's TargetStates (BlockKL: never [N, V]) against the same batch on the materialised
    distribution (the unfused path: DFlashDraft.logits, TargetKL, expected_acceptance): the loss, every trained
    parameter's gradient (draft.norm's included: it stays in autograd) and the metrics, in fp64, fp32 and under
    bf16 autocast with a bf16 head (the CPU trainer's default), over several row slices."""
    dtype = torch.float64 if precision == "fp64" else torch.float32
    draft, ids, aux, last, index, norm = _dflash_problem(dtype)
    head = TargetHead(
        norm, draft.head_weight.clone(), draft.draft_to_target, torch.bfloat16 if precision == "bf16" else None
    )
    names, params = zip(*((n, p) for n, p in draft.named_parameters() if p.requires_grad), strict=False)
    monkeypatch.setattr(blocks, "HEAD_ROWS", 100)  # the matmuls' slices (100 rows) and the reductions' (64) both cross
    assert sum(len(r) for r in index.scored) > 3 * REDUCE_ROWS  # their edges
    runs = []
    with torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext():
        states = head(last, index)
        assert isinstance(states, TargetStates) and states.states.shape == (len(index.needed), 32)
        for target in (states, materialised(states)):
            out = ttt_forward(draft, ids, aux, target, index, 3, 0.9)
            runs.append((out, torch.autograd.grad(out.loss, params)))
    (fused, g_fused), (plain, g_plain) = runs
    # non-trivial values first: a comparison of zeros would pass whatever the fused path computed
    assert fused.loss.item() > 0.5 and all(g.abs().sum() > 0 for g in g_fused)
    assert "norm.weight" in names and len(names) > 10  # the final norm and every layer's weights
    count = fused.sums[COUNT]
    assert (fused.sums[CORRECT] > 0).all() and (fused.sums[CORRECT] < count).all()
    assert (fused.sums[ACCEPT] > 0.02 * count).all() and (fused.sums[ACCEPT] < count).all()
    # the same arithmetic in the same dtypes: equal to rounding (measured here: the loss and sums bit for bit, the
    # gradients within 1e-16 (fp64) / 8e-8 (fp32, bf16) of their norm: the hidden states' gradient adds the rows up
    # in another order)
    rounding = 1e-12 if precision == "fp64" else 1e-6
    torch.testing.assert_close(fused.loss, plain.loss, rtol=rounding, atol=0)
    torch.testing.assert_close(fused.sums[[KL, ACCEPT]], plain.sums[[KL, ACCEPT]], rtol=rounding, atol=0)
    assert torch.equal(fused.sums[[CORRECT, COUNT]], plain.sums[[CORRECT, COUNT]])
    for name, a, b in zip(names, g_fused, g_plain, strict=False):
        assert (a - b).norm() <= rounding * b.norm(), name
    if precision == "fp64":  # and both equal the dense definition
        ref = _dense_block_loss(draft, ids, aux, last, index, norm, 0.9)
        torch.testing.assert_close(fused.loss, ref, rtol=1e-6, atol=0)


def _dense_block_loss(draft, ids, aux, last, index, norm, step_weight):
    """sum_j step_weight**(j-1) * mean over block position j's scored rows of KL(p || q), from whole [*, V] tensors."""
    with torch.no_grad():
        hidden = next(dflash_hidden_states(draft, ids, aux, index)).flatten(0, 1)
        logq = torch.log_softmax(draft.logits(hidden), -1)
        logp = torch.log_softmax(norm(last.flatten(0, 1)) @ draft.head_weight.T, -1)[index.needed]
    loss = 0.0
    for k, (rows, at) in enumerate(zip(index.scored, index.target, strict=False)):
        kl = (logp[at].exp() * (logp[at] - logq[rows])).sum(-1)
        loss = loss + step_weight**k * kl.sum() / max(len(rows), 1)
    return loss


@pytest.mark.parametrize("group", [True, False])
def test_block_kl_is_the_dense_kl_with_an_exact_gradient_for_any_upstream_gradient(group):
    """BlockKL per row against the dense definition (KL, top-1 agreement, sum min(p, q)), its gradient by
    gradcheck with hints that are and are not the upstream gradient, and what it keeps for the backward: the rows'
    gradient [N, H], not logits [N, V]. group: the rows taken by target row (a CPU's way) or as they come (a GPU's)."""
    gen = torch.Generator().manual_seed(21)
    n, v, h, needed = 2 * REDUCE_ROWS + 9, 300, 8, 40
    weight = torch.randn(v, h, dtype=torch.float64, generator=gen)
    states = target_states(torch.randn(needed, h, dtype=torch.float64, generator=gen), torch.nn.Identity(), weight)
    x = torch.randn(n, h, dtype=torch.float64, generator=gen, requires_grad=True)
    at = torch.randint(0, needed, (n,), generator=gen)
    logp = torch.log_softmax((states.states @ weight.T).float(), -1).double()[at]  # target_distribution's fp32 p
    logq = torch.log_softmax(x @ weight.T, -1)
    kl, correct, accept = block_kl(x, weight, states, at, rows=48, sub=20, group=group)  # both slicings' edges
    dense = (logp.exp() * (logp - logq)).sum(-1)
    assert dense.min() > 0.05 and 0 < int(correct.sum()) < n
    torch.testing.assert_close(kl, dense, rtol=1e-5, atol=1e-7)  # p is fp32, as the unfused path's
    assert torch.equal(correct, logq.argmax(-1) == states.argmax[at])
    torch.testing.assert_close(accept, torch.minimum(logp.exp(), logq.exp()).sum(-1), rtol=1e-6, atol=1e-8)
    saved = kl.grad_fn.saved_tensors
    assert max(t.numel() for t in saved if t is not None) == n * h  # the rows' gradient, no [N, V]
    upstream = torch.rand(n, dtype=torch.float64, generator=gen) + 0.5
    (g,) = torch.autograd.grad((kl * upstream).sum(), x)
    (ref,) = torch.autograd.grad((dense * upstream).sum(), x)
    torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6)
    small = x.detach()[:7].requires_grad_()
    for hint in (None, upstream[:7], torch.zeros(7, dtype=torch.float64)):
        fn = lambda y: BlockKL.apply(
            y,
            weight,
            states,
            at[:7],
            hint if hint is not None else torch.ones(7, dtype=torch.float64),  # noqa: B023 - called within this iteration
            None,
            None,
            None,
            KLOptions(rows=3, sub=2, metrics=False, group=group),
        )[0]  # noqa: E731
        if hint is not None and not hint.any():  # a zero hint: no gradient (ttt_forward never gives one)
            assert fn(small).requires_grad and torch.autograd.grad(fn(small).sum(), small)[0].abs().sum() == 0
        else:
            assert torch.autograd.gradcheck(fn, (small,), fast_mode=True)
    with pytest.raises(ValueError, match="top-1"):
        block_kl(x, weight, target_states(states.states, torch.nn.Identity(), weight, full=False), at)


def test_a_whole_vocabulary_target_head_keeps_the_normed_rows_and_materialises_the_same_distribution():
    """TargetHead over the target's whole vocabulary returns TargetStates ([N, H]); materialised() gives exactly what
    it returned before (target_distribution), and an EAGLE-3 draft over the whole vocabulary trains on it as on that."""
    gen = torch.Generator().manual_seed(13)
    draft = _tiny_draft(vocab=40, draft_vocab=40, every=1)
    norm, weight = torch.nn.RMSNorm(32, eps=1e-5), torch.randn(40, 32, generator=gen)
    ids, aux = torch.randint(0, 40, (2, 12), generator=gen), torch.randn(2, 12, 96, generator=gen)
    mask = torch.rand(2, 12, generator=gen) > 0.3
    index = step_index(mask.numpy(), 3)
    last = torch.randn(2, 12, 32, generator=gen)
    head = TargetHead(norm, weight, draft.draft_to_target)
    states, lean = head(last, index), head(last, index, full=False)
    assert isinstance(states, TargetStates) and lean.argmax is None and states.argmax is not None
    before = target_distribution(last.flatten(0, 1)[index.needed], norm, weight, weight)
    after = materialised(states)
    for a, b in ((after.probs, before.probs), (after.neg_entropy, before.neg_entropy), (after.argmax, before.argmax)):
        assert torch.equal(a, b)
    torch.testing.assert_close(after.mass, before.mass)
    torch.testing.assert_close(states.states, norm(last.flatten(0, 1)[index.needed]))
    torch.testing.assert_close(states.neg_entropy, before.neg_entropy)
    a, b = (ttt_forward(draft, ids, aux, t, index, 3) for t in (states, before))
    assert a.loss > 0 and torch.equal(a.loss, b.loss) and torch.equal(a.sums, b.sums)
    assert materialised(before) is before
