"""A draft, wherever it lives: `load_draft(path)` reads a training run, a checkpoint or an export in any format
into one `DraftSource` (spec, tensors in the module's names, target identity, origin, training summary).

Below both the trainer (`train --init-from`) and draftsmith.export / draftsmith.evaluate, so it reads an export
through the fields every draft directory records (`checkpoint.DraftManifest`). The one rule that reads a draft
directory's config.json as P-EAGLE or not, and its mask token, lives here (`parallel_drafting_token`), for the
export writer, `load_draft` and every command that starts vLLM alike.
The tensors of a DraftSource are named as Eagle3Draft's state dict (vLLM's own module names, `layers.0.` for
decoder layer 0) without the target's embedding; `spell_layer0` is the one rename a format needs (vLLM's and
SGLang's files spell layer 0 `midlayer.`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.manifest import TargetIdentity, read_manifest, read_manifest_json
from draftsmith.core.targets import read_config, resolve_target, target_identity
from draftsmith.train import checkpoint
from draftsmith.train.model import DFlashDraft, DraftSpec, Eagle3Draft, draft_class, draft_tensors

LAYER0_SPELLINGS = ("layers.0.", "midlayer.")


@dataclass
class DraftSource:
    """A draft in the module's names, wherever it came from (training run, checkpoint, export)."""

    spec: DraftSpec
    tensors: dict[str, torch.Tensor]
    target: TargetIdentity
    origin: Path
    training: dict[str, Any]


