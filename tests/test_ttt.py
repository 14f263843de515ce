"""TTT: loss-mask alignment, the target distribution, loss normalisation and metrics."""

from __future__ import annotations

import pytest
import torch

from draftsmith.core import targets
from draftsmith.train.model import DraftSpec, Eagle3Draft
from draftsmith.train.ttt import (
    TargetDistribution,
    step_counts,
    step_views,
    summarise,
    target_distribution,
    ttt_forward,
)


def _tiny_draft(vocab=40, draft_vocab=16, hidden=32, layers=1, seed=0):
    cfg = DraftSpec(hidden_size=hidden, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=hidden // 4, num_hidden_layers=layers, rms_norm_eps=1e-5, hidden_act="silu",
                    max_position_embeddings=2048, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                    target_hidden_size=hidden, vocab_size=vocab, draft_vocab_size=draft_vocab, aux_layer_ids=[1, 2, 3])
    draft = Eagle3Draft(cfg)
    draft.init_weights(seed)
    with torch.no_grad():
        draft.embed_tokens.weight.normal_(generator=torch.Generator().manual_seed(seed + 1))
    draft.set_draft_vocab(torch.arange(0, 2 * draft_vocab, 2))
    return draft


def _random_target(b, t, vocab_d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(b, t, vocab_d, generator=gen) * 2, -1)
    return TargetDistribution(probs=probs, neg_entropy=(probs * probs.log()).sum(-1),
                              mass=torch.full((b, t), 0.9), argmax=torch.randint(0, 40, (b, t), generator=gen))


@pytest.mark.parametrize("layers", [1, 2])
def test_full_ttt_forward_matches_naive_reference(layers):
    draft = _tiny_draft(layers=layers).double()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 40, (2, 12), generator=gen)
    mask = torch.rand(2, 12, generator=gen) > 0.3
    aux = torch.randn(2, 12, 96, dtype=torch.float64, generator=gen)
    target = _random_target(2, 12, 16)
    target = TargetDistribution(*(x.double() if x.is_floating_point() else x for x in
                                  (target.probs, target.neg_entropy, target.mass, target.argmax)))
    results = {}
    for mode in ("ttt", "naive"):
        draft.zero_grad()
        out = ttt_forward(draft, ids, mask, aux, target, ttt_steps=5, mode=mode)
        out.loss.backward()
        results[mode] = (out, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None})
    (a, ga), (b, gb) = results["ttt"], results["naive"]
    torch.testing.assert_close(a.loss, b.loss)
    torch.testing.assert_close(a.correct, b.correct)
    assert ga.keys() == gb.keys() and "fc.weight" in ga
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], msg=name)


def test_loss_mask_is_aligned_with_the_predicted_token_at_every_step():
    """Hand-built: tokens 100..111; assistant tokens are 105..108 and 111; a perfect target predicts x_{j+1} at j."""
    x = torch.arange(100, 112)[None]  # [1, 12]
    loss_mask = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 1]], dtype=torch.bool)
    argmax = torch.cat((x[:, 1:], torch.tensor([[0]])), 1)  # target's top-1 at j is x_{j+1}
    target = TargetDistribution(probs=torch.zeros(1, 12, 3), neg_entropy=torch.zeros(1, 12), mass=torch.ones(1, 12),
                                argmax=argmax)
    for k in range(6):
        ids, _, _, _, tgt, mask = step_views(k, x, loss_mask, target)
        n = 12 - k - 2
        assert tgt.shape[1] == mask.shape[1] == n
        for t in range(n):
            assert ids[0, t] == x[0, t + k + 1]  # step k at t reads x_{t+k+1}
            assert tgt[0, t] == x[0, t + k + 2]  # ... and predicts x_{t+k+2}
            # the weight is the predicted token's own mask: 1 exactly for the assistant tokens
            assert bool(mask[0, t]) == (int(tgt[0, t]) in (105, 106, 107, 108, 111)), (k, t)
    # step counts: positions whose predicted token is an assistant token
    assert step_counts(loss_mask, 5).tolist() == [5, 5, 5, 5, 4]


