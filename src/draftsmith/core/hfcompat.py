"""Hugging Face directories that every supported transformers reads the same way (4.56 -> 5.x).

vLLM 0.11.1 to 0.19.x run with transformers 4.56/4.57, later vLLMs with transformers 5, and both read the
directories draftsmith writes (the converted default target, exported drafts). transformers 5 writes two names that
4.x does not know:

- tokenizer_config.json `tokenizer_class: TokenizersBackend` (4.x: "Tokenizer class TokenizersBackend does not
  exist"); `PreTrainedTokenizerFast` is the same tokenizer under the name both releases know.
- config.json `rope_parameters` instead of `rope_theta` / `rope_scaling`: 4.x ignores it and silently falls back to
  its default theta (10000), a different model. The 4.x keys are written beside it; transformers 5 reads the pair
  exactly as it reads `rope_parameters` alone.

Where a transformers API differs between the releases, the difference is found by looking for the feature (a class,
a constructor argument), never by comparing version numbers.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import transformers

from draftsmith.core.fsio import atomic_write_text

PORTABLE_TOKENIZER_CLASS = "PreTrainedTokenizerFast"
# transformers-5 names of PreTrainedTokenizerFast (the class both releases load a tokenizer.json with)
_FAST_TOKENIZER_ALIASES = {"TokenizersBackend", PORTABLE_TOKENIZER_CLASS}
_LEGACY_ROPE_KEYS = ("rope_theta", "rope_scaling")


def _rope_type(rope: dict[str, object]) -> str:
    return str(rope.get("rope_type") or rope.get("type") or "default")


def legacy_rope_keys(rope_parameters: object) -> dict[str, object]:
    """transformers-4 `rope_theta` (and `rope_scaling` for a scaled RoPE) equivalent to transformers-5
    `rope_parameters`; empty for a form 4.x has no flat equivalent of (per-layer-type RoPE)."""
    if not isinstance(rope_parameters, dict) or "rope_theta" not in rope_parameters:
        return {}
    out: dict[str, object] = {"rope_theta": rope_parameters["rope_theta"]}
    if _rope_type(rope_parameters) != "default":
        scaling = {k: v for k, v in rope_parameters.items() if k not in ("rope_theta", "partial_rotary_factor")}
        scaling["rope_type"] = _rope_type(rope_parameters)
        out["rope_scaling"] = scaling
    if "partial_rotary_factor" in rope_parameters:
        out["partial_rotary_factor"] = rope_parameters["partial_rotary_factor"]
    return out


def rope_parameters_of(config: dict[str, Any]) -> dict[str, Any]:
    """A config dict's RoPE in transformers-5 form, whichever release wrote it."""
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and rope:
        return dict(rope)
    rope = dict(config.get("rope_scaling") or {})
    rope["rope_type"] = _rope_type(rope)
    rope.pop("type", None)
    rope["rope_theta"] = float(config.get("rope_theta", 10000.0))
    return rope


def portable_config(config: dict[str, object]) -> dict[str, object]:
    """config.json content with the transformers-4 RoPE keys beside `rope_parameters` (in every nested
    sub-config too: a multimodal wrapper's text_config)."""
    out = {k: (portable_config(v) if isinstance(v, dict) and k.endswith("_config") else v) for k, v in config.items()}
    for key, value in legacy_rope_keys(config.get("rope_parameters")).items():
        if out.get(key) is None:
            out[key] = value
    return out


def canonical_config(config: dict[str, object]) -> dict[str, object]:
    """config.json content as transformers 5 writes it: the transformers-4 RoPE keys folded into
    `rope_parameters`, so a target means the same whichever release wrote (or portable_config touched) it."""
    out = {k: (canonical_config(v) if isinstance(v, dict) and k.endswith("_config") else v) for k, v in config.items()}
    if (isinstance(config.get("rope_parameters"), dict) and config["rope_parameters"]) or "rope_theta" in config:
        rope = out["rope_parameters"] = rope_parameters_of(config)
        for key in _LEGACY_ROPE_KEYS:
            out.pop(key, None)
        if "partial_rotary_factor" in rope and out.get("partial_rotary_factor") == rope["partial_rotary_factor"]:
            out.pop("partial_rotary_factor")
    return out


