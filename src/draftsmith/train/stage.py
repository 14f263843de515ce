"""`draftsmith train`: set up data, target and draft, then one explicit training loop (nanoGPT style).

    batch -> (online: run the target) -> target distribution -> TTT forward -> loss -> backward
          -> clip -> AdamW step -> learning-rate schedule -> log -> evaluate / checkpoint

Gradients are exact under grad accumulation and DDP: each micro-batch's loss is divided by the number of scored
positions per TTT step summed over all micro-batches of the step and all ranks, then multiplied by the world size
(DDP averages gradients), so the update equals one process on the combined batch.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from draftsmith.config import StageResult, TrainConfig, save_resolved_config
from draftsmith.core import targets
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import atomic_write_text
from draftsmith.core.manifest import read_manifest_json
from draftsmith.train import checkpoint, distributed
from draftsmith.train.batches import Batch, OnlineSource, TokenBudgetSampler, fetch, token_counts_from
from draftsmith.train.drafts import draft_module, load_draft, require_draft_for_target
from draftsmith.train.model import DraftSpec, Eagle3Draft
from draftsmith.train.ttt import TTTModel, TTTResult, needed_positions, step_counts, summarise, target_distribution

METRICS_FILE = "metrics.jsonl"
# Options that may change between a run and its resume without changing what is being trained.
_RESUMABLE_CHANGES = {"resume", "force", "device", "log_every", "save_every", "eval_every", "keep_checkpoints",
                      "output", "data", "target"}


# ---------------------------------------------------------------------------------------------- set-up

@dataclass
class TargetHead:
    """The target's final norm and lm_head: layer N -> the target's distribution over the draft vocabulary."""

    norm: nn.Module
    weight: torch.Tensor
    draft_to_target: torch.Tensor

    def __call__(self, last_hidden: torch.Tensor, loss_mask: torch.Tensor | None = None):
        needed = None if loss_mask is None else needed_positions(loss_mask)
        return target_distribution(last_hidden, self.norm, self.weight, self.draft_to_target, needed=needed)


@dataclass
class Setup:
    dataset: Any  # store (offline) or prepared set (online): dataset[i] -> dict
    data_kind: str
    target_path: Path
    identity: Any
    aux_layer_ids: list[int]
    target: nn.Module
    online: OnlineSource | None
    draft_to_target: torch.Tensor
    coverage: float
    train_ids: list[int]
    eval_ids: list[int]
    lengths: np.ndarray
    token_counts: torch.Tensor
    notes: list[str] = field(default_factory=list)


def _split(sample_ids: np.ndarray, total: int, cfg: TrainConfig) -> tuple[list[int], list[int]]:
    """Held-out split by sample id (the same split the evaluator reproduces from eval_fraction and seed)."""
    from draftsmith.prepare.dataset import split_indices

    _, held = split_indices(total, cfg.eval_fraction, cfg.seed)
    held_set = set(held)
    train = [i for i, s in enumerate(sample_ids.tolist()) if s not in held_set]
    evals = [i for i, s in enumerate(sample_ids.tolist()) if s in held_set]
    return train, evals


def setup(cfg: TrainConfig, device: torch.device) -> Setup:
    """Open the data (store or prepared set), check it against the target, load the target, pick the draft vocab."""
    from draftsmith.extract import store as store_mod
    from draftsmith.prepare.dataset import open_prepared
    from draftsmith.prepare.vocab import build_draft_vocab

    kind = read_manifest_json(cfg.data).get("kind") if (Path(cfg.data) / "manifest.json").is_file() else None
    if kind not in ("store", "prepared"):
        raise DraftsmithError(f"{cfg.data}: --data must be a hidden-state store (`draftsmith extract`) or a prepared "
                              f"data set (`draftsmith prepare`), found {kind or 'no draftsmith artefact'}")
    counts = None
    if kind == "store":
        dataset = store_mod.open(cfg.data, dtype=torch.float32)
        identity = dataset.manifest.target
        aux = list(dataset.aux_layer_ids)
        if dataset.layer_ids[-1] != identity.num_layers:
            raise DraftsmithError(f"{cfg.data}: the store's last layer is {dataset.layer_ids[-1]}, not the target's "
                                  f"last layer {identity.num_layers}; extract again with draftsmith")
        if cfg.aux_layer_ids is not None and sorted(cfg.aux_layer_ids) != aux:
            raise DraftsmithError(f"{cfg.data}: the store holds aux layers {aux} but --aux-layer-ids asks for "
                                  f"{sorted(cfg.aux_layer_ids)}; extract a store with those layers or drop the option")
        sample_ids = np.asarray(dataset.sample_ids, dtype=np.int64)
        prepared = dataset.manifest.prepared
        total = prepared.num_samples if prepared else int(sample_ids.max(initial=-1)) + 1
        if prepared and Path(prepared.path).is_dir():
            with contextlib.suppress(DraftsmithError):
                counts = open_prepared(Path(prepared.path)).token_counts()
    else:
        dataset = open_prepared(cfg.data)
        identity = dataset.manifest.target
        from draftsmith.core.layers import resolve_layer_ids  # the same default the extract stage uses

        aux = resolve_layer_ids(cfg.aux_layer_ids, identity.num_layers)[:-1]
        sample_ids = np.arange(len(dataset), dtype=np.int64)
        total = len(dataset)
        counts = dataset.token_counts()
    lengths = np.asarray(dataset.lengths, dtype=np.int64)
    if len(dataset) == 0:
        raise DraftsmithError(f"{cfg.data}: the data set is empty; prepare/extract some conversations first")

    target_path = targets.resolve_target(cfg.target or identity.path)
    diff = targets.target_identity(target_path).mismatch(identity)
    if diff:
        raise DraftsmithError(f"{cfg.data}: was made for another target than {target_path} ({diff}); pass the "
                              "matching --target or prepare/extract the data for this one")
    dtype = torch.bfloat16 if device.type == "cuda" and kind == "prepared" else torch.float32
    # From a store only the embedding, final norm and lm_head are used: the decoder layers stay on disk.
    load = targets.load_target if kind == "prepared" else targets.load_target_head
    target = load(target_path, dtype=dtype, device=device, trust_remote_code=cfg.trust_remote_code)

    if cfg.max_samples is not None:
        sample_ids, lengths = sample_ids[:cfg.max_samples], lengths[:cfg.max_samples]
    train_ids, eval_ids = _split(sample_ids, total, cfg)
    if counts is None:
        counts = token_counts_from(dataset, identity.vocab_size)
    if int(counts.sum()) == 0:
        raise DraftsmithError(f"{cfg.data}: no loss-masked (assistant) tokens at all; nothing to train on")
    vocab = build_draft_vocab(counts, min(cfg.draft_vocab_size, identity.vocab_size))
    online = OnlineSource(target, aux + [identity.num_layers]) if kind == "prepared" else None
    return Setup(dataset, kind, target_path, identity, aux, target, online, vocab.draft_to_target, vocab.coverage,
                 train_ids, eval_ids, lengths, torch.as_tensor(counts))


def initial_draft(cfg: TrainConfig, s: Setup) -> tuple[Eagle3Draft, DraftSpec, float]:
    """(draft, its spec, draft-vocab coverage of the data): a fresh draft, or the one --init-from names."""
    if cfg.init_from is None:
        spec = DraftSpec.from_target_config(targets.read_config(s.target_path), cfg.draft_vocab_size, cfg.num_layers,
                                            s.aux_layer_ids)
        draft = Eagle3Draft.from_target(spec, s.target, s.draft_to_target, cfg.lm_head_init, cfg.seed)
        return draft, spec, s.coverage
    where = f"--init-from {cfg.init_from}"
    if not Path(cfg.init_from).exists():
        raise DraftsmithError(f"{where}: does not exist; pass an exported draft directory or a training checkpoint")
    source = load_draft(cfg.init_from)
    require_draft_for_target(source, s.identity, s.target_path, where, "start from a draft for this target")
    if sorted(source.spec.aux_layer_ids) != s.aux_layer_ids:
        fix = ("extract a store with those layers" if s.data_kind == "store"
               else f"pass --aux-layer-ids {','.join(map(str, source.spec.aux_layer_ids))}")
        raise DraftsmithError(f"{where}: the draft fuses aux layers {source.spec.aux_layer_ids}, the training data "
                              f"gives {s.aux_layer_ids}; {fix}")
    if source.spec.num_hidden_layers != cfg.num_layers:
        raise DraftsmithError(f"{where}: the draft has {source.spec.num_hidden_layers} decoder layer(s), --num-layers "
                              f"asks for {cfg.num_layers}; drop the option or start from a matching draft")
    draft = draft_module(source, targets.embed_tokens(s.target).weight)
    counts = s.token_counts.to(torch.float64)
    coverage = float(counts[draft.draft_to_target].sum() / counts.sum().clamp(min=1))
    return draft, source.spec, coverage


def lr_at(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Linear warm-up, then cosine / linear decay to min_lr_ratio * lr (a pure function of the step)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, max(0.0, (step - cfg.warmup_steps) / span))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1 - progress
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape)


def _autocast(device: torch.device, precision: str):
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def batch_forward(model: TTTModel | nn.Module, head: TargetHead, batch: Batch, cfg: TrainConfig, normaliser: torch.Tensor | None,
                  noise_seed: int | None = None) -> TTTResult:
    """One micro-batch: split the stored layers, target distribution from layer N, optional noise, TTT."""
    hs = batch.hidden_states  # [B, T, L, H]
    b, t, layers, h = hs.shape
    aux = hs[:, :, :-1].reshape(b, t, (layers - 1) * h)  # aux layers concatenated in id order
    if cfg.noise_std > 0 and noise_seed is not None:
        gen = torch.Generator(device=hs.device).manual_seed(noise_seed)
        aux = aux + cfg.noise_std * torch.randn(aux.shape, generator=gen, device=hs.device, dtype=aux.dtype)
    return model(batch.input_ids, batch.loss_mask, aux, head(hs[:, :, -1], batch.loss_mask), cfg.ttt_steps,
                 cfg.step_weight, normaliser)


def _nonfinite_sample(batch: Batch) -> int | None:
    bad = ~torch.isfinite(batch.hidden_states).flatten(1).all(1)
    return batch.sample_ids[int(bad.nonzero()[0])] if bool(bad.any()) else None


def _changed_hyperparameters(saved: dict, cfg: TrainConfig) -> list[str]:
    now = cfg.model_dump(mode="json")
    # An option added after the checkpoint was written is not a change.
    return [f"{k}: {saved[k]!r} -> {now[k]!r}" for k in now if k not in _RESUMABLE_CHANGES and k in saved
            and saved[k] != now[k]]


# ---------------------------------------------------------------------------------------------- the loop

def _on_step_end(step: int) -> None:
    """Hook for tests (simulated crashes); does nothing."""


def run(cfg: TrainConfig) -> StageResult:
    info = distributed.init(cfg.device, cfg.distributed)
    try:
        return _train(cfg, info)
    finally:
        distributed.shutdown(info)


def _train(cfg: TrainConfig, info: distributed.DistInfo) -> StageResult:
    device, out = info.device, Path(cfg.output)
    torch.manual_seed(cfg.seed)
    s = setup(cfg, device)
    draft, spec, coverage = initial_draft(cfg, s)
    draft = draft.to(device)
    head = TargetHead(targets.final_norm(s.target), targets.lm_head(s.target).weight, draft.draft_to_target)
    sampler = TokenBudgetSampler(s.train_ids, s.lengths, cfg.token_budget, cfg.seed, info.rank, info.world_size)
    max_epochs = cfg.epochs if cfg.max_steps is None else 1 << 30  # --max-steps overrides --epochs
    first_epoch_steps = len(sampler.batches(0)) // cfg.grad_accum
    total_steps = cfg.max_steps or sum(len(sampler.batches(e)) // cfg.grad_accum for e in range(cfg.epochs))
    if first_epoch_steps == 0:
        raise DraftsmithError(f"{cfg.data}: too little training data for one optimizer step per process "
                              f"({len(s.train_ids)} samples, {info.world_size} processes, --grad-accum "
                              f"{cfg.grad_accum}); add data or lower --grad-accum / --eval-fraction")

    # Resume (or refuse to overwrite) before anything is written.
    step, epoch, tokens, best_len, resumed_from = 0, 0, 0, None, None
    latest = checkpoint.latest_checkpoint(out)
    training_state = None
    if latest is not None:
        if not cfg.resume and not cfg.force:
            raise DraftsmithError(f"{out}: already holds a training run; use --resume to continue it, --force to "
                                  "start over, or another --output")
        if cfg.resume:
            manifest = checkpoint.read_manifest(latest, checkpoint.CheckpointManifest)
            changed = _changed_hyperparameters(manifest.hyperparameters, cfg)
            if changed and not cfg.force:
                raise DraftsmithError(f"{latest}: was trained with other hyper-parameters ({'; '.join(changed)}); "
                                      "resume with the same ones, pass --force to continue anyway, or use another --output")
            if changed and info.is_main:
                warnings.warn(f"resuming {latest} with changed hyper-parameters: {'; '.join(changed)}", stacklevel=1)
            if manifest.target.mismatch(s.identity) or manifest.draft.aux_layer_ids != s.aux_layer_ids:
                raise DraftsmithError(f"{latest}: was trained for another target or aux layers; use another --output")
            draft.load_draft_tensors(checkpoint.read_weights(latest, manifest))
            training_state = checkpoint.load_training_state(latest)
            step, epoch, tokens = training_state["step"], training_state["epoch"], training_state["tokens"]
            best_len = training_state.get("best_acceptance_length")
            sampler.load_state_dict(training_state["sampler"])
            torch.set_rng_state(training_state["rng_torch"])
            resumed_from = latest
    model = distributed.wrap(TTTModel(draft), info)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    if training_state is not None:
        distributed.load_optimizer_state(model, optimizer, training_state["optimizer"], info)

    metrics = _MetricsSink(out / METRICS_FILE, info.is_main, keep_through_step=step if resumed_from else -1)
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        save_resolved_config(cfg, out)
    base_manifest = dict(target=s.identity, draft=spec, draft_vocab_coverage=coverage,
                         data=str(Path(cfg.data).resolve()), data_kind=s.data_kind, eval_fraction=cfg.eval_fraction,
                         split_seed=cfg.seed, hyperparameters=cfg.model_dump(mode="json"))
    last_eval: dict = {}
    last_eval_step = -1
    last_saved = resumed_from

    def load(ids: list[int]) -> Batch:
        batch = fetch(s.dataset, ids)
        return (s.online(batch.to(device)) if s.online else batch.to(device))

    def save(best: bool = False) -> Path | None:
        """Every rank gathers (FSDP2); rank 0 writes; a failed write stops every rank with rank 0's message."""
        state = distributed.full_model_state(model, info)
        opt_state = distributed.full_optimizer_state(model, optimizer, info) if not best else None
        error, path = None, None
        if info.is_main:
            manifest = checkpoint.CheckpointManifest(**base_manifest, step=step, epoch=epoch, tokens=tokens,
                                                     metrics=last_eval, best_acceptance_length=best_len)
            train_state = None if best else {
                "optimizer": opt_state, "sampler": sampler.state_dict(), "step": step, "epoch": epoch,
                "tokens": tokens, "best_acceptance_length": best_len, "rng_torch": torch.get_rng_state()}
            try:
                path = checkpoint.save_checkpoint(out, manifest, state, train_state, cfg.keep_checkpoints, best)
            except DraftsmithError as err:
                error = f"{err} (training stopped at step {step}; the last good checkpoint is {last_saved})"
        error = distributed.broadcast_error(error, info)
        if error:
            raise DraftsmithError(error)
        return path

    def evaluate() -> dict:
        nonlocal best_len, last_eval, last_eval_step
        if not s.eval_ids or last_eval_step == step:
            return last_eval
        last_eval_step = step
        model.eval()
        eval_sampler = TokenBudgetSampler(s.eval_ids, s.lengths, cfg.token_budget, cfg.seed, info.rank,
                                          info.world_size, shuffle=False) if len(s.eval_ids) >= info.world_size else None
        sums = torch.zeros(4, cfg.ttt_steps, dtype=torch.float64)
        with torch.no_grad(), _autocast(device, cfg.precision):
            for ids in (eval_sampler.batches(0) if eval_sampler else []):
                r = batch_forward(model, head, load(ids), cfg, None)
                sums += torch.stack((r.kl_sum, r.correct, r.accept_sum, r.count))
        sums = distributed.all_reduce_sum(sums, info)
        model.train()
        last_eval = summarise(*sums, cfg.step_weight)
        metrics.write({"type": "eval", "step": step, "epoch": epoch, **last_eval})
        if best_len is None or last_eval["acceptance_length"] > best_len:
            best_len = last_eval["acceptance_length"]
            save(best=True)
        return last_eval

    progress = _Progress(total_steps, enabled=info.is_main)
    model.train()
    t_start, tokens_at_start, last_train = time.perf_counter(), tokens, {}
    try:
        while step < total_steps and epoch < max_epochs:
            batches = sampler.batches(epoch)
            n_steps = len(batches) // cfg.grad_accum
            while sampler.position < n_steps and step < total_steps:
                micro_ids = batches[sampler.position * cfg.grad_accum:(sampler.position + 1) * cfg.grad_accum]
                micro = [load(ids) for ids in micro_ids]
                bad = next((x for x in map(_nonfinite_sample, micro) if x is not None), None)
                if distributed.all_reduce_sum(torch.tensor([float(bad is not None)]), info).item() > 0:
                    where = f"sample {bad}" if bad is not None else "a sample on another rank"
                    raise DraftsmithError(f"step {step + 1}: {where} has NaN/Inf hidden states; stopped (last good "
                                          f"checkpoint: {last_saved or 'none yet'}); re-extract or drop that sample")
                normaliser = distributed.all_reduce_sum(
                    sum(step_counts(mb.loss_mask, cfg.ttt_steps).cpu() for mb in micro), info)
                lr = lr_at(step, cfg, total_steps)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                sums = torch.zeros(4, cfg.ttt_steps, dtype=torch.float64)
                for j, mb in enumerate(micro):
                    sync = j == len(micro) - 1 or not hasattr(model, "no_sync")
                    with (contextlib.nullcontext() if sync else model.no_sync()), _autocast(device, cfg.precision):
                        noise_seed = hash((cfg.seed, step, info.rank, j)) & 0x7FFFFFFF
                        r = batch_forward(model, head, mb, cfg, normaliser, noise_seed)
                        bad_ranks = distributed.all_reduce_sum(torch.tensor([float(not torch.isfinite(r.loss))]), info)
                        if bad_ranks.item() > 0:  # every rank stops together (no rank left waiting in backward)
                            where = f"samples {mb.sample_ids[:8]}" if not torch.isfinite(r.loss) else "another rank"
                            raise DraftsmithError(
                                f"step {step + 1}: loss is NaN/Inf on {where}; stopped (last good checkpoint: "
                                f"{last_saved or 'none yet'}); lower --lr or check the data")
                        (r.loss * info.world_size).backward()
                    sums += torch.stack((r.kl_sum, r.correct, r.accept_sum, r.count))
                grad_norm = (torch.nn.utils.clip_grad_norm_(params, cfg.clip) if cfg.clip > 0
                             else torch.zeros(()))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                sums = distributed.all_reduce_sum(sums, info)
                step += 1
                sampler.position += 1
                tokens += int(distributed.all_reduce_sum(torch.tensor([sum(mb.num_tokens for mb in micro)],
                                                                      dtype=torch.float64), info).item())
                last_train = summarise(*sums, cfg.step_weight)
                tok_s = (tokens - tokens_at_start) / max(time.perf_counter() - t_start, 1e-9)
                if step % cfg.log_every == 0 or step == total_steps:
                    metrics.write({"type": "train", "step": step, "epoch": epoch, "lr": lr,
                                   "grad_norm": float(grad_norm), "tokens_seen": tokens,
                                   "tokens_per_s": round(tok_s, 1), **last_train})
                progress.update(step, tok_s, last_train)
                end_of_epoch = sampler.position >= n_steps
                if end_of_epoch or (cfg.eval_every and step % cfg.eval_every == 0):
                    evaluate()
                if end_of_epoch:  # before any checkpoint, so a resume never repeats the epoch's end
                    epoch += 1
                    sampler.epoch, sampler.position = epoch, 0
                if step % cfg.save_every == 0 and step < total_steps:
                    last_saved = save()
                _on_step_end(step)
                if end_of_epoch:
                    break
            if n_steps == 0:  # an epoch packed into fewer batches than --grad-accum: skip it
                epoch += 1
                sampler.epoch, sampler.position = epoch, 0
        evaluate()  # no-op when this step was just evaluated
        last_saved = save()
    finally:
        progress.close()
        metrics.close()
    elapsed = time.perf_counter() - t_start
    summary = {
        "mode": "offline (store)" if s.data_kind == "store" else "online (target in the trainer)",
        "steps": step, "epochs": epoch, "tokens": tokens,
        "tokens/s": round((tokens - tokens_at_start) / max(elapsed, 1e-9), 1),
        "train loss": last_train.get("loss"),
        "final acceptance length (sim.)": last_eval.get("acceptance_length", last_train.get("acceptance_length")),
        "best acceptance length (sim.)": best_len,
        "per-step acc": last_eval.get("acc", last_train.get("acc")),
        "draft vocab coverage": round(coverage, 4),
        "checkpoint": str(last_saved),
    }
    if cfg.init_from is not None:
        summary["started from"] = str(cfg.init_from)
    if resumed_from:
        summary["resumed from"] = str(resumed_from)
    return StageResult(stage="train", output=out, summary=summary)


