"""A draft, wherever it lives: `load_draft(path)` reads a training run, a checkpoint or an export in any format
into one `DraftSource` (spec, tensors in the module's names, target identity, origin, training summary).

Below both the trainer (`train --init-from`) and draftsmith.export / draftsmith.evaluate, so it reads an export
through the fields every draft directory records (`draft_dir.DraftManifest`); what an export's config.json says
about its method (P-EAGLE's mask token, DFlash's block) is read by that method (`methods.method_of_config`), as
vLLM reads it, for the export writer, `load_draft` and every command that starts vLLM alike.
The tensors of a DraftSource are named as Eagle3Draft's state dict (vLLM's own module names, `layers.0.` for
decoder layer 0) without the target's embedding; `spell_layer0` is the one rename a format needs (vLLM's and
SGLang's files spell layer 0 `midlayer.`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.manifest import TargetIdentity, read_manifest, read_manifest_json
from draftsmith.core.targets import read_config, resolve_target, target_identity
from draftsmith.methods import draft_dir, method_of, method_of_config, same_family
from draftsmith.methods.base import Draft
from draftsmith.methods.layers import draft_tensors
from draftsmith.methods.spec import DraftSpec

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
        raise DraftsmithError(
            f"{path}: does not exist; pass a `draftsmith train` run or checkpoint directory, or an exported draft"
        )
    if not path.is_dir():
        raise DraftsmithError(
            f"{path}: is a file, not a draft directory; pass a `draftsmith train` run or "
            "checkpoint directory, or an exported draft"
        )
    directory = draft_dir.resolve(path)
    kind = read_manifest_json(directory).get("kind")
    manifest: draft_dir.CheckpointManifest | draft_dir.DraftManifest
    if kind == "checkpoint":
        tensors, manifest = draft_dir.load_checkpoint(directory)
    elif kind == "export":
        manifest = read_manifest(directory, draft_dir.DraftManifest)
        tensors = draft_dir.read_weights(directory, manifest)
        manifest.draft = _spec_from_config(directory, manifest.draft, tensors)
    else:
        raise DraftsmithError(
            f"{directory}: is a {kind!r} artefact, not a draft; pass a `draftsmith train` run or "
            "checkpoint directory, or an exported draft"
        )
    tensors = spell_layer0(tensors, "layers.0.")
    validate_tensors(tensors, manifest.draft, where=str(directory / draft_dir.WEIGHTS_FILE))
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
