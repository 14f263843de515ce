"""Building a training run: data and its held-out split, the draft vocabulary, the target's head, the draft, the
optimizer and a resume -- everything the loop in `draftsmith.train.stage` needs, made once (`build`).

The held-out split is drawn by sample id with its own seed (`--split-seed`, recorded in every checkpoint and export
so `draftsmith evaluate --prompts PREPARED` holds out the same samples); the draft vocabulary is counted on the
training split alone.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from draftsmith.config import TrainConfig
from draftsmith.config.methods import flat_options
from draftsmith.core import devices, hardware, targets
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.layers import resolve_layer_ids
from draftsmith.core.manifest import TargetIdentity, read_manifest, read_manifest_json
from draftsmith.core.tensorfile import Samples
from draftsmith.extract import store as store_mod
from draftsmith.methods import all_methods, artefact, method, method_of
from draftsmith.methods.artefact import draft_module, load_draft, require_draft_for_target
from draftsmith.methods.base import Draft
from draftsmith.methods.spec import DraftSpec
from draftsmith.prepare.dataset import PreparedDataset, open_prepared, split_indices
from draftsmith.train import checkpoint, distributed, packing
from draftsmith.train.batches import (
    FeatureSource,
    LayerSubset,
    OnlineSource,
    Sampling,
    TokenBudgetSampler,
    TrainData,
    default_num_workers,
    token_counts,
)
from draftsmith.train.checkpoint import RunState
from draftsmith.train.engine_source import EngineSource
from draftsmith.train.objective import TargetHead, TTTModel

# Options that may change between a run and its resume without changing what is being trained.
# Checkpoints hold full state dicts: DDP and FSDP2 resume each other; the engines' placement and the spool's size
# change where the states are computed, not which.
RESUMABLE_CHANGES = {
    "resume",
    "force",
    "device",
    "log_every",
    "save_every",
    "eval_every",
    "probe_every",
    "probe_prompts",
    "probe_num_prompts",
    "probe_max_new_tokens",
    "probe_engine",
    "probe_device",
    "keep_checkpoints",
    "output",
    "data",
    "target",
    "num_workers",
    "compile",
    "attention_kernel",
    "activation_checkpointing",
    "distributed",
    "spool",
    "spool_gb",
    "engine_tensor_parallel_size",
    "engine_data_parallel_size",
    "engine_devices",
    "vllm_strategy",
    "vllm_compile",
    "keep_epoch0",
    "remote_engines",
    "stall_timeout_s",
}


@dataclass
class Source:
    """The training data, opened and checked against its target."""

    dataset: Samples | LayerSubset  # store (offline, storage dtype) or prepared set (online): dataset[i] -> dict
    kind: str  # "store" or "prepared"
    identity: TargetIdentity
    target_path: Path
    target: nn.Module  # the target's head only (offline) or the whole target (online)
    aux_layer_ids: list[int]
    sample_ids: np.ndarray  # [N] the prepared set's sample id of each dataset index
    lengths: np.ndarray  # [N]
    num_prepared: int  # samples in the prepared set the split is drawn over


@dataclass
class Run:
    """A training run, built: what the loop reads and (model, optimizer, state) what it changes."""

    cfg: TrainConfig
    info: distributed.DistInfo
    data: TrainData
    head: TargetHead
    model: nn.Module  # TTTModel, under DDP / FSDP2 with torchrun
    optimizer: torch.optim.Optimizer
    params: list[nn.Parameter]
    total_steps: int
    epochs: int | None  # None: --max-steps ends the run
    manifest: dict[str, Any]  # the fields every checkpoint manifest of the run shares
    coverage: float
    data_kind: str
    state: RunState
    resumed_from: Path | None
    dtype: torch.dtype  # the features' compute dtype

    @property
    def sampler_seed(self) -> int:
        return self.data.train.seed


def open_data(cfg: TrainConfig, device: torch.device) -> Source:
    """Open the data (store or prepared set), check it against the target, load what of the target is needed."""
    kind = read_manifest_json(cfg.data).get("kind") if (Path(cfg.data) / "manifest.json").is_file() else None
    if kind not in ("store", "prepared"):
        found = (
            f"a {kind!r} artefact"
            if kind
            else "a directory without manifest.json"
            if Path(cfg.data).is_dir()
            else "a file"
            if Path(cfg.data).exists()
            else "nothing: it does not exist"
        )
        raise DraftsmithError(
            f"{cfg.data}: --data must be a hidden-state store (`draftsmith extract`) or a prepared "
            f"data set (`draftsmith prepare`), found {found}"
        )
    if kind == "store" and cfg.engine == "vllm":
        raise DraftsmithError(
            f"{cfg.data}: is a hidden-state store, which trains offline; --engine vllm trains from "
            "a prepared set (`draftsmith prepare`), extracting its states while it trains"
        )
    dataset: store_mod.HiddenStateStore | LayerSubset | PreparedDataset
    if kind == "store":
        dataset = store_mod.open(cfg.data, dtype=None)  # bf16 / fp8 views of the shards, decoded on the device
        identity, aux = dataset.manifest.target, list(dataset.aux_layer_ids)
        if dataset.layer_ids[-1] != identity.num_layers:
            raise DraftsmithError(
                f"{cfg.data}: the store's last layer is {dataset.layer_ids[-1]}, not the target's "
                f"last layer {identity.num_layers}; extract again with draftsmith"
            )
        if cfg.aux_layer_ids is not None and sorted(cfg.aux_layer_ids) != aux:
            missing = sorted(set(cfg.aux_layer_ids) - set(aux))
            if missing:
                raise DraftsmithError(
                    f"{cfg.data}: the store holds aux layers {aux} but --aux-layer-ids asks for "
                    f"{sorted(cfg.aux_layer_ids)} ({missing} not among them); extract a store with "
                    "those layers or drop the option"
                )
            # a subset: one store trains drafts of several methods (e.g. EAGLE-3's 3 layers, DFlash's 5)
            wanted = sorted(set(int(i) for i in cfg.aux_layer_ids))
            dataset = LayerSubset(dataset, [aux.index(i) for i in wanted] + [len(aux)])
            aux = wanted
        sample_ids = np.asarray(dataset.sample_ids, dtype=np.int64)
        prepared = dataset.manifest.prepared
        total = prepared.num_samples if prepared else int(sample_ids.max(initial=-1)) + 1
    else:
        dataset = open_prepared(cfg.data)
        identity = dataset.manifest.target
        assert cfg.num_layers is not None  # TrainConfig's validator sets the method's default
        aux = resolve_layer_ids(
            cfg.aux_layer_ids or method(cfg.method.name).default_aux_layer_ids(identity.num_layers, cfg.num_layers),
            identity.num_layers,
        )[:-1]  # the method's default (extract's, or DFlash's spread)
        sample_ids, total = np.arange(len(dataset), dtype=np.int64), len(dataset)
    if len(dataset) == 0:
        raise DraftsmithError(f"{cfg.data}: the data set is empty; prepare/extract some conversations first")
    target_path = targets.resolve_target(cfg.target or identity.path)
    diff = targets.target_identity(target_path).mismatch(identity)
    if diff:
        raise DraftsmithError(
            f"{cfg.data}: was made for another target than {target_path} ({diff}); pass the "
            "matching --target or prepare/extract the data for this one"
        )
    in_trainer = kind == "prepared" and cfg.engine == "hf"  # the whole target runs here
    dtype = torch.bfloat16 if device.type == "cuda" and in_trainer else torch.float32
    # From a store (or vLLM engines) only the embedding, final norm and lm_head are used: the decoder layers stay on disk.
    load = targets.load_target if in_trainer else targets.load_target_head
    target = load(target_path, dtype=dtype, device=device, trust_remote_code=cfg.trust_remote_code)
    lengths = np.asarray(dataset.lengths, dtype=np.int64)
    if cfg.max_samples is not None:
        sample_ids, lengths = sample_ids[: cfg.max_samples], lengths[: cfg.max_samples]
    return Source(dataset, kind, identity, target_path, target, aux, sample_ids, lengths, total)


def split(source: Source, cfg: TrainConfig) -> tuple[list[int], list[int]]:
    """(training, held-out) dataset indices: the prepared set's split_indices(n, eval_fraction, split_seed)."""
    _, held = split_indices(source.num_prepared, cfg.eval_fraction, cfg.split_seed)
    held_out = np.isin(source.sample_ids, np.asarray(held, dtype=np.int64))
    return np.flatnonzero(~held_out).tolist(), np.flatnonzero(held_out).tolist()


