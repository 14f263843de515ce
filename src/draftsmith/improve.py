"""`draftsmith improve`: a better draft from what the target served, proven before it is served.

One round, resumable step by step (OUT/rounds/NNN/state.json, as the quickstart keeps its own):

    split      the recording's chat requests that this target answered, by time: the newest --held-out fraction is
               held out (never trained on); of the rest, --select keeps all, or the worst-accepted fraction
    prepare    the kept requests as conversations (the client's history, then the target's answer), as
               `prepare --data DIR` reads a recording
    extract    the target's hidden states at the current draft's layers (--backend hf or vllm)
    train      from the current draft (train --init-from), --max-steps steps
    export     the candidate, in vLLM's format, at the current draft's k
    prove      both drafts on the held-out requests in the same engine (--engine; vLLM runs the gate for each)
    decide     promote only a candidate whose τ's 95 % interval lies above the current draft's: a new version
               OUT/vN and OUT/current swapped to it atomically (a server restarted on OUT/current serves it);
               otherwise the current draft stays, and the summary says why

OUT holds users' requests (the split, the prepared set): it is made 0700, the split's files 0600.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from draftsmith import evaluate, export, prepare
from draftsmith.config import (
    EvaluateConfig,
    ExportConfig,
    ExtractConfig,
    ImproveConfig,
    PrepareConfig,
    StageResult,
    TrainConfig,
)
from draftsmith.core import recording
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import atomic_write_json
from draftsmith.core.manifest import MANIFEST_NAME
from draftsmith.evaluate import vllm_runner
from draftsmith.evaluate.gate import GateFailed
from draftsmith.evaluate.report import REPORT_JSON, EvaluationReport, RunReport, read_report
from draftsmith.export import read_export_manifest
from draftsmith.extract import stage as extract
from draftsmith.methods.artefact import load_draft, resolve_draft_target
from draftsmith.train import stage as train

CURRENT = "current"  # OUT/current: a link to the version to serve
STATE = "state.json"
SPLIT = ("train.jsonl", "held-out.jsonl")
DEFAULT_K = 3
# what a round's steps are run with: a later run continues a round only with the same
ROUND_OPTIONS = ("recording", "held_out", "select", "backend", "engine", "max_steps", "lr", "token_budget", "k")


# ------------------------------------------------------------------------------------------ versions


def _versions(out: Path) -> list[int]:
    return sorted(int(p.name[1:]) for p in out.glob("v[0-9]*") if p.is_dir() and p.name[1:].isdigit())


def _point_current(out: Path, version: int) -> None:
    """OUT/current -> vN, swapped in one rename: a reader sees the old version or the new, never neither."""
    link = out / f".{CURRENT}.tmp"
    link.unlink(missing_ok=True)
    os.symlink(f"v{version}", link)
    os.replace(link, out / CURRENT)


def _adopt(draft: Path, out: Path) -> Path:
    """The version a round starts from: the draft given where it is OUT/current or one of OUT's versions; the one
    OUT/current serves where the draft given was adopted before (the first round's command run for the next); else
    the draft copied in as the next version (v1 on a first run) and made current."""
    draft = draft.resolve()
    if draft.parent == out.resolve() and draft.name[:1] == "v" and draft.name[1:].isdigit():
        return draft
    if read_export_manifest(draft) is None:
        raise DraftsmithError(
            f"--draft {draft}: is not an export (draftsmith export writes one); improve starts from one"
        )
    manifest = (draft / MANIFEST_NAME).read_bytes()
    for known in _versions(out):  # adopted before: the draft served now, never an older version
        if (out / f"v{known}" / MANIFEST_NAME).read_bytes() == manifest:
            return (out / CURRENT).resolve() if (out / CURRENT).exists() else out / f"v{known}"
    version = max(_versions(out), default=0) + 1
    shutil.copytree(draft, out / f"v{version}")
    _point_current(out, version)
    return out / f"v{version}"


# ------------------------------------------------------------------------------------------ split


def _usable(directory: Path, target: str) -> tuple[list[dict], dict[str, int]]:
    """The recording's chat requests this target answered, oldest first, and what was left out, by reason."""
    kept: list[dict] = []
    left: dict[str, int] = {}
    for _, _, record, why in recording.iter_records(directory):
        reason = why if record is None else (recording.skip_reason(record, target) or ("", ""))[0]
        if reason or record is None:
            left[reason] = left.get(reason, 0) + 1
        else:
            kept.append(record)
    kept.sort(key=lambda r: float(r["recorded"].get("time") or 0.0))
    return kept, left


def _acceptance(record: dict) -> float | None:
    value = (record["recorded"].get("acceptance") or {}).get("mean_acceptance_length")
    return float(value) if isinstance(value, (int, float)) else None


def split(cfg: ImproveConfig, target: str, into: Path) -> dict[str, Any]:
    """Write the round's training and held-out requests (0600); what they hold."""
    records, left = _usable(Path(cfg.recording), target)
    held = max(1, math.ceil(cfg.held_out * len(records)))
    if len(records) - held < 1:
        raise DraftsmithError(
            f"--recording {cfg.recording}: {len(records)} chat requests this target answered"
            + (f" ({', '.join(f'{n} {r}' for r, n in left.items())} left out)" if left else "")
            + f"; too few to hold out {cfg.held_out:g} of them and train on the rest"
        )
    learn, held_out = records[:-held], records[-held:]
    if cfg.select.startswith("worst:"):
        scored = [r for r in learn if _acceptance(r) is not None]
        if not scored:
            raise DraftsmithError(
                f"--select {cfg.select}: no request of {cfg.recording} carries its acceptance (the server's vLLM did "
                "not report it per request: 0.32 does); use --select all"
            )
        scored.sort(key=_acceptance)  # type: ignore[arg-type]  # all scored
        learn = scored[: max(1, math.ceil(float(cfg.select[6:]) * len(learn)))]
    into.mkdir(parents=True, exist_ok=True)
    for name, part in zip(SPLIT, (learn, held_out), strict=True):
        fd = os.open(into / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in part)
    since = held_out[0]["recorded"]["time"]
    return {"train": len(learn), "held out": len(held_out), "left out": left, "held out since": since}


# ------------------------------------------------------------------------------------------ the round


def _engine(cfg: ImproveConfig, target: Path, method: str) -> str:
    """The engine both drafts are proven in: --engine auto as vLLM where the probe finds it can decode the draft here
    (then the gate runs for each), else the reference decoder."""
    if cfg.engine != "auto":
        return cfg.engine
    return "vllm" if vllm_runner.vllm_verdict(target, "--engine vllm", method=method).refusal is None else "hf"


def _stage_configs(cfg: ImproveConfig, current: Path, target: Path, round_dir: Path, k: int) -> dict[str, Any]:
    source = load_draft(current)
    data = round_dir / "data"
    common = {"trust_remote_code": cfg.trust_remote_code}
    engine = _engine(cfg, target, source.spec.method)
    proven = {
        "prompts": str(data / SPLIT[1]),
        "engine": engine,
        "k": [k],
        "num_prompts": cfg.num_prompts,
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": 0.0,
        "device": cfg.device,
        "gate": engine == "vllm",  # the gate wherever vLLM decodes
    }
    return {
        "prepare": PrepareConfig(
            data=[str(data / SPLIT[0])],
            target=str(target),
            output=round_dir / "prepared",
            max_length=cfg.max_length,
            **common,
        ),
        "extract": ExtractConfig(
            prepared=round_dir / "prepared",
            output=round_dir / "store",
            backend=cfg.backend,
            aux_layer_ids=list(source.spec.aux_layer_ids),
            device=cfg.device,
            **common,
        ),
        "train": TrainConfig(
            data=round_dir / "store",
            output=round_dir / "train",
            method=source.spec.method,
            init_from=current,
            max_steps=cfg.max_steps,
            lr=cfg.lr,
            token_budget=cfg.token_budget,
            warmup_steps=min(20, cfg.max_steps // 10),
            device=cfg.device,
            **common,
        ),
        "export": ExportConfig(
            checkpoint=round_dir / "train", format="vllm", output=round_dir / "candidate", speculative_tokens=k
        ),
        "prove current": EvaluateConfig(draft=current, output=round_dir / "eval-current", **proven, **common),
        "prove candidate": EvaluateConfig(  # the target alone decoded once, for both: in the current's proof
            draft=round_dir / "candidate", output=round_dir / "eval-candidate", baseline=False, **proven, **common
        ),
    }


_MODULES = {"prepare": prepare, "extract": extract, "train": train, "export": export}


def _prove(config: EvaluateConfig) -> dict[str, Any]:
    """Evaluate one draft; a gate it fails is its result (the report is written), not the round's end."""
    try:
        evaluate.run(config)
        failed = ""
    except GateFailed as err:
        failed = str(err)
    return {"gate failed": failed}


def _tau(report: EvaluationReport, k: int) -> RunReport:
    return next(r for r in report.runs if r.k == k)


def decide(current: EvaluationReport, candidate: EvaluationReport, k: int, gates: dict[str, str]) -> tuple[bool, str]:
    """(promote?, why): only a candidate the gate passed whose τ interval lies wholly above the current draft's."""
    if gates.get("prove candidate"):
        return False, f"the candidate failed the gate ({gates['prove candidate']})"
    now, new = _tau(current, k), _tau(candidate, k)
    if now.tau_95 is None or new.tau_95 is None:
        return False, f"{current.engine} gives no per-request interval for τ here: nothing is promoted without one"
    said = (
        f"τ {new.tau:.3f} [{new.tau_95[0]:.3f}, {new.tau_95[1]:.3f}] against {now.tau:.3f} "
        f"[{now.tau_95[0]:.3f}, {now.tau_95[1]:.3f}] on {new.num_prompts} held-out requests (k={k})"
    )
    if gates.get("prove current"):  # both τ are vLLM's, as served; the summary says the current draft's gate failed
        said += f"; the current draft failed its gate ({gates['prove current']})"
    if new.tau_95[0] > now.tau_95[1]:
        return True, f"better beyond the intervals: {said}"
    return False, f"not better beyond the intervals: {said}"


def _round(out: Path, cfg: ImproveConfig) -> Path:
    """The unfinished round this command continues, else a new one; a round started with other options is refused."""
    rounds = sorted((out / "rounds").glob("[0-9][0-9][0-9]"))
    options = json.loads(cfg.model_dump_json(include=set(ROUND_OPTIONS)))
    if rounds and (rounds[-1] / STATE).is_file():
        state = json.loads((rounds[-1] / STATE).read_text())
        if "decide" not in state["finished"]:
            if state["options"] != options:
                moved = sorted(k for k in options if state["options"].get(k) != options[k])
                raise DraftsmithError(
                    f"{rounds[-1]}: an unfinished round started with other options ({', '.join(moved)}); run it with "
                    "its own to finish it, or remove that round's directory"
                )
            return rounds[-1]
    number = int(rounds[-1].name) + 1 if rounds else 1
    path = out / "rounds" / f"{number:03d}"
    path.mkdir(parents=True)
    atomic_write_json(path / STATE, {"options": options, "finished": {}})
    return path


def run(cfg: ImproveConfig, console: Console | None = None) -> StageResult:  # noqa: C901 - one branch per step
    console = console or Console(stderr=True)
    recording.read_recording(cfg.recording)  # a missing or damaged recording: one line before anything runs
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    round_dir = _round(out, cfg)
    state = json.loads((round_dir / STATE).read_text())
    if "current" not in state:  # kept at once: an interrupted round does not adopt the draft twice
        state["current"] = str(_adopt(Path(cfg.draft), out))
        atomic_write_json(round_dir / STATE, state)
    current = Path(state["current"])
    source = load_draft(current)
    target_path, identity = resolve_draft_target(cfg.target, source, str(current), "improve it")
    manifest = read_export_manifest(current)
    k = cfg.k or (manifest.speculative_tokens if manifest and manifest.speculative_tokens else DEFAULT_K)
    configs = _stage_configs(cfg, current, target_path, round_dir, k)
    steps = ["split", "prepare", "extract", "train", "export", "prove current", "prove candidate", "decide"]
    for index, step in enumerate(steps, start=1):
        if step in state["finished"]:
            console.print(f"[dim][{index}/{len(steps)}] {step}: finished earlier, skipped[/]")
            continue
        console.rule(f"[bold][{index}/{len(steps)}] {step}[/]  ({round_dir.name})")
        t0 = time.perf_counter()
        if step == "split":
            done = split(cfg, recording.fingerprint(identity.config_hash, identity.tokenizer_hash), round_dir / "data")
        elif step.startswith("prove"):
            done = _prove(configs[step])
        elif step == "decide":
            done = _decide(out, round_dir, state, k)
        else:
            done = {"summary": json.loads(json.dumps(_MODULES[step].run(configs[step]).summary, default=str))}
        state["finished"][step] = {"seconds": round(time.perf_counter() - t0, 1), **done}
        atomic_write_json(round_dir / STATE, state)
    return _result(cfg, round_dir, state, k)


def _decide(out: Path, round_dir: Path, state: dict[str, Any], k: int) -> dict[str, Any]:
    reports = [read_report(round_dir / name / REPORT_JSON) for name in ("eval-current", "eval-candidate")]
    gates = {step: state["finished"][step]["gate failed"] for step in ("prove current", "prove candidate")}
    promote, why = decide(reports[0], reports[1], k, gates)
    if not promote:
        return {"promoted": None, "why": why}
    version = max(_versions(out), default=0) + 1
    shutil.copytree(round_dir / "candidate", out / f"v{version}")
    _point_current(out, version)
    return {"promoted": f"v{version}", "why": why}


def _lines(name: str, run: RunReport, alone: float | None) -> list[tuple[str, str]]:
    """A draft's τ on the held-out requests: its interval, acceptance per position, speed-up over the target alone
    (`alone` tokens/s, decoded in the current draft's proof) and split by segment."""
    interval = f" [{run.tau_95[0]:.3f}, {run.tau_95[1]:.3f}]" if run.tau_95 else ""
    per_pos = " ".join(f"{a:.2f}" for a in run.acceptance_per_pos)
    speed = f"; {run.tokens_per_s / alone:.2f}x the target alone's tokens/s" if alone else ""
    lines = [(f"τ {name} (k={run.k})", f"{run.tau:.3f}{interval}; acceptance per position {per_pos}{speed}")]
    split = [f"{seg} {s.tau:.2f} ({s.rounds} rounds)" for seg, s in (run.by_segment or {}).items() if s.tau is not None]
    return lines + ([(f"τ {name} by segment", ", ".join(split))] if split else [])


def _result(cfg: ImproveConfig, round_dir: Path, state: dict[str, Any], k: int) -> StageResult:
    out = Path(cfg.output)
    split_done, decided = state["finished"]["split"], state["finished"]["decide"]
    reports = [read_report(round_dir / name / REPORT_JSON) for name in ("eval-current", "eval-candidate")]
    taus = [_tau(r, k) for r in reports]
    serving = (out / CURRENT).resolve()
    summary = {
        "round": str(round_dir),
        "requests": f"{split_done['train']} trained on, {split_done['held out']} held out",
        **{
            key: line
            for name, run in zip(("current", "candidate"), taus, strict=True)
            for key, line in _lines(name, run, reports[0].baseline.tokens_per_s if reports[0].baseline else None)
        },
        "decision": (f"promoted {decided['promoted']}: " if decided["promoted"] else "kept the current draft: ")
        + decided["why"],
        "current": f"{out / CURRENT} -> {serving.name}",
    }
    return StageResult(
        stage="improve",
        output=out,
        summary=summary,
        commands={"serve the current draft, recording": f"draftsmith serve {out / CURRENT} --record {cfg.recording}"},
    )
