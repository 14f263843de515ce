"""Find, identify and load a target model; tap its layers in vLLM's layer-id convention.

Layer ids (docs/architecture.md): 0 = embeddings, k = output of decoder layer k-1 (the residual stream before the final
norm), N = the last decoder layer's output, un-normalised.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import snapshot_download
from safetensors import safe_open
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.utils import logging as hf_logging

from draftsmith.core import assets, devices, hfcompat, sizing
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import sha256_bytes
from draftsmith.core.manifest import TargetIdentity
from draftsmith.core.target_config import (  # noqa: F401 - re-exported: callers read configs from targets too
    context_length,
    is_multimodal_wrapper,
    read_config,
    text_config,
)

# Config keys that change nothing about the computation (bookkeeping written by save_pretrained).
_VOLATILE_CONFIG_KEYS = {
    "transformers_version",
    "_name_or_path",
    "_model_name_or_path",
    "dtype",
    "torch_dtype",
    "quantization_config",
    "use_cache",
}
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
# tokenizer_config.json keys that record how the tokenizer was loaded, not how it tokenises: save_pretrained writes
# e.g. "local_files_only": true under HF_HUB_OFFLINE=1, which must not make the same target "another target".
_VOLATILE_TOKENIZER_KEYS = {
    "local_files_only",
    "name_or_path",
    "_commit_hash",
    "cache_dir",
    "revision",
    "token",
    "use_auth_token",
    "force_download",
    "proxies",
    "subfolder",
    "_from_auto",
    "tokenizer_file",
    "trust_remote_code",
}


def resolve_target(spec: str | Path | None) -> Path:
    """Turn what the user typed into a local HF directory (converting a GGUF file once)."""
    if spec is None or str(spec) == "":
        return assets.default_target_dir()
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise DraftsmithError(f"{path}: GGUF file does not exist")
        return assets.converted_gguf_dir(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise DraftsmithError(f"{path}: not a Hugging Face model directory (no config.json)")
        return path
    if path.exists():
        raise DraftsmithError(f"{path}: expected an HF model directory, a .gguf file or a hub id")
    try:
        local = Path(snapshot_download(str(spec), local_files_only=True))
    except Exception:  # noqa: BLE001 - any hub failure means "not in the local cache"
        raise DraftsmithError(
            f"target {spec!r}: not a local directory or .gguf file, and not in the local Hugging Face cache "
            "(draftsmith never downloads from a hub at run time; download it first, e.g. `hf download`)"
        ) from None
    return local


def _tokenizer_file_bytes(file: Path) -> bytes:
    """The file's bytes, except tokenizer_config.json: its content without loading-time bookkeeping."""
    data = file.read_bytes()
    if file.name != "tokenizer_config.json":
        return data
    try:
        config = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return data
    if not isinstance(config, dict):
        return data
    config = hfcompat.canonical_tokenizer_config(config)  # one name for the fast tokenizer, whoever wrote it
    stable = {k: v for k, v in config.items() if k not in _VOLATILE_TOKENIZER_KEYS}
    return json.dumps(stable, sort_keys=True).encode()


def target_identity(path: Path) -> TargetIdentity:
    """Hashes and sizes that let every later stage refuse inputs made for another target."""
    path = Path(path)
    config = read_config(path)
    text = text_config(config)
    # canonical: the same target whichever transformers wrote it (or made it portable, hfcompat)
    stable = {k: v for k, v in sorted(hfcompat.canonical_config(config).items()) if k not in _VOLATILE_CONFIG_KEYS}
    tok_hash = sha256_bytes(
        b"".join(_tokenizer_file_bytes(path / name) for name in _TOKENIZER_FILES if (path / name).is_file())
    )
    try:
        return TargetIdentity(
            path=str(path.resolve()),
            architecture=(config.get("architectures") or ["unknown"])[0],
            config_hash=sha256_bytes(json.dumps(stable, sort_keys=True).encode()),
            tokenizer_hash=tok_hash,
            num_layers=int(text["num_hidden_layers"]),
            hidden_size=int(text["hidden_size"]),
            vocab_size=int(text["vocab_size"]),
        )
    except KeyError as err:
        raise DraftsmithError(f"{path}/config.json: missing {err}; is this a decoder-only causal LM?") from None


