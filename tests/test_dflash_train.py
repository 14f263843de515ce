"""DFlash training (`train --method dflash`): the block index, the memory-linear block attention against its
explicit-mask reference, what a block position reads, the trainer's metrics and checkpoints, and the export round
trip (the parity with the reference decoder's rounds is in tests/test_parity.py, vLLM in tests/test_dflash_vllm.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import write_random_prepared

from draftsmith import export
from draftsmith.config import ExportConfig, TrainConfig
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.layers import dflash_aux_layer_ids
from draftsmith.export.formats import vllm_speculative_config
from draftsmith.methods import artefact
from draftsmith.methods.artefact import load_draft
from draftsmith.methods.dflash.modeling import DFlashDraft
from draftsmith.methods.objective import Anchors
from draftsmith.methods.spec import DraftSpec
from draftsmith.train import stage as trainer
from draftsmith.train.blocks import block_index, dflash_hidden_states
from draftsmith.train.objective import TargetHead, ttt_forward


def _spec(layers: int = 2, block: int = 4) -> DraftSpec:
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
        draft_vocab_size=50,
        aux_layer_ids=[1, 2, 3],
        method="dflash",
        block_size=block,
        mask_token_id=7,
    )


def _draft(layers: int = 2, block: int = 4) -> DFlashDraft:
    draft = DFlashDraft(_spec(layers, block))
    draft.init_weights(1)
    gen = torch.Generator().manual_seed(2)
    draft.set_target(torch.randn(50, 32, generator=gen), torch.randn(50, 32, generator=gen))
    return draft.double()


def test_the_reference_spread_of_target_layers():
    # z-lab's Qwen3-8B DFlash drafts read target layers 1, 9, 17, 25, 33 (vLLM ids one higher)
    assert dflash_aux_layer_ids(36) == [2, 10, 18, 26, 34]
    assert dflash_aux_layer_ids(30) == [2, 9, 15, 21, 28] and dflash_aux_layer_ids(61, 1) == [31]
    assert dflash_aux_layer_ids(4) == [2]  # a shallow target: the spread collides, each id once


def test_block_index_scores_each_position_against_the_tokens_distribution():
    mask = np.zeros((2, 30), dtype=bool)
    mask[0, 6:30] = True
    mask[1, 4:15] = True  # a shorter, right-padded sample
    anchors = Anchors(block_size=5, per_sample=8, seed=3)
    index = block_index(mask, anchors, sample_ids=[10, 11], epoch=0)
    assert index.anchors.shape == (2, 8)
    for row in range(2):
        a = index.anchors[row].tolist()
        valid = [t for t in range(1, 29) if mask[row, t] and mask[row, t + 1]]
        assert set(a) <= set(valid) and len(set(a)) == min(8, len(valid)) and a == sorted(a)
    needed = index.needed.tolist()
    for j in range(1, 5):  # block position j of anchor a proposes x_{a+j}, scored on p_{a+j-1}
        expected = []
        for row in range(2):
            for n, a in enumerate(index.anchors[row].tolist()):
                if a + j < 30 and mask[row, a + j]:
                    expected.append(((row * 8 + n) * 5 + j, row * 30 + a + j - 1))
        got = list(zip(index.scored[j - 1].tolist(), [needed[i] for i in index.target[j - 1].tolist()], strict=False))
        assert got == expected and int(index.counts[j - 1]) == len(expected) > 0
    # the same blocks on a resume (seed, epoch, sample id), others the next epoch
    again, other = block_index(mask, anchors, [10, 11], 0), block_index(mask, anchors, [10, 11], 1)
    assert torch.equal(again.anchors, index.anchors) and not torch.equal(other.anchors, index.anchors)


@pytest.mark.parametrize("layers", [1, 2])
def test_block_attention_equals_the_explicit_mask_forward_and_backward(layers):
    draft = _draft(layers, block=4)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 50, (2, 70), generator=gen)
    mask = torch.ones(2, 70, dtype=torch.bool)
    mask[1, 50:] = False
    index = block_index(mask.numpy(), Anchors(4, 40, 0), [0, 1])  # 40 anchors: several chunks of 16 blocks
    assert len(index.chunk_limits) > 1
    aux = torch.randn(2, 70, 96, dtype=torch.float64, generator=gen)
    head = TargetHead(
        torch.nn.Identity(), torch.randn(50, 32, dtype=torch.float64, generator=gen), draft.draft_to_target
    )
    target = head(torch.randn(2, 70, 32, dtype=torch.float64, generator=gen), index)
    params = [p for p in draft.parameters() if p.requires_grad]
    results = []
    for mode in ("ttt", "naive"):
        r = ttt_forward(draft, ids, aux, target, index, 3, 0.9, mode=mode)
        results.append((r, torch.autograd.grad(r.loss, params)))
    (a, ga), (b, gb) = results
    assert a.loss.item() > 0 and all(g.abs().sum() > 0 for g in ga)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-12, atol=1e-12)
    for x, y in zip(ga, gb, strict=False):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-12)


def test_a_block_sees_the_context_before_its_anchor_and_its_whole_block():
    draft = _draft(2, block=4)
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 50, (1, 20), generator=gen)
    mask = torch.ones(1, 20, dtype=torch.bool)
    index = block_index(mask.numpy(), Anchors(4, 1, 0), [0])  # one block
    a = int(index.anchors[0, 0])
    aux = torch.randn(1, 20, 96, dtype=torch.float64, generator=gen, requires_grad=True)
    hidden = next(dflash_hidden_states(draft, ids, aux, index))
    hidden[0, 1].sum().backward()  # block position 1 (proposes x_{a+1})
    assert aux.grad[0, :a].abs().sum() > 0 and aux.grad[0, a:].abs().sum() == 0  # context s < anchor only
    # position 1 sees position 3 of its block (no causal order inside a block): its input changes position 1
    block = draft.block_ids(ids[:, a])  # [1, S]
    out = draft.forward_hidden(
        block, torch.arange(a, a + 4)[None], draft.context(aux.detach()[:, :a]), torch.arange(a)[None], _full
    )
    with torch.no_grad():
        draft.embed_tokens.weight[7] += 1.0  # the mask token's embedding: positions 1..3 read it
    again = draft.forward_hidden(
        block, torch.arange(a, a + 4)[None], draft.context(aux.detach()[:, :a]), torch.arange(a)[None], _full
    )
    assert not torch.allclose(out[0, 0], again[0, 0])  # even the anchor's position sees the masks after it


def _full(q, k, v, kc, vc):
    from draftsmith.methods.attention import full_attention

    return full_attention(q, k, v, kc, vc)


# ---------------------------------------------------------------------------------------------- the trainer


@pytest.fixture(scope="module")
def prepared(tiny_target_dir, tmp_path_factory):
    return write_random_prepared(tmp_path_factory.mktemp("dflash") / "prepared", tiny_target_dir, 24, 20, 48)


def _cfg(data, out, **kw) -> TrainConfig:
    base = dict(
        data=data,
        output=out,
        method="dflash",
        block_size=5,
        anchors_per_sample=6,
        num_layers=2,
        lr=3e-3,
        warmup_steps=2,
        token_budget=256,
        eval_fraction=0.15,
        log_every=1,
        save_every=1000,
        device="cpu",
        seed=0,
        max_steps=6,
    )
    base.update(kw)
    if base["method"] not in ("dflash", "dspark"):  # an EAGLE-family run beside them: no block options
        base = {k: v for k, v in base.items() if k not in ("block_size", "anchors_per_sample")}
    return TrainConfig(**base)


def test_dflash_config_derives_steps_and_weights_from_the_block():
    cfg = TrainConfig(method="dflash")
    assert (cfg.num_layers, cfg.method.block_size, cfg.method.depths, cfg.method.anchors_per_sample) == (5, 16, 15, 512)
    assert abs(cfg.method.depth_weight**6 - np.exp(-6 / 7)) < 1e-12  # position j weighs exp(-(j-1)/7)
    assert TrainConfig().num_layers == 1
    with pytest.raises(ValueError, match="block-size"):
        TrainConfig(method="dflash", ttt_steps=4)


def test_dflash_training_logs_per_position_metrics_checkpoints_and_exports(prepared, tmp_path, tiny_target_dir):
    out = tmp_path / "run"
    trainer.run(_cfg(prepared, out))
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in metrics if m["type"] == "train"]
    assert len(train) == 6 and all(len(m["acc"]) == len(m["kl"]) == 4 for m in train)
    assert train[-1]["loss"] < train[0]["loss"]
    assert [m for m in metrics if m["type"] == "eval"][-1]["scored"][0] > 0
    tensors, manifest = artefact.load_checkpoint(out)
    spec = manifest.draft
    assert (spec.method, spec.block_size, spec.num_hidden_layers, spec.draft_vocab_size) == ("dflash", 5, 2, 320)
    assert spec.aux_layer_ids == [2]  # the tiny target's 4 layers: the spread collides
    assert not any(n.startswith(("embed_tokens", "lm_head", "head_weight", "d2t", "t2d")) for n in tensors)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= set(tensors)
    for fmt in ("vllm", "speculators"):
        exported = tmp_path / fmt
        export.run(ExportConfig(checkpoint=out, output=exported, format=fmt, dtype="fp32"))
        config = json.loads((exported / "config.json").read_text())
        back = load_draft(exported)
        assert back.spec == spec and set(back.tensors) == set(tensors)
        for name, value in tensors.items():
            torch.testing.assert_close(back.tensors[name], value)
        speculative = vllm_speculative_config(exported, 3)
        assert speculative["method"] == "dflash" and speculative["num_speculative_tokens"] == 4
        if fmt == "vllm":
            assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 5
            assert config["dflash_config"] == {"mask_token_id": spec.mask_token_id, "target_layer_ids": [1]}
            assert config["num_target_layers"] == 4 and "lm_head.weight" not in _names(exported)
    with pytest.raises(DraftsmithError, match="sglang"):
        export.run(ExportConfig(checkpoint=out, output=tmp_path / "sglang", format="sglang"))


def _names(directory):
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_an_eagle3_draft_cannot_start_a_dflash_run(prepared, tmp_path):
    eagle = tmp_path / "eagle"
    trainer.run(_cfg(prepared, eagle, method="eagle3", max_steps=1, num_layers=1, draft_vocab_size=300))
    with pytest.raises(DraftsmithError, match="architectures differ"):
        trainer.run(_cfg(prepared, tmp_path / "dflash", init_from=eagle))


@pytest.mark.skipif(not hasattr(torch.nn.attention, "flex_attention"), reason="no flex_attention in this torch")
@pytest.mark.parametrize("kernel", ["chunked", "flex"])
def test_block_attention_kernels_equal_the_explicit_mask_forward_and_backward(kernel, monkeypatch):
    """Both kernels of the DFlash block attention against the explicit [A*S, T + A*S] mask, gradients included.
    flex (CUDA's) runs eager here through flex_attention's reference backward (CPU refuses it unless its device check
    is lifted)."""
    import torch.nn.attention.flex_attention as flex_module

    from draftsmith.methods import attention

    if kernel == "flex":
        if not hasattr(flex_module, "_validate_device"):
            pytest.skip("this torch's flex_attention has no device check to lift")
        monkeypatch.setattr(flex_module, "_validate_device", lambda *a: None)
        monkeypatch.setattr(attention, "_compiled_flex_attention", lambda: flex_module.flex_attention)
    gen = torch.Generator().manual_seed(8)
    b, hq, hkv, t, s, d = 2, 4, 2, 50, 4, 8
    mask = np.ones((b, t), dtype=bool)
    mask[1, 40:] = False
    index = block_index(mask, Anchors(s, 20, 0), [0, 1])
    rows = index.anchors.shape[1] * s
    tensors = [
        torch.randn(shape, dtype=torch.float64, generator=gen, requires_grad=True)
        for shape in ((b, hq, rows, d), (b, hkv, rows, d), (b, hkv, rows, d), (b, hkv, t, d), (b, hkv, t, d))
    ]
    ours = attention.block_attention(*tensors, index.anchors, index.chunk_limits, kernel=kernel)
    ref = attention.naive_block_attention(*tensors, index.anchors)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)
    weights = torch.randn(ref.shape, dtype=torch.float64, generator=gen)
    for x, y in zip(
        torch.autograd.grad((ours * weights).sum(), tensors),
        torch.autograd.grad((ref * weights).sum(), tensors),
        strict=False,
    ):
        assert x.abs().sum() > 0
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-10)


def test_a_whole_vocabulary_head_is_used_as_it_is_with_the_same_distribution():
    """DFlash drafts over the target's whole vocabulary: TargetHead keeps the lm_head itself (no [V, H] copy) and
    the full-vocabulary metrics reuse the draft-vocabulary logits; the distribution is the one of a copied head."""
    from draftsmith.train.objective import target_distribution

    gen = torch.Generator().manual_seed(9)
    weight = torch.randn(50, 32, generator=gen)
    rows = torch.randn(7, 32, generator=gen)
    head = TargetHead(torch.nn.Identity(), weight, torch.arange(50))
    assert head.draft_weight is weight
    assert TargetHead(torch.nn.Identity(), weight, torch.arange(0, 50, 2)).draft_weight.shape == (25, 32)
    ours = target_distribution(rows, torch.nn.Identity(), weight, head.draft_weight)
    copied = target_distribution(rows, torch.nn.Identity(), weight, weight.clone())
    for a, b in (
        (ours.probs, copied.probs),
        (ours.neg_entropy, copied.neg_entropy),
        (ours.mass, copied.mass),
        (ours.argmax, copied.argmax),
    ):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(ours.mass, torch.ones(7))


@pytest.mark.parametrize("autocast", [False, True])
def test_the_layers_keep_less_and_compute_what_the_plain_modules_compute(autocast):
    """What a DFlash layer keeps for the backward (dflash_model: LeanRMSNorm, lean_mlp, DFlashAttention.project)
    against model.py's RMSNorm and MLP and the attention's one-projection-at-a-time path as autograd runs them:
    the same outputs, and the same gradients (to fp32 rounding under autocast, where autograd sums the per-linear
    gradients in its own order), fp64 and under CPU bf16 autocast (train --precision auto's), on fp32 rows as the
    residual stream holds them and on bf16 rows as q_norm reads them."""
    from draftsmith.methods.dflash.modeling import lean_mlp
    from draftsmith.methods.layers import RMSNorm, apply_rope

    dtype = torch.float32 if autocast else torch.float64
    layer = _draft(1).layers[0].to(dtype)
    attn = layer.self_attn
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for norm in (layer.input_layernorm, attn.q_norm):
            norm.weight.copy_(torch.rand(norm.weight.shape, generator=gen) + 0.5)
    cos, sin = _draft(1).rotary(torch.arange(9).expand(2, 9), dtype)

    def plain(x):
        y = RMSNorm.forward(layer.input_layernorm, x)
        query = apply_rope(attn._heads(attn.q_proj, attn.q_norm, y, attn.num_heads), cos, sin)
        return (y, layer.mlp(y), query, *attn.keys_values(y, cos, sin))

    def lean(x):
        y = layer.input_layernorm(x)
        return (y, lean_mlp(layer.mlp, y), *attn.project(y, cos, sin))

    def plain_q_norm(x):
        return (RMSNorm.forward(attn.q_norm, x),)

    def lean_q_norm(x):
        return (attn.q_norm(x),)

    x = torch.randn(2, 9, 32, dtype=dtype, generator=gen) * 3
    cases = [(x, plain, lean)]
    if autocast:
        cases.append((torch.randn(2, 9, 4, 8, generator=gen).bfloat16(), plain_q_norm, lean_q_norm))
    tol = dict(rtol=1e-5, atol=1e-6) if autocast else dict(rtol=1e-12, atol=1e-12)
    params = [p for p in layer.parameters() if p.requires_grad]
    for x, *paths in cases:
        results = []
        for path in paths:
            leaf = x.clone().requires_grad_(True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                outs = path(leaf)
            loss = sum((o.double() * torch.linspace(-1, 1, o.numel()).view(o.shape).double()).sum() for o in outs)
            results.append((outs, torch.autograd.grad(loss, [leaf, *params], allow_unused=True)))
        (outs0, grads0), (outs1, grads1) = results
        for a, b in zip(outs1, outs0, strict=False):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # the forward is model.py's, op for op
        assert grads0[0].abs().sum() > 0
        for a, b in zip(grads1, grads0, strict=False):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.dtype == b.dtype
                torch.testing.assert_close(a, b, **tol)
