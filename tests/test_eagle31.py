"""Eagle 3.1 (methods/eagle31/method.py): fc_norm and norm_output in the module, training offline and online from an
EAGLE-3 draft, the export vLLM and speculators read. Its lossless decoding in real vLLM, with the reference decoder's
per-position acceptance, is the gate's test (tests/test_gate.py decodes an Eagle 3.1 draft that memorised its
prompts); training's step k+1 reading the normed output as the decoder does is tests/test_parity.py's."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import write_random_prepared
from safetensors.torch import load_file

from draftsmith import export
from draftsmith.config import ExportConfig, ExtractConfig, TrainConfig
from draftsmith.core.errors import DraftsmithError
from draftsmith.methods import artefact, method, method_of_config
from draftsmith.methods.artefact import load_draft
from draftsmith.methods.eagle3.modeling import Eagle3Draft
from draftsmith.methods.spec import DraftSpec
from draftsmith.train import stage as trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def _spec(**kw) -> DraftSpec:
    base = dict(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=1,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        target_hidden_size=16,
        vocab_size=50,
        draft_vocab_size=20,
        aux_layer_ids=[1, 2, 3],
    )
    return DraftSpec(**{**base, **kw})


def test_fc_norm_reads_each_captured_layer_at_one_scale_and_norm_output_feeds_the_normed_state():
    """A deep layer's states are orders of magnitude larger than a shallow one's: Eagle 3.1's fc sees each layer
    normed (scaling one layer's states changes nothing), EAGLE-3's fc sees them as they are."""
    torch.manual_seed(0)
    plain = Eagle3Draft(_spec())
    eagle31 = Eagle3Draft(_spec(method="eagle3.1", fc_norm=True, norm_output=True))
    plain.init_weights(1)
    eagle31.init_weights(1)
    assert [tuple(n.weight.shape) for n in eagle31.fc_norm] == [(16,)] * 3 and not hasattr(plain, "fc_norm")
    aux = torch.randn(2, 5, 48)
    scaled = aux.clone()
    scaled[..., 16:32] *= 300.0  # the second captured layer, as a deep layer's scale
    with torch.no_grad():
        assert (plain.fuse(aux) - plain.fuse(scaled)).abs().max() > 1.0
        torch.testing.assert_close(eagle31.fuse(scaled), eagle31.fuse(aux), rtol=1e-4, atol=1e-5)
        h = torch.randn(2, 5, 32) * 7.0
        assert torch.equal(plain.feedback(h), h)
        fed = eagle31.feedback(h)
        torch.testing.assert_close(fed.pow(2).mean(-1), torch.ones(2, 5), rtol=1e-4, atol=1e-4)  # RMS 1: normed
        torch.testing.assert_close(fed, eagle31.norm(h))


@pytest.fixture(scope="module")
def data(tiny_target_dir, tmp_path_factory):
    """A prepared set of the tiny target and its store (fp32 states), for the online and the offline run."""
    from draftsmith.extract import stage as extract

    root = tmp_path_factory.mktemp("eagle31")
    prepared = write_random_prepared(root / "prepared", tiny_target_dir, 24, 20, 48)
    store = root / "store"
    extract.run(
        ExtractConfig(prepared=prepared, output=store, device="cpu", aux_layer_ids=[1, 2, 3], compute_dtype="float32"),
        show_progress=False,
    )
    return prepared, store


def _cfg(data, out, **kw) -> TrainConfig:
    base = dict(
        data=data,
        output=out,
        draft_vocab_size=200,
        ttt_steps=3,
        lr=3e-3,
        warmup_steps=2,
        token_budget=256,
        eval_fraction=0.15,
        log_every=1,
        save_every=1000,
        device="cpu",
        seed=0,
        max_steps=4,
        method="eagle3.1",
    )
    return TrainConfig(**{**base, **kw})


def test_an_eagle3_draft_starts_an_eagle31_run_offline_and_online(data, tmp_path):
    """train --method eagle3.1 from the store (offline) and from the prepared set (the target in the trainer),
    --init-from an EAGLE-3 run: its weights carried over, fc_norm starting at ones and learned."""
    prepared, store = data
    eagle3 = tmp_path / "eagle3"
    trainer.run(_cfg(store, eagle3, method="eagle3", max_steps=2))
    source, _ = artefact.load_checkpoint(eagle3)
    assert not any(name.startswith("fc_norm.") for name in source)
    same = tmp_path / "same"  # lr 1e-12: the weights as they came
    trainer.run(_cfg(store, same, init_from=eagle3, max_steps=1, lr=1e-12, warmup_steps=0, schedule="constant"))
    tensors, manifest = artefact.load_checkpoint(same)
    assert manifest.draft.method == "eagle3.1" and manifest.draft.fc_norm and manifest.draft.norm_output
    assert all(torch.equal(tensors[f"fc_norm.{i}.weight"], torch.ones(64)) for i in range(3))
    for name, value in source.items():
        torch.testing.assert_close(tensors[name], value, rtol=1e-6, atol=1e-8)
    for data_dir, kind in ((store, "store"), (prepared, "prepared")):
        out = tmp_path / kind
        layers = dict(aux_layer_ids=[1, 2, 3]) if kind == "prepared" else {}  # the store's, computed online
        trainer.run(_cfg(data_dir, out, init_from=eagle3, **layers))
        tensors, manifest = artefact.load_checkpoint(artefact.latest_checkpoint(out))
        assert manifest.data_kind == kind and manifest.draft.method == "eagle3.1"
        assert not torch.equal(tensors["fc_norm.0.weight"], torch.ones(64)), kind  # learned
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [len(m["acc"]) for m in metrics if m["type"] == "train"] == [3] * 4


@pytest.fixture(scope="module")
def eagle31_run(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("eagle31-run") / "run"
    trainer.run(_cfg(data[1], out))
    return out


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_an_eagle31_export_says_both_flags_where_vllm_reads_them_and_reads_back(eagle31_run, tmp_path, fmt):
    out = tmp_path / fmt
    export.run(ExportConfig(checkpoint=eagle31_run, format=fmt, output=out, dtype="fp32"))
    config = json.loads((out / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True and method_of_config(config).name == "eagle3.1"
    weights = load_file(str(out / "model.safetensors"))
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(weights)
    back = load_draft(out)
    assert back.spec.method == "eagle3.1" and back.spec.fc_norm and back.spec.norm_output
    assert back.spec == load_draft(eagle31_run).spec
    if fmt == "speculators":  # vLLM's own reader of speculators' eagle3 type keeps both flags
        pytest.importorskip("vllm")
        from vllm.transformers_utils.configs.speculators.algos import SUPPORTED_SPECULATORS_TYPES

        vllm_config: dict = {}
        SUPPORTED_SPECULATORS_TYPES[config["speculators_model_type"]](config, vllm_config)
        assert vllm_config["fc_norm"] is True and vllm_config["norm_output"] is True
    else:  # vLLM's Eagle-3 loader maps every name of the file to its module's
        pytest.importorskip("vllm")
        from vllm.model_executor.models.llama_eagle3 import LlamaModel

        assert all(LlamaModel.hf_to_vllm_mapper.map_name(n) for n in weights)
    config["norm_output"] = False  # vLLM reads the flags apart: one without the other is not what was trained
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftsmithError, match="sets fc_norm but not norm_output"):
        load_draft(out)


def test_sglang_is_refused_for_an_eagle31_draft_in_one_line(eagle31_run, tmp_path):
    with pytest.raises(DraftsmithError, match="^format sglang: SGLang's EAGLE-3 draft has no fc_norm"):
        export.run(ExportConfig(checkpoint=eagle31_run, format="sglang", output=tmp_path / "s"))
    assert method("eagle3.1").speculative_config("d", 3, {}) == {
        "method": "eagle3",
        "model": "d",
        "num_speculative_tokens": 3,
    }