def initial_draft(cfg: TrainConfig, s: Source, train_ids: list[int]) -> tuple[Draft, DraftSpec, float]:
    """(draft, its spec, draft-vocab coverage of the training split): a fresh draft of --method (its vocabulary counted
    on the training split), or the one --init-from names (its own vocabulary), made a draft of --method
    (`DraftMethod.adopt`: e.g. an EAGLE-3 draft gains P-EAGLE's mask_hidden)."""
    counts = token_counts(s.dataset, train_ids, s.identity.vocab_size)
    if int(counts.sum()) == 0:
        raise DraftsmithError(
            f"{cfg.data}: no loss-masked (assistant) tokens in the training split; nothing to train on"
        )
    assert cfg.num_layers is not None  # TrainConfig's validator sets the method's default
    wanted = method(cfg.method.name)
    wanted.check_run(cfg)
    target_config = targets.read_config(s.target_path)
    if cfg.init_from is None:
        draft, spec, coverage = wanted.fresh_draft(cfg, target_config, s.target, counts, s.aux_layer_ids)
        return (*wanted.adopt(draft, spec, cfg, target_config), coverage)
    where = f"--init-from {cfg.init_from}"
    if not Path(cfg.init_from).exists():
        raise DraftsmithError(f"{where}: does not exist; pass an exported draft directory or a training checkpoint")
    source = load_draft(cfg.init_from)
    require_draft_for_target(source, s.identity, s.target_path, where, "start from a draft for this target")
    recorded = method_of(source.spec)
    if not wanted.starts_from(recorded):
        raise DraftsmithError(
            f"{where}: {'an' if recorded.kind[0] in 'AEIOU' else 'a'} {recorded.kind} draft cannot start a --method "
            f"{cfg.method.name} run (the architectures differ); start a fresh draft or from a draft of "
            f"{' / '.join(m.kind for m in all_methods() if wanted.starts_from(m))}"
        )
    if sorted(source.spec.aux_layer_ids) != s.aux_layer_ids:
        fix = (
            "extract a store with those layers"
            if s.kind == "store"
            else f"pass --aux-layer-ids {','.join(map(str, source.spec.aux_layer_ids))}"
        )
        raise DraftsmithError(
            f"{where}: the draft fuses aux layers {source.spec.aux_layer_ids}, the training data "
            f"gives {s.aux_layer_ids}; {fix}"
        )
    if source.spec.num_hidden_layers != cfg.num_layers:
        raise DraftsmithError(
            f"{where}: the draft has {source.spec.num_hidden_layers} decoder layer(s), --num-layers "
            f"asks for {cfg.num_layers}; drop the option or start from a matching draft"
        )
    draft = draft_module(source, targets.embed_tokens(s.target).weight, targets.lm_head(s.target).weight)
    coverage = float(counts[draft.draft_to_target.numpy()].sum() / max(int(counts.sum()), 1))
    return (*wanted.adopt(draft, source.spec, cfg, target_config), coverage)


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


