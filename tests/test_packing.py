"""Tree-packed batches (train/packing.py): a conversation's samples in one sequence give the per-sample layout's loss,
metrics and gradients, for every drafting method (the unrolled objective's and the block objective's), in fp64, and
within bf16's rounding in bf16."""

from __future__ import annotations

import pytest
import torch

from draftsmith.core.manifest import TargetIdentity
from draftsmith.extract import store
from draftsmith.methods import attention
from draftsmith.methods.dflash.modeling import DFlashDraft
from draftsmith.methods.dspark.modeling import DSparkDraft
from draftsmith.methods.eagle3.modeling import Eagle3Draft
from draftsmith.methods.objective import COD, Anchors, Steps
from draftsmith.methods.spec import DraftSpec
from draftsmith.train.batches import Sampling, TokenBudgetSampler
from draftsmith.train.objective import TargetHead, ttt_forward
from draftsmith.train.packing import TreeSampler, margin

H, V, K = 32, 50, 4  # target hidden, vocabulary, TTT steps
# sample -> (parent, tokens shared, tokens of its own): 1 and 3 branch from 0 (3 within K of 0's start), 2 from 1 inside
# 0's prefix and beyond, 5 from 2 (rows of four samples), 4 and 6 share nothing; 6 is a second tree's root.
TREE = {0: (-1, 0, 40), 1: (0, 30, 15), 2: (1, 38, 12), 3: (0, 3, 20), 4: (-1, 0, 25), 5: (2, 44, 10), 6: (-1, 0, 9)}
# what each sample supervises, shared positions included: a tool result or a declaration never, the target's turns as
# rendered (a child may supervise a shared token its parent does not, and the other way round)
SUPERVISED = 0.55


def _samples(seed: int = 0) -> dict[int, dict]:
    g = torch.Generator().manual_seed(seed)
    out: dict[int, dict] = {}
    for i, (parent, shared, own) in TREE.items():
        ids = torch.randint(0, V, (own,), generator=g)
        states = torch.randn(own, 4, H, generator=g) * 2
        if parent >= 0:
            ids = torch.cat([out[parent]["input_ids"][:shared], ids])
            states = torch.cat([out[parent]["hidden_states"][:shared], states])
        out[i] = {
            "input_ids": ids,
            "loss_mask": torch.rand(len(ids), generator=g) < SUPERVISED,
            "hidden_states": states,
        }
    return out


@pytest.fixture(scope="module")
def chained(tmp_path_factory):
    """A store of the branching samples, each shared row once (what extract writes)."""
    target = TargetIdentity(
        path="/t",
        architecture="LlamaForCausalLM",
        config_hash="c",
        tokenizer_hash="t",
        num_layers=4,
        hidden_size=H,
        vocab_size=V,
    )
    spec = store.StoreSpec(target=target, layer_ids=[1, 2, 3, 4], hidden_size=H, dtype="bf16")
    path = tmp_path_factory.mktemp("tree") / "store"
    samples = _samples()
    with store.create_or_resume(path, spec, worker="0/1", shard_bytes=4000) as writer:
        for i, s in samples.items():
            parent, shared, _ = TREE[i]
            writer.add(i, s["input_ids"], s["loss_mask"], s["hidden_states"][shared:], None, parent, shared)
    return path


def _spec(method: str, layers: int) -> DraftSpec:
    block = method in ("dflash", "dspark")
    return DraftSpec(
        hidden_size=H,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=layers,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        target_hidden_size=H,
        vocab_size=V,
        draft_vocab_size=V if block else 20,
        aux_layer_ids=[1, 2, 3],
        method=method,
        mask_token_id=7 if method in ("peagle", "dflash", "dspark") else None,
        block_size=4 if block else None,
        markov_rank=8 if method == "dspark" else None,
        fc_norm=method == "eagle3.1",
        norm_output=method == "eagle3.1",
    )


