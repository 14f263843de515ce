"""Typed configs for every stage: a YAML file, then CLI overrides, validated by pydantic.

The CLI builds each sub-command's options from these models (cli.py), so a field added here with a
`description` is a documented `--option` at once, and docs/reference/ is generated from the same source.
"""

from __future__ import annotations

from draftsmith.config.base import (
    RESOLVED_CONFIG_NAME,
    StageConfig,
    StageResult,
    load_config,
    save_resolved_config,
    validate_config,
)
from draftsmith.config.data import ExtractConfig, PrepareConfig, RegenerateConfig, parse_shard
from draftsmith.config.serving import EvaluateConfig, ExportConfig, ImproveConfig, QuickstartConfig, ServeConfig
from draftsmith.config.training import FeedConfig, TrainConfig

__all__ = [
    "RESOLVED_CONFIG_NAME",
    "EvaluateConfig",
    "ExportConfig",
    "ExtractConfig",
    "FeedConfig",
    "PrepareConfig",
    "ImproveConfig",
    "QuickstartConfig",
    "RegenerateConfig",
    "ServeConfig",
    "StageConfig",
    "StageResult",
    "TrainConfig",
    "load_config",
    "parse_shard",
    "save_resolved_config",
    "validate_config",
]