def make_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over two parameter groups: matrices decay, norm weights (and any bias: 1-d parameters) do not.
    Fused (one kernel for every parameter) on CUDA and on CPU (3x faster there than the per-tensor loop: 20 ->
    6.5 ms a step of the benchmark's draft)."""
    decay: list[nn.Parameter] = []
    plain: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else plain).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=device.type in ("cuda", "cpu") or None)


def regroup(saved: dict, optimizer: torch.optim.Optimizer, model: nn.Module) -> dict:
    """An optimizer state saved with one parameter group (draftsmith 0.1: every trainable parameter in model order)
    renumbered for this optimizer's groups; any other state as it is."""
    if len(saved["param_groups"]) != 1 or len(optimizer.param_groups) == 1:
        return saved
    old = saved["param_groups"][0]
    order = {id(p): i for i, p in enumerate(p for p in model.parameters() if p.requires_grad)}  # the old numbering
    groups, state, new_id = [], {}, 0
    for group in optimizer.param_groups:
        ids = []
        for p in group["params"]:
            if order[id(p)] in saved["state"]:
                state[new_id] = saved["state"][order[id(p)]]
            ids.append(new_id)
            new_id += 1
        groups.append({**old, "weight_decay": group["weight_decay"], "params": ids})
    return {"state": state, "param_groups": groups}


def _changed_hyperparameters(saved: dict, cfg: TrainConfig) -> list[str]:
    """What differs key by key, the method's options flat beside its name (as flags and older checkpoints hold them)."""
    saved, now = flat_options(saved), flat_options(cfg.model_dump(mode="json"))
    # An option added after the checkpoint was written is not a change.
    return [
        f"{k}: {saved[k]!r} -> {now[k]!r}"
        for k in now
        if k not in RESUMABLE_CHANGES and k in saved and saved[k] != now[k]
    ]