# ---------------------------------------------------------------------------------------------- sinks

class _MetricsSink:
    """metrics.jsonl (and TensorBoard when installed), rank 0 only; a resume drops lines after its step."""

    def __init__(self, path: Path, enabled: bool, keep_through_step: int):
        self.path, self.enabled, self._tb = path, enabled, None
        if not enabled:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            kept = [line for line in path.read_text(encoding="utf-8").splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= keep_through_step]
            atomic_write_text(path, "".join(line + "\n" for line in kept))
        self._file = open(path, "a", encoding="utf-8")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(path.parent / "tensorboard"))
        except ImportError:
            self._tb = None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            kind, step = record.get("type", "train"), record["step"]
            for key in ("loss", "acceptance_length", "lr", "tokens_per_s"):
                if key in record:
                    self._tb.add_scalar(f"{kind}/{key}", record[key], step)
            for k, a in enumerate(record.get("acc", [])):
                self._tb.add_scalar(f"{kind}/acc_{k}", a, step)

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            if self._tb is not None:
                self._tb.close()


class _Progress:
    """A rich progress bar on stderr: step, tokens/s, loss, per-step accuracy."""

    def __init__(self, total: int, enabled: bool):
        self._bar = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                             TextColumn("{task.fields[info]}"), console=Console(file=sys.stderr), transient=False)
        self._task = self._bar.add_task("train", total=total, info="")
        self._bar.start()

    def update(self, step: int, tokens_per_s: float, stats: dict) -> None:
        if self._bar is None:
            return
        acc = " ".join(f"{a:.2f}" for a in stats.get("acc", [])[:4])
        self._bar.update(self._task, completed=step,
                         info=f"{tokens_per_s:,.0f} tok/s  loss {stats.get('loss', 0):.3f}  acc {acc}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
