"""core/sizing.py: the big-target arithmetic on the published configs (tests/families.py), tied to real modules.

The parameter counts are checked against the models' published totals and, on the tiny family checkpoints (the
same configs, shrunk), against the parameters transformers actually builds; the draft's count against the draft
module; the store's bytes against the store's own layout.
"""

from __future__ import annotations

import json

import pytest
import torch
from families import FAMILIES, PUBLISHED, target_dir

from draftsmith.core import sizing
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.layers import resolve_layer_ids


@pytest.mark.parametrize(
    "name, total, active",
    [
        ("llama", 8_030_261_248, 8_030_261_248),  # Llama-3.1-8B: 8.03B, as its model card says
        ("qwen3", 8_190_735_360, 8_190_735_360),  # Qwen3-8B: 8.2B
        ("qwen3_moe", 30.5e9, 3.3e9),  # Qwen3-30B-A3B: 30.5B total, 3.3B activated
        ("deepseek_v3", 671e9, 37e9),  # DeepSeek-V3: 671B total, 37B activated (MTP module aside)
        ("kimi_k25", 1.03e12, 32.9e9),  # Kimi-K2's backbone: "1T total, 32B activated"
    ],
)
def test_parameter_counts_match_the_published_totals(name, total, active):
    shape = sizing.target_shape(PUBLISHED[name])
    assert shape.params == pytest.approx(total, rel=0.01) and shape.active_params == pytest.approx(active, rel=0.03)
    text = PUBLISHED[name].get("text_config") or PUBLISHED[name]
    assert (shape.hidden_size, shape.num_layers) == (text["hidden_size"], text["num_hidden_layers"])
    assert shape.attention == ("mla" if "kv_lora_rank" in text else "mha/gqa")


def test_the_moe_layer_pattern_is_read_from_the_config():
    ds, kimi, qwen = (sizing.target_shape(PUBLISHED[n]) for n in ("deepseek_v3", "kimi_k25", "qwen3_moe"))
    assert (ds.moe_layers, ds.experts, ds.experts_per_token, ds.shared_experts) == (58, 256, 8, 1)  # 3 dense first
    assert (kimi.moe_layers, kimi.experts, kimi.shared_experts) == (60, 384, 1)  # 1 dense first
    assert (qwen.moe_layers, qwen.experts, qwen.shared_experts) == (48, 128, 0)
    assert sizing.target_shape({**PUBLISHED["qwen3_moe"], "mlp_only_layers": [0, 1]}).moe_layers == 46


@pytest.mark.parametrize("name", FAMILIES)
def test_parameter_count_equals_what_transformers_builds(name):
    from draftsmith.core import targets

    path = target_dir(name)
    model = targets.load_target(path)
    backbone, _ = targets.text_backbone(model)
    built = {id(p): p for p in backbone.parameters()} | {id(p): p for p in targets.lm_head(model).parameters()}
    # DeepSeek's router bias is a buffer in transformers, a tensor of the checkpoint (and a parameter in vLLM)
    bias = [b for n, b in backbone.named_buffers() if n.endswith("e_score_correction_bias")]
    config = json.loads((path / "config.json").read_text())
    assert sizing.target_shape(config).params == sum(p.numel() for p in [*built.values(), *bias])


def test_store_bytes_per_token_for_kimi_k25_and_the_stores_own_layout():
    from draftsmith.extract import store

    shape = sizing.target_shape(PUBLISHED["kimi_k25"])
    layer_ids = resolve_layer_ids(None, shape.num_layers)
    assert layer_ids == [2, 30, 58, 61]
    bf16, fp8 = (sizing.state_bytes_per_token(7168, 4, d) for d in ("bf16", "fp8"))
    assert (bf16, fp8) == (4 * 7168 * 2, 4 * 7168 + 4 * 4)
    for dtype, states in (("bf16", bf16), ("fp8", fp8)):
        spec = type("Spec", (), {"layer_ids": layer_ids, "hidden_size": 7168, "dtype": dtype})()
        assert store.bytes_per_token(spec) == states  # the store's own arithmetic
        assert sizing.store_bytes_per_token(7168, 4, dtype) == states + 5  # + input id (int32) + loss-mask flag
    assert sizing.store_bytes(1_000_000, 7168, 4, "bf16") == 57_349_000_000  # 53.4 GiB per million tokens