def find_resume(
    cfg: TrainConfig, s: Source, info: distributed.DistInfo
) -> tuple[Path, artefact.CheckpointManifest] | tuple[None, None]:
    """(checkpoint, its manifest) to resume from, or (None, None); refuses to overwrite a run without --resume /
    --force, and a resume with other hyper-parameters without --force. Nothing is written before this."""
    out = Path(cfg.output)
    latest = artefact.latest_checkpoint(out)
    if latest is None:
        return None, None
    if not cfg.resume and not cfg.force:
        raise DraftsmithError(
            f"{out}: already holds a training run; use --resume to continue it, --force to "
            "start over, or another --output"
        )
    if not cfg.resume:
        return None, None
    manifest = read_manifest(latest, artefact.CheckpointManifest)
    changed = _changed_hyperparameters(manifest.hyperparameters, cfg)
    if changed and not cfg.force:
        raise DraftsmithError(
            f"{latest}: was trained with other hyper-parameters ({'; '.join(changed)}); "
            "resume with the same ones, pass --force to continue anyway, or use another --output"
        )
    if changed and info.is_main:
        warnings.warn(f"resuming {latest} with changed hyper-parameters: {'; '.join(changed)}", stacklevel=1)
    if manifest.target.mismatch(s.identity) or manifest.draft.aux_layer_ids != s.aux_layer_ids:
        raise DraftsmithError(f"{latest}: was trained for another target or aux layers; use another --output")
    return latest, manifest


def plan_steps(cfg: TrainConfig, sampler: TokenBudgetSampler, n_train: int, world: int) -> tuple[int, int | None]:
    """(total optimizer steps, epochs or None when --max-steps decides)."""
    if sampler.steps_in(0, cfg.grad_accum) == 0:
        raise DraftsmithError(
            f"{cfg.data}: too little training data for one optimizer step per process "
            f"({n_train} samples, {world} processes, --grad-accum {cfg.grad_accum}); add data "
            "or lower --grad-accum / --eval-fraction"
        )
    if cfg.max_steps is not None:  # --max-steps overrides --epochs
        return cfg.max_steps, None
    return sum(sampler.steps_in(e, cfg.grad_accum) for e in range(cfg.epochs)), cfg.epochs


def feature_source(
    cfg: TrainConfig,
    info: distributed.DistInfo,
    s: Source,
    train_ids: Sequence[int],
    eval_ids: Sequence[int],
    state: RunState,
    total_steps: int,
    epochs: int | None,
) -> FeatureSource:
    """Where the batches' hidden states come from: the store's own (offline), the target in the trainer (online), or
    the vLLM engines through the spool (online, --engine vllm: it plans every rank's chunks, so it gets every rank's
    sampler)."""
    if s.kind != "prepared":
        return FeatureSource()  # the store's own
    if cfg.engine != "vllm":
        return OnlineSource(s.target, s.aux_layer_ids + [s.identity.num_layers])
    ranks = [
        TokenBudgetSampler(train_ids, s.lengths, cfg.token_budget, cfg.seed, r, info.world_size)
        for r in range(info.world_size)
    ]
    return EngineSource.open(
        cfg,
        info,
        ranks,
        eval_ids,
        s.lengths,
        s.aux_layer_ids,
        s.identity.num_layers,
        s.identity.hidden_size,
        (state.step, state.epoch, state.position),
        total_steps,
        epochs,
    )


def train_sampler(
    cfg: TrainConfig, s: Source, train_ids: Sequence[int], info: distributed.DistInfo, sampling: Sampling
) -> TokenBudgetSampler:
    """The training batches: tree-packed (packing.py) from a store whose samples share prefixes, right-padded samples
    otherwise (and online: the target, or vLLM's engines, compute each batch's samples)."""
    budget = (cfg.token_budget, cfg.seed, info.rank, info.world_size)
    if s.kind == "store":
        parent, shared = s.dataset.prefixes()  # type: ignore[union-attr]  # a store (or its LayerSubset)
        if bool((parent >= 0).any()):
            keep = packing.margin(sampling.draw, cfg.method.depths)
            return packing.TreeSampler(train_ids, s.lengths, (parent, shared), keep, *budget)
    return TokenBudgetSampler(train_ids, s.lengths, *budget)


