"""Exported drafts: the vLLM, SGLang and speculators model directories, the only module that writes or reads them.

Every format holds the same tensors; they differ in names and in config.json (see docs/formats.md):

    vllm         architectures ["LlamaForCausalLMEagle3"], flat Llama config plus draft_vocab_size,
                 target_hidden_size, eagle_aux_hidden_state_layer_ids (vLLM's layer ids: 0 = embeddings,
                 k = output of decoder layer k-1). Weights fc, midlayer.*, norm, lm_head, d2t, t2d.
    sglang       same weights and config, but SGLang reads the aux layers from
                 eagle_config.eagle_aux_hidden_state_layer_ids and adds 1 to each (its id k = output of layer k),
                 so the ids written there are vLLM's minus one.
    speculators  speculators_model_type "eagle3": transformer_layer_config (the draft's Llama config),
                 speculators_config (algorithm, proposal_methods, default_proposal_method, verifier),
                 norm_before_residual written explicitly (vLLM's speculators reader defaults it to True).
                 Weights use layers.0.* instead of midlayer.*.

None of them carries the embedding: the servers share the target's. A writer checks every tensor name, shape
and dtype against the format and the target before anything is written, and refuses a mismatch; the output
directory appears whole or not at all. `manifest.json` (kind "export") records the target identity, the
layer ids in draftsmith's (vLLM's) convention and the tensor checksum, so `draftsmith evaluate` can read
any of the three formats back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from draftsmith import __version__
from draftsmith.config import ExportConfig, StageResult, save_resolved_config
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import atomic_dir, sha256_file
from draftsmith.core.manifest import MANIFEST_NAME, Manifest, TargetIdentity, read_manifest, write_manifest

Format = Literal["vllm", "sglang", "speculators"]
FORMATS: tuple[str, ...] = ("vllm", "sglang", "speculators")
VLLM_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
WEIGHTS_NAME = "model.safetensors"
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class DraftArch(BaseModel):
    """The shape of an EAGLE-3 draft: everything a writer, a reader or the reference decoder needs."""

    model_config = ConfigDict(extra="forbid")

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int = 1
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    rope_parameters: dict[str, Any] = Field(default_factory=dict, description="the target's RoPE (transformers 5)")
    vocab_size: int = Field(description="target vocabulary size")
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int] = Field(description="vLLM convention: 0 = embeddings, k = output of decoder layer k-1")
    norm_before_residual: bool = False

    @classmethod
    def from_draft_config(cls, cfg: Any, aux_layer_ids: list[int]) -> "DraftArch":
        """From draftsmith.model.DraftConfig (the checkpoint's draft config) and the aux layer ids."""
        return cls(
            hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim, num_hidden_layers=cfg.num_layers, rms_norm_eps=cfg.rms_norm_eps,
            hidden_act=cfg.hidden_act, max_position_embeddings=cfg.max_position_embeddings,
            rope_parameters=dict(cfg.rope_parameters), vocab_size=cfg.vocab_size,
            draft_vocab_size=cfg.draft_vocab_size, target_hidden_size=cfg.target_hidden_size,
            aux_layer_ids=list(aux_layer_ids))

    def to_draft_config(self) -> Any:
        """The draftsmith.model.DraftConfig that builds a module with these shapes."""
        from draftsmith.train.model import DraftConfig

        return DraftConfig(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, hidden_act=self.hidden_act,
            rope_parameters=dict(self.rope_parameters), max_position_embeddings=self.max_position_embeddings,
            target_hidden_size=self.target_hidden_size, vocab_size=self.vocab_size,
            draft_vocab_size=self.draft_vocab_size, num_layers=self.num_hidden_layers,
            num_aux_layers=len(self.aux_layer_ids))

    def expected_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        """Canonical (vLLM) tensor name -> (shape, dtype; None = any floating dtype)."""
        h, i, hd = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
        shapes: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {
            "fc.weight": ((h, len(self.aux_layer_ids) * self.target_hidden_size), None),
            "norm.weight": ((h,), None),
            "lm_head.weight": ((self.draft_vocab_size, h), None),
            "d2t": ((self.draft_vocab_size,), torch.int64),
            "t2d": ((self.vocab_size,), torch.bool),
        }
        for layer in range(self.num_hidden_layers):
            p = layer_prefix(layer)
            d_in = 2 * h if layer == 0 else h
            shapes |= {
                f"{p}input_layernorm.weight": ((h,), None),
                f"{p}self_attn.q_proj.weight": ((q, d_in), None),
                f"{p}self_attn.k_proj.weight": ((kv, d_in), None),
                f"{p}self_attn.v_proj.weight": ((kv, d_in), None),
                f"{p}self_attn.o_proj.weight": ((h, q), None),
                f"{p}post_attention_layernorm.weight": ((h,), None),
                f"{p}mlp.gate_proj.weight": ((i, h), None),
                f"{p}mlp.up_proj.weight": ((i, h), None),
                f"{p}mlp.down_proj.weight": ((h, i), None),
            }
            if layer == 0:
                shapes[f"{p}hidden_norm.weight"] = ((h,), None)
        return shapes

    def llama_config(self) -> dict[str, Any]:
        """The draft's own decoder as a plain Llama config dict (shared by all three formats)."""
        return {
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": self.num_hidden_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": self.hidden_act,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": dict(self.rope_parameters),
            **({"rope_theta": self.rope_parameters["rope_theta"]} if "rope_theta" in self.rope_parameters else {}),
            "vocab_size": self.vocab_size,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
        }


def layer_prefix(layer: int) -> str:
    """Canonical name prefix of draft decoder layer `layer` (vLLM maps `midlayer.` to `layers.0.`)."""
    return "midlayer." if layer == 0 else f"layers.{layer}."


class ExportManifest(Manifest):
    """What an exported directory holds, in draftsmith's own conventions (whatever the format)."""

    kind: str = "export"
    format: str
    target: TargetIdentity
    arch: DraftArch
    weights_file: str = WEIGHTS_NAME
    weights_sha256: str
    dtype: str
    speculative_tokens: int
    source_checkpoint: str | None = None
    training: dict[str, Any] = Field(default_factory=dict)
    measured: dict[str, Any] = Field(default_factory=dict)


@dataclass
class ExportedDraft:
    """A draft read back from an export directory: canonical tensor names, the manifest, the directory."""

    path: Path
    manifest: ExportManifest
    tensors: dict[str, torch.Tensor]

    @property
    def arch(self) -> DraftArch:
        return self.manifest.arch


# ---------------------------------------------------------------------------------------------- validation


def validate_tensors(tensors: dict[str, torch.Tensor], arch: DraftArch, where: str = "draft") -> None:
    """Refuse (DraftsmithError) any missing, unexpected, mis-shaped or mis-typed tensor, or a broken d2t/t2d."""
    expected = arch.expected_shapes()
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing:
        raise DraftsmithError(f"{where}: missing tensor(s) {missing[:4]} for a {arch.num_hidden_layers}-layer EAGLE-3 "
                              "draft; the checkpoint does not match the export format")
    if extra:
        raise DraftsmithError(f"{where}: unexpected tensor(s) {extra[:4]} not in the EAGLE-3 format; refusing to "
                              "write weights a server would ignore or reject")
    for name, (shape, dtype) in expected.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise DraftsmithError(f"{where}: tensor {name} has shape {tuple(t.shape)}, the format needs {shape} "
                                  f"(target hidden {arch.target_hidden_size}, vocab {arch.vocab_size}, draft vocab "
                                  f"{arch.draft_vocab_size})")
        if dtype is not None and t.dtype != dtype:
            raise DraftsmithError(f"{where}: tensor {name} is {t.dtype}, the format needs {dtype}")
        if dtype is None:
            if not t.is_floating_point():
                raise DraftsmithError(f"{where}: tensor {name} is {t.dtype}, expected floating point weights")
            if not torch.isfinite(t).all():
                raise DraftsmithError(f"{where}: tensor {name} holds NaN or Inf; refusing to export a broken draft")
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    target_ids = torch.arange(arch.draft_vocab_size, dtype=torch.int64) + d2t
    if target_ids.min() < 0 or target_ids.max() >= arch.vocab_size:
        raise DraftsmithError(f"{where}: d2t maps draft ids outside the target vocabulary 0..{arch.vocab_size - 1}")
    if arch.draft_vocab_size > 1 and not bool((target_ids[1:] > target_ids[:-1]).all()):
        raise DraftsmithError(f"{where}: d2t target ids are not strictly increasing (draft vocab must be sorted by id)")
    if int(t2d.sum()) != arch.draft_vocab_size or not bool(t2d[target_ids].all()):
        raise DraftsmithError(f"{where}: t2d does not mark exactly the target ids that d2t maps to")


def check_arch_against_target(arch: DraftArch, target: TargetIdentity, where: str) -> None:
    """The draft must have been built for this target's hidden size, vocabulary and layers."""
    problems = []
    if arch.target_hidden_size != target.hidden_size:
        problems.append(f"hidden size {arch.target_hidden_size} != {target.hidden_size}")
    if arch.vocab_size != target.vocab_size:
        problems.append(f"vocab {arch.vocab_size} != {target.vocab_size}")
    bad = [i for i in arch.aux_layer_ids if not 0 <= i <= target.num_layers]
    if bad:
        problems.append(f"aux layer ids {bad} outside 0..{target.num_layers}")
    if problems:
        raise DraftsmithError(f"{where}: draft was built for another target ({'; '.join(problems)}) than "
                              f"{target.path}; pass the target it was trained for, or train a draft for this one")


# -------------------------------------------------------------------------------------- per-format naming


def _to_format_name(name: str, fmt: str) -> str:
    if fmt == "speculators" and name.startswith("midlayer."):
        return "layers.0." + name[len("midlayer."):]
    return name


def _from_format_name(name: str, fmt: str) -> str:
    if fmt == "speculators" and name.startswith("layers.0."):
        return "midlayer." + name[len("layers.0."):]
    return name


def format_config(arch: DraftArch, fmt: str, *, verifier: str, verifier_architectures: list[str],
                  speculative_tokens: int, dtype: str, special_tokens: dict[str, Any]) -> dict[str, Any]:
    """config.json for one format."""
    torch_dtype = str(_DTYPES[dtype]).removeprefix("torch.")
    llama = {**arch.llama_config(), **special_tokens}
    if fmt in ("vllm", "sglang"):
        config = {"architectures": [VLLM_ARCHITECTURE], **llama, "torch_dtype": torch_dtype,
                  "draft_vocab_size": arch.draft_vocab_size, "target_hidden_size": arch.target_hidden_size,
                  "norm_before_residual": arch.norm_before_residual}
        if fmt == "vllm":
            config["eagle_aux_hidden_state_layer_ids"] = list(arch.aux_layer_ids)
        else:
            if 0 in arch.aux_layer_ids:
                raise DraftsmithError("format sglang: aux layer id 0 (the embeddings) cannot be expressed in SGLang's "
                                      "layer-id convention; export as vllm or speculators")
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in arch.aux_layer_ids],
                                      "use_aux_hidden_state": True}
        return config
    if fmt == "speculators":
        return {
            "architectures": [SPECULATORS_ARCHITECTURE],
            "speculators_model_type": "eagle3",
            "torch_dtype": torch_dtype,
            "transformer_layer_config": {**llama, "torch_dtype": torch_dtype},
            "draft_vocab_size": arch.draft_vocab_size,
            "target_hidden_size": arch.target_hidden_size,
            "norm_before_residual": arch.norm_before_residual,
            "eagle_aux_hidden_state_layer_ids": list(arch.aux_layer_ids),
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier, "architectures": verifier_architectures},
            },
            "draftsmith_version": __version__,
        }
    raise DraftsmithError(f"option 'format': unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")