def test_store_bytes_equal_a_real_stores_files(tmp_path, tiny_target_dir):
    """The estimate the disk check uses against the bytes a store really writes (shard headers included)."""
    from draftsmith.config import ExtractConfig
    from draftsmith.core.targets import target_identity
    from draftsmith.extract import stage as extract
    from draftsmith.extract import store
    from draftsmith.prepare.dataset import write_prepared

    g = torch.Generator().manual_seed(0)
    samples = [
        {"input_ids": torch.randint(0, 320, (int(n),), generator=g), "loss_mask": torch.ones(int(n), dtype=torch.bool)}
        for n in torch.randint(20, 200, (30,), generator=g)
    ]
    write_prepared(tmp_path / "p", samples, target_identity(tiny_target_dir), chat_template_hash="x", max_length=200)
    for dtype in ("bf16", "fp8"):
        extract.run(
            ExtractConfig(prepared=tmp_path / "p", output=tmp_path / dtype, device="cpu", dtype=dtype),
            show_progress=False,
        )
        manifest = store.open(tmp_path / dtype).manifest
        written = sum(s.num_bytes for s in manifest.shards)
        estimate = sizing.store_bytes(manifest.num_tokens, 64, len(manifest.layer_ids), dtype, samples=30)
        assert estimate >= written * 0.99 and estimate <= written * 1.05, (dtype, estimate, written)


def test_the_draft_parameter_count_equals_the_draft_module():
    from draftsmith.methods.eagle3.modeling import Eagle3Draft
    from draftsmith.methods.spec import DraftSpec

    config = {
        **PUBLISHED["qwen3"],
        "hidden_size": 96,
        "intermediate_size": 160,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 500,
    }
    for layers in (1, 2):
        spec = DraftSpec.from_target_config(
            config, draft_vocab_size=200, num_hidden_layers=layers, aux_layer_ids=[2, 18, 33]
        )
        draft = Eagle3Draft(spec)
        trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
        assert sizing.draft_params(spec) == trainable


def test_training_memory_for_kimi_k25_draft():
    from draftsmith.methods.spec import DraftSpec

    spec = DraftSpec.from_target_config(
        PUBLISHED["kimi_k25"], draft_vocab_size=32000, num_hidden_layers=1, aux_layer_ids=[2, 30, 58]
    )
    memory = sizing.training_memory(spec, token_budget=4096, ttt_steps=7)
    # 56 heads x 128 with 8 KV heads (MLA has no head shape to copy): fc 3 x 7168 x 7168, q/k/v from 2H, o, MLP,
    # norms, a 32000-row head
    assert (spec.num_attention_heads, spec.head_dim, spec.num_key_value_heads) == (56, 128, 8)
    H = 7168
    assert memory.draft_params == 3 * H * H + 2 * H * (H + 2 * 1024) + H * H + 3 * H * 18432 + 4 * H + 32000 * H
    assert memory.weights_and_optimizer == 16 * memory.draft_params  # fp32 weights, grads, two AdamW moments
    assert memory.target_head == 2 * (2 * 163840 * 7168 + 7168)  # embedding + LM head + norm, bf16
    assert 20 * sizing.GiB < memory.total < 80 * sizing.GiB  # fits one 80 GB GPU at this budget
    double = sizing.training_memory(spec, token_budget=8192, ttt_steps=7)
    assert double.activations == pytest.approx(2 * memory.activations)
    assert double.weights_and_optimizer == memory.weights_and_optimizer


