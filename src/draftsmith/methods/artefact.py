"""A draft, wherever it lives, below every stage: the manifests and layout of a draft directory (`DraftManifest`, what
every draft directory records; `CheckpointManifest`; where a run keeps its checkpoints: `RUN/best/`,
`RUN/checkpoints/step-N/`), its weights read with their checksums checked, and `load_draft(path)`, which reads a
training run, a checkpoint or an export in any format into one `DraftSource` (spec, tensors in the module's names,
target identity, origin, training summary). train/checkpoint.py writes checkpoints; draftsmith.export exports.

The trainer (`train --init-from`), draftsmith.export, draftsmith.evaluate, serve and the quickstart read drafts here.
An export is read through the fields every draft directory records (`DraftManifest`); what an export's config.json
says about its method (P-EAGLE's mask token, DFlash's block) is read by that method (`methods.method_of_config`), as
vLLM reads it, for the export writer, `load_draft` and every command that starts vLLM alike.
The tensors of a DraftSource are named as Eagle3Draft's state dict (vLLM's own module names, `layers.0.` for
decoder layer 0) without the target's embedding; `spell_layer0` is the one rename a format needs (vLLM's and
SGLang's files spell layer 0 `midlayer.`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError
from safetensors.torch import load_file

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import sha256_file
from draftsmith.core.manifest import MANIFEST_NAME, Manifest, TargetIdentity, read_manifest, read_manifest_json
from draftsmith.core.targets import read_config, resolve_target, target_identity
from draftsmith.methods import method_of, method_of_config, recorded_spec, same_family
from draftsmith.methods.base import Draft
from draftsmith.methods.layers import draft_tensors
from draftsmith.methods.spec import DraftSpec

CHECKPOINTS_DIR = "checkpoints"
BEST_DIR = "best"
WEIGHTS_FILE = "model.safetensors"
STATE_FILE = "training_state.pt"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_PASS_A_DRAFT = "pass a `draftsmith train` run or checkpoint directory, or an exported draft"


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
    an embedding that older checkpoints carry is dropped (it is the target's), and so are the identity vocabulary
    maps older drafts over the target's whole vocabulary carry (d2t, t2d: the module no longer saves them)."""
    file = _checked_file(Path(directory), WEIGHTS_FILE, manifest, verify)
    try:
        tensors = draft_tensors(load_file(str(file)))
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types for damaged files
        raise DraftsmithError(f"{file}: cannot read ({err}); the {manifest.kind} is damaged") from None
    if manifest.draft.draft_vocab_size == manifest.draft.vocab_size and not bool(
        tensors.get("d2t", torch.zeros(1)).any()
    ):
        tensors.pop("d2t", None)
        tensors.pop("t2d", None)
    return tensors


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


LAYER0_SPELLINGS = ("layers.0.", "midlayer.")


@dataclass
class DraftSource:
    """A draft in the module's names, wherever it came from (training run, checkpoint, export)."""

    spec: DraftSpec
    tensors: dict[str, torch.Tensor]
    target: TargetIdentity
    origin: Path
    training: dict[str, object]