def _readme(manifest: ExportManifest, fmt: str, draft_dir_hint: str) -> str:
    arch, target = manifest.arch, manifest.target
    lines = [
        f"# EAGLE-3 draft for {Path(target.path).name}",
        "",
        f"Exported by draftsmith {__version__} in the **{fmt}** format.",
        "",
        "| | |", "|---|---|",
        f"| target | `{target.path}` ({target.architecture}, {target.num_layers} layers, hidden {target.hidden_size}, "
        f"vocab {target.vocab_size}) |",
        f"| target config sha256 | `{target.config_hash[:16]}…` |",
        f"| aux layers (vLLM ids) | {arch.aux_layer_ids} |",
        f"| draft | {arch.num_hidden_layers} decoder layer(s), hidden {arch.hidden_size}, draft vocab "
        f"{arch.draft_vocab_size} |",
        f"| weights | `{WEIGHTS_NAME}` ({manifest.dtype}), sha256 `{manifest.weights_sha256[:16]}…` |",
    ]
    if manifest.source_checkpoint:
        lines.append(f"| checkpoint | `{manifest.source_checkpoint}` |")
    for key, value in manifest.training.items():
        lines.append(f"| training: {key} | {value} |")
    for key, value in manifest.measured.items():
        lines.append(f"| measured: {key} | {value} |")
    if not manifest.measured:
        lines.append("| measured acceptance | not measured yet: run `draftsmith evaluate` |")
    lines += ["", "## Use", ""]
    if fmt in ("vllm", "speculators"):
        lines += ["```python", "from vllm import LLM", "",
                  f'llm = LLM(model="{target.path}",',
                  f'          speculative_config={{"method": "eagle3", "model": "{draft_dir_hint}", '
                  f'"num_speculative_tokens": {manifest.speculative_tokens}}})', "```"]
    else:
        lines += ["```", f"python -m sglang.launch_server --model-path {target.path} --speculative-algorithm EAGLE3 \\",
                  f"    --speculative-draft-model-path {draft_dir_hint} "
                  f"--speculative-num-steps {manifest.speculative_tokens} --speculative-eagle-topk 1 \\",
                  f"    --speculative-num-draft-tokens {manifest.speculative_tokens + 1}", "```",
                  "", "SGLang numbers aux layers one lower than vLLM: `eagle_config` holds "
                  f"{[i - 1 for i in arch.aux_layer_ids]} for vLLM ids {arch.aux_layer_ids}."]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------- write / read