def test_training_fit_says_whether_a_gpu_holds_the_draft_and_the_largest_token_budget():
    from draftsmith.methods.spec import DraftSpec
    from draftsmith.planning import sizing_rows, training_fit_line

    spec = DraftSpec.from_target_config(
        PUBLISHED["kimi_k25"], draft_vocab_size=32000, num_hidden_layers=1, aux_layer_ids=[2, 30, 58]
    )
    memory = sizing.training_memory(spec, token_budget=4096, ttt_steps=7)
    fit = sizing.training_fit(spec, 80 * sizing.GiB, token_budget=4096, ttt_steps=7)
    assert fit.fits and fit.needed_bytes == memory.total and fit.usable_bytes == pytest.approx(72 * sizing.GiB)
    at_most = sizing.training_memory(spec, token_budget=fit.max_token_budget, ttt_steps=7).total
    beyond = sizing.training_memory(spec, token_budget=fit.max_token_budget + 1, ttt_steps=7).total
    assert at_most <= fit.usable_bytes < beyond  # the largest budget that fits, exactly
    small = sizing.training_fit(spec, 24 * sizing.GiB, token_budget=4096, ttt_steps=7)
    assert not small.fits and 0 < small.max_token_budget < 4096
    assert sizing.training_fit(spec, 8 * sizing.GiB, token_budget=4096, ttt_steps=7).max_token_budget == 0

    rows = dict(sizing_rows(PUBLISHED["kimi_k25"], gpu_memory_gb=80))
    assert rows["fits one 80 GiB GPU?"].startswith(f"yes: {sizing.human_bytes(memory.total)} of the 72 GiB usable")
    assert f"up to {fit.max_token_budget:,} fits" in rows["fits one 80 GiB GPU?"]
    line = training_fit_line(spec, 24, token_budget=4096, ttt_steps=7)
    assert line.startswith("no: ") and f"up to {small.max_token_budget:,} fits" in line and "\n" not in line
    assert "alone do not fit" in training_fit_line(spec, 8, token_budget=4096, ttt_steps=7)
    assert not any(k.startswith("fits") for k in dict(sizing_rows(PUBLISHED["kimi_k25"])))  # only when asked


def test_a_store_that_does_not_fit_is_refused_in_one_line():
    sizing.check_disk(100, 1000, where="--output x", what="the store")
    with pytest.raises(DraftsmithError, match=r"--output x: the store needs 2\.0 GiB but only 1\.0 GiB are") as err:
        sizing.check_disk(2 << 30, 1 << 30, where="--output x", what="the store")
    assert "\n" not in str(err.value) and "--dtype fp8" in str(err.value)


def test_a_config_without_sizes_is_a_clear_error():
    with pytest.raises(DraftsmithError, match="target config: no hidden_size"):
        sizing.target_shape({"architectures": ["Foo"], "num_hidden_layers": 2})


def test_human_units():
    assert sizing.human_bytes(512) == "512 B" and sizing.human_bytes(1536) == "1.5 KiB"
    assert sizing.human_bytes(57_349_000_000) == "53.4 GiB"
    assert sizing.human_count(8_030_261_248) == "8.03B" and sizing.human_count(1.03e12) == "1.03T"


def test_the_online_spool_for_kimi_k25_at_20000_tokens_a_second():
    """bound = rate x lead x row x 4/3: the engines fill 3 of the 4 chunks ahead while the trainer reads the 4th."""
    row = sizing.store_bytes_per_token(7168, 4, "bf16")
    assert row == 57_349 and sizing.SPOOL_CHUNKS == 4
    bound = sizing.spool_bytes(row, 20_000, 60)
    assert bound == 20_000 * 60 * 57_349 * 4 // 3 == 91_758_400_000  # 85.46 GiB
    assert bound / sizing.GiB == pytest.approx(85.457, abs=1e-3)
    assert bound * (sizing.SPOOL_CHUNKS - 1) / sizing.SPOOL_CHUNKS == 20_000 * 60 * row  # 3 chunks = 60 s ahead
    assert sizing.spool_bytes(sizing.store_bytes_per_token(7168, 4, "fp8"), 20_000, 60) == 45_908_800_000
    assert sizing.spool_bytes(row, 20_000, 30) == bound // 2 and sizing.spool_bytes(10, 1, 0.3) == 4  # rounded up
    assert sizing.min_spool_bytes(row, 4096 * 2 * 8) == 4 * 65_536 * row  # budget x grad_accum x world, 4 chunks
    with pytest.raises(DraftsmithError, match="must all be > 0") as err:
        sizing.spool_bytes(row, 0)
    assert "\n" not in str(err.value)


