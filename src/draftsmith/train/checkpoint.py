"""Training checkpoints: the only module that reads or writes them.

Run directory layout (`draftsmith train --output RUN`):

    RUN/config.yaml                      resolved TrainConfig
    RUN/metrics.jsonl                    one JSON line per logged step / evaluation
    RUN/checkpoints/step-00000100/       one directory per saved step (the newest `keep_checkpoints` are kept)
        manifest.json                    CheckpointManifest (kind "checkpoint")
        model.safetensors                the whole draft in fp32: embed_tokens, fc, layers.*, norm, lm_head, d2t, t2d
        training_state.pt                optimizer, sampler position, RNG states, counters (torch.load weights_only)
    RUN/best/                            manifest.json + model.safetensors of the best evaluation so far

Each directory is built beside its final name and renamed into place (fsio.atomic_dir), so a crash or a full disk
leaves the previous checkpoint whole. `load_checkpoint(path)` accepts RUN (best/, else the newest step), best/ or
a step directory and returns (Eagle3Draft, CheckpointManifest): what export and evaluation need.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch
from pydantic import Field
from safetensors.torch import load_file, save_file

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import atomic_dir, sha256_file
from draftsmith.core.manifest import (
    MANIFEST_NAME,
    Manifest,
    TargetIdentity,
    read_manifest,
    read_manifest_json,
    write_manifest,
)
from draftsmith.train.model import DraftConfig, Eagle3Draft

CHECKPOINTS_DIR = "checkpoints"
BEST_DIR = "best"
MODEL_FILE = "model.safetensors"
STATE_FILE = "training_state.pt"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointManifest(Manifest):
    """What a draft checkpoint is: for which target, which aux layers, which draft vocabulary, how trained."""

    kind: str = "checkpoint"
    target: TargetIdentity
    aux_layer_ids: list[int] = Field(description="vLLM convention; the order the fc input concatenates them")
    draft: DraftConfig
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
    files: dict[str, str] = Field(default_factory=dict, description="sha256 of each file in the directory")


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR / f"step-{step:08d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete step checkpoints (those with a manifest), oldest first."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()
             and (p / MANIFEST_NAME).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def save_checkpoint(run_dir: Path, manifest: CheckpointManifest, model_state: dict[str, torch.Tensor],
                    training_state: dict | None, keep: int = 2, best: bool = False) -> Path:
    """Write a step checkpoint (with training state) or, with best=True, RUN/best (weights only). Atomic."""
    target = Path(run_dir) / BEST_DIR if best else step_dir(run_dir, manifest.step)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model_state.items()}
    with atomic_dir(target) as tmp:
        save_file(tensors, str(tmp / MODEL_FILE), metadata={"format": "pt", "draftsmith": "eagle3-draft"})
        files = {MODEL_FILE: sha256_file(tmp / MODEL_FILE)}
        if training_state is not None and not best:
            torch.save(training_state, tmp / STATE_FILE)
            files[STATE_FILE] = sha256_file(tmp / STATE_FILE)
        write_manifest(tmp, manifest.model_copy(update={"files": files}))
    if not best:
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return target


def resolve(path: Path) -> Path:
    """A run directory -> its best/ (else newest step); a checkpoint directory -> itself."""
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


def read_checkpoint_manifest(path: Path) -> CheckpointManifest:
    return read_manifest(resolve(path), CheckpointManifest)


def load_model_state(directory: Path, manifest: CheckpointManifest, verify: bool = True) -> dict[str, torch.Tensor]:
    file = Path(directory) / MODEL_FILE
    if not file.is_file():
        raise DraftsmithError(f"{file}: missing; the checkpoint is incomplete")
    if verify and manifest.files.get(MODEL_FILE) and sha256_file(file) != manifest.files[MODEL_FILE]:
        raise DraftsmithError(f"{file}: sha256 does not match its manifest (damaged checkpoint)")
    try:
        return load_file(str(file))
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types for damaged files
        raise DraftsmithError(f"{file}: cannot read ({err}); the checkpoint is damaged") from None


def load_checkpoint(path: Path, device: str | torch.device = "cpu",
                    verify: bool = True) -> tuple[Eagle3Draft, CheckpointManifest]:
    """The trained draft (eval mode, fp32) and its manifest, from a run directory or a checkpoint directory."""
    directory = resolve(path)
    data = read_manifest_json(directory)
    if data.get("kind") != "checkpoint":
        raise DraftsmithError(f"{directory}: is a {data.get('kind')!r} artefact, expected a draftsmith checkpoint")
    manifest = read_manifest(directory, CheckpointManifest)
    state = load_model_state(directory, manifest, verify)
    draft = Eagle3Draft(manifest.draft)
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise DraftsmithError(f"{directory}/{MODEL_FILE}: weights do not match the manifest's draft config "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    return draft.to(device).eval(), manifest


def load_training_state(directory: Path) -> dict:
    """Optimizer/sampler/RNG state of a step checkpoint; tensors and plain containers only (weights_only=True)."""
    file = Path(directory) / STATE_FILE
    if not file.is_file():
        raise DraftsmithError(f"{file}: missing; this checkpoint cannot be resumed (best/ holds weights only)")
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unpickling failure means a damaged or foreign file
        raise DraftsmithError(f"{file}: cannot read training state ({type(err).__name__}); damaged checkpoint") from None