def test_only_the_target_position_of_a_scored_token_reaches_the_loss():
    """x_6 is the only assistant token. Every step k predicts it from t = 4 - k towards p_5, so the loss depends on
    the target's distribution at position 5 only (an off-by-one would read p_4 or p_6)."""
    draft = _tiny_draft()
    ids = torch.randint(0, 40, (1, 10), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.zeros(1, 10, dtype=torch.bool)
    loss_mask[0, 6] = True
    aux = torch.randn(1, 10, 96, generator=torch.Generator().manual_seed(1))
    base = _random_target(1, 10, 16)

    def loss_with(position):
        probs = base.probs.clone()
        if position is not None:
            probs[0, position] = torch.softmax(torch.randn(16, generator=torch.Generator().manual_seed(9)), -1)
        target = TargetDistribution(probs, (probs * probs.log()).sum(-1), base.mass, base.argmax)
        with torch.no_grad():
            return ttt_forward(draft, ids, loss_mask, aux, target, ttt_steps=3)

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
    hook = layers[-1].register_forward_hook(lambda m, a, o: captured.setdefault("h", o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        logits = target(ids).logits
    hook.remove()
    draft_ids = torch.arange(0, 300, 3)
    head = targets.lm_head(target).weight
    dist = target_distribution(captured["h"], targets.final_norm(target), head, draft_ids)
    small = target_distribution(captured["h"], targets.final_norm(target), head, draft_ids, chunk_elements=500)
    expected = torch.softmax(logits[..., draft_ids], -1)
    torch.testing.assert_close(dist.probs, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(small.probs, dist.probs)
    assert torch.equal(dist.argmax, logits.argmax(-1))
    torch.testing.assert_close(dist.mass, torch.softmax(logits, -1)[..., draft_ids].sum(-1), atol=1e-5, rtol=1e-4)


def test_target_head_on_needed_positions_only_gives_the_same_ttt_result():
    from draftsmith.train.ttt import needed_positions

    draft = _tiny_draft()
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 40, (2, 12), generator=gen)
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[0, 5:] = True
    mask[1, 3:7] = True  # a second assistant turn ends mid-sample: positions after it are not needed
    aux = torch.randn(2, 12, 96, generator=gen)
    last = torch.randn(2, 12, 32, generator=gen)
    norm, weight = torch.nn.RMSNorm(32), torch.randn(40, 32, generator=gen)
    needed = needed_positions(mask)
    assert needed[0].tolist() == [False] * 4 + [True] * 7 + [False]
    assert needed[1].tolist() == [False] * 2 + [True] * 4 + [False] * 6
    full = target_distribution(last, norm, weight, draft.draft_to_target)
    part = target_distribution(last, norm, weight, draft.draft_to_target, needed=needed, chunk_elements=80)
    for name in ("probs", "neg_entropy", "mass", "argmax"):
        a, b = getattr(full, name), getattr(part, name)
        torch.testing.assert_close(b[needed], a[needed])
        assert not b[~needed].any(), name  # never computed
    with torch.no_grad():
        a = ttt_forward(draft, ids, mask, aux, full, ttt_steps=3)
        b = ttt_forward(draft, ids, mask, aux, part, ttt_steps=3)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-6)  # other chunking: float rounding only
    for name in ("kl_sum", "correct", "accept_sum", "count"):
        torch.testing.assert_close(getattr(b, name), getattr(a, name), rtol=1e-5, atol=1e-6)


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
    target = TargetDistribution(probs=probs, neg_entropy=(probs * probs.log()).sum(-1), mass=torch.ones(1, 9),
                                argmax=top + draft.d2t[top])
    out = ttt_forward(draft, ids, mask, aux, target, ttt_steps=1)
    assert abs(out.loss.item()) < 1e-5
    assert out.correct[0] == out.count[0] == 7
    torch.testing.assert_close(out.accept_sum[0], out.count[0], atol=1e-4, rtol=0)


def test_split_batches_with_a_shared_normaliser_give_the_combined_gradient():
    draft = _tiny_draft()
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 40, (4, 11), generator=gen)
    mask = torch.rand(4, 11, generator=gen) > 0.4
    aux = torch.randn(4, 11, 96, generator=gen)
    target = _random_target(4, 11, 16)

    def grads(parts):
        draft.zero_grad()
        norm = step_counts(mask, 3)
        for sl in parts:
            part = TargetDistribution(*(x[sl] for x in (target.probs, target.neg_entropy, target.mass, target.argmax)))
            ttt_forward(draft, ids[sl], mask[sl], aux[sl], part, 3, normaliser=norm).loss.backward()
        return draft.fc.weight.grad.clone()

    torch.testing.assert_close(grads([slice(0, 4)]), grads([slice(0, 1), slice(1, 4)]), atol=1e-6, rtol=1e-5)


def test_summary_and_simulated_acceptance_length():
    s = summarise(kl_sum=torch.tensor([2.0, 4.0]), correct=torch.tensor([8.0, 5.0]),
                  accept_sum=torch.tensor([9.0, 6.0]), count=torch.tensor([10.0, 10.0]), step_weight=0.5)
    assert s["acc"] == [0.8, 0.5]
    assert s["acceptance_length"] == pytest.approx(1 + 0.8 + 0.8 * 0.5)
    assert s["loss"] == pytest.approx(0.2 + 0.5 * 0.4)
    assert s["accept"] == [0.9, 0.6]
