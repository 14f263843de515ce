"""A target's config.json, read as plain JSON: the file, its language model's part, whether it is a multimodal
wrapper, its context length. No torch and no transformers (doctor and the vLLM probe read configs without them);
core/targets.py, which loads targets, re-exports these."""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.core.errors import DraftsmithError


def read_config(path: Path) -> dict:
    try:
        return json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise DraftsmithError(f"{path}/config.json: cannot read target config ({err})") from None


def text_config(config: dict) -> dict:
    """The language model's part of a config.json: a multimodal wrapper's `text_config`, else the config itself."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def is_multimodal_wrapper(config: dict) -> bool:
    """A config whose language model is nested (`text_config`) inside a wrapper with other towers (vision ...)."""
    return isinstance(config.get("text_config"), dict)


# Keys a config.json may declare its context length under (the first present wins, as in the engines that read them).
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")


def context_length(config: dict) -> int | None:
    """The positions the target declares (its language model's `max_position_embeddings` or an older key); None
    when the config names none."""
    text = text_config(config)
    for key in _CONTEXT_KEYS:
        value = text.get(key, config.get(key))
        if isinstance(value, int) and value > 0:
            return value
    return None
