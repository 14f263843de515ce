"""EAGLE-3: the draft proposes one token per forward, each step reading its own previous output (training-time test).

The module is `Eagle3Draft` (methods/eagle3/modeling.py; vLLM's `Eagle3LlamaForCausalLM` weights); training unrolls
`ttt_steps` steps (`train.unrolled.ttt_hidden_states`, every step scored); a reference-decoder round is k forwards;
vLLM serves it as speculative method "eagle3" (`LlamaForCausalLMEagle3` in vLLM's and SGLang's files, `Eagle3Speculator` in speculators').
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Generic, TypeVar

import numpy as np
import torch
from torch import nn

from draftsmith.core.errors import DraftsmithError
from draftsmith.methods.base import (
    Choose,
    Draft,
    DraftMethod,
    ExportContext,
    Runner,
    RunOptions,
    llama_config,
    speculators_file,
)
from draftsmith.methods.eagle3 import Eagle3Options
from draftsmith.methods.eagle3.modeling import Eagle3Draft
from draftsmith.methods.spec import DraftSpec
from draftsmith.methods.vocab import build_draft_vocab

VLLM_ARCHITECTURE = "LlamaForCausalLMEagle3"
EagleOptionsT = TypeVar("EagleOptionsT", bound=Eagle3Options)  # Eagle 3.1's and P-EAGLE's extend EAGLE-3's
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"


class Eagle3(DraftMethod[Eagle3Draft, EagleOptionsT], Generic[EagleOptionsT]):
    name = "eagle3"
    kind = "EAGLE-3"
    module = Eagle3Draft
    speculators_type = "eagle3"
    speculators_architecture = SPECULATORS_ARCHITECTURE

    # -- training

    def fresh_draft(
        self,
        cfg: RunOptions[EagleOptionsT],
        target_config: dict,
        target: nn.Module,
        counts: np.ndarray,
        aux_layer_ids: list[int],
    ) -> tuple[Eagle3Draft, DraftSpec, float]:
        """A fresh EAGLE-3 draft (`adopt` makes it this method's): the draft vocabulary the most frequent of the
        loss-masked `counts`, the lm_head from the target's rows of it (--lm-head-init target)."""
        assert cfg.num_layers is not None  # TrainConfig's validator sets the method's default
        size = cfg.method.draft_vocab_size
        vocab = build_draft_vocab(counts, min(size, len(counts)))
        spec = DraftSpec.from_target_config(target_config, size, cfg.num_layers, aux_layer_ids)
        draft = Eagle3Draft.from_target(spec, target, vocab.draft_to_target, cfg.lm_head_init, cfg.seed)
        return draft, spec, vocab.coverage

    def adopt(
        self, draft: Draft, spec: DraftSpec, cfg: RunOptions[EagleOptionsT], target_config: dict
    ) -> tuple[Draft, DraftSpec]:
        """An EAGLE-family draft as this method's (e.g. --init-from a P-EAGLE draft): the method recorded, its
        extra weights dropped and this method's added (`extra_weights`), the others kept."""
        if spec.method == self.name:
            return draft, spec
        spec = spec.model_copy(update={"method": self.name, **self.spec_fields(target_config)})
        new = Eagle3Draft(spec)
        tensors = {k: v for k, v in draft.state_dict().items() if k in new.state_dict()}
        tensors.update(self.extra_weights(new, cfg))
        new.load_state_dict(tensors, strict=True)
        return new, spec

    def spec_fields(self, target_config: dict) -> dict[str, object]:
        """The DraftSpec fields that make an EAGLE-family spec this method's (EAGLE-3: no mask token, no norms of
        Eagle 3.1)."""
        return {"mask_token_id": None, "fc_norm": False, "norm_output": False}

    def extra_weights(self, draft: Eagle3Draft, cfg: RunOptions[EagleOptionsT]) -> dict[str, torch.Tensor]:
        """Initial values of the weights this method adds to an EAGLE-3 draft."""
        return {}

    # -- the reference decoder

    def propose(
        self, runner: Runner[Eagle3Draft], ids: torch.Tensor, features: torch.Tensor, last: int, k: int, choose: Choose
    ) -> list[int]:
        """k forwards: the pending positions, then each proposal read back with the draft's own hidden state."""
        logits, hidden = runner.step(ids, features)
        chain: list[int] = []
        for i in range(k):
            chain.append(choose(logits))
            if i < k - 1:
                logits, hidden = runner.step(torch.tensor([chain[-1]], device=ids.device), hidden[None])
        return chain

    # -- export and serving

    def check_export(self, spec: DraftSpec, fmt: str) -> None:
        super().check_export(spec, fmt)
        if fmt == "sglang" and spec.num_hidden_layers != 1:
            raise DraftsmithError(
                f"format sglang: SGLang's EAGLE-3 draft has exactly one decoder layer, this draft has "
                f"{spec.num_hidden_layers}; export as vllm or speculators"
            )
        if fmt == "sglang" and 0 in spec.aux_layer_ids:
            raise DraftsmithError(
                "format sglang: aux layer id 0 (the embeddings) cannot be expressed in SGLang's "
                "layer-id convention; export as vllm or speculators"
            )

    def export_config(self, spec: DraftSpec, fmt: str, ctx: ExportContext) -> dict[str, object]:
        llama = {**llama_config(spec), **ctx.special_tokens}
        draft = {
            "draft_vocab_size": spec.draft_vocab_size,
            "target_hidden_size": spec.target_hidden_size,
            "norm_before_residual": False,
        }
        if fmt == "speculators":
            aux = {"eagle_aux_hidden_state_layer_ids": list(spec.aux_layer_ids), **self.speculators_extra(spec)}
            layer = {**llama, "torch_dtype": ctx.torch_dtype}
            return speculators_file(self.speculators_architecture, self.speculators_type, ctx, layer, {**draft, **aux})
        config = {"architectures": [VLLM_ARCHITECTURE], **llama, "torch_dtype": ctx.torch_dtype, **draft}
        if fmt == "vllm":
            return {**config, "eagle_aux_hidden_state_layer_ids": list(spec.aux_layer_ids), **self.vllm_extra(spec)}
        # SGLang reads the aux layers from eagle_config and adds 1 to each: its id k is the output of layer k
        config["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in spec.aux_layer_ids],
            "use_aux_hidden_state": True,
        }
        return config

    def vllm_extra(self, spec: DraftSpec) -> dict[str, object]:
        """What this method adds to the vllm format's config.json."""
        return {}

    def speculators_extra(self, spec: DraftSpec) -> dict[str, object]:
        """What this method adds to the speculators format's config.json."""
        return {}

    def claims(self, config: Mapping[str, object], where: str) -> bool:
        return True  # the registry asks it last: every other EAGLE-style config

    def spec_from_config(
        self, spec: DraftSpec, config: Mapping[str, object], tensors: dict[str, torch.Tensor], where: str
    ) -> DraftSpec:
        if "mask_hidden" in tensors:
            raise DraftsmithError(
                f"{where}: names no mask token, so vLLM would serve the draft as EAGLE-3, but its "
                "weights hold a P-EAGLE draft's mask_hidden; put its mask token back (ptd_token_id) "
                "or export the draft again from its training run"
            )
        return spec.model_copy(update={"method": self.name, "mask_token_id": None})


EAGLE3 = Eagle3[Eagle3Options]()