def portable_tokenizer_config(config: dict[str, object]) -> dict[str, object]:
    """tokenizer_config.json content naming a tokenizer class both releases have."""
    if config.get("tokenizer_class") in _FAST_TOKENIZER_ALIASES:
        return {**config, "tokenizer_class": PORTABLE_TOKENIZER_CLASS}
    return config


def canonical_tokenizer_config(config: dict[str, object]) -> dict[str, object]:
    """tokenizer_config.json content with the fast tokenizer under one name (transformers 5's), for hashing."""
    if config.get("tokenizer_class") in _FAST_TOKENIZER_ALIASES:
        return {**config, "tokenizer_class": "TokenizersBackend"}
    return config


def read_json_object(file: Path) -> dict[str, object] | None:
    """A JSON file holding an object (config.json, tokenizer_config.json), None when it is missing or is not one."""
    try:
        data = json.loads(Path(file).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def fast_tokenizer_under_unknown_name(path: Path) -> bool:
    """Whether a directory's tokenizer is a plain tokenizer.json under a fast-tokenizer class name this transformers
    does not have (TokenizersBackend in 4.x), so PreTrainedTokenizerFast reads it as what it is."""
    name = (read_json_object(Path(path) / "tokenizer_config.json") or {}).get("tokenizer_class")
    known = isinstance(name, str) and name in _FAST_TOKENIZER_ALIASES and not has_class(name)
    return known and (Path(path) / "tokenizer.json").is_file()


def _rewrite_json(file: Path, transform: Callable[[dict], dict | None]) -> bool:
    data = read_json_object(file)
    if data is None:
        return False
    new = transform(data)
    if new == data:
        return False
    atomic_write_text(file, json.dumps(new, indent=2, ensure_ascii=False) + "\n")
    return True


def make_portable(path: Path, *, plain_fast_tokenizer: bool = False) -> bool:
    """Rewrite an HF directory's config.json and tokenizer_config.json so transformers 4.56+ and 5.x read the same
    model and tokenizer from it; True when a file changed. `plain_fast_tokenizer`: the directory's tokenizer.json
    describes the tokenizer completely (draftsmith saved it from a fast tokenizer), so it is named
    PreTrainedTokenizerFast whatever class wrote it (a model-specific class such as LlamaTokenizer is another
    tokenizer in transformers 5 than in 4.x)."""
    path = Path(path)
    changed = _rewrite_json(path / "config.json", portable_config)
    if plain_fast_tokenizer and (path / "tokenizer.json").is_file():

        def transform(config: dict[str, object]) -> dict[str, object]:
            return {**config, "tokenizer_class": PORTABLE_TOKENIZER_CLASS}
    else:
        transform = portable_tokenizer_config
    return _rewrite_json(path / "tokenizer_config.json", transform) or changed


def is_portable(path: Path) -> bool:
    """Whether make_portable would leave the directory as it is."""
    path = Path(path)
    for name, transform in (("config.json", portable_config), ("tokenizer_config.json", portable_tokenizer_config)):
        data = read_json_object(path / name)
        if data is not None and transform(data) != data:
            return False
    return True


def rope_config_kwargs(
    config_class: type[transformers.PretrainedConfig], rope_parameters: dict[str, Any]
) -> dict[str, Any]:
    """Constructor arguments that give a transformers config class this RoPE: `rope_parameters` where the class
    takes it (transformers 5), else the transformers-4 `rope_theta` / `rope_scaling`."""
    if "rope_parameters" in inspect.signature(config_class.__init__).parameters:
        return {"rope_parameters": dict(rope_parameters)}
    legacy = legacy_rope_keys(rope_parameters)
    return {"rope_theta": legacy.get("rope_theta", 10000.0), "rope_scaling": legacy.get("rope_scaling")}


def has_class(name: str) -> bool:
    """Whether this transformers exports `name` (a model or config class some families need)."""
    try:
        return getattr(transformers, name, None) is not None
    except Exception:  # noqa: BLE001 - transformers' lazy import of an optional backend failed: not available
        return False