def spell_layer0(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The same tensors with decoder layer 0 spelled `prefix`: "layers.0." (the module's names, speculators' files)
    or "midlayer." (vLLM's and SGLang's files; vLLM's loader maps it back to `layers.0.`)."""
    out = {}
    for name, tensor in tensors.items():
        old = next((p for p in LAYER0_SPELLINGS if name.startswith(p)), None)
        out[prefix + name[len(old) :] if old else name] = tensor
    return out


# ---------------------------------------------------------------------------------------------- validation


def validate_tensors(tensors: dict[str, torch.Tensor], spec: DraftSpec, where: str = "draft") -> None:
    """Refuse (DraftsmithError) any missing, unexpected, mis-shaped or mis-typed tensor, or a broken d2t/t2d.
    The expected names, shapes and dtypes are the module's own (built on the meta device: no memory)."""
    with torch.device("meta"):
        expected = draft_tensors(draft_class(spec)(spec).state_dict())
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    kind = spec.kind
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
    if spec.method == "dflash":  # the target's vocabulary: no d2t / t2d
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
    directory = checkpoint.resolve(path)
    kind = read_manifest_json(directory).get("kind")
    manifest: checkpoint.CheckpointManifest | checkpoint.DraftManifest
    if kind == "checkpoint":
        tensors, manifest = checkpoint.load_checkpoint(directory)
    elif kind == "export":
        manifest = read_manifest(directory, checkpoint.DraftManifest)
        tensors = checkpoint.read_weights(directory, manifest)
        manifest.draft = (
            _dflash_from_config(directory, manifest.draft)
            if manifest.draft.method == "dflash"
            else _parallel_from_config(directory, manifest.draft, tensors)
        )
    else:
        raise DraftsmithError(
            f"{directory}: is a {kind!r} artefact, not a draft; pass a `draftsmith train` run or "
            "checkpoint directory, or an exported draft"
        )
    tensors = spell_layer0(tensors, "layers.0.")
    validate_tensors(tensors, manifest.draft, where=str(directory / checkpoint.WEIGHTS_FILE))
    return DraftSource(
        spec=manifest.draft, tensors=tensors, target=manifest.target, origin=path, training=manifest.training
    )


# ------------------------------------------------------------------------------------ P-EAGLE or not

# The keys that name a P-EAGLE draft's mask token, in the order vLLM reads them from the draft's config
# (vllm/v1/spec_decode/llm_base_proposer.py, `_init_parallel_drafting_params`): mask_token_id unless it is null, then
# pard_token, then ptd_token_id, whenever present. (vLLM reads DFlash's dflash_config.mask_token_id and DSpark's
# dspark_noise_token_id before pard_token: other methods' keys, which no P-EAGLE draft carries.)
MASK_TOKEN_KEYS = ("mask_token_id", "pard_token", "ptd_token_id")


def parallel_drafting_token(config: dict[str, Any], where: str = "config.json") -> int | None:
    """The one rule for "is this draft P-EAGLE" (the export writer, `load_draft`, the speculative config every
    command that starts vLLM passes): the mask token a draft directory's config.json names, as vLLM reads it; None
    for an EAGLE-3 draft.

    A speculators config is P-EAGLE exactly when its speculators_model_type is "peagle" (vLLM's reader turns that
    type into parallel drafting itself); vLLM reads the token from the config it converts it to: the
    transformer_layer_config, with the top-level mask_token_id as pard_token. Any other config is P-EAGLE when one
    of MASK_TOKEN_KEYS names a token (draftsmith's vllm format writes ptd_token_id), the first in vLLM's order. A
    key vLLM would take that holds no token id is refused in one line; `where` names the file in that message."""
    if config.get("speculators_model_type") is not None:
        if config["speculators_model_type"] != "peagle":
            return None
        if config.get("mask_token_id") is None:
            raise DraftsmithError(
                f"{where}: a speculators P-EAGLE config (speculators_model_type peagle) without "
                "mask_token_id, which vLLM's reader requires; set it to the token the draft's "
                "parallel slots were trained on"
            )
        config = {**(config.get("transformer_layer_config") or {}), "pard_token": config["mask_token_id"]}
    for key in MASK_TOKEN_KEYS:
        if key not in config or (key == "mask_token_id" and config[key] is None):
            continue
        token = config[key]
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise DraftsmithError(
                f"{where}: {key} {token!r} is not a token id; vLLM's parallel drafting reads this "
                "P-EAGLE draft's mask token from it"
            )
        return token
    return None


def dflash_block_size(config: dict[str, Any], where: str = "config.json") -> int | None:
    """The one rule for "is this draft DFlash" (`load_draft`, the speculative config every command that starts vLLM
    passes): its block size, read from a draft directory's config.json (vLLM's layout: a `dflash_config`, the block
    size beside it; speculators': speculators_model_type "dflash"); None for an EAGLE-3 or P-EAGLE draft. vLLM drafts
    block_size - 1 tokens a round with it."""
    layer = _dflash_layer_config(config)
    if layer is None:
        return None
    size = config.get("block_size", layer.get("block_size", (layer.get("dflash_config") or {}).get("block_size")))
    if not isinstance(size, int) or isinstance(size, bool) or size < 2:
        raise DraftsmithError(
            f"{where}: a DFlash draft with block_size {size!r}; vLLM drafts block_size - 1 tokens "
            "a round, so the config must say the block size the draft was trained with"
        )
    return size


def _dflash_layer_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """The drafter's own config inside a DFlash config.json (vLLM's layout: the file itself; speculators': its
    transformer_layer_config), None when the file is no DFlash config."""
    kind = config.get("speculators_model_type")
    if kind is not None:
        return (config.get("transformer_layer_config") or {}) if kind == "dflash" else None
    return config if "dflash_config" in config else None


def _dflash_from_config(directory: Path, spec: DraftSpec) -> DraftSpec:
    """An exported DFlash draft's spec as vLLM serves it: the mask token and block size its config.json names."""
    try:
        config = read_config(directory)
    except DraftsmithError:
        return spec
    where = directory / "config.json"
    size = dflash_block_size(config, str(where))
    if size is None:
        raise DraftsmithError(
            f"{where}: is not a DFlash config (no dflash_config), but the weights are a DFlash "
            "draft's; export the draft again from its training run"
        )
    layer = _dflash_layer_config(config)
    assert layer is not None  # dflash_block_size found the block size in it
    token = (layer.get("dflash_config") or {}).get("mask_token_id", config.get("mask_token_id"))
    if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < spec.vocab_size:
        raise DraftsmithError(
            f"{where}: dflash_config.mask_token_id {token!r} is not a target token id "
            f"(0..{spec.vocab_size - 1}); vLLM embeds it at every mask position of a block"
        )
    return spec.model_copy(update={"block_size": size, "mask_token_id": token})


def _parallel_from_config(directory: Path, spec: DraftSpec, tensors: dict[str, torch.Tensor]) -> DraftSpec:
    """An export's spec as vLLM serves it: P-EAGLE or not, and its mask token, are what its config.json names
    (parallel_drafting_token, the rule every command applies), whatever its manifest says (one
    written before DraftSpec knew parallel drafting, a config.json edited by hand); no config.json: the manifest's.
    Weights that do not match that reading (P-EAGLE needs mask_hidden, EAGLE-3 has none) are refused in one line."""
    try:
        config = read_config(directory)
    except DraftsmithError:
        return spec
    where = directory / "config.json"
    token = parallel_drafting_token(config, str(where))
    has_mask_hidden = "mask_hidden" in tensors
    if token is None:
        if has_mask_hidden:
            raise DraftsmithError(
                f"{where}: names no mask token, so vLLM would serve the draft as EAGLE-3, but its "
                "weights hold a P-EAGLE draft's mask_hidden; put its mask token back (ptd_token_id) "
                "or export the draft again from its training run"
            )
        return spec.model_copy(update={"parallel_drafting": False, "mask_token_id": None})
    if not has_mask_hidden:
        raise DraftsmithError(
            f"{where}: names mask token {token}, so vLLM would serve the draft as P-EAGLE, but its "
            f"weights have no mask_hidden; remove the mask token ({', '.join(MASK_TOKEN_KEYS)}) "
            "or export the draft again from its training run"
        )
    if token >= spec.vocab_size:
        raise DraftsmithError(
            f"{where}: mask token {token} is not a target token id (0..{spec.vocab_size - 1}); "
            "vLLM's parallel slots embed that token"
        )
    return spec.model_copy(update={"parallel_drafting": True, "mask_token_id": token})


def draft_module(
    source: DraftSource, embed_weight: torch.Tensor, head_weight: torch.Tensor | None = None
) -> Eagle3Draft | DFlashDraft:
    """The draft's module (fp32, CPU) holding its weights and the target's embedding `embed_weight` (DFlash: and the
    target's lm_head `head_weight`, which it uses as its own)."""
    draft: Eagle3Draft | DFlashDraft
    if source.spec.method == "dflash":
        if head_weight is None:
            raise ValueError("a DFlash draft needs the target's lm_head")
        draft = DFlashDraft(source.spec)
        draft.set_target(embed_weight, head_weight)
    else:
        draft = Eagle3Draft(source.spec)
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(embed_weight)
    draft.load_draft_tensors(source.tensors)
    return draft
