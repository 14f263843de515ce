import json
import shutil

import pytest
import torch

from draftsmith.core import layers, targets
from draftsmith.core.errors import DraftsmithError


def test_identity_reads_sizes_from_config(tiny_target_dir):
    ident = targets.target_identity(tiny_target_dir)
    assert (ident.num_layers, ident.hidden_size, ident.vocab_size) == (4, 64, 320)
    assert ident.architecture == "LlamaForCausalLM"
    assert len(ident.config_hash) == 64 and len(ident.tokenizer_hash) == 64


def test_identity_ignores_bookkeeping_but_not_weights_shape(tiny_target_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_target_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    config["transformers_version"] = "0.0.0"
    (copy / "config.json").write_text(json.dumps(config))
    a, b = targets.target_identity(tiny_target_dir), targets.target_identity(copy)
    assert a.mismatch(b) is None
    config["hidden_size"] = 128
    (copy / "config.json").write_text(json.dumps(config))
    assert "config_hash" in targets.target_identity(copy).mismatch(a)


def test_identity_ignores_how_the_tokenizer_was_loaded(tiny_target_dir, tmp_path):
    # save_pretrained under HF_HUB_OFFLINE=1 writes "local_files_only": true; the same target must stay the same
    copy = tmp_path / "copy"
    shutil.copytree(tiny_target_dir, copy)
    config_file = copy / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.update(local_files_only=not config.get("local_files_only", False), name_or_path="/somewhere/else")
    config_file.write_text(json.dumps(config, indent=4))
    reference = targets.target_identity(tiny_target_dir)
    assert targets.target_identity(copy).mismatch(reference) is None
    config["eos_token"] = "<not-the-same>"  # what the tokenizer does still counts
    config_file.write_text(json.dumps(config))
    assert "tokenizer_hash" in targets.target_identity(copy).mismatch(reference)


def test_default_aux_layers_follow_eagle3():
    assert layers.default_aux_layer_ids(30) == [2, 15, 27]
    assert layers.default_aux_layer_ids(32) == [2, 16, 29]


def test_layer_id_checks():
    assert layers.check_layer_ids([15, 2, 27], 30) == [2, 15, 27]
    with pytest.raises(DraftsmithError, match="out of range"):
        layers.check_layer_ids([2, 31], 30)
    with pytest.raises(DraftsmithError, match="duplicates"):
        layers.check_layer_ids([2, 2], 30)


def test_resolve_target_errors_are_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DraftsmithError, match="no config.json"):
        targets.resolve_target(tmp_path / "empty")
    with pytest.raises(DraftsmithError, match="GGUF file does not exist"):
        targets.resolve_target(tmp_path / "missing.gguf")
    with pytest.raises(DraftsmithError, match="not in the local Hugging Face cache"):
        targets.resolve_target("no-such-org/no-such-model-xyz")


def test_load_target_and_layer_accessors(tiny_target_dir):
    model = targets.load_target(tiny_target_dir)
    assert len(targets.decoder_layers(model)) == 4
    assert targets.embed_tokens(model).weight.shape == (320, 64)
    assert targets.lm_head(model).weight.shape == (320, 64)
    assert not any(p.requires_grad for p in model.parameters())
    x = torch.randn(1, 3, 64)
    assert targets.final_norm(model)(x).shape == x.shape


@pytest.mark.parametrize("tied", [False, True])
def test_head_parts_equal_the_whole_models_without_its_layers(tmp_path, tied):
    from conftest import build_tiny_target

    path = build_tiny_target(tmp_path / "t", tie_word_embeddings=tied)
    full, head = targets.load_target(path), targets.load_target_head(path)
    assert isinstance(head, targets.TargetHeadParts) and not hasattr(head, "model")  # no decoder layers
    for part in (targets.embed_tokens, targets.final_norm, targets.lm_head):
        a, b = part(full).state_dict(), part(head).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part.__name__
    assert (targets.lm_head(head).weight is targets.embed_tokens(head).weight) == tied
    assert not any(p.requires_grad for p in head.parameters())


def test_head_parts_fall_back_to_the_whole_model_for_other_layouts(tmp_path):
    from conftest import build_tiny_target
    from safetensors.torch import load_file

    path = build_tiny_target(tmp_path / "t")
    state = load_file(str(path / "model.safetensors"))
    torch.save(state, path / "pytorch_model.bin")  # a .bin checkpoint: no tensor can be read by name
    (path / "model.safetensors").unlink()
    assert not isinstance(targets.load_target_head(path), targets.TargetHeadParts)