def _draft(method: str, layers: int) -> tuple[Eagle3Draft | DFlashDraft, Sampling, TargetHead]:
    """A random draft of `method` in fp64, what its batches draw, and a target head for it."""
    spec = _spec(method, layers)
    g = torch.Generator().manual_seed(5)
    norm, weight = torch.nn.RMSNorm(H).double(), torch.randn(V, H, generator=g, dtype=torch.float64)
    if method in ("dflash", "dspark"):
        block = (DSparkDraft if method == "dspark" else DFlashDraft)(spec)
        block.init_weights(1)
        block.set_target(torch.randn(V, H, generator=g), weight.float())
        block = block.double()
        anchors = Anchors(4, 6, seed=2, from_anchor=method == "dspark")  # 6 of each sample's candidates, drawn
        return block, Sampling(anchors), TargetHead(norm, block.head_weight.clone(), block.draft_to_target)
    draft = Eagle3Draft(spec)
    draft.init_weights(1)
    with torch.no_grad():
        draft.embed_tokens.weight.normal_(generator=torch.Generator().manual_seed(2))
        if draft.spec.mask_token_id is not None:
            draft.mask_hidden.normal_(generator=torch.Generator().manual_seed(3))
    draft.set_draft_vocab(torch.arange(0, 40, 2))
    cod = COD(0.6, 0.3) if method == "peagle" else None  # P-EAGLE's sampling draws the same anchors either way
    return draft.double(), Sampling(Steps(cod)), TargetHead(norm, weight, draft.draft_to_target)


def _run(draft, head, batch, dtype, mode="ttt"):
    """(loss, metric sums, gradients) of one batch."""
    draft.zero_grad()
    aux, last = batch.features(dtype)
    steps = len(batch.index.counts)  # TTT steps, or a block's proposals
    out = ttt_forward(draft, batch.input_ids, aux, head(last, batch.index), batch.index, steps, mode=mode)
    out.loss.backward()
    return (
        out.loss.detach(),
        out.sums.detach(),
        {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None},
    )


def _samplers(chained, ids, sampling=None):
    dataset = store.open(chained, dtype=None)
    lengths, keep = dataset.lengths, margin((sampling or Sampling()).draw, K)
    return (
        dataset,
        TokenBudgetSampler(ids, lengths, 10_000),
        TreeSampler(ids, lengths, dataset.prefixes(), keep, 10_000),
    )


@pytest.mark.parametrize(
    ("method", "layers", "chunk"),  # chunks of 8 query rows: most of them inside one sample's rows, some across two
    [("eagle3", 1, 64), ("eagle3", 2, 8), ("eagle3.1", 1, 64), ("peagle", 2, 8), ("dflash", 2, 64), ("dspark", 1, 64)],
)
def test_a_tree_packed_batch_gives_the_per_sample_loss_metrics_and_gradients_in_fp64(
    chained, method, layers, chunk, monkeypatch
):
    monkeypatch.setattr(attention, "CHUNK", chunk)
    draft, sampling, head = _draft(method, layers)
    ids = list(TREE)
    dataset, padded, tree = _samplers(chained, ids, sampling)
    (order,) = tree.batches(0)
    assert sorted(order) == ids and order.index(5) > order.index(2) > order.index(1) > order.index(0)
    packed = tree.collate(dataset, order, K, sampling, 0)
    whole = padded.collate(dataset, order, K, sampling, 0)
    distinct = sum(own for _, _, own in TREE.values())
    assert packed.input_ids.shape == (1, packed.index.tree.positions.numel())  # type: ignore[attr-defined]
    assert distinct <= packed.input_ids.shape[1] <= distinct + K * 4 < 0.7 * sum(whole.lengths)
    assert packed.lengths == whole.lengths and packed.sample_ids == whole.sample_ids
    assert torch.equal(packed.index.counts, whole.index.counts) and float(packed.index.counts[-1]) > 10
    a, b = _run(draft, head, whole, torch.float64), _run(draft, head, packed, torch.float64)
    assert float(a[0]) > 0.1 and float(a[1][0].sum()) > 1  # a real loss, real KL sums
    torch.testing.assert_close(b[0], a[0], rtol=1e-12, atol=0)
    torch.testing.assert_close(b[1], a[1], rtol=1e-12, atol=1e-12)
    assert a[2].keys() == b[2].keys() and len(a[2]) > 8
    for name in a[2]:
        assert a[2][name].abs().max() > 0, name
        torch.testing.assert_close(b[2][name], a[2][name], rtol=1e-9, atol=1e-12, msg=name)
    naive = _run(draft, head, packed, torch.float64, mode="naive")  # the tree mask as one explicit mask
    torch.testing.assert_close(naive[0], a[0], rtol=1e-12, atol=0)
    # a later batch: sample 0 (scored in an earlier one) as context only, its children sharing its rows
    packed = tree.collate(dataset, [~0, 3, 1, 2], K, sampling, 0)
    keep = margin(sampling.draw, K)
    rows = 40 + sum(TREE[i][1] + TREE[i][2] - max(0, TREE[i][1] - keep) for i in (3, 1, 2))  # 0 whole, the rest grow it
    assert packed.sample_ids == [3, 1, 2] and packed.input_ids.shape[1] == rows
    a, b = (_run(draft, head, x, torch.float64) for x in (padded.collate(dataset, [3, 1, 2], K, sampling, 0), packed))
    torch.testing.assert_close(b[0], a[0], rtol=1e-12, atol=0)
    for name in a[2]:
        torch.testing.assert_close(b[2][name], a[2][name], rtol=1e-9, atol=1e-12, msg=name)