def load_tokenizer(path: Path, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The target's tokenizer; one saved by transformers 5 (`tokenizer_class: TokenizersBackend`, a class 4.x lacks)
    loads in transformers 4.x as what it is, the fast tokenizer of its tokenizer.json.

    Decoding gives the tokens' own text: `clean_up_tokenization_spaces` is off whatever the tokenizer's config says
    (transformers 4.x honours a `true` there and drops the space before "'", "," or "n't", so a regenerated answer
    would no longer be the text the target wrote; transformers 5 and vLLM's detokenizer never clean up)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        if not hfcompat.fast_tokenizer_under_unknown_name(Path(path)):
            raise DraftsmithError(f"{path}: cannot load the tokenizer ({err})".replace("\n", " ")) from None
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    tokenizer.clean_up_tokenization_spaces = False
    return tokenizer


def auto_model_class(config: Any) -> Any:
    """The transformers auto class that builds this target with its LM head: AutoModelForCausalLM, or for a
    multimodal wrapper whose config it does not map (Kimi-K2.5, ...) AutoModelForImageTextToText, whose model holds
    the language model and the head."""

    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
        if type(config) in auto._model_mapping or getattr(config, "auto_map", {}).get(auto.__name__):
            return auto
    return AutoModelForCausalLM  # its own error names the config class


def load_target(
    path: Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", trust_remote_code: bool = False
) -> PreTrainedModel:
    """The target with its LM head (a causal LM, or the multimodal model around one) in eval mode, gradients off."""

    hf_logging.disable_progress_bar()  # our own progress display is the one a user reads
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = auto_model_class(config).from_pretrained(
            path, config=config, dtype=dtype, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as err:
        raise DraftsmithError(f"{path}: cannot load the target model ({err})".replace("\n", " ")) from None
    model.to(device).eval().requires_grad_(False)
    decoder_layers(model)  # a model whose decoder stack cannot be found is refused here, in one line
    return model


class TargetHeadParts(nn.Module):
    """A target's embedding, final norm and lm_head without its decoder layers: all that training from a store
    touches (an 8B target's layers are ~15 GB the offline trainer would load and never run)."""

    def __init__(self, embed: nn.Module, norm: nn.Module, head: nn.Module):
        super().__init__()
        self.embed_tokens, self.norm, self.lm_head = embed, norm, head

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


def _safetensors_names(path: Path) -> dict[str, tuple[Path, str]] | None:
    """tensor name -> (file, name) for a safetensors checkpoint (single file or sharded with an index), else None."""

    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {name: (path / file, name) for name, file in json.loads(index.read_text())["weight_map"].items()}
    single = path / "model.safetensors"
    if not single.is_file():
        return None
    with safe_open(str(single), framework="pt") as f:
        return {name: (single, name) for name in f.keys()}  # noqa: SIM118 - a safetensors handle, not a dict


def _tensor_shapes(files: dict[str, tuple[Path, str]]) -> dict[str, tuple[int, ...]]:
    """checkpoint name -> shape, read from the safetensors headers (no tensor data)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in {file for file, _ in files.values()}:
        with safe_open(str(file), framework="pt") as f:
            shapes.update((name, tuple(f.get_slice(name).get_shape())) for name in f.keys())  # noqa: SIM118 - a safetensors handle
    return {name: shapes[stored] for name, (_, stored) in files.items() if stored in shapes}


def _checkpoint_name(
    module_name: str, shape: tuple[int, ...], files: dict[str, tuple[Path, str]], shapes: dict[str, tuple[int, ...]]
) -> str | None:
    """The checkpoint tensor a module parameter loads from: its own name, else the one tensor of its shape that ends
    in the same module and parameter name and shares the most name parts with it (Kimi-K2.5 stores the module's
    `model.language_model.norm.weight` as `language_model.model.norm.weight` and `lm_head.weight` as
    `language_model.lm_head.weight`); None when no tensor, or more than one, fits (the caller loads the whole
    model then). Read from the checkpoint itself, so it needs no transformers-version-specific renaming table."""

    if module_name in files:
        return module_name
    parts = module_name.split(".")
    best: list[tuple[int, str]] = []
    for name in files:
        other = name.split(".")
        if other[-2:] != parts[-2:] or shapes.get(name) != shape:
            continue
        shared = sum(min(parts.count(p), other.count(p)) for p in set(parts))
        best.append((shared - abs(len(other) - len(parts)), name))
    best.sort(reverse=True)
    if not best or (len(best) > 1 and best[0][0] == best[1][0]):
        return None
    return best[0][1]


# The whole target is loaded in place of its head only below this many bytes of checkpoint: a 1T-parameter target
# in fp32 on the CPU, in every training rank, is never what was meant.
WHOLE_TARGET_LIMIT = 32 * 2**30
# model types whose final norm is not a plain RMSNorm (Gemma's and Qwen3-Next's scale by 1 + weight)
_NOT_PLAIN_RMSNORM = ("gemma", "gemma2", "gemma3", "gemma3_text", "qwen3_next")


def checkpoint_bytes(path: Path, files: dict[str, tuple[Path, str]] | None = None) -> int:
    """The bytes of a checkpoint's weights: its index's total_size, else the size of its weight files."""
    path = Path(path)
    if files is None:
        files = _safetensors_names(path) if path.is_dir() else None
    index = path / "model.safetensors.index.json"
    if index.is_file():
        total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
        if isinstance(total, (int, float)):
            return int(total)
    found = {file for file, _ in files.values()} if files else set(path.glob("*.safetensors")) | set(path.glob("*.bin"))
    return sum(f.stat().st_size for f in found if f.is_file())


def _whole_target(
    path: Path,
    dtype: torch.dtype,
    device: str | torch.device,
    trust_remote_code: bool,
    files: dict[str, tuple[Path, str]] | None,
    why: str,
) -> nn.Module:
    """load_target in place of the head, where the target is small enough for that to be reasonable."""
    size = checkpoint_bytes(Path(path), files)
    if size > WHOLE_TARGET_LIMIT:
        raise DraftsmithError(
            f"{path}: the target's embedding, final norm and lm_head cannot be read by name ({why}), and loading the "
            f"whole target ({sizing.human_bytes(size)} of checkpoint) in their place is refused above "
            f"{sizing.human_bytes(WHOLE_TARGET_LIMIT)}; a safetensors checkpoint whose config.json names hidden_size, "
            "vocab_size and rms_norm_eps is read without its model code"
        )
    return load_target(path, dtype, device, trust_remote_code)


def _head_by_name(
    config: dict, files: dict[str, tuple[Path, str]], shapes: dict[str, tuple[int, ...]]
) -> tuple[dict[str, str], float, bool] | str:
    """The head's tensors found by name and shape alone, without the model's code: ({"embed", "norm", "head"} ->
    checkpoint name, the norm's eps, tied), or why not. The embedding is the one [vocab, hidden] `*embed_tokens.weight`,
    the final norm the `norm.weight` beside it (Kimi-K2.5: `language_model.model.norm.weight`), the head the one
    [vocab, hidden] `*lm_head.weight` (or the embedding, where tied)."""
    text = text_config(config)
    hidden, vocab, eps = text.get("hidden_size"), text.get("vocab_size"), text.get("rms_norm_eps")
    if not isinstance(hidden, int) or not isinstance(vocab, int) or not isinstance(eps, (int, float)):
        return "config.json names no hidden_size, vocab_size and rms_norm_eps"
    if text.get("model_type") in _NOT_PLAIN_RMSNORM or config.get("model_type") in _NOT_PLAIN_RMSNORM:
        return f"model type {text.get('model_type')}: its final norm is not a plain RMSNorm"
    embeds = [n for n in files if n.endswith("embed_tokens.weight") and shapes.get(n) == (vocab, hidden)]
    if len(embeds) != 1:
        return f"{len(embeds)} tensors named *embed_tokens.weight of shape [{vocab}, {hidden}]"
    norm = embeds[0].removesuffix("embed_tokens.weight") + "norm.weight"
    if shapes.get(norm) != (hidden,):
        return f"no {norm} of shape [{hidden}] beside the embedding"
    tied = bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    heads = [n for n in files if n.endswith("lm_head.weight") and shapes.get(n) == (vocab, hidden)]
    if len(heads) > 1 or (not heads and not tied):
        return f"{len(heads)} tensors named *lm_head.weight of shape [{vocab}, {hidden}]"
    return {"embed": embeds[0], "norm": norm, "head": heads[0] if heads else embeds[0]}, float(eps), tied


def _read(files: dict[str, tuple[Path, str]], name: str) -> torch.Tensor:
    file, stored = files[name]
    with safe_open(str(file), framework="pt") as f:
        return f.get_tensor(stored)


def hf_backend_hint(target: Path) -> str:
    """ ", or --backend hf" where the target would fit one device in transformers (twice its checkpoint: fp32 compute
    of bf16 weights, dequantised ones), else "": a hint to load 600 GB on one device is no hint."""
    memory = devices.device_memory_bytes()
    return ", or --backend hf" if memory is None or 2 * checkpoint_bytes(target) <= memory else ""


def load_target_head(
    path: Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", trust_remote_code: bool = False
) -> nn.Module:
    """Only the embedding, final norm and lm_head, read by name from the safetensors files (a checkpoint whose
    names are not the module's, like Kimi-K2.5's `language_model.model.*`, matched by _checkpoint_name). Where the
    model's own code cannot build a skeleton (remote code that does not import with this transformers), they are
    found by name and shape alone (_head_by_name, a plain RMSNorm). The whole target (load_target) only when the
    checkpoint is not laid out so and is small (WHOLE_TARGET_LIMIT); a big one is refused in one line."""

    path = Path(path)
    try:
        files = _safetensors_names(path)
    except Exception:  # noqa: BLE001 - an unreadable index or header: no by-name layout, as before this read moved up
        files = None
    if files is None:
        return _whole_target(path, dtype, device, trust_remote_code, files, "not a safetensors checkpoint")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            skeleton = auto_model_class(config).from_config(config, trust_remote_code=trust_remote_code)
    except Exception as err:  # noqa: BLE001 - the model's code did not build: read the head by name instead
        found = _head_by_name(read_config(path), files, _tensor_shapes(files))
        if isinstance(found, str):
            why = f"{found}; the model's code did not build: {type(err).__name__}: {err}".replace("\n", " ")
            return _whole_target(path, dtype, device, trust_remote_code, files, why[:400])
        names, eps, tied = found
        embed_weight = _read(files, names["embed"])
        vocab, hidden = embed_weight.shape
        embed = nn.Embedding(vocab, hidden, _weight=embed_weight)
        norm = LlamaRMSNorm(embed_weight.shape[1], eps=eps)
        norm.weight = nn.Parameter(_read(files, names["norm"]))
        head = nn.Linear(embed_weight.shape[1], embed_weight.shape[0], bias=False)
        head.weight = embed.weight if tied else nn.Parameter(_read(files, names["head"]))
        return TargetHeadParts(embed, norm, head).to(device=device, dtype=dtype).eval().requires_grad_(False)
    shapes = _tensor_shapes(files)
    parts = {"embed": embed_tokens(skeleton), "norm": final_norm(skeleton), "head": lm_head(skeleton)}
    module_names = {id(m): n for n, m in skeleton.named_modules()}
    tied = parts["head"].weight is parts["embed"].weight
    loaded: dict[str, nn.Module] = {}
    for key, module in parts.items():
        prefix = module_names[id(module)]
        if key == "head" and tied:  # the embedding's weight, loaded above
            loaded[key] = parts["head"].to_empty(device="cpu")
            continue
        found_names = {
            k: _checkpoint_name(f"{prefix}.{k}", tuple(t.shape), files, shapes) for k, t in module.state_dict().items()
        }
        missing = [f"{prefix}.{k}" for k, name in found_names.items() if name is None]
        if missing:
            return _whole_target(
                path, dtype, device, trust_remote_code, files, f"no one checkpoint tensor for {', '.join(missing)}"
            )
        state = {k: _read(files, name) for k, name in found_names.items() if name is not None}
        loaded[key] = module.to_empty(device="cpu")
        loaded[key].load_state_dict(state, strict=True)
    if tied:
        loaded["head"].weight = loaded["embed"].weight
    head_parts = TargetHeadParts(loaded["embed"], loaded["norm"], loaded["head"])
    return head_parts.to(device=device, dtype=dtype).eval().requires_grad_(False)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


# ------------------------------------------------------------------------------------------ the module tree
#
# Where the decoder layers, the final norm and the head are is read from the model itself, not from a list of
# architecture names: the text backbone is the module that holds the model's input embedding next to a list of
# exactly num_hidden_layers modules (model.model for a causal LM, model.model.language_model for Kimi-K2.5 and
# other multimodal wrappers); the final norm is the backbone's one normalisation child; the head is the model's
# output embedding. A model where any of these is ambiguous or missing is refused in one line.


def _num_hidden_layers(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = getattr(text, "num_hidden_layers", None)
    return int(n) if n is not None else None


def _cannot(model: nn.Module, what: str) -> DraftsmithError:
    return DraftsmithError(
        f"{type(model).__name__}: cannot find {what} in the model's module tree (draftsmith "
        "needs a decoder-only text backbone: an input embedding beside a list of "
        "num_hidden_layers decoder layers, a final norm and an LM head)"
    )


def text_backbone(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    """(the text decoder stack, its list of decoder layers), found in the module tree."""
    if isinstance(model, TargetHeadParts):
        raise _cannot(model, "decoder layers (only the embedding, final norm and head were loaded)")
    get_embed = getattr(model, "get_input_embeddings", None)
    embed = get_embed() if callable(get_embed) else None
    n = _num_hidden_layers(model)
    if embed is None or n is None:
        raise _cannot(model, "the input embedding or config.num_hidden_layers")
    for module in model.modules():  # pre-order: the shallowest match first
        children = list(module.children())
        if not any(child is embed for child in children):
            continue
        stacks = [c for c in children if isinstance(c, nn.ModuleList) and len(c) == n]
        if len(stacks) == 1:
            return module, stacks[0]
    raise _cannot(model, f"a list of {n} decoder layers beside the input embedding")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return text_backbone(model)[1]


def final_norm(model: nn.Module) -> nn.Module:
    """The norm applied to the last decoder layer's output before the LM head."""
    if isinstance(model, TargetHeadParts):
        return model.norm
    backbone, layers = text_backbone(model)
    norms = [c for c in backbone.children() if c is not layers and "norm" in type(c).__name__.lower()]
    if len(norms) != 1:
        raise _cannot(model, f"the final norm (the backbone {type(backbone).__name__} has {len(norms)} norm modules)")
    return norms[0]


def embed_tokens(model: nn.Module) -> nn.Embedding:
    embed = model.get_input_embeddings()  # type: ignore[operator]  # a transformers method behind nn.Module.__getattr__
    if embed is None:
        raise _cannot(model, "the input embedding")
    return embed


def lm_head(model: nn.Module) -> nn.Linear:
    head = model.get_output_embeddings()  # type: ignore[operator]  # a transformers method behind nn.Module.__getattr__
    if head is None:
        raise _cannot(model, "the LM head (get_output_embeddings() is None)")
    return head


def eos_ids(tokenizer: PreTrainedTokenizerBase, target_dir: Path) -> set[int]:
    """The ids that end an answer: the tokenizer's eos and generation_config.json's eos_token_id(s)."""
    ids = set() if tokenizer.eos_token_id is None else {int(tokenizer.eos_token_id)}
    gen = Path(target_dir) / "generation_config.json"
    if gen.is_file():
        value = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
        ids.update([value] if isinstance(value, int) else [int(v) for v in value or []])
    return ids