def build(cfg: TrainConfig, info: distributed.DistInfo) -> Run:
    """Everything the loop needs, resumed from the latest checkpoint of --output when there is one."""
    device = info.device
    torch.manual_seed(cfg.seed)
    s = open_data(cfg, device)
    train_ids, eval_ids = split(s, cfg)
    draft, spec, coverage = initial_draft(cfg, s, train_ids)
    sampling = Sampling(method_of(spec).sampling(cfg))
    train = train_sampler(cfg, s, train_ids, info, sampling)
    evaluation = (
        TokenBudgetSampler(eval_ids, s.lengths, cfg.token_budget, cfg.seed, info.rank, info.world_size, shuffle=False)
        if len(eval_ids) >= info.world_size
        else None
    )
    total_steps, epochs = plan_steps(cfg, train, len(train_ids), info.world_size)
    latest, manifest = find_resume(cfg, s, info)
    saved, state = None, RunState()
    if latest is not None:
        draft.load_draft_tensors(artefact.read_weights(latest, manifest))  # type: ignore[arg-type]  # set with latest
        saved = checkpoint.load_training_state(latest)
        state = checkpoint.run_state(saved)
        state.last_eval = state.last_eval or dict(manifest.metrics)  # type: ignore[union-attr]  # set with latest
    draft = draft.to(device)
    if cfg.compile:  # each decoder layer's forward (the TTT attention's CUDA kernels are compiled either way)
        for layer in draft.layers:
            layer.compile(dynamic=True)
    compute = autocast_dtype(device, cfg.precision)
    head = TargetHead(targets.final_norm(s.target), targets.lm_head(s.target).weight, draft.draft_to_target, compute)
    info.strategy = distributed.choose_strategy(cfg.distributed, draft, spec.draft_vocab_size)
    gathered = compute if device.type == "cuda" else None  # FSDP2's param dtype
    model = distributed.wrap(TTTModel(draft, cfg.attention_kernel), info, gathered)
    optimizer = make_optimizer(model, cfg, device)
    if saved is not None:
        opt_state = saved["optimizer"] if info.strategy == "fsdp2" else regroup(saved["optimizer"], optimizer, model)
        distributed.load_optimizer_state(model, optimizer, opt_state, info)
        checkpoint.restore_rng(checkpoint.saved_rng(saved))
    workers = (
        cfg.num_workers if cfg.num_workers is not None else default_num_workers(device, distributed.local_world_size())
    )
    features = feature_source(
        cfg, info, s, train_ids, eval_ids if evaluation is not None else [], state, total_steps, epochs
    )
    data = TrainData(
        s.dataset, train, evaluation, cfg.method.depths, cfg.grad_accum, device, workers, features, sampling
    )
    base = dict(
        target=s.identity,
        draft=spec,
        draft_vocab_coverage=coverage,
        data=str(Path(cfg.data).resolve()),
        data_kind=s.kind,
        eval_fraction=cfg.eval_fraction,
        split_seed=cfg.split_seed,
        hyperparameters=cfg.model_dump(mode="json"),
    )
    dtype = torch.bfloat16 if compute is not None else torch.float32
    return Run(
        cfg,
        info,
        data,
        head,
        model,
        optimizer,
        [p for p in model.parameters() if p.requires_grad],
        total_steps,
        epochs,
        base,
        coverage,
        s.kind,
        state,
        latest,
        dtype,
    )


def autocast_dtype(device: torch.device, precision: str) -> torch.dtype | None:
    """bf16 autocast with --precision bf16, and with auto on a GPU or a CPU that computes bf16 natively
    (core.hardware); none (fp32) otherwise."""
    if precision == "auto":
        return torch.bfloat16 if devices.auto_dtype(device) == torch.bfloat16 else None
    return torch.bfloat16 if precision == "bf16" else None


def resolved_precision(device: torch.device, precision: str) -> str:
    """What --precision means on this device ("bf16" / "fp32"), for config.yaml and the one line train prints."""
    return "bf16" if autocast_dtype(device, precision) is not None else "fp32"


def precision_note(device: torch.device, precision: str) -> str:
    resolved = resolved_precision(device, precision)
    if precision != "auto":
        return f"train: {resolved} (--precision {precision})"
    where = hardware.cpu_info().describe() if device.type == "cpu" else str(device)
    return f"train: {resolved} (--precision auto on {where})"