def write_export(output: Path, tensors: dict[str, torch.Tensor], arch: DraftArch, fmt: str, *,
                 target: TargetIdentity, verifier_architectures: list[str], special_tokens: dict[str, Any] | None = None,
                 dtype: str = "bf16", speculative_tokens: int = 3, source_checkpoint: str | None = None,
                 training: dict[str, Any] | None = None, measured: dict[str, Any] | None = None) -> ExportManifest:
    """Validate the canonical tensors against the format and write the whole directory atomically."""
    from safetensors.torch import save_file

    if fmt not in FORMATS:
        raise DraftsmithError(f"option 'format': unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == "sglang" and arch.num_hidden_layers != 1:
        raise DraftsmithError(f"format sglang: SGLang's EAGLE-3 draft has exactly one decoder layer, this draft has "
                              f"{arch.num_hidden_layers}; export as vllm or speculators")
    check_arch_against_target(arch, target, "export")
    validate_tensors(tensors, arch, where="export")
    config = format_config(arch, fmt, verifier=target.path, verifier_architectures=verifier_architectures,
                           speculative_tokens=speculative_tokens, dtype=dtype, special_tokens=special_tokens or {})
    out_tensors = {}
    for name, t in tensors.items():
        t = t.detach().to("cpu")
        if t.is_floating_point():
            t = t.to(_DTYPES[dtype])
        out_tensors[_to_format_name(name, fmt)] = t.contiguous()
    output = Path(output)
    with atomic_dir(output) as tmp:
        save_file(out_tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt", "draftsmith": __version__})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        manifest = ExportManifest(format=fmt, target=target, arch=arch, weights_sha256=sha256_file(tmp / WEIGHTS_NAME),
                                  dtype=dtype, speculative_tokens=speculative_tokens,
                                  source_checkpoint=source_checkpoint, training=training or {},
                                  measured=measured or {})
        write_manifest(tmp, manifest)
        (tmp / "README.md").write_text(_readme(manifest, fmt, str(output.resolve())), encoding="utf-8")
    return manifest


def read_export(path: Path) -> ExportedDraft:
    """Read any export format back into canonical tensor names, checking checksum, names and shapes."""
    from safetensors.torch import load_file

    path = Path(path)
    manifest = read_manifest(path, ExportManifest)
    weights = path / manifest.weights_file
    if not weights.is_file():
        raise DraftsmithError(f"{weights}: missing; the export is incomplete, run `draftsmith export` again")
    if sha256_file(weights) != manifest.weights_sha256:
        raise DraftsmithError(f"{weights}: sha256 does not match {path / MANIFEST_NAME}; the export is damaged")
    tensors = {_from_format_name(k, manifest.format): v for k, v in load_file(str(weights)).items()}
    validate_tensors(tensors, manifest.arch, where=str(weights))
    return ExportedDraft(path=path, manifest=manifest, tensors=tensors)


def is_export(path: Path) -> bool:
    try:
        return json.loads((Path(path) / MANIFEST_NAME).read_text(encoding="utf-8")).get("kind") == "export"
    except (OSError, json.JSONDecodeError):
        return False


# ---------------------------------------------------------------------------------- from a training checkpoint


@dataclass
class DraftSource:
    """A draft in canonical form, wherever it came from (checkpoint or export)."""

    arch: DraftArch
    tensors: dict[str, torch.Tensor]
    target: TargetIdentity
    origin: Path
    training: dict[str, Any]


def draft_from_checkpoint(path: Path) -> DraftSource:
    """Load a training checkpoint and turn the draft module into canonical (vLLM-named) tensors."""
    from draftsmith.train.checkpoint import load_checkpoint

    path = Path(path)
    if not path.exists():
        raise DraftsmithError(f"{path}: checkpoint does not exist; run `draftsmith train` first or pass its output")
    model, manifest = load_checkpoint(path)
    return draft_source_from_model(model, manifest, path)


def draft_source_from_model(model: torch.nn.Module, manifest: Any, origin: Path) -> DraftSource:
    """Canonical tensors + arch from a draftsmith draft module and its checkpoint manifest."""
    target: TargetIdentity = manifest.target
    tensors = canonical_tensors(model)
    arch = arch_from_model(model, manifest)
    training = training_summary(manifest)
    return DraftSource(arch=arch, tensors=tensors, target=target, origin=Path(origin), training=training)


def canonical_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The draft's state in vLLM names; the frozen embedding (shared with the target by every server) is dropped."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("embed_tokens.") or ".embed_tokens." in name:
            continue
        out[_canonical_name(name)] = tensor.detach().cpu()
    return out


def _canonical_name(name: str) -> str:
    """draftsmith.train.model names -> vLLM names: `layers.0.` is spelled `midlayer.`."""
    return "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name


def module_state_dict(tensors: dict[str, torch.Tensor], embed_weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Canonical tensors (+ the target's embedding) -> a state dict draftsmith.model.Eagle3Draft loads strictly."""
    state = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in tensors.items()}
    state["embed_tokens.weight"] = embed_weight
    return state


def draft_module(source: "DraftSource", embed_weight: torch.Tensor) -> torch.nn.Module:
    """draftsmith.model.Eagle3Draft (fp32, CPU) holding the draft's weights and the target's embedding."""
    from draftsmith.train.model import Eagle3Draft

    draft = Eagle3Draft(source.arch.to_draft_config())
    state = module_state_dict(source.tensors, embed_weight.detach().cpu())
    draft.load_state_dict({k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}, strict=True)
    return draft


def arch_from_model(model: torch.nn.Module, manifest: Any) -> DraftArch:
    """DraftArch from the draft module's DraftConfig and the checkpoint's aux layer ids."""
    cfg = model.config
    if cfg.attention_bias or cfg.mlp_bias:
        raise DraftsmithError("export: drafts with attention or MLP biases are not part of the EAGLE-3 formats")
    aux = getattr(manifest, "aux_layer_ids", None) or getattr(cfg, "aux_layer_ids", None)
    if not aux or len(aux) != cfg.num_aux_layers:
        raise DraftsmithError(f"export: the checkpoint records aux layer ids {aux}, the draft fuses "
                              f"{cfg.num_aux_layers} layers; the checkpoint manifest is damaged")
    return DraftArch.from_draft_config(cfg, [int(i) for i in aux])


def training_summary(manifest: Any) -> dict[str, Any]:
    """A few lines about how the checkpoint was trained, for README.md and the export manifest."""
    summary: dict[str, Any] = {}
    for key in ("data", "data_kind", "step", "epoch", "tokens", "best_acceptance_length", "draft_vocab_coverage"):
        value = getattr(manifest, key, None)
        if value not in (None, "", 0, 0.0):
            summary[key] = round(value, 4) if isinstance(value, float) else value
    metrics = getattr(manifest, "metrics", None) or {}
    for key, value in metrics.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            summary[f"eval {key}"] = round(float(value), 4)
    return summary


# ---------------------------------------------------------------------------------------------------- stage


def require_draft_for_target(source: DraftSource, identity: TargetIdentity, target_path: Path | str, where: str,
                             advice: str) -> None:
    """Refuse a draft whose shapes do not fit this target or that was trained for another one."""
    check_arch_against_target(source.arch, identity, where)
    problem = identity.mismatch(source.target)
    if problem:
        raise DraftsmithError(f"{where}: draft was trained for target {source.target.path}, not {target_path} "
                              f"({problem}); {advice}")


def _target_info(spec: str | None, source: DraftSource, where: str) -> tuple[TargetIdentity, list[str], dict]:
    """The target to record in the export: the given one (refused unless it is the draft's) or the recorded one."""
    from draftsmith.core.targets import read_config, resolve_target, target_identity

    recorded = source.target
    if spec is None and not (Path(recorded.path) / "config.json").is_file():
        return recorded, [recorded.architecture], {}
    path = resolve_target(spec if spec is not None else recorded.path)
    identity = target_identity(path)
    require_draft_for_target(source, identity, path, where, "export a draft trained for this target")
    config = read_config(path)
    text = config.get("text_config") or config
    special = {k: text[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if text.get(k) is not None}
    return identity, list(config.get("architectures") or [identity.architecture]), special


def load_draft(path: Path) -> DraftSource:
    """A draft from an export directory (any format) or a training checkpoint, in canonical form."""
    path = Path(path)
    if is_export(path):
        exported = read_export(path)
        m = exported.manifest
        return DraftSource(arch=m.arch, tensors=exported.tensors, target=m.target, origin=path, training=m.training)
    return draft_from_checkpoint(path)


def run(cfg: ExportConfig) -> StageResult:
    """`draftsmith export`: checkpoint -> a vLLM / SGLang / speculators directory."""
    source = draft_from_checkpoint(cfg.checkpoint)
    target, architectures, special = _target_info(cfg.target, source, str(cfg.checkpoint))
    measured: dict[str, Any] = {}
    if cfg.report is not None:
        measured = measured_from_report(cfg.report)
    manifest = write_export(cfg.output, source.tensors, source.arch, cfg.format, target=target,
                            verifier_architectures=architectures, special_tokens=special, dtype=cfg.dtype,
                            speculative_tokens=cfg.speculative_tokens, source_checkpoint=str(Path(cfg.checkpoint)),
                            training=source.training, measured=measured)
    save_resolved_config(cfg, cfg.output)
    n_params = sum(t.numel() for k, t in source.tensors.items() if t.is_floating_point())
    return StageResult(stage="export", output=Path(cfg.output), summary={
        "format": cfg.format, "target": Path(target.path).name, "aux layers": source.arch.aux_layer_ids,
        "draft vocab": source.arch.draft_vocab_size, "parameters": n_params, "dtype": cfg.dtype,
        "weights sha256": manifest.weights_sha256[:16]})


def measured_from_report(report: Path) -> dict[str, Any]:
    """τ and speed-up per k from an evaluation report.json, for README.md."""
    report = Path(report)
    try:
        data = json.loads(report.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise DraftsmithError(f"{report}: cannot read the evaluation report ({err})") from None
    out: dict[str, Any] = {}
    for run_ in data.get("runs", []):
        k = run_.get("k")
        out[f"τ (k={k}, {data.get('engine', '?')}, {data.get('prompts', '?')})"] = round(run_.get("tau", 0.0), 3)
        if run_.get("speedup") is not None:
            out[f"speed-up (k={k})"] = round(run_["speedup"], 3)
    return out