def test_doctor_rows_for_the_online_spool():
    from draftsmith.doctor import check_online
    from draftsmith.planning import sizing_rows

    rows = dict(sizing_rows(PUBLISHED["kimi_k25"], tokens=50_000_000, online_rate=20_000))
    spool = rows["online spool (20,000 tok/s, 60 s lead)"]
    assert spool.startswith("85.5 GiB bf16 / 42.8 GiB fp8: --spool-gb 85.5 (--spool-dtype fp8: --spool-gb 42.8)")
    assert spool.endswith("vs the offline store of 50,000,000 tokens: 2.61 TiB bf16 / 1.3 TiB fp8")
    assert "4,096 tokens a step" in rows["online spool floor"] and "896 MiB bf16" in rows["online spool floor"]
    # a slow trainer: the floor (4 chunks of one step) wins over the lead
    slow = dict(sizing_rows(PUBLISHED["kimi_k25"], online_rate=10, spool_lead_s=1, token_budget=16384))
    floor = sizing.min_spool_bytes(57_349, 16384)
    assert slow["online spool (10 tok/s, 1 s lead)"].startswith(f"{sizing.human_bytes(floor)} bf16")
    assert "vs the offline" not in slow["online spool (10 tok/s, 1 s lead)"]
    plain = dict(sizing_rows(PUBLISHED["kimi_k25"]))
    assert plain["online spool"] == "--online-rate TOKENS_PER_S: the spool `train --engine vllm` needs"
    assert "online spool floor" not in plain
    for bad, match in (
        ({"online_rate": -5, "target": "x"}, "--online-rate -5: must be > 0"),
        ({"online_rate": 100, "target": "x", "spool_lead_s": 0}, "--spool-lead-s 0: must be > 0"),
        ({"online_rate": 100, "target": None}, "give --target too"),
    ):
        with pytest.raises(DraftsmithError, match=match):
            check_online(bad["target"], bad["online_rate"], bad.get("spool_lead_s", 60.0))
    big = dict(sizing_rows(PUBLISHED["kimi_k25"], online_rate=1.5e6, spool_lead_s=2.5))
    assert "online spool (1,500,000 tok/s, 2.5 s lead)" in big


# Kimi-K2.5's quantization_config as its checkpoint declares it: int4 routed experts (compressed-tensors, groups of
# 32 with a bf16 scale each), attention, shared experts and the dense MLPs left in bf16.
KIMI_QUANTIZATION = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "group_size": 32,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "dynamic": False,
            },
        }
    },
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
}


def test_kimi_k25_as_stored_and_where_vllm_holds_it():
    """The int4 checkpoint's size from its quantization_config (the published checkpoint holds about 594 GB of
    weights), and the tensor parallel size each GPU kind needs: TP=4 does not fit a 141 GiB H200 under vLLM's 0.9
    memory fraction (~138 GiB a GPU), TP=8 does; 80 GiB GPUs do not hold it even at TP=8."""
    import copy

    from draftsmith.core import sizing
    from draftsmith.planning import sizing_rows

    config = copy.deepcopy(PUBLISHED["kimi_k25"])
    config["text_config"]["quantization_config"] = KIMI_QUANTIZATION
    stored = sizing.stored_weight_bytes(config)
    assert stored.read and 590e9 < stored.bytes < 600e9, stored
    assert stored.how.startswith("routed experts int4 (group 32, bf16 scales) 532 GiB; the rest bf16 ")
    fits = {tp: sizing.vllm_fits(stored.bytes, tp, 141 * sizing.GiB) for tp in (4, 8)}
    assert not fits[4][0] and 137 * sizing.GiB < fits[4][1] < 139 * sizing.GiB and fits[8][0]
    assert not sizing.vllm_fits(stored.bytes, 8, 80 * sizing.GiB)[0]
    rows = dict(sizing_rows(config, tensor_parallel_size=8))
    assert rows["weights as stored"].startswith("553 GiB: routed experts int4")
    assert "80 GiB (H100, A100): not at TP=8" in rows["vLLM loads it on"]
    assert "141 GiB (H200): TP=8 (69.2 GiB per GPU of 123 GiB)" in rows["vLLM loads it on"]
    # without a quantization_config: bf16, as before; one this arithmetic does not read says so
    plain = sizing.stored_weight_bytes(PUBLISHED["kimi_k25"])
    assert plain.bytes == 2 * sizing.target_shape(PUBLISHED["kimi_k25"]).params and plain.how.startswith("all bf16")
    config["text_config"]["quantization_config"] = {"quant_method": "awq", "bits": 4}
    assert "not one this arithmetic reads" in dict(sizing_rows(config))["weights as stored"]
