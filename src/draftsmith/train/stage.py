"""`draftsmith train`: build the run (train/setup.py), then one explicit training loop (nanoGPT style).

    batch -> (online: run the target, or read the vLLM engines' spool) -> target distribution -> TTT forward -> loss -> backward
          -> clip -> AdamW step -> learning-rate schedule -> log -> evaluate / checkpoint

Gradients are exact under grad accumulation and DDP: each micro-batch's loss is divided by the number of scored
positions per TTT step summed over all micro-batches of the step and all ranks, then multiplied by the world size
(DDP and FSDP2 average gradients), so the update equals one process on the combined batch. The step itself never
waits for the host: the batch's index tensors come from the collate function, metrics stay on the device until a
logged (or evaluated, or saved) step reduces them over ranks in one all-reduce.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import torch

from draftsmith.config import StageResult, TrainConfig, save_resolved_config
from draftsmith.core import hostmem
from draftsmith.core import threads as openmp
from draftsmith.core.errors import DraftsmithError
from draftsmith.methods import artefact
from draftsmith.train import checkpoint, distributed, probe
from draftsmith.train.batches import Batch
from draftsmith.train.metrics import METRICS_FILE, SAMPLES_FILE, MetricsSink, Progress, StepStats
from draftsmith.train.objective import TargetHead, TTTResult, summarise
from draftsmith.train.setup import Run, autocast_dtype, build, lr_at, precision_note, resolved_precision

__all__ = ["run", "METRICS_FILE"]


def run(cfg: TrainConfig) -> StageResult:
    info = distributed.init(cfg.device, cfg.distributed)
    try:
        return train(cfg, info)
    finally:
        distributed.shutdown(info)


def train(cfg: TrainConfig, info: distributed.DistInfo) -> StageResult:
    r = build(cfg, info)  # data, target head, draft, optimizer; resumed from --output's latest checkpoint
    state, model, optimizer, out = r.state, r.model, r.optimizer, Path(cfg.output)
    _start_output(cfg, info, out)
    sink = MetricsSink(out / METRICS_FILE, info.is_main, state.step if r.resumed_from else -1)
    ledger = MetricsSink(out / SAMPLES_FILE, info.is_main, state.step if r.resumed_from else -1, tensorboard=False)
    stats, progress = StepStats(cfg.method.depths, info.device), Progress(r.total_steps, info.is_main)
    completed = False
    last_saved, last_train, probed = str(r.resumed_from) if r.resumed_from else None, {}, -1
    t0, tokens_at_start = time.perf_counter(), state.tokens
    steps = r.data.steps(state.epoch, state.position, r.epochs)
    model.train()
    try:
        while state.step < r.total_steps and (micro := next(steps, None)) is not None:
            if micro[0].epoch != state.epoch:  # the first step of an epoch (an empty epoch was skipped)
                state.epoch, state.epoch_start = micro[0].epoch, state.step
            lr = lr_at(state.step, cfg, r.total_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            logged = (state.step + 1) % cfg.log_every == 0 or state.step + 1 == r.total_steps
            normaliser = distributed.all_reduce_sum(torch.stack([mb.index.counts for mb in micro]).sum(0), info)
            stats.new_step()
            for j, mb in enumerate(micro):
                with distributed.grad_sync(model, info, j == len(micro) - 1), autocast(info.device, cfg.precision):
                    seed = hash((cfg.seed, state.step, info.rank, j)) & 0x7FFFFFFF
                    result = forward(model, r.head, mb, cfg, r.dtype, normaliser, logged, noise_seed=seed)
                    (result.loss * info.world_size).backward()
                stats.add(state.step + 1, result, mb)
            grad_norm = optimizer_step(r)
            state.step += 1
            ledger.write(_samples_row(state.step, micro))
            if micro[-1].last:  # before any checkpoint, so a resume never repeats the epoch's end
                state.epoch, state.epoch_start = state.epoch + 1, state.step
            evaluate_now = micro[-1].last or bool(cfg.eval_every and state.step % cfg.eval_every == 0)
            save_now = state.step % cfg.save_every == 0 and state.step < r.total_steps
            if logged or evaluate_now or save_now:  # one all-reduce; a NaN/Inf since the last one stops here
                sums, tokens = stats.reduce(info, last_saved)
                state.tokens += tokens
                tok_s = (state.tokens - tokens_at_start) / max(time.perf_counter() - t0, 1e-9)
                if logged:
                    last_train = log_train(r, sink, progress, sums, micro[0].epoch, lr, grad_norm, tok_s)
            progress.update(state.step)
            if evaluate_now:
                evaluate(r, sink, micro[0].epoch)
            if save_now:
                last_saved = save(r, last_saved)
            probed = probe_draft(r, sink, probed, last=False)
        if stats.pending:
            state.tokens += stats.reduce(info, last_saved)[1]
        evaluate(r, sink, state.epoch)  # no-op when this step was just evaluated
        last_saved = save(r, last_saved)
        probe_draft(r, sink, probed, last=True)
        completed = True
    finally:
        steps.close()  # the DataLoader's workers stop
        r.data.features.close(completed)  # online engines stop; a completed run's spool is emptied
        progress.close()
        sink.close()
        ledger.close()
    summary = _summary(r, last_train, last_saved, tokens_at_start, time.perf_counter() - t0)
    return StageResult(stage="train", output=out, summary=summary)


def _start_output(cfg: TrainConfig, info: distributed.DistInfo, out: Path) -> None:
    """The run's directory and its resolved config.yaml (rank 0), and the precision line."""
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        # config.yaml holds what auto resolved to here (the checkpoints keep what was asked, for resuming)
        save_resolved_config(cfg.model_copy(update={"precision": resolved_precision(info.device, cfg.precision)}), out)
        threads = f"; {openmp.WAIT_POLICY}" if info.device.type == "cpu" else ""
        print(f"{precision_note(info.device, cfg.precision)}{threads}", file=sys.stderr, flush=True)