def spell_layer0(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The same tensors with decoder layer 0 spelled `prefix`: "layers.0." (the module's names, speculators' files)
    or "midlayer." (vLLM's and SGLang's files; vLLM's loader maps it back to `layers.0.`)."""
    out = {}
    for name, tensor in tensors.items():
        old = next((p for p in LAYER0_SPELLINGS if name.startswith(p)), None)
        out[prefix + name[len(old) :] if old else name] = tensor
    return out


# ---------------------------------------------------------------------------------------------- validation


def validate_tensors(tensors: dict[str, torch.Tensor], spec: DraftSpec, where: str = "draft") -> None:  # noqa: C901 - one check per way a draft's tensors can be wrong
    """Refuse (DraftsmithError) any missing, unexpected, mis-shaped or mis-typed tensor, or a broken d2t/t2d.
    The expected names, shapes and dtypes are the module's own (built on the meta device: no memory)."""
    with torch.device("meta"):
        expected = draft_tensors(method_of(spec).module(spec).state_dict())
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    kind = method_of(spec).kind
    if missing:
        raise DraftsmithError(
            f"{where}: missing tensor(s) {missing[:4]} for a {spec.num_hidden_layers}-layer {kind} "
            "draft; the weights do not match the draft's spec"
        )
    if extra:
        raise DraftsmithError(
            f"{where}: unexpected tensor(s) {extra[:4]} not in the {kind} format; refusing to "
            "write weights a server would ignore or reject"
        )
    for name, want in expected.items():
        t = tensors[name]
        if t.shape != want.shape:
            raise DraftsmithError(
                f"{where}: tensor {name} has shape {tuple(t.shape)}, the format needs "
                f"{tuple(want.shape)} (target hidden {spec.target_hidden_size}, vocab "
                f"{spec.vocab_size}, draft vocab {spec.draft_vocab_size})"
            )
        if not want.is_floating_point() and t.dtype != want.dtype:
            raise DraftsmithError(f"{where}: tensor {name} is {t.dtype}, the format needs {want.dtype}")
        if want.is_floating_point():
            if not t.is_floating_point():
                raise DraftsmithError(f"{where}: tensor {name} is {t.dtype}, expected floating point weights")
            if not torch.isfinite(t).all():
                raise DraftsmithError(f"{where}: tensor {name} holds NaN or Inf; refusing to export a broken draft")
    if "d2t" not in expected:  # the target's whole vocabulary (a block drafter's default): no d2t / t2d
        return
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    target_ids = torch.arange(spec.draft_vocab_size, dtype=torch.int64) + d2t
    if target_ids.min() < 0 or target_ids.max() >= spec.vocab_size:
        raise DraftsmithError(f"{where}: d2t maps draft ids outside the target vocabulary 0..{spec.vocab_size - 1}")
    if spec.draft_vocab_size > 1 and not bool((target_ids[1:] > target_ids[:-1]).all()):
        raise DraftsmithError(f"{where}: d2t target ids are not strictly increasing (draft vocab must be sorted by id)")
    if int(t2d.sum()) != spec.draft_vocab_size or not bool(t2d[target_ids].all()):
        raise DraftsmithError(f"{where}: t2d does not mark exactly the target ids that d2t maps to")


def check_spec_against_target(spec: DraftSpec, target: TargetIdentity, where: str) -> None:
    """The draft must have been built for this target's hidden size, vocabulary and layers."""
    problems = []
    if spec.target_hidden_size != target.hidden_size:
        problems.append(f"hidden size {spec.target_hidden_size} != {target.hidden_size}")
    if spec.vocab_size != target.vocab_size:
        problems.append(f"vocab {spec.vocab_size} != {target.vocab_size}")
    bad = [i for i in spec.aux_layer_ids if not 0 <= i <= target.num_layers]
    if bad:
        problems.append(f"aux layer ids {bad} outside 0..{target.num_layers}")
    if problems:
        raise DraftsmithError(
            f"{where}: draft was built for another target ({'; '.join(problems)}) than "
            f"{target.path}; pass the target it was trained for, or train a draft for this one"
        )


def require_draft_for_target(
    source: DraftSource, identity: TargetIdentity, target_path: Path | str, where: str, advice: str
) -> None:
    """Refuse a draft whose shapes do not fit this target or that was trained for another one."""
    check_spec_against_target(source.spec, identity, where)
    problem = identity.mismatch(source.target)
    if problem:
        raise DraftsmithError(
            f"{where}: draft was trained for target {source.target.path}, not {target_path} ({problem}); {advice}"
        )


def resolve_draft_target(spec: str | None, source: DraftSource, where: str, use: str) -> tuple[Path, TargetIdentity]:
    """The target a draft runs with: `spec` (refused unless the draft was trained for it) or the recorded one, which
    must still be on this machine. `use` finishes the refusal's advice ("evaluate it", "serve it" ...)."""
    recorded = source.target
    if spec is None and not (Path(recorded.path) / "config.json").is_file():
        raise DraftsmithError(f"{where}: the draft's target {recorded.path} is not on this machine; pass --target")
    path = resolve_target(spec if spec is not None else recorded.path)
    identity = target_identity(path)
    require_draft_for_target(source, identity, path, where, f"{use} with the target it was trained for")
    return path, identity


# ---------------------------------------------------------------------------------------------- loading


def load_draft(path: Path) -> DraftSource:
    """A draft from a training run directory (its best/, else newest step), a checkpoint directory or an export in
    any format; checksum, tensor names, shapes and the draft vocabulary maps checked."""
    path = Path(path)
    if not path.exists():
        raise DraftsmithError(f"{path}: does not exist; {_PASS_A_DRAFT}")
    if not path.is_dir():
        raise DraftsmithError(f"{path}: is a file, not a draft directory; {_PASS_A_DRAFT}")
    directory = resolve(path)
    kind = read_manifest_json(directory).get("kind")
    manifest: CheckpointManifest | DraftManifest
    if kind == "checkpoint":
        tensors, manifest = load_checkpoint(directory)
    elif kind == "export":
        manifest = read_manifest(directory, DraftManifest)
        tensors = read_weights(directory, manifest)
        manifest.draft = _spec_from_config(directory, manifest.draft, tensors)
    else:
        raise DraftsmithError(f"{directory}: is a {kind!r} artefact, not a draft; {_PASS_A_DRAFT}")
    tensors = spell_layer0(tensors, "layers.0.")
    validate_tensors(tensors, manifest.draft, where=str(directory / WEIGHTS_FILE))
    return DraftSource(
        spec=manifest.draft, tensors=tensors, target=manifest.target, origin=path, training=manifest.training
    )


def _spec_from_config(directory: Path, spec: DraftSpec, tensors: dict[str, torch.Tensor]) -> DraftSpec:
    """An export's spec as vLLM serves it: its method, and what the method reads there (a mask token, a block), are
    what its config.json says (`method_of_config`, the rule every command applies), whatever its manifest says (one
    written by an older draftsmith, a config.json edited by hand); no config.json: the manifest's. A config.json
    that names a method of another family than the weights (a DFlash config on EAGLE-3 weights) is refused."""
    try:
        config = read_config(directory)
    except DraftsmithError:
        return spec
    where = str(directory / "config.json")
    recorded, read = method_of(spec), method_of_config(config, where)
    if not same_family(read, recorded):
        raise DraftsmithError(
            f"{where}: is a {read.kind} config, but the weights are a {recorded.kind} draft's; export the draft "
            "again from its training run"
        )
    return read.spec_from_config(spec, config, tensors, where)


def draft_module(source: DraftSource, embed_weight: torch.Tensor, head_weight: torch.Tensor) -> Draft:
    """The draft's module (fp32, CPU) of its method, holding its weights and the target's embedding `embed_weight`
    and lm_head `head_weight` (which a draft reads when it has no head of its own: DFlash)."""
    draft = method_of(source.spec).module(source.spec)
    draft.set_target(embed_weight, head_weight)
    draft.load_draft_tensors(source.tensors)
    return draft
