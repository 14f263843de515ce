"""A draft directory's layout and its reading, below every stage: `DraftManifest` (what every draft directory records:
a training checkpoint, an export in any format) and `CheckpointManifest`, where a run keeps its checkpoints
(`RUN/best/`, `RUN/checkpoints/step-N/`), and the reading of a draft's weights, checksums checked. train/checkpoint.py
writes checkpoints and their training state; `methods.artefact.load_draft` turns any draft directory into a draft.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from pydantic import ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError
from safetensors.torch import load_file

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import sha256_file
from draftsmith.core.manifest import MANIFEST_NAME, Manifest, TargetIdentity, read_manifest
from draftsmith.methods import recorded_spec
from draftsmith.methods.layers import draft_tensors
from draftsmith.methods.spec import DraftSpec

CHECKPOINTS_DIR = "checkpoints"
BEST_DIR = "best"
WEIGHTS_FILE = "model.safetensors"
STATE_FILE = "training_state.pt"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class DraftManifest(Manifest):
    """The fields every draft directory (training checkpoint, export in any format) records: for which target,
    which draft, the checksums of its files, how it was trained. Read as this base, any draft directory's manifest
    gives what `load_draft` needs; CheckpointManifest and the export's manifest add their own fields."""

    model_config = ConfigDict(extra="ignore")  # the base reads any draft directory; the subclasses forbid extras

    kind: str = Field("", description="checkpoint or export (set by each subclass)")
    format_version: int = 3
    target: TargetIdentity
    draft: DraftSpec
    files: dict[str, str] = Field(default_factory=dict, description="sha256 of each file in the directory")
    training: dict[str, Any] = Field(
        default_factory=dict,
        description="how the draft was trained, in a few lines (README.md): data, step, tokens, evaluation",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_format_1(cls, data: object) -> object:
        """Manifests of draftsmith 0.1 (format_version 1), converted on read: a checkpoint's `draft` was a
        DraftConfig (num_layers, num_aux_layers, attention_bias, mlp_bias) beside a top-level `aux_layer_ids`;
        an export's `arch` (a DraftArch, with norm_before_residual) and `weights_file` + `weights_sha256`. Then as
        format 2 (`_from_format_2`)."""
        if not isinstance(data, dict) or data.get("format_version", 3) >= 2:  # written, or built here
            return cls._from_format_2(data)
        data = dict(data, format_version=2)
        if "arch" in data:  # an export
            draft = dict(data.pop("arch"))
            if draft.pop("norm_before_residual", False):
                raise PydanticCustomError(
                    "older_draftsmith",
                    "made by an older draftsmith with norm_before_residual, "
                    "which this one does not build; re-run `draftsmith export`",
                )
            weights = data.pop("weights_file", WEIGHTS_FILE)
            if "weights_sha256" in data:
                data["files"] = {weights: data.pop("weights_sha256")}
        else:  # a checkpoint
            draft = dict(data.get("draft") or {})
            aux = list(data.pop("aux_layer_ids", None) or [])
            if draft.pop("attention_bias", False) or draft.pop("mlp_bias", False):
                raise PydanticCustomError(
                    "older_draftsmith",
                    "made by an older draftsmith with attention/MLP biases, "
                    "which no EAGLE-3 format carries; re-run `draftsmith train`",
                )
            if draft.pop("num_aux_layers", len(aux)) != len(aux):
                raise PydanticCustomError(
                    "damaged",
                    "aux_layer_ids {aux} do not match draft.num_aux_layers; the checkpoint is damaged",
                    {"aux": aux},
                )
            draft["num_hidden_layers"] = draft.pop("num_layers", 1)
            draft["aux_layer_ids"] = aux
        data["draft"] = draft
        return cls._from_format_2(data)

    @staticmethod
    def _from_format_2(data: object) -> object:
        """Manifests of format 2, converted on read: their drafts' specs as the methods record them now
        (`methods.recorded_spec`: a P-EAGLE draft was EAGLE-3's method with a flag)."""
        if not isinstance(data, dict) or data.get("format_version", 3) >= 3:
            return data
        return dict(data, format_version=3, draft=recorded_spec(dict(data.get("draft") or {})))


class CheckpointManifest(DraftManifest):
    """What a draft checkpoint is: for which target, which draft (its aux layers and vocabulary), how trained."""

    model_config = ConfigDict(extra="forbid")

    kind: str = "checkpoint"
    draft_vocab_coverage: float = Field(0.0, description="fraction of loss-masked training tokens in the draft vocab")
    data: str = Field("", description="store or prepared set trained on")
    data_kind: str = Field("", description="store (offline) or prepared (online)")
    eval_fraction: float = 0.0
    split_seed: int = 0
    step: int = 0
    epoch: int = 0
    tokens: int = 0
    metrics: dict[str, Any] = Field(default_factory=dict, description="latest evaluation (acc, accept, length)")
    best_acceptance_length: float | None = None
    hyperparameters: dict[str, Any] = Field(default_factory=dict, description="the resolved TrainConfig")
    training: dict[str, Any] = Field(
        default_factory=dict, exclude=True, description="summary of the fields above (not written: derived on read)"
    )

    @model_validator(mode="after")
    def _summarise(self) -> CheckpointManifest:
        summary: dict[str, object] = {}
        for key in ("data", "data_kind", "step", "epoch", "tokens", "best_acceptance_length", "draft_vocab_coverage"):
            value = getattr(self, key)
            if value not in (None, "", 0, 0.0):
                summary[key] = round(value, 4) if isinstance(value, float) else value
        if self.data:  # the held-out split, which `draftsmith evaluate --prompts PREPARED` reproduces from an export
            summary["eval_fraction"], summary["split_seed"] = self.eval_fraction, self.split_seed
        for key, value in self.metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                summary[f"eval {key}"] = round(float(value), 4)
            elif key == "acc" and isinstance(value, list):  # per step: what `evaluate --gate` compares serving with
                summary["eval acc"] = [round(float(a), 4) for a in value]
        self.training = summary
        return self


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR / f"step-{step:08d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete step checkpoints (those with a manifest), oldest first."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and p.is_dir() and (p / MANIFEST_NAME).is_file()
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def resolve(path: Path) -> Path:
    """A run directory -> its best/ (else newest step); a checkpoint (or any artefact) directory -> itself."""
    path = Path(path)
    if not path.is_dir():
        raise DraftsmithError(f"{path}: checkpoint does not exist; point at a `draftsmith train` output directory")
    if (path / MANIFEST_NAME).is_file():
        return path
    if (path / BEST_DIR / MANIFEST_NAME).is_file():
        return path / BEST_DIR
    latest = latest_checkpoint(path)
    if latest is None:
        raise DraftsmithError(f"{path}: no checkpoint in it (no best/ and no checkpoints/step-*); train first")
    return latest


def read_weights(directory: Path, manifest: DraftManifest, verify: bool = True) -> dict[str, torch.Tensor]:
    """The tensors of a draft directory's model.safetensors (checksum checked against its manifest), as written;
    an embedding that older checkpoints carry is dropped (it is the target's)."""
    file = _checked_file(Path(directory), WEIGHTS_FILE, manifest, verify)
    try:
        return draft_tensors(load_file(str(file)))
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types for damaged files
        raise DraftsmithError(f"{file}: cannot read ({err}); the {manifest.kind} is damaged") from None


def load_checkpoint(path: Path, verify: bool = True) -> tuple[dict[str, torch.Tensor], CheckpointManifest]:
    """The draft's tensors (module names, no embedding) and the manifest, from a run or a checkpoint directory."""
    directory = resolve(path)
    manifest = read_manifest(directory, CheckpointManifest)
    return read_weights(directory, manifest, verify), manifest


def verify_checkpoint(path: Path) -> list[Path]:
    """Re-hash every file a draft directory's manifest lists (a run: best/ and every step checkpoint); returns the
    directories checked, or raises DraftsmithError naming the first damaged or missing file."""
    path = Path(path)
    directories = (
        [path]
        if (path / MANIFEST_NAME).is_file()
        else ([path / BEST_DIR] if (path / BEST_DIR / MANIFEST_NAME).is_file() else []) + list_checkpoints(path)
    )
    if not directories:
        resolve(path)  # the one-line error for a directory that holds no checkpoint
    for directory in directories:
        manifest = read_manifest(directory, DraftManifest)
        for name in manifest.files:
            _checked_file(directory, name, manifest)
    return directories


def _checked_file(directory: Path, name: str, manifest: DraftManifest, verify: bool = True) -> Path:
    """directory / name, refused in one line when missing or (`verify`) not the sha256 its manifest lists."""
    file, kind = directory / name, manifest.kind or "checkpoint"
    if not file.is_file():
        raise DraftsmithError(f"{file}: missing; the {kind} is incomplete")
    digest = manifest.files.get(name)
    if verify and digest and sha256_file(file) != digest:
        raise DraftsmithError(f"{file}: sha256 does not match {directory / MANIFEST_NAME}; the {kind} is damaged")
    return file
