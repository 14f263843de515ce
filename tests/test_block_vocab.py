"""A reduced draft vocabulary for the block methods (`train --method dflash --draft-vocab-size N`): the fused block
loss over it against a dense definition and EAGLE-3's unfused loss, a fresh draft's vocabulary and head, a tiny run
from a store that lowers its held-out loss and exports in both layouts that read back, the reference decoder's
lossless rounds in target ids, and (slow) real vLLM 0.32 decoding it as the reference decoder does."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import MEMORISED_PROMPTS, memorise
from safetensors.torch import load_file
from test_dflash_train import _cfg
from test_dflash_train import _spec as dflash_spec
from test_families import needs_vllm

from draftsmith import export
from draftsmith.config import ExportConfig, TrainConfig
from draftsmith.core import targets
from draftsmith.core.layers import dflash_aux_layer_ids
from draftsmith.evaluate.specdec import DraftRunner, TargetRunner, plain_generate, speculative_generate
from draftsmith.methods import artefact
from draftsmith.methods.artefact import draft_module, load_draft
from draftsmith.methods.dflash.method import DFLASH
from draftsmith.methods.dflash.modeling import DFlashDraft
from draftsmith.methods.objective import Anchors
from draftsmith.methods.spec import DraftSpec
from draftsmith.methods.vocab import build_draft_vocab
from draftsmith.train import blocks, objective
from draftsmith.train import stage as trainer
from draftsmith.train.block_loss import BlockKL, KLOptions, block_kl, target_states
from draftsmith.train.blocks import block_index, dflash_hidden_states
from draftsmith.train.objective import ACCEPT, CORRECT, COUNT, KL, TargetHead, materialised, ttt_forward

VOCAB, DRAFT_VOCAB, HIDDEN = 50, 20, 32


def _spec(draft_vocab: int = DRAFT_VOCAB) -> DraftSpec:
    """test_dflash_train's tiny DFlash spec (vocabulary 50, blocks of 4) over `draft_vocab` ids."""
    return dflash_spec().model_copy(update={"draft_vocab_size": draft_vocab})


def _problem(dtype):
    """A DFlash draft over 20 of the target's 50 ids (its own lm_head: the target's rows, perturbed), a two-sample
    batch (one right-padded) with 40 blocks of 4 per sample, the target's final norm, lm_head and layer-N states."""
    gen = torch.Generator().manual_seed(2)
    draft = DFlashDraft(_spec())
    draft.init_weights(1)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.5
    draft.set_target(torch.randn(VOCAB, HIDDEN, generator=gen), weight)
    ids = torch.randperm(VOCAB, generator=gen)[:DRAFT_VOCAB].sort().values
    draft.set_draft_vocab(ids)
    with torch.no_grad():
        weight[ids] *= 1.5  # the target's mass mostly inside the draft vocabulary, not all of it
        draft.lm_head.weight.copy_(weight[ids] + 0.3 * torch.randn(DRAFT_VOCAB, HIDDEN, generator=gen))
        draft.norm.weight.uniform_(0.5, 1.5, generator=gen)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (2, 70), generator=gen)
    mask = torch.ones(2, 70, dtype=torch.bool)
    mask[1, 50:] = False
    index = block_index(mask.numpy(), Anchors(4, 40, 0), [0, 1])
    aux = torch.randn(2, 70, 3 * HIDDEN, dtype=dtype, generator=gen)
    last = torch.randn(2, 70, HIDDEN, dtype=dtype, generator=gen) * 2
    norm = torch.nn.RMSNorm(HIDDEN, eps=1e-5, dtype=dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0, generator=gen)
    return draft.to(dtype), tokens, aux, last, index, norm, weight.to(dtype)


