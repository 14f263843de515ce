"""`draftsmith export`: a trained draft -> a vLLM / SGLang / speculators model directory.

The draft is a training run, a checkpoint or an export in another format (`load_draft`); the target recorded in
the export is the draft's own, or the given one when it is the same model; formats.py writes the directory (a
P-EAGLE draft: vllm or speculators, its serve commands with parallel drafting).
"""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.config import ExportConfig, StageResult, save_resolved_config
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.manifest import TargetIdentity
from draftsmith.core.targets import read_config, resolve_target, target_identity
from draftsmith.export.formats import VLLM_LOADABLE, serve_commands, write_export
from draftsmith.methods import method_of
from draftsmith.methods.artefact import WEIGHTS_FILE, DraftSource, load_draft, require_draft_for_target


def _target_info(spec: str | None, source: DraftSource, where: str) -> tuple[TargetIdentity, list[str], dict]:
    """The target to record in the export: the given one (refused unless it is the draft's) or the recorded one."""
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


def measured_from_report(report: Path) -> dict[str, object]:
    """τ and speed-up per k from an evaluation report.json, for README.md."""
    report = Path(report)
    try:
        data = json.loads(report.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise DraftsmithError(f"{report}: cannot read the evaluation report ({err})") from None
    out: dict[str, object] = {}
    for run_ in data.get("runs", []):
        k = run_.get("k")
        out[f"τ (k={k}, {data.get('engine', '?')}, {data.get('prompts', '?')})"] = round(run_.get("tau", 0.0), 3)
        if run_.get("speedup") is not None:
            out[f"speed-up (k={k})"] = round(run_["speedup"], 3)
    return out


def run(cfg: ExportConfig) -> StageResult:
    """`draftsmith export`: a draft (training run, checkpoint or export) -> a vLLM / SGLang / speculators directory."""
    source = load_draft(cfg.checkpoint)
    target, architectures, special = _target_info(cfg.target, source, str(cfg.checkpoint))
    measured = measured_from_report(cfg.report) if cfg.report is not None else {}
    manifest = write_export(
        cfg.output,
        source.tensors,
        source.spec,
        cfg.format,
        target=target,
        verifier_architectures=architectures,
        special_tokens=special,
        dtype=cfg.dtype,
        speculative_tokens=cfg.speculative_tokens,
        source_checkpoint=str(Path(cfg.checkpoint)),
        training=source.training,
        measured=measured,
    )
    save_resolved_config(cfg, cfg.output)
    n_params = sum(t.numel() for t in source.tensors.values() if t.is_floating_point())
    facts = method_of(source.spec).facts(source.spec)  # what the method adds (P-EAGLE's mask token, DFlash's block)
    commands = serve_commands(Path(target.path), Path(cfg.output).resolve(), cfg.speculative_tokens)
    return StageResult(
        stage="export",
        output=Path(cfg.output),
        summary={
            "format": cfg.format,
            "target": Path(target.path).name,
            "aux layers": source.spec.aux_layer_ids,
            "draft vocab": source.spec.draft_vocab_size,
            **facts,
            "parameters": n_params,
            "dtype": cfg.dtype,
            "weights sha256": manifest.files[WEIGHTS_FILE][:16],
        },
        commands=dict(list(commands.items())[: None if cfg.format in VLLM_LOADABLE else 1]),
    )