def test_a_kimi_checkpoint_whose_model_code_does_not_import_gives_its_head_by_name(tmp_path, one_thread):
    """Kimi-K2.5's own modelling code imports names newer transformers dropped: the head is then read by name and
    shape from config.json and the safetensors index alone (no model code), equal to the model's own parts, and
    where even that cannot be done, a whole-model load of a 594 GB checkpoint is refused in one line."""
    from families import target_dir
    from safetensors import safe_open

    source = target_dir("kimi_k25")
    model = targets.load_target(source)
    path = tmp_path / "kimi"
    shutil.copytree(source, path)
    config = json.loads((path / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "configuration_kimi_k25.KimiK25Config",
        "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / "configuration_kimi_k25.py").write_text(
        "from transformers.models.llama.modeling_llama import LlamaFlashAttention2  # gone since transformers 4.48\n"
    )
    head = targets.load_target_head(path, trust_remote_code=True)
    assert isinstance(head, targets.TargetHeadParts)
    for part in (targets.embed_tokens, targets.lm_head):
        assert torch.equal(part(model).weight, part(head).weight), part.__name__
    x = torch.randn(2, 5, 128)
    assert torch.allclose(targets.final_norm(model)(x), targets.final_norm(head)(x), atol=1e-6)  # its own norm's output
    assert not torch.allclose(targets.final_norm(head)(x), x, atol=1e-2)  # (a norm that does something)

    # the same checkpoint as Kimi-K2.5's index describes it (594 GB), without the final norm: refused, not loaded
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = [n for n in f.keys() if not n.endswith("model.norm.weight")]  # noqa: SIM118 - a safetensors handle
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 594_000_000_000}, "weight_map": {n: "model.safetensors" for n in names}})
    )
    with pytest.raises(DraftsmithError) as err:
        targets.load_target_head(path, trust_remote_code=True)
    message = str(err.value)
    assert "\n" not in message and message.startswith(
        f"{path}: the target's embedding, final norm and lm_head cannot "
        "be read by name (no language_model.model.norm.weight of shape "
        "[128] beside the embedding; the model's code did not build: "
    )
    assert "LlamaFlashAttention2" in message, message
    assert "loading the whole target (553 GiB of checkpoint) in their place is refused above 32 GiB" in message


# ------------------------------------------------------------------------------------------ every family


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k25"])
def test_the_module_tree_of_every_family(name, one_thread):
    from families import PUBLISHED, target_dir

    path = target_dir(name)
    model = targets.load_target(path)
    backbone, layers = targets.text_backbone(model)
    text = targets.text_config(targets.read_config(path))
    assert len(layers) == len(targets.decoder_layers(model)) == text["num_hidden_layers"] == 4
    assert targets.embed_tokens(model) is backbone.get_input_embeddings()
    assert targets.final_norm(model) is backbone.norm  # the backbone's one norm, found by its type
    assert targets.lm_head(model).weight.shape == (320, 128)
    ident = targets.target_identity(path)
    assert ident.architecture == PUBLISHED[name]["architectures"][0]  # a wrapper keeps its own name ...
    assert (ident.num_layers, ident.hidden_size, ident.vocab_size) == (4, 128, 320)  # ... and its text sizes
    assert targets.is_multimodal_wrapper(targets.read_config(path)) == (name == "kimi_k25")
    if name == "kimi_k25":  # the text backbone inside the multimodal model, not the vision tower
        assert backbone is model.model.language_model and type(model).__name__ == "Kimi_K25ForConditionalGeneration"
    # the head parts of a store-trained draft, read by name (Kimi-K2.5's checkpoint names are not its module names:
    # read through transformers' renaming), equal to the whole model's
    head = targets.load_target_head(path)
    assert isinstance(head, targets.TargetHeadParts) and not hasattr(head, "model")
    for part in (targets.embed_tokens, targets.final_norm, targets.lm_head):
        a, b = part(model).state_dict(), part(head).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (name, part.__name__)


def test_a_model_without_a_readable_decoder_stack_is_refused_in_one_line():
    from transformers import LlamaConfig

    class Odd(torch.nn.Module):  # layers not beside the embedding
        def __init__(self):
            super().__init__()
            self.config = LlamaConfig(num_hidden_layers=2)
            self.embed = torch.nn.Embedding(10, 4)
            self.blocks = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)]))

        def get_input_embeddings(self):
            return self.embed

        def get_output_embeddings(self):
            return None

    for accessor in (targets.decoder_layers, targets.final_norm, targets.lm_head):
        with pytest.raises(DraftsmithError, match="Odd: cannot find") as err:
            accessor(Odd())
        assert "\n" not in str(err.value)
    with pytest.raises(DraftsmithError, match="cannot find decoder layers"):
        targets.decoder_layers(
            targets.TargetHeadParts(torch.nn.Embedding(3, 2), torch.nn.LayerNorm(2), torch.nn.Linear(2, 3))
        )


def test_decoding_gives_the_tokens_own_text_whatever_the_tokenizer_config_says(tiny_target_dir, tmp_path):
    # transformers 4.x honours "clean_up_tokenization_spaces": true and drops the space before "," or "'s": a
    # regenerated answer decoded that way is no longer the text the target wrote (CI saw "from'react'")
    import transformers
    from transformers import AutoTokenizer

    copy = tmp_path / "copy"
    shutil.copytree(tiny_target_dir, copy)
    config_file = copy / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "clean_up_tokenization_spaces": True}))
    text = "from 'react' , it 's"
    plain = AutoTokenizer.from_pretrained(copy)
    ids = plain(text, add_special_tokens=False)["input_ids"]
    assert plain.decode(ids, clean_up_tokenization_spaces=False) == text  # the tokens hold the text exactly
    if transformers.__version__.startswith("4."):  # 4.x cleans up as the config says (5 never does for BPE)
        assert plain.decode(ids) != text
    tok = targets.load_tokenizer(copy)
    assert tok.decode(ids) == text and tok.batch_decode([ids]) == [text]


def test_the_backend_hf_hint_is_given_only_for_a_target_that_fits_one_device(tmp_path, monkeypatch):
    from conftest import build_tiny_target

    from draftsmith.core import devices

    small = build_tiny_target(tmp_path / "small")
    big = tmp_path / "big"
    big.mkdir()
    (big / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 594_000_000_000}, "weight_map": {}})
    )
    assert targets.checkpoint_bytes(big) == 594_000_000_000
    assert 0 < targets.checkpoint_bytes(small) < 10**7
    monkeypatch.setattr(devices, "device_memory_bytes", lambda: 141 * 2**30)  # one H200
    assert targets.hf_backend_hint(small) == ", or --backend hf" and targets.hf_backend_hint(big) == ""
