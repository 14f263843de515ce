"""`draftsmith evaluate --gate`: does this draft decode in the installed vLLM as draftsmith's reference decoder
decodes it, on the user's own prompts?

A draft whose training metrics look fine can be accepted near never where it is served, because of something between
the checkpoint and the server: a config.json key changed after export, or one the serving vLLM does not read, a layer
id off by one, a rotary setting. The gate decodes the prompts with vLLM (which reads config.json; greedy, k, the dtype
vLLM runs), then scores the same draft with the reference decoder (which reads the draft as draftsmith trained it: the
export's manifest) along vLLM's own output: at each round the target's choice is vLLM's token, so both engines propose
from the same accepted prefix and the comparison is paired, in any dtype (unpaired, two engines' greedy paths part
within a few tokens in bf16 and accept on different texts). It passes when every position's acceptance agrees within
`--gate-tolerance` (plus one round's worth, for small samples) and no key vLLM reads changed since export:

- config.json against the draft as trained: each key whose value differs from what the export wrote for this draft
  (`format_config` of the manifest's spec), each key it added or lost. One that the installed vLLM's source reads
  fails the gate by itself, naming the key, both values and that this vLLM reads it; one it never reads is served as
  if absent, and is a warning;
- else a position that disagrees names the dtype both engines ran in and the target to check.

It also compares the served acceptance with what training predicted on its held-out split (the last evaluation's
teacher-forced accuracy per step: position j is accepted with probability prod_{i<=j} acc_i), a number the verdict
reports and never judges. Everything here is pure: the engines run in stage.py.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from itertools import accumulate
from pathlib import Path

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.targets import read_config
from draftsmith.evaluate.report import GateResult, PositionCheck, TrainingPrediction
from draftsmith.evaluate.specdec import DecodeStats
from draftsmith.export.formats import VLLM_LOADABLE, format_config, read_export_manifest
from draftsmith.extract.vllm.source import unmentioned

__all__ = ["GateFailed", "compare", "config_drift", "served_drift", "training_prediction", "judge"]

# config.json keys that do not change what the draft computes: the target's special tokens (copied from its config),
# the verifier's name (a path on the machine that exported) and the writer's version
_NOT_DRAFTING = {"bos_token_id", "eos_token_id", "pad_token_id", "verifier", "draftsmith_version"}
# (and what a re-save by transformers rewrites: its version, the dtype's key; a served draft runs in the target's dtype)
_NOT_DRAFTING |= {"transformers_version", "torch_dtype", "dtype"}
# a served τ this far (relative) from training's held-out prediction gets the usual reasons in its line
PREDICTION_GAP = 0.25


class GateFailed(DraftsmithError):
    """The gate's verdict when the served acceptance differs from the reference decoder's (the report is written)."""


def compare(reference: DecodeStats, served: DecodeStats, tolerance: float) -> list[PositionCheck]:
    """Acceptance per position of the two engines' runs at the same k. The reference decoder follows vLLM's output,
    so the rounds differ only where the two drafts' numerics flip a near-tie (none in the runs measured, bf16
    included): `tolerance` of the rounds, plus one round of the smaller run."""
    rounds = max(1, min(reference.num_rounds, served.num_rounds))
    allowed = tolerance + 1 / rounds
    return [
        PositionCheck(position=i + 1, reference=a, served=b, allowed=allowed, agrees=abs(b - a) <= allowed)
        for i, (a, b) in enumerate(zip(reference.acceptance_per_pos, served.acceptance_per_pos, strict=False))
    ]


def _flatten(config: dict[str, object], prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in config.items():
        if key in _NOT_DRAFTING:
            continue
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_drift(draft_dir: Path) -> dict[str, str]:
    """config.json of a vLLM-loadable export against the one its manifest's draft gets from the writer: for each key
    (dotted inside sub-configs) that differs, was added or is missing, one phrase saying how; empty for a checkpoint
    or another format (vLLM is then given a directory draftsmith writes itself)."""
    manifest = read_export_manifest(draft_dir)
    if manifest is None or manifest.format not in VLLM_LOADABLE:
        return {}
    actual = read_config(Path(draft_dir))
    expected = format_config(
        manifest.draft,
        manifest.format,
        verifier="",
        verifier_architectures=[],
        speculative_tokens=manifest.speculative_tokens,
        dtype=manifest.dtype,
        special_tokens={},
        num_target_layers=manifest.target.num_layers,
    )
    have, want = _flatten(actual), _flatten(expected)
    drift: dict[str, str] = {}
    for key in sorted(set(have) | set(want)):
        if key.endswith("speculative_tokens"):  # how many tokens a round proposes by default: the command decides
            continue
        if key not in have:
            drift[key] = f"{key} is missing from config.json (the draft was trained with {json.dumps(want[key])})"
        elif key not in want:
            drift[key] = f"{key} is {json.dumps(have[key])} in config.json, a key the draft was not trained with"
        elif have[key] != want[key]:
            drift[key] = f"{key} is {json.dumps(have[key])} in config.json, {json.dumps(want[key])} as trained"
    return drift


def served_drift(draft_dir: Path) -> tuple[dict[str, str], list[str]]:
    """(config_drift's keys and phrases, those of its keys the installed vLLM's source never reads: served as if
    absent); a sub-config's key is read by its own name ("rope_theta" of rope_parameters.rope_theta). Where no vLLM
    source can be read, every key counts as read."""
    drift = config_drift(draft_dir)
    names = set(unmentioned(sorted({key.rsplit(".", 1)[-1] for key in drift})) or [])
    return drift, [key for key in drift if key.rsplit(".", 1)[-1] in names]


def training_prediction(training: Mapping[str, object], k: int) -> TrainingPrediction | None:
    """What training's last held-out evaluation predicts per position (prod_{i<=j} acc_i, as its simulated
    acceptance length) for the first min(k, its steps) positions; None where the draft carries no such record (an
    export of an older draftsmith, a checkpoint saved before its first evaluation)."""
    acc = training.get("eval acc")
    if not isinstance(acc, list) or not acc:
        return None
    per_pos = list(accumulate((float(a) for a in acc[:k]), lambda run, a: run * a))
    return TrainingPrediction(acceptance_per_pos=per_pos, tau=1.0 + sum(per_pos), positions=len(per_pos))


def _training_line(prediction: TrainingPrediction | None, served: DecodeStats) -> str:
    if prediction is None:
        return "training's held-out prediction: none recorded with this draft"
    n = prediction.positions
    served_tau = 1.0 + sum(served.acceptance_per_pos[:n])
    gap = (served_tau - prediction.tau) / prediction.tau
    where = f"first {n} positions" if n < served.k else f"{n} positions"
    line = (
        f"served τ {served_tau:.2f} against training's held-out prediction {prediction.tau:.2f} over the {where} "
        f"({gap:+.0%})"
    )
    if abs(gap) > PREDICTION_GAP:
        line += (
            " (a gap this large usually means prompts whose answers the target writes differently from the training "
            "data's, or training answers cut shorter than what is generated here)"
        )
    return line


def judge(
    reference: DecodeStats,
    served: DecodeStats,
    *,
    tolerance: float,
    vllm_version: str | None,
    dtype: str,
    drift: dict[str, str],
    unread: list[str],
    training: Mapping[str, object],
) -> GateResult:
    """The gate's verdict for one k, as the module docstring says. `drift` is config_drift's (key: phrase), `unread`
    the drifted keys this vLLM's source never reads."""
    positions = compare(reference, served, tolerance)
    prediction = training_prediction(training, served.k)
    engine = f"vLLM {vllm_version or '(version unknown)'}"
    read = [f"{phrase}, and {engine} reads it" for key, phrase in drift.items() if key not in unread]
    ignored = [f"{drift[key]} ({engine} does not read it: served as if absent)" for key in unread]
    worst = max(positions, key=lambda p: abs(p.gap) - p.allowed) if positions else None
    passed = not read and (worst is None or worst.agrees)
    taus = f"k={served.k}, τ {served.tau:.2f} served, {reference.tau:.2f} reference along vLLM's output"
    tail = _training_line(prediction, served)
    if read:
        verdict = f"gate failed: config.json changed since export: {'; '.join(read)} ({taus}); {tail}"
    elif passed:
        within = positions[0].allowed if positions else 0
        verdict = f"gate passed: {engine} accepts what the reference decoder accepts ({taus}, every position within "
        verdict += f"{within:.2f}); {tail}"
    else:
        assert worst is not None
        cause = "config.json is as exported" if not drift else f"config.json differs only where {engine} does not read"
        cause += (
            f"; check the target (the same checkpoint and revision in both engines) and the dtype ({dtype} in both)"
        )
        verdict = (
            f"gate failed: {engine} accepts {worst.served:.2f} of rounds at position {worst.position} where the "
            f"reference decoder accepts {worst.reference:.2f} ({taus}; allowed {worst.allowed:.2f}); likeliest "
            f"cause: {cause}; {tail}"
        )
    if ignored:
        verdict += "; warning: config.json changed since export: " + "; ".join(ignored)
    return GateResult(
        passed=passed,
        verdict=verdict,
        k=served.k,
        positions=positions,
        reference_tau=reference.tau,
        served_tau=served.tau,
        config_drift=list(drift.values()),
        not_read_by_vllm=unread,
        training=None if prediction is None else prediction.model_copy(update={"line": tail}),
    )
