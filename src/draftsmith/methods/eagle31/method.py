"""Eagle 3.1: EAGLE-3 with a norm on each captured layer before fc, and the normed output fed back as the next step's
hidden state.

The module is EAGLE-3's (`methods.eagle3.modeling.Eagle3Draft`) built from a spec with `fc_norm` (one RMSNorm per aux layer,
`fc_norm.{i}.weight`, over the target's hidden size: each layer's states reach fc at one scale, whatever the depth
they come from) and `norm_output` (step k + 1 reads norm(h) of step k, the state the lm_head reads, instead of the
pre-norm h). Training, the reference decoder and vLLM run it as EAGLE-3: vLLM serves it as method "eagle3", its
Eagle-3 Llama draft reading `fc_norm` and `norm_output` from config.json (vLLM 0.22 on; evaluate and serve refuse an
older one in one line: the probe's "Eagle 3.1 drafts" row); speculators' eagle3 type carries the same two flags.
An EAGLE-3 (or Eagle 3.1) draft can start a run: its weights are kept, fc_norm starts at ones.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from draftsmith.core.errors import DraftsmithError
from draftsmith.methods.base import RunOptions
from draftsmith.methods.eagle3.method import Eagle3
from draftsmith.methods.eagle3.modeling import Eagle3Draft
from draftsmith.methods.eagle31 import NEEDS, Eagle31Options
from draftsmith.methods.spec import DraftSpec

FLAGS = ("fc_norm", "norm_output")  # vLLM's config.json keys, and DraftSpec's fields


class Eagle31(Eagle3[Eagle31Options]):
    name = "eagle3.1"
    kind = "Eagle 3.1"
    refusals = {
        "sglang": "SGLang's EAGLE-3 draft has no fc_norm / norm_output, so it cannot serve this Eagle 3.1 draft; "
        "export as vllm or speculators"
    }
    vllm_needs = NEEDS

    def spec_fields(self, target_config: dict) -> dict[str, object]:
        return {**super().spec_fields(target_config), **dict.fromkeys(FLAGS, True)}

    def extra_weights(self, draft: Eagle3Draft, cfg: RunOptions[Eagle31Options]) -> dict[str, torch.Tensor]:
        """fc_norm at ones: an EAGLE-3 draft starts out reading its layers normed."""
        return {name: torch.ones_like(t) for name, t in draft.state_dict().items() if name.startswith("fc_norm.")}

    def vllm_extra(self, spec: DraftSpec) -> dict[str, object]:
        return {flag: True for flag in FLAGS}

    def speculators_extra(self, spec: DraftSpec) -> dict[str, object]:
        return {flag: True for flag in FLAGS}  # vLLM's eagle3 reader (speculators/algos.py) copies both

    def claims(self, config: Mapping[str, object], where: str) -> bool:
        return any(bool(config.get(flag)) for flag in FLAGS)

    def spec_from_config(
        self, spec: DraftSpec, config: Mapping[str, object], tensors: dict[str, torch.Tensor], where: str
    ) -> DraftSpec:
        """vLLM reads the two flags apart; draftsmith trains them together and refuses one without the other."""
        missing = [flag for flag in FLAGS if not config.get(flag)]
        if missing:
            raise DraftsmithError(
                f"{where}: sets {' and '.join(f for f in FLAGS if f not in missing)} but not {missing[0]}; an Eagle 3.1 "
                "draft has both (vLLM reads each on its own): export the draft again from its training run"
            )
        return super().spec_from_config(spec, config, tensors, where).model_copy(update=dict.fromkeys(FLAGS, True))

    def describe_run(self, cfg: RunOptions[Eagle31Options]) -> str:
        return f"Eagle 3.1 (EAGLE-3 with fc_norm and norm_output), {cfg.method.depths} TTT steps"


EAGLE31 = Eagle31()
