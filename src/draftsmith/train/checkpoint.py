"""Training checkpoints: the only module that writes them (methods/artefact.py reads them, and holds
`DraftManifest`, what every draft directory records: a checkpoint here, an export in draftsmith.export).

Run directory layout (`draftsmith train --output RUN`):

    RUN/config.yaml                      resolved TrainConfig
    RUN/metrics.jsonl                    one JSON line per logged step / evaluation
    RUN/checkpoints/step-00000100/       one directory per saved step (the newest `keep_checkpoints` are kept)
        manifest.json                    CheckpointManifest (kind "checkpoint")
        model.safetensors                the draft in fp32: fc, layers.*, norm, lm_head, d2t, t2d (module names);
                                         never the embedding, which is the target's (reloaded from it)
        training_state.pt                the RunState, optimizer, sampler position, RNG states (torch.load weights_only)
    RUN/best/                            manifest.json + model.safetensors of the best evaluation so far

Each directory is built beside its final name and renamed into place (fsio.atomic_dir), so a crash or a full disk
leaves the previous checkpoint whole; a directory being replaced (best/, or a step written again) and a checkpoint
being dropped are first renamed out of the way, so no half-deleted one is ever seen under a checkpoint's name.
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import torch
from safetensors.torch import save_file

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import atomic_dir, sha256_file
from draftsmith.core.manifest import MANIFEST_NAME, read_manifest, write_manifest
from draftsmith.methods.artefact import (
    BEST_DIR,
    STATE_FILE,
    WEIGHTS_FILE,
    CheckpointManifest,
    list_checkpoints,
    step_dir,
)
from draftsmith.methods.layers import draft_tensors

STATE_FORMAT = 2


@dataclass
class RunState:
    """Where a training run stands, saved with every step checkpoint. One step counter: the position in the epoch
    is derived (step - epoch_start, the step at which `epoch` began)."""

    step: int = 0
    epoch: int = 0
    epoch_start: int = 0
    tokens: int = 0  # tokens trained on, all ranks (updated whenever metrics are reduced: before every save)
    best: float | None = None  # best held-out acceptance length so far
    last_eval: dict[str, Any] = field(default_factory=dict)
    last_eval_step: int = -1

    @property
    def position(self) -> int:
        return self.step - self.epoch_start


# rng_state()'s; the functional form, as a class body's key `torch` would shadow the module in its annotations
RngState = TypedDict("RngState", {"torch": torch.Tensor, "cuda": list[torch.Tensor]})  # noqa: UP013 - see above


def rng_state() -> RngState:
    """The RNG states a run's randomness could come from: torch's CPU generator and every CUDA device's."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return {"torch": torch.get_rng_state(), "cuda": cuda}


def restore_rng(state: RngState) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def training_state(run: RunState, optimizer_state: dict, sampler_seed: int) -> dict[str, object]:
    """What training_state.pt holds: the RunState, the optimizer, the RNG states and the sampler's position."""
    return {
        "format": STATE_FORMAT,
        "run": asdict(run),
        "optimizer": optimizer_state,
        "rng": rng_state(),
        "sampler": {"epoch": run.epoch, "position": run.position, "seed": sampler_seed},
    }


def run_state(saved: dict[str, Any]) -> RunState:
    """The RunState of a loaded training state (this format, or draftsmith 0.1's flat counters)."""
    if "run" in saved:
        return RunState(**saved["run"])
    sampler = saved["sampler"]
    return RunState(
        step=saved["step"],
        epoch=sampler["epoch"],
        epoch_start=saved["step"] - sampler["position"],
        tokens=saved["tokens"],
        best=saved.get("best_acceptance_length"),
    )


def saved_rng(saved: dict[str, Any]) -> RngState:
    return saved["rng"] if "rng" in saved else {"torch": saved["rng_torch"], "cuda": []}


def _move_aside(path: Path) -> Path | None:
    """Rename a directory out of the way (atomic); it is deleted afterwards, or by the next save if killed."""
    if not path.exists():
        return None
    aside = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
    os.replace(path, aside)
    return aside


def _remove_stale(root: Path) -> None:
    for stale in root.glob(".*.old-*"):
        shutil.rmtree(stale, ignore_errors=True)


def save_checkpoint(
    run_dir: Path,
    manifest: CheckpointManifest,
    model_state: dict[str, torch.Tensor],
    training_state: dict | None,
    keep: int = 2,
    best: bool = False,
) -> Path:
    """Write a step checkpoint (with training state) or, with best=True, RUN/best (weights only). Atomic.
    model_state: the draft's state dict; the target's embedding in it is not written."""
    target = Path(run_dir) / BEST_DIR if best else step_dir(run_dir, manifest.step)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in draft_tensors(model_state).items()}
    with atomic_dir(target) as tmp:
        _remove_stale(target.parent)
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", "draftsmith": "eagle3-draft"})
        files = {WEIGHTS_FILE: sha256_file(tmp / WEIGHTS_FILE)}
        if training_state is not None and not best:
            with open(tmp / STATE_FILE, "wb") as f:  # a file object: a full disk raises OSError, not torch's own
                torch.save(training_state, f)
            files[STATE_FILE] = sha256_file(tmp / STATE_FILE)
        write_manifest(tmp, manifest.model_copy(update={"files": files}))
        replaced = _move_aside(target)  # atomic_dir renames tmp into the freed name
    removed = [replaced] + ([_move_aside(old) for old in list_checkpoints(run_dir)[:-keep]] if not best else [])
    for old in removed:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return target


def load_training_state(directory: Path) -> dict:
    """Optimizer/sampler/RNG state of a step checkpoint (checksum checked against its manifest); tensors and plain
    containers only (weights_only=True)."""
    file = Path(directory) / STATE_FILE
    if not file.is_file():
        raise DraftsmithError(f"{file}: missing; this checkpoint cannot be resumed (best/ holds weights only)")
    digest = read_manifest(directory, CheckpointManifest).files.get(STATE_FILE)
    if digest and sha256_file(file) != digest:
        raise DraftsmithError(
            f"{file}: sha256 does not match {Path(directory) / MANIFEST_NAME}; the checkpoint is "
            "damaged (delete this step directory to resume from the one before)"
        )
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unpickling failure means a damaged or foreign file
        raise DraftsmithError(
            f"{file}: cannot read training state ({type(err).__name__}); damaged checkpoint"
        ) from None