def _dense(draft, tokens, aux, last, index, norm, weight, step_weight):
    """The loss (with autograd) and per-step sums from whole tensors, written from the definition: p the target's
    softmax over its whole vocabulary; the loss KL(p restricted to the draft vocabulary and renormalised || q) per
    scored row, weighed step_weight**d / scored rows; top-1 compared in target ids; acceptance sum_v min(p, q)."""
    hidden = next(dflash_hidden_states(draft, tokens, aux, index)).flatten(0, 1)
    logq = torch.log_softmax(draft.norm(hidden) @ draft.lm_head.weight.T, -1)  # [rows, Vd]
    full = torch.softmax(norm(last.flatten(0, 1)) @ weight.T, -1)[index.needed]  # [N, V]
    ids = draft.draft_to_target
    inside = full[:, ids]  # [N, Vd]
    p = inside / inside.sum(-1, keepdim=True)
    loss, sums = 0.0, torch.zeros(4, len(index.scored), dtype=torch.float64)
    for k, (rows, at) in enumerate(zip(index.scored, index.target, strict=False)):
        kl = (p[at] * (p[at].log() - logq[rows])).sum(-1)
        loss = loss + step_weight**k * kl.sum() / max(len(rows), 1)
        sums[KL, k] = kl.sum().detach()
        sums[CORRECT, k] = (ids[logq[rows].argmax(-1)] == full[at].argmax(-1)).sum()
        sums[ACCEPT, k] = torch.minimum(inside[at], logq[rows].exp()).sum().detach()
        sums[COUNT, k] = len(rows)
    return loss, sums