def test_a_tree_packed_batch_in_bf16_stays_within_bf16_of_the_per_sample_layout(chained):
    """The default on a CPU with bf16 (and on every GPU): autocast, states as stored."""
    draft, _, fp64 = _draft("eagle3", 1)
    draft = draft.float()
    head = TargetHead(fp64.norm.float(), fp64.weight.float(), draft.draft_to_target, torch.bfloat16)
    dataset, padded, tree = _samplers(chained, list(TREE))
    (order,) = tree.batches(0)
    batches = [s.collate(dataset, order, K, Sampling(), 0) for s in (padded, tree)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = (_run(draft, head, batch, torch.bfloat16) for batch in batches)
    torch.testing.assert_close(b[0], a[0], rtol=2e-2, atol=0)
    for name in a[2]:
        cos = torch.nn.functional.cosine_similarity(a[2][name].flatten().float(), b[2][name].flatten().float(), dim=0)
        assert cos > 0.99, name


def test_tree_batches_hold_every_sample_once_within_the_budget_parents_first(chained):
    dataset = store.open(chained, dtype=None)
    train = [0, 1, 2, 3, 5, 6]  # 4 held out; a budget that cuts the first tree, and has room for 0 as context
    sampler = TreeSampler(train, dataset.lengths, dataset.prefixes(), K, 70, seed=3)
    contexts = 0
    for epoch in range(3):
        batches = sampler.batches(epoch)
        assert sorted(i for b in batches for i in b if i >= 0) == train and len(batches) > 2
        for b in batches:
            batch = sampler.collate(dataset, b, K, Sampling(), epoch)
            assert batch.input_ids.shape[1] <= 70 and batch.sample_ids == [i for i in b if i >= 0]
            real = [i if i >= 0 else ~i for i in b]
            for j, i in enumerate(b):
                parent = TREE[real[j]][0]
                assert parent not in real or real.index(parent) < j
                if i < 0:  # context: the branch point 0 of its children 1 and 3, in an earlier batch
                    contexts += 1
                    assert i == ~0 and b[j + 1] in (1, 3) and any(0 in e for e in batches[: batches.index(b)])
    assert contexts > 0
    assert sampler.batches(1) == TreeSampler(train, dataset.lengths, dataset.prefixes(), K, 70, seed=3).batches(1)
    assert sampler.batches(0) != sampler.batches(1)
