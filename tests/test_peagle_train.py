"""P-EAGLE training (`train --method peagle`): COD sampling counts per depth, the parallel depths' inputs, the kernels,
and the trainer's checkpoints (the killed-run resume is in tests/test_train_faults.py, the parity with the reference
decoder's parallel proposals in tests/test_parity.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import write_random_prepared
from safetensors.torch import load_file

from draftsmith.config import TrainConfig
from draftsmith.methods import artefact
from draftsmith.methods.attention import KVCache
from draftsmith.methods.base import mask_token_id
from draftsmith.methods.eagle3.modeling import Eagle3Draft
from draftsmith.methods.objective import COD
from draftsmith.methods.spec import DraftSpec
from draftsmith.train import stage as trainer
from draftsmith.train.unrolled import step_index, ttt_hidden_states


def _spec(layers: int = 1, parallel: bool = True) -> DraftSpec:
    return DraftSpec(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=layers,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        target_hidden_size=32,
        vocab_size=50,
        draft_vocab_size=20,
        aux_layer_ids=[1, 2, 3],
        method="peagle" if parallel else "eagle3",
        mask_token_id=7 if parallel else None,
    )


def _draft(layers: int = 1) -> Eagle3Draft:
    draft = Eagle3Draft(_spec(layers))
    draft.init_weights(1)
    with torch.no_grad():
        draft.embed_tokens.weight.normal_(generator=torch.Generator().manual_seed(2))
        draft.mask_hidden.normal_(generator=torch.Generator().manual_seed(3))
    draft.set_draft_vocab(torch.arange(0, 40, 2))
    return draft.double()


# ---------------------------------------------------------------------------------------------- COD sampling


def test_cod_keeps_ratio_to_the_depth_of_each_depths_candidates_with_a_floor():
    mask = np.zeros((3, 60), dtype=bool)
    for row, (start, end) in enumerate([(10, 60), (5, 40), (20, 55)]):
        mask[row, start:end] = True  # right-padded samples of different lengths
    cod = COD(ratio=0.6, floor=0.15, seed=4)
    full = step_index(mask, 6)
    index = step_index(mask, 6, cod, sample_ids=[11, 12, 13], epoch=0)
    for k in range(6):
        expected = 0
        for row in range(3):
            n = int(mask[row, k + 2 :].sum())  # depth k's candidates: loss-masked x_{t+k+2}
            expected += n if k == 0 else min(n, max(math.ceil(n * 0.6**k), math.ceil(n * 0.15)))
        assert int(index.counts[k]) == expected == len(index.scored[k]), k
        assert set(index.scored[k].tolist()) <= set(full.scored[k].tolist())  # a subset of the candidates
        # each scored row still reads the target distribution of its own predicted token
        pos = {int(r): i for i, r in enumerate(full.scored[k])}
        assert [int(full.target[k][pos[int(r)]]) for r in index.scored[k]] == index.target[k].tolist()
    assert int(index.counts[5]) < int(index.counts[1]) < int(index.counts[0])
    assert int(index.counts[0]) == int(full.counts[0])  # depth 0 is never sampled
    # deterministic in (seed, epoch, sample id): a resumed run draws the same anchors; the next epoch others
    again = step_index(mask, 6, cod, sample_ids=[11, 12, 13], epoch=0)
    other = step_index(mask, 6, cod, sample_ids=[11, 12, 13], epoch=1)
    assert all(torch.equal(a, b) for a, b in zip(index.scored, again.scored, strict=False))
    assert not all(torch.equal(a, b) for a, b in zip(index.scored[1:], other.scored[1:], strict=False))
    # ratio 1 keeps every candidate; a floor of 1 too
    for keep_all in (COD(1.0, 0.0), COD(0.3, 1.0)):
        same = step_index(mask, 6, keep_all, sample_ids=[11, 12, 13])
        assert torch.equal(same.counts, full.counts)


def test_cod_kept_anchors_shrink_nested_with_depth():
    mask = np.ones((1, 200), dtype=bool)
    index = step_index(mask, 5, COD(0.7, 0.0, 1), sample_ids=[0])
    for k in range(1, 4):
        assert set(index.scored[k + 1].tolist()) <= set(index.scored[k].tolist())  # one priority per anchor


# ---------------------------------------------------------------------------------------------- the depths


@pytest.mark.parametrize("layers", [1, 2])
def test_parallel_depths_read_the_mask_slots_not_the_previous_depth(layers):
    """Depth k >= 1 at anchor t: one forward of the draft over the real slots 0..t and k mask slots after them
    (what a decoder runs) -- and the memory-linear kernels equal the explicit-mask reference."""
    draft = _draft(layers).eval()
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 50, (1, 16), generator=gen)
    aux = torch.randn(1, 16, 96, dtype=torch.float64, generator=gen)
    with torch.no_grad():
        steps = [h[0] for h in ttt_hidden_states(draft, ids, aux, 4)]
        naive = [h[0] for h in ttt_hidden_states(draft, ids, aux, 4, mode="naive")]
        fused, mask = draft.fuse(aux[0]), draft.mask_features()[0]
        for k in range(4):
            torch.testing.assert_close(steps[k], naive[k], rtol=1e-12, atol=1e-12)
        for t in range(0, 16 - 5, 3):
            for k in range(1, 4):
                seq_ids = torch.cat([ids[0, 1 : t + 2], torch.full((k,), 7)])
                hidden = torch.cat([fused[: t + 1], mask.expand(k, -1)])
                out = draft.forward_hidden(seq_ids[None], hidden[None], torch.arange(t + 1 + k)[None], KVCache(layers))
                torch.testing.assert_close(out[0, -1], steps[k][t], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(steps[1], steps[2])


def test_a_parallel_depths_loss_reaches_mask_hidden_and_not_through_the_previous_depth():
    draft = _draft(1)
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 50, (1, 12), generator=gen)
    aux = torch.randn(1, 12, 96, dtype=torch.float64, generator=gen, requires_grad=True)
    steps = list(ttt_hidden_states(draft, ids, aux, 3))
    steps[2][0, 3].sum().backward()
    # depth 2 at anchor 3 reads the target's features of positions 0..3 only (through the real keys), mask_hidden
    assert draft.mask_hidden.grad.abs().sum() > 0
    assert aux.grad[0, :4].abs().sum() > 0 and aux.grad[0, 4:].abs().sum() == 0


# ---------------------------------------------------------------------------------------------- the trainer


@pytest.fixture(scope="module")
def prepared(tiny_target_dir, tmp_path_factory):
    return write_random_prepared(tmp_path_factory.mktemp("peagle") / "prepared", tiny_target_dir, 24, 20, 48)


def _cfg(data, out, **kw) -> TrainConfig:
    base = dict(
        data=data,
        output=out,
        draft_vocab_size=300,
        ttt_steps=4,
        lr=3e-3,
        warmup_steps=2,
        token_budget=256,
        eval_fraction=0.15,
        log_every=1,
        save_every=1000,
        device="cpu",
        seed=0,
        method="peagle",
        max_steps=6,
    )
    base.update(kw)
    return TrainConfig(**base)


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_peagle_training_logs_per_depth_metrics_and_checkpoints_mask_hidden(prepared, tmp_path, tiny_target_dir):
    out = tmp_path / "run"
    trainer.run(_cfg(prepared, out, cod_ratio=0.5, cod_floor=0.1))
    train = [m for m in _metrics(out) if m["type"] == "train"]
    assert len(train) == 6 and all(len(m["acc"]) == len(m["kl"]) == 4 for m in train)
    evals = [m for m in _metrics(out) if m["type"] == "eval"]
    assert evals and len(evals[-1]["acc"]) == 4
    tensors, manifest = artefact.load_checkpoint(out)
    assert manifest.draft.method == "peagle" and manifest.draft.mask_token_id is not None
    assert tensors["mask_hidden"].shape == (1, len(manifest.draft.aux_layer_ids) * 64)
    latest = load_file(str(artefact.latest_checkpoint(out) / artefact.WEIGHTS_FILE))
    init = torch.randn(tensors["mask_hidden"].shape, generator=torch.Generator().manual_seed(0)) * 0.02
    assert not torch.allclose(latest["mask_hidden"], init)  # learned, not left at its initial value
    config = json.loads((tiny_target_dir / "config.json").read_text())
    assert manifest.draft.mask_token_id == mask_token_id(config)
    assert mask_token_id({"vocab_size": 10, "pad_token_id": None, "eos_token_id": [4, 5]}) == 4
    assert mask_token_id({"vocab_size": 10}) == 0


def test_cod_scores_fewer_positions_at_depth_and_eval_scores_all(prepared, tmp_path):
    out = tmp_path / "run"
    trainer.run(_cfg(prepared, out, cod_ratio=0.5, cod_floor=0.0, max_steps=3))
    full = tmp_path / "full"
    trainer.run(_cfg(prepared, full, cod_ratio=1.0, max_steps=3))
    a, b = ([m for m in _metrics(x) if m["type"] == "train"] for x in (out, full))
    for sampled, every in zip(a, b, strict=False):  # the same batches: depth 0 is never sampled, deeper ones ~ 0.5**k
        assert sampled["scored"][0] == every["scored"][0] == sampled["tokens"]
        for k in range(1, 4):
            assert sampled["scored"][k] < every["scored"][k]
            assert sampled["scored"][k] >= 0.5**k * every["scored"][k] - 4  # ceil per sample, a few samples
    ea, eb = ([m for m in _metrics(x) if m["type"] == "eval"][-1] for x in (out, full))
    assert ea["scored"] == eb["scored"]  # evaluation scores every anchor at every depth


def test_an_eagle3_draft_starts_a_peagle_run_and_keeps_its_weights(prepared, tmp_path):
    eagle = tmp_path / "eagle"
    trainer.run(_cfg(prepared, eagle, method="eagle3", max_steps=2))
    source, _ = artefact.load_checkpoint(eagle)
    assert "mask_hidden" not in source
    out = tmp_path / "peagle"
    trainer.run(_cfg(prepared, out, init_from=eagle, max_steps=1, lr=1e-12, warmup_steps=0, schedule="constant"))
    tensors, manifest = artefact.load_checkpoint(out)
    assert manifest.draft.method == "peagle" and "mask_hidden" in tensors
    for name, value in source.items():
        torch.testing.assert_close(tensors[name], value, rtol=1e-6, atol=1e-8)  # lr 1e-12: the same weights


def test_resuming_a_peagle_run_as_eagle3_is_refused_unless_forced(prepared, tmp_path):
    from draftsmith.core.errors import DraftsmithError

    out = tmp_path / "run"
    trainer.run(_cfg(prepared, out, max_steps=2, save_every=1))
    with pytest.raises(DraftsmithError, match="method"):
        trainer.run(_cfg(prepared, out, method="eagle3", max_steps=4))