def test_the_fused_reduced_vocabulary_loss_and_its_gradients_equal_the_dense_definition(monkeypatch):
    """fp64: ttt_forward over TargetHead's TargetStates (BlockKL, a slice of rows at a time) against `_dense`: the
    loss, every trained parameter's gradient (the draft's own lm_head's included) and the metrics."""
    draft, tokens, aux, last, index, norm, weight = _problem(torch.float64)
    head = TargetHead(norm, weight, draft.draft_to_target)
    monkeypatch.setattr(blocks, "HEAD_ROWS", 100)  # the matmuls' slices (100 rows) and the reductions' (64) both cross
    assert sum(len(r) for r in index.scored) > 3 * objective.REDUCE_ROWS  # their edges
    names, params = zip(*((n, p) for n, p in draft.named_parameters() if p.requires_grad), strict=False)
    assert "lm_head.weight" in names and "norm.weight" in names
    states = head(last, index)
    assert states.weight.shape == (DRAFT_VOCAB, HIDDEN) and states.mass is not None  # [N, H] kept, never [N, V]
    fused = ttt_forward(draft, tokens, aux, states, index, 3, 0.9)
    g_fused = torch.autograd.grad(fused.loss, params)
    ref, sums = _dense(draft, tokens, aux, last, index, norm, weight, 0.9)
    g_ref = torch.autograd.grad(ref, params)
    # non-trivial values first: zeros compared with zeros would pass whatever the fused path computed
    count = sums[COUNT]
    assert ref.item() > 0.5 and all(g.abs().sum() > 0 for g in g_ref)
    assert 0 < sums[CORRECT].sum() < count.sum()
    assert (sums[ACCEPT] > 0.02 * count).all() and (sums[ACCEPT] < 0.98 * count).all()  # mass outside: p < 1
    # p is fp32 in both of the trainer's paths (target_distribution's), so equal to fp32 rounding
    torch.testing.assert_close(fused.loss, ref.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(fused.sums[[KL, ACCEPT]], sums[[KL, ACCEPT]], rtol=1e-5, atol=0)
    assert torch.equal(fused.sums[[CORRECT, COUNT]], sums[[CORRECT, COUNT]])
    for name, a, b in zip(names, g_fused, g_ref, strict=False):
        assert (a - b).norm() <= 1e-5 * b.norm(), name


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_fused_loss_is_eagle3s_unfused_loss_over_the_draft_vocabulary(precision):
    """The same batch scored by the fused path and by EAGLE-3's (materialised: target_distribution's p over the
    draft vocabulary and mass, DFlashDraft.logits [N, Vd], TargetKL, expected_acceptance): equal to rounding, in
    fp32 and under bf16 autocast with a bf16 target head (the CPU trainer's default)."""
    draft, tokens, aux, last, index, norm, weight = _problem(torch.float32)
    head = TargetHead(norm, weight, draft.draft_to_target, torch.bfloat16 if precision == "bf16" else None)
    names, params = zip(*((n, p) for n, p in draft.named_parameters() if p.requires_grad), strict=False)
    runs = []
    with torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext():
        states = head(last, index)
        for target in (states, materialised(states)):
            out = ttt_forward(draft, tokens, aux, target, index, 3, 0.9)
            runs.append((out, torch.autograd.grad(out.loss, params)))
    (fused, g_fused), (plain, g_plain) = runs
    assert fused.loss.item() > 0.5 and fused.sums[CORRECT].sum() > 0
    torch.testing.assert_close(fused.loss, plain.loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(fused.sums[[KL, ACCEPT]], plain.sums[[KL, ACCEPT]], rtol=1e-6, atol=0)
    assert torch.equal(fused.sums[[CORRECT, COUNT]], plain.sums[[CORRECT, COUNT]])
    for name, a, b in zip(names, g_fused, g_plain, strict=False):
        # the head's gradient under bf16 autocast: the unfused path rounds each block position's dz^T x to bf16
        # (F.linear's weight gradient), the fused one sums the slices' in fp32: they differ by bf16's rounding
        bf16_head = precision == "bf16" and name == "lm_head.weight"
        assert (a - b).norm() <= (2**-7 if bf16_head else 1e-5) * b.norm(), name


def test_block_kl_gives_its_own_head_an_exact_gradient_and_keeps_no_logits():
    """block_kl with a trainable head over a reduced vocabulary: the gradients of x and the head by gradcheck (the
    hint the upstream gradient, as ttt_forward gives it), and what it keeps for the backward: [N, H] and [Vd, H],
    not [N, Vd]."""
    gen = torch.Generator().manual_seed(21)
    n, v, vd, h, needed = 150, 300, 120, 8, 40
    weight = torch.randn(v, h, dtype=torch.float64, generator=gen)
    ids = torch.randperm(v, generator=gen)[:vd].sort().values
    weight[ids] *= 1.5  # most of the target's mass inside the draft vocabulary
    rows = torch.randn(needed, h, dtype=torch.float64, generator=gen)
    states = target_states(rows, torch.nn.Identity(), weight, draft_weight=weight[ids])
    assert states.mass is not None and 0.2 < float(states.mass.mean()) < 0.95
    own = (weight[ids] + 0.3 * torch.randn(vd, h, dtype=torch.float64, generator=gen)).requires_grad_()
    at = torch.randint(0, needed, (n,), generator=gen)
    x = (rows[at] + 0.5 * torch.randn(n, h, dtype=torch.float64, generator=gen)).requires_grad_()  # near the target
    kl, correct, accept = block_kl(x, own, states, at, rows=48, sub=20, to_target=ids)
    assert 0 < int(correct.sum()) < n and kl.min() > 1e-3
    saved = kl.grad_fn.saved_tensors
    assert max(t.numel() for t in saved if t is not None) == max(n * h, vd * h) < n * vd
    small, at7 = x.detach()[:7].requires_grad_(), at[:7]
    hint = torch.rand(7, dtype=torch.float64, generator=gen) + 0.5
    fn = lambda y, w: BlockKL.apply(y, w, states, at7, hint, None, None, ids, KLOptions(3, 2, False, True))[0]  # noqa: E731
    assert torch.autograd.gradcheck(lambda y, w: (fn(y, w) * hint).sum(), (small, own))  # the hint's own grad
    with pytest.raises(RuntimeError, match="hint"):  # a grad that is not the hint times one number: refused
        fn(small, own).sum().backward()


def test_a_fresh_draft_takes_eagle3s_vocabulary_only_when_asked(tiny_target_dir):
    """--draft-vocab-size given: the N most frequent loss-masked ids (build_draft_vocab) and an lm_head of the
    target's rows of them (--lm-head-init target) or random ones; not given: the target's whole vocabulary and its
    frozen head (EAGLE-3's default 32000 does not apply); DSpark refuses it in one line."""
    model = targets.load_target(tiny_target_dir)
    config = json.loads((tiny_target_dir / "config.json").read_text())
    vocab = config["vocab_size"]
    counts = np.random.default_rng(0).integers(0, 100, vocab)
    aux = dflash_aux_layer_ids(config["num_hidden_layers"], 2)
    want = build_draft_vocab(counts, 64)
    target_head = targets.lm_head(model).weight
    draft, spec, coverage = DFLASH.fresh_draft(
        TrainConfig(method="dflash", draft_vocab_size=64), config, model, counts, aux
    )
    assert isinstance(draft, DFlashDraft) and draft.own_head and spec.draft_vocab_size == 64
    assert torch.equal(draft.draft_to_target, want.draft_to_target) and coverage == pytest.approx(want.coverage)
    assert torch.equal(draft.lm_head.weight, target_head[want.draft_to_target].float())
    assert draft.lm_head.weight.requires_grad and "head_weight" not in dict(draft.named_buffers())
    assert {"lm_head.weight", "d2t", "t2d"} <= set(draft.state_dict())
    cfg = TrainConfig(method="dflash", draft_vocab_size=64, lm_head_init="random")
    random, _, _ = DFLASH.fresh_draft(cfg, config, model, counts, aux)
    assert not torch.equal(random.lm_head.weight, target_head[want.draft_to_target].float())
    whole, spec, coverage = DFLASH.fresh_draft(TrainConfig(method="dflash"), config, model, counts, aux)
    assert not whole.own_head and spec.draft_vocab_size == vocab and coverage == 1.0
    assert not any(n.startswith(("lm_head", "d2t", "t2d")) for n in whole.state_dict())
    with pytest.raises(
        ValueError,
        match="--draft-vocab-size is an option of --method eagle3 / eagle3.1 / peagle / "
        "dflash; --method dspark takes --block-size",
    ):
        TrainConfig(method="dspark", draft_vocab_size=64)  # DSpark's Markov head reads the whole vocabulary


@pytest.fixture(scope="module")
def store(tiny_block_data) -> Path:
    """conftest's store of the tiny target (hf, float32) with the layer a two-layer DFlash draft reads."""
    return tiny_block_data[1]


N = 64  # of the tiny target's 320 ids


@pytest.fixture(scope="module")
def run(store, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("block-vocab-run") / "run"
    trainer.run(_cfg(store, out, draft_vocab_size=N, eval_every=1, max_steps=8))  # test_dflash_train's tiny run
    return out


def test_a_tiny_run_lowers_the_held_out_loss_and_exports_both_layouts_that_read_back(run, tmp_path):
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    held_out = [m["loss"] for m in metrics if m["type"] == "eval"]
    assert len(held_out) >= 8 and held_out[-1] < held_out[0], held_out
    tensors, manifest = artefact.load_checkpoint(run)
    spec = manifest.draft
    assert (spec.method, spec.vocab_size, spec.draft_vocab_size) == ("dflash", 320, N)
    assert tensors["lm_head.weight"].shape == (N, spec.hidden_size)
    ids = tensors["d2t"] + torch.arange(N)
    assert bool((ids[1:] > ids[:-1]).all()) and torch.equal(torch.nonzero(tensors["t2d"]).flatten(), ids)
    for fmt in ("vllm", "speculators"):
        exported = tmp_path / fmt
        export.run(ExportConfig(checkpoint=run, output=exported, format=fmt, dtype="fp32"))
        config = json.loads((exported / "config.json").read_text())
        written = load_file(str(exported / "model.safetensors"))
        assert written["lm_head.weight"].shape == (N, spec.hidden_size)
        assert written["d2t"].dtype == torch.int64 and torch.equal(written["d2t"] + torch.arange(N), ids)
        if fmt == "vllm":  # vLLM sizes its lm_head by draft_vocab_size and scatters through d2t (t2d it skips)
            assert config["architectures"] == ["DFlashDraftModel"] and config["draft_vocab_size"] == N
            assert config["vocab_size"] == 320
        else:  # speculators' DFlash: draft_vocab_size beside its transformer_layer_config, both maps kept
            assert config["speculators_model_type"] == "dflash" and config["draft_vocab_size"] == N
            assert written["t2d"].dtype == torch.bool and int(written["t2d"].sum()) == N
        back = load_draft(exported)
        assert back.spec == spec and set(back.tensors) == set(tensors)
        for name, value in tensors.items():
            torch.testing.assert_close(back.tensors[name], value)


def test_the_reference_decoder_proposes_target_ids_through_d2t_losslessly(run, tiny_target_dir):
    source = load_draft(run)
    model = targets.load_target(tiny_target_dir)
    draft = draft_module(source, targets.embed_tokens(model).weight, targets.lm_head(model).weight).eval()
    runner = DraftRunner(draft)
    inside = set(draft.draft_to_target.tolist())
    proposed: list[int] = []
    propose = runner.propose

    def recording(*args):
        chain = propose(*args)
        proposed.extend(chain)
        return chain

    runner.propose = recording  # type: ignore[method-assign]
    target = TargetRunner(model, source.spec.aux_layer_ids)
    for prompt in ([1, 5, 9, 33, 7], [40, 41, 42, 43, 44, 45]):
        base = plain_generate(target, torch.tensor(prompt), 24)
        spec = speculative_generate(target, runner, torch.tensor(prompt), 4, 24)
        assert spec.tokens == base.tokens
        assert spec.stats.num_draft_tokens == 4 * spec.stats.num_rounds > 0
    assert proposed and set(proposed) <= inside and max(proposed) >= N  # target ids, not draft ids


# ---------------------------------------------------------------------------------------- real vLLM 0.32 (slow)


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_vllm_decodes_a_reduced_vocabulary_dflash_draft_losslessly_with_the_reference_acceptance(
    memorised_store, tmp_path_factory, tmp_path, monkeypatch
):
    """The memorised DFlash draft of tests/test_dflash_vllm.py over 8,192 of the default target's 49,152 ids: vLLM
    (its own lm_head [8192, H], draft logits scattered through d2t) lossless, with the reference decoder's per-position
    acceptance (one engine start beside the target-alone run the session shares). Measured on a 2-core CPU: both
    engines 97 rounds, accepted per position [25, 3, 1]; `deep=1` asks for position 2 (position 3's one acceptance
    is too thin a margin to ask of another CPU)."""
    from test_parity import evaluate_in_both_engines

    from draftsmith.extract import store as stores

    layers = stores.open(memorised_store).manifest.target.num_layers
    draft = memorise(
        memorised_store,
        tmp_path_factory.mktemp("dflash-vocab"),
        aux_layer_ids=dflash_aux_layer_ids(layers, 1),
        method="dflash",
        draft_vocab_size=8192,
        block_size=4,
        num_layers=1,
        anchors_per_sample=64,
    )
    config = json.loads((draft / "config.json").read_text())
    assert config["draft_vocab_size"] == 8192 and load_draft(draft).spec.draft_vocab_size == 8192
    hf, vl = evaluate_in_both_engines(draft, tmp_path, monkeypatch, 9, deep=1, num_prompts=MEMORISED_PROMPTS)
    assert hf.k == vl.k == 3
