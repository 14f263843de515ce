"""P-EAGLE: EAGLE-3 with parallel drafting -- all k tokens of a round from one draft forward.

The module is EAGLE-3's (`methods.eagle3.modeling.Eagle3Draft`) with one more tensor, `mask_hidden` [1, num_aux * H_target]:
the aux features every parallel slot reads (vLLM's Eagle-3 loader takes a weight of that name and fuses it with fc),
each slot embedding the mask token. Training unrolls the depths with COD sampling (`methods.objective.COD`); a round is one
forward (the pending positions, then k - 1 slots). vLLM serves it as method "eagle3" with `"parallel_drafting":
true` (without it vLLM skips mask_hidden and drafts one token per forward); its config.json names the mask token:
vllm's `ptd_token_id`, speculators' own P-EAGLE type (`mask_token_id`, which vLLM's reader hands on as
pard_token). SGLang has no parallel drafting.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from draftsmith.core.errors import DraftsmithError
from draftsmith.methods.base import Budget, Choose, Runner, RunOptions, int_at_least, mask_token_id, section
from draftsmith.methods.eagle3.method import Eagle3
from draftsmith.methods.eagle3.modeling import Eagle3Draft
from draftsmith.methods.objective import COD, Steps
from draftsmith.methods.peagle import NEEDS, PEagleOptions
from draftsmith.methods.spec import DraftSpec

SPECULATORS_ARCHITECTURE = "PEagleSpeculator"

# The keys that name a P-EAGLE draft's mask token, in the order vLLM reads them from the draft's config
# (vllm/v1/spec_decode/llm_base_proposer.py, `_init_parallel_drafting_params`): mask_token_id unless it is null, then
# pard_token, then ptd_token_id, whenever present. (vLLM reads DFlash's dflash_config.mask_token_id and DSpark's
# dspark_noise_token_id before pard_token: other methods' keys, which no P-EAGLE draft carries.)
MASK_TOKEN_KEYS = ("mask_token_id", "pard_token", "ptd_token_id")


def parallel_drafting_token(config: Mapping[str, object], where: str = "config.json") -> int | None:
    """The one rule for "is this draft P-EAGLE": the mask token a draft directory's config.json names, as vLLM
    reads it; None for any other draft.

    A speculators config is P-EAGLE exactly when its speculators_model_type is "peagle" (vLLM's reader turns that
    type into parallel drafting itself); vLLM reads the token from the config it converts it to: the
    transformer_layer_config, with the top-level mask_token_id as pard_token. Any other config is P-EAGLE when one
    of MASK_TOKEN_KEYS names a token (draftsmith's vllm format writes ptd_token_id), the first in vLLM's order. A
    key vLLM would take that holds no token id is refused in one line; `where` names the file in that message."""
    if config.get("speculators_model_type") is not None:
        if config["speculators_model_type"] != "peagle":
            return None
        if config.get("mask_token_id") is None:
            raise DraftsmithError(
                f"{where}: a speculators P-EAGLE config (speculators_model_type peagle) without "
                "mask_token_id, which vLLM's reader requires; set it to the token the draft's "
                "parallel slots were trained on"
            )
        config = {**section(config, "transformer_layer_config"), "pard_token": config["mask_token_id"]}
    for key in MASK_TOKEN_KEYS:
        if key not in config or (key == "mask_token_id" and config[key] is None):
            continue
        token = config[key]
        if not int_at_least(token, 0):
            raise DraftsmithError(
                f"{where}: {key} {token!r} is not a token id; vLLM's parallel drafting reads this "
                "P-EAGLE draft's mask token from it"
            )
        return token
    return None


class PEagle(Eagle3[PEagleOptions]):
    name = "peagle"
    kind = "P-EAGLE"
    speculators_type = "peagle"
    speculators_architecture = SPECULATORS_ARCHITECTURE
    refusals = {"sglang": "SGLang has no parallel drafting, so it cannot serve this P-EAGLE draft; export as vllm"}
    vllm_needs = NEEDS

    # -- training

    def spec_fields(self, target_config: dict) -> dict[str, object]:
        return {**super().spec_fields(target_config), "mask_token_id": mask_token_id(target_config)}

    def extra_weights(self, draft: Eagle3Draft, cfg: RunOptions[PEagleOptions]) -> dict[str, torch.Tensor]:
        """mask_hidden seeded small normal (--seed), like a fresh draft's weights."""
        gen = torch.Generator().manual_seed(cfg.seed)
        return {"mask_hidden": torch.randn(draft.mask_hidden.shape, generator=gen) * 0.02}

    def check_run(self, cfg: RunOptions[PEagleOptions]) -> None:
        if cfg.method.depths < 2:
            raise DraftsmithError(
                f"--method peagle --ttt-steps {cfg.method.depths}: P-EAGLE trains depth 0 and the parallel "
                "depths after it; pass --ttt-steps 2 or more (the most tokens a round proposes)"
            )

    def sampling(self, cfg: RunOptions[PEagleOptions]) -> Steps:
        return Steps(COD(cfg.method.cod_ratio, cfg.method.cod_floor, cfg.seed))

    def depths_trained(self, cfg: RunOptions[PEagleOptions]) -> int | None:
        return cfg.method.depths

    def quickstart_options(
        self, budget: Budget, ks: Sequence[int], num_target_layers: Callable[[], int]
    ) -> tuple[list[int] | None, dict[str, Any]]:
        """Every evaluated k reaches trained parallel slots (at least 2 depths)."""
        layers, options = super().quickstart_options(budget, ks, num_target_layers)
        return layers, {**options, "ttt_steps": max(budget.ttt_steps, *ks, 2)}

    # -- the reference decoder

    def check_spec(self, spec: DraftSpec) -> None:
        if spec.mask_token_id is None:
            raise DraftsmithError(
                "the draft drafts in parallel (P-EAGLE) but names no mask token: its spec "
                "needs mask_token_id (config.json: ptd_token_id)"
            )

    def propose(
        self, runner: Runner[Eagle3Draft], ids: torch.Tensor, features: torch.Tensor, last: int, k: int, choose: Choose
    ) -> list[int]:
        """One forward: the pending positions, then k - 1 parallel slots (the mask token, fc(mask_hidden)) behind
        them at positions L..L+k-2; proposal d is the output of the d-th of the last k positions."""
        draft = runner.draft
        assert draft.spec.mask_token_id is not None  # check_spec
        mask_ids = torch.full((k - 1,), draft.spec.mask_token_id, dtype=ids.dtype, device=ids.device)
        mask_hidden = draft.mask_features().to(features.dtype).expand(k - 1, -1)
        logits, _ = runner.forward_slots(torch.cat((ids, mask_ids)), torch.cat((features, mask_hidden)), keep=k)
        return [choose(row) for row in logits]

    # -- export and serving

    def check_export(self, spec: DraftSpec, fmt: str) -> None:
        super().check_export(spec, fmt)
        if spec.mask_token_id is None or not 0 <= spec.mask_token_id < spec.vocab_size:
            raise DraftsmithError(
                f"export: the P-EAGLE draft's mask_token_id {spec.mask_token_id} is not a target "
                f"token id (0..{spec.vocab_size - 1}); vLLM's parallel slots embed that token"
            )

    def vllm_extra(self, spec: DraftSpec) -> dict[str, object]:
        return {"ptd_token_id": spec.mask_token_id}  # the token vLLM's parallel drafting embeds in every slot

    def speculators_extra(self, spec: DraftSpec) -> dict[str, object]:
        return {"mask_token_id": spec.mask_token_id}  # vLLM's P-EAGLE reader requires it (its pard_token)

    def claims(self, config: Mapping[str, object], where: str) -> bool:
        return parallel_drafting_token(config, where) is not None

    def spec_from_config(
        self, spec: DraftSpec, config: Mapping[str, object], tensors: dict[str, torch.Tensor], where: str
    ) -> DraftSpec:
        token = parallel_drafting_token(config, where)
        assert token is not None  # the registry asked `claims`
        if "mask_hidden" not in tensors:
            raise DraftsmithError(
                f"{where}: names mask token {token}, so vLLM would serve the draft as P-EAGLE, but its "
                f"weights have no mask_hidden; remove the mask token ({', '.join(MASK_TOKEN_KEYS)}) "
                "or export the draft again from its training run"
            )
        if token >= spec.vocab_size:
            raise DraftsmithError(
                f"{where}: mask token {token} is not a target token id (0..{spec.vocab_size - 1}); "
                "vLLM's parallel slots embed that token"
            )
        return spec.model_copy(update={"method": self.name, "mask_token_id": token})

    def speculative_config(self, draft_dir: str, k: int, config: Mapping[str, object]) -> dict[str, object]:
        return {**super().speculative_config(draft_dir, k, config), "parallel_drafting": True}

    def title(self, spec: DraftSpec) -> str:
        return "P-EAGLE (parallel drafting)"

    def facts(self, spec: DraftSpec) -> dict[str, str]:
        return {"parallel drafting": f"P-EAGLE, mask token {spec.mask_token_id}"}

    def serving_note(self) -> str | None:
        return (
            'Keep `"parallel_drafting": true`: without it vLLM skips the draft\'s `mask_hidden` (the '
            "features of the parallel slots) and drafts one token per forward, which this draft was not "
            "trained for."
        )

    def describe_run(self, cfg: RunOptions[PEagleOptions]) -> str:
        return f"P-EAGLE (all k tokens of a round in one draft forward), {cfg.method.depths} depths trained"


PEAGLE = PEagle()