def _samples_row(step: int, micro: list[Batch]) -> dict:
    """The samples ledger's row of an optimizer step: which samples it read, and where the sampler was."""
    samples = [i for mb in micro for i in mb.sample_ids]
    return {"type": "samples", "step": step, "epoch": micro[0].epoch, "position": micro[0].position, "samples": samples}


def log_train(
    r: Run,
    sink: MetricsSink,
    progress: Progress,
    sums: torch.Tensor,
    epoch: int,
    lr: float,
    grad_norm: torch.Tensor | None,
    tok_s: float,
) -> dict:
    """A logged step's metrics (its reduced `sums`) into metrics.jsonl and the progress line; returns them."""
    kl, correct, accept, count, weight = *sums, r.cfg.method.depth_weight
    last_train, source = summarise(kl, correct, accept, count, weight), r.data.features.metrics()
    sink.write(
        {
            "type": "train",
            "step": r.state.step,
            "epoch": epoch,
            "lr": lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else 0.0,
            "tokens_seen": r.state.tokens,
            "tokens_per_s": round(tok_s, 1),
            **last_train,
            **source,
        }
    )
    progress.update(r.state.step, tok_s, last_train, r.data.features.describe(source))
    return last_train


def optimizer_step(r: Run) -> torch.Tensor | None:
    """Clip (--clip; the norm before it, None at 0), step, clear the gradients; on a CPU, hand a large freed heap back
    to the system (`hostmem`: a block method's step leaves GiBs of it fragmented)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(r.params, r.cfg.clip) if r.cfg.clip > 0 else None
    r.optimizer.step()
    r.optimizer.zero_grad(set_to_none=True)
    if r.info.device.type == "cpu":
        hostmem.trim_freed_heap()
    return grad_norm


def autocast(device: torch.device, precision: str) -> torch.autocast | contextlib.nullcontext[None]:
    dtype = autocast_dtype(device, precision)
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def forward(
    model: torch.nn.Module,
    head: TargetHead,
    batch: Batch,
    cfg: TrainConfig,
    dtype: torch.dtype,
    normaliser: torch.Tensor | None,
    metrics: bool,
    noise_seed: int | None = None,
) -> TTTResult:
    """One micro-batch: decode the stored layers on the device, target distribution from layer N (the full
    vocabulary only when `metrics`), optional feature noise, the TTT unroll."""
    aux, last = batch.features(dtype)
    if cfg.noise_std > 0 and noise_seed is not None:
        gen = torch.Generator(device=aux.device).manual_seed(noise_seed)
        aux = aux + cfg.noise_std * torch.randn(aux.shape, generator=gen, device=aux.device, dtype=aux.dtype)
    target = head(last, batch.index, full=metrics)
    return model(
        batch.input_ids,
        aux,
        target,
        batch.index,
        cfg.method.depths,
        normaliser=normaliser,
        step_weight=cfg.method.depth_weight,
        metrics=metrics,
        checkpointed=cfg.activation_checkpointing,
    )


def evaluate(r: Run, sink: MetricsSink, epoch: int) -> dict:
    """The held-out split, every rank its share; one all-reduce. Saves best/ when the acceptance length improves."""
    state = r.state
    if r.data.evaluation is None or state.last_eval_step == state.step:
        return state.last_eval
    r.model.eval()
    sums = torch.zeros(4, r.cfg.method.depths, dtype=torch.float64, device=r.info.device)
    with torch.no_grad(), autocast(r.info.device, r.cfg.precision):
        for batch in r.data.eval_batches():
            sums += forward(r.model, r.head, batch, r.cfg, r.dtype, None, True).sums
    sums = distributed.all_reduce_sum(sums, r.info).cpu()
    r.model.train()
    kl, correct, accept, count = sums
    state.last_eval, state.last_eval_step = summarise(kl, correct, accept, count, r.cfg.method.depth_weight), state.step
    sink.write({"type": "eval", "step": state.step, "epoch": epoch, **state.last_eval})
    if state.best is None or state.last_eval["acceptance_length"] > state.best:
        state.best = state.last_eval["acceptance_length"]
        save(r, None, best=True)
    return state.last_eval


def _manifest(r: Run) -> artefact.CheckpointManifest:
    """The checkpoint manifest of the draft as it is now."""
    state = r.state
    return artefact.CheckpointManifest(
        **r.manifest,
        step=state.step,
        epoch=state.epoch,
        tokens=state.tokens,
        metrics=state.last_eval,
        best_acceptance_length=state.best,
    )


def probe_draft(r: Run, sink: MetricsSink, probed: int, last: bool) -> int:
    """A probe of the draft as it is now where one is due and this step was not probed yet (train/probe.py): every
    rank gathers its weights (FSDP2), rank 0 decodes while the others wait at the next collective. Returns the last
    step probed."""
    if not probe.due(r.cfg, r.state.step, last) or probed == r.state.step:
        return probed
    weights = distributed.full_model_state(r.model, r.info)
    if r.info.is_main:
        probe.run(r.cfg, _manifest(r), weights, sink)
    return r.state.step


def save(r: Run, last_saved: str | None, best: bool = False) -> str | None:
    """A step checkpoint (or best/). Every rank gathers (FSDP2); rank 0 writes; a failed write stops every rank
    with rank 0's message. Returns the last step checkpoint's path (best/ leaves it as it was)."""
    info, state = r.info, r.state
    weights = distributed.full_model_state(r.model, info)
    opt_state = None if best else distributed.full_optimizer_state(r.model, r.optimizer, info)
    error = None
    if info.is_main:
        manifest = _manifest(r)
        training = None if opt_state is None else checkpoint.training_state(state, opt_state, r.sampler_seed)
        try:
            checkpoint.save_checkpoint(r.cfg.output, manifest, weights, training, r.cfg.keep_checkpoints, best)
        except DraftsmithError as err:
            error = (
                f"{err} (training stopped at step {state.step}; the last good checkpoint is {last_saved or 'none yet'})"
            )
    error = distributed.broadcast_error(error, info)
    if error:
        raise DraftsmithError(error)
    return last_saved if best else str(artefact.step_dir(r.cfg.output, state.step))


def _summary(r: Run, last_train: dict, last_saved: str | None, tokens_at_start: int, elapsed: float) -> dict:
    state, cfg = r.state, r.cfg
    summary = {
        "mode": "offline (store)" if r.data_kind == "store" else "online (target in the trainer)",
        "precision": resolved_precision(r.info.device, cfg.precision),
        **r.data.features.summary(),
        "steps": state.step,
        "epochs": state.epoch,
        "tokens": state.tokens,
        "tokens/s": round((state.tokens - tokens_at_start) / max(elapsed, 1e-9), 1),
        "train loss": last_train.get("loss"),
        "final acceptance length (sim.)": state.last_eval.get("acceptance_length", last_train.get("acceptance_length")),
        "best acceptance length (sim.)": state.best,
        "per-step acc": state.last_eval.get("acc", last_train.get("acc")),
        "draft vocab coverage": round(r.coverage, 4),
        "checkpoint": str(last_saved),
    }
    if cfg.init_from is not None:
        summary["started from"] = str(cfg.init_from)
    if r.resumed_from:
        summary["resumed from"] = str(r.resumed_from)
    return summary
