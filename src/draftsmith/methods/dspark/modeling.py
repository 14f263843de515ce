"""The DSpark draft model (vLLM's `Qwen3DSparkModel`, qwen3_dspark.py; speculators' `DSparkDraftModel`): DFlash's
block drafter, whose block also predicts at its anchor, plus a Markov head and a confidence head.

Reads top to bottom: the Markov head -> the confidence head -> the draft. The backbone (context, layers, norm, the
target's embedding and lm_head) is `DFlashDraft`'s, unchanged.

    block    = [x_p, mask x (S-1)] at positions p .. p+S-1          # S = block_size rows, x_p the last verified token
    h        = DFlashDraft's backbone over the block and the context  # [S, H], one forward
    logits_k = lm_head(norm(h_k)) + markov_w2(markov_w1[prev_k])    # [V]: slot k proposes x_{p+k+1}
    conf_k   = proj(cat(norm(h_k), markov_w1[prev_k]))              # the logit of slot k's acceptance probability
    prev_k   = x_p for k = 0; then the token slot k-1 proposed (decoding) or x_{p+k} (training, teacher forcing)

The layout is `sample_from_anchor` (speculators' DSpark default; vLLM's DSparkSpeculator with `sample_from_anchor:
true`, which it defaults to): every block row is a prediction, the anchor's included, so a round of S rows drafts S
tokens (vLLM's num_speculative_tokens = block_size, its default for the dspark method). DFlash's block has the same rows, but
its anchor row proposes nothing (block_size - 1 tokens). Decoding runs as vLLM's DSparkSpeculator does: one backbone
forward gives every slot's base logits, then the Markov steps run left to right, each adding the bias of the token
the slot before it chose (`markov_steps`); the backbone is not run again.

State-dict names are speculators' and vLLM's (vLLM's loader prefixes `model.`): DFlash's plus
`markov_head.markov_w1.weight` [V, r] (rows by target token id), `markov_head.markov_w2.weight` [V, r],
`confidence_head.proj.weight` [1, H + r] and `confidence_head.proj.bias` [1]. The Markov head is the vanilla one (the
only one vLLM serves) and the confidence head reads the Markov embedding (`confidence_head_with_markov`). The draft
vocabulary is the target's, as DFlash's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.methods.dflash.modeling import DFlashDraft
from draftsmith.methods.spec import DraftSpec

# The confidence loss beside the KL: BCE(confidence logit, the row's expected acceptance sum_v min(p, q), detached),
# weighed per proposal as the KL is; 1.0 as speculators' confidence_head_alpha defaults.
CONFIDENCE_WEIGHT = 1.0
MARKOV_INIT_STD = 0.01  # markov_w1 ~ N(0, 0.01), as speculators initialises it


class MarkovHead(nn.Module):
    """The vanilla low-rank transition bias (vLLM's DSparkMarkovHead): bias = markov_w2(markov_w1[prev])."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)  # rows by target token id
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)  # the draft vocabulary: the target's

    def embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """prev_ids [...] -> the Markov embedding [..., r]."""
        return self.markov_w1(prev_ids)

    def bias(self, embedded: torch.Tensor) -> torch.Tensor:
        """[..., r] -> the logit bias over the vocabulary [..., V]."""
        return self.markov_w2(embedded.to(self.markov_w2.weight.dtype))


class ConfidenceHead(nn.Module):
    """Each slot's acceptance-probability logit from its normed hidden state and its Markov embedding (vLLM's
    DSparkConfidenceHead with_markov)."""

    def __init__(self, hidden_size: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1, bias=True)

    def forward(self, hidden_normed: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """[..., H], [..., r] -> [...] (a logit: sigmoid gives the probability)."""
        x = torch.cat((hidden_normed, embedded.to(hidden_normed.dtype)), dim=-1)
        return self.proj(x.to(self.proj.weight.dtype)).squeeze(-1)


class DSparkDraft(DFlashDraft):
    """A DSpark draft: DFlashDraft's backbone, every block row a prediction, the Markov and confidence heads."""

    def __init__(self, spec: DraftSpec):
        super().__init__(spec)
        if spec.markov_rank is None:
            raise ValueError("DSparkDraft needs a spec with markov_rank")
        self.markov_head = MarkovHead(spec.vocab_size, spec.markov_rank)
        self.confidence_head = ConfidenceHead(spec.hidden_size, spec.markov_rank)

    def init_weights(self, seed: int = 0) -> None:
        """DFlashDraft's init (the heads registered last: the backbone is a fresh DFlash draft's of the same seed),
        then markov_w1 ~ N(0, 0.01)."""
        super().init_weights(seed)
        w1 = self.markov_head.markov_w1.weight
        with torch.no_grad():
            w1.copy_(torch.randn(w1.shape, generator=torch.Generator().manual_seed(seed + 1)) * MARKOV_INIT_STD)

    scores_acceptance: ClassVar[bool] = True
    proposing_rows: ClassVar[slice] = slice(0, None)  # every row, the anchor's included (base logits, no Markov bias)

    def row_terms(self, prev_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The Markov bias as its factors: (markov_w1[prev] [N, r], markov_w2 [V, r])."""
        return self.markov_head.embed(prev_ids), self.markov_head.markov_w2.weight

    def row_loss(
        self, hidden_normed: torch.Tensor, terms: tuple[torch.Tensor, torch.Tensor] | None, accept: torch.Tensor
    ) -> torch.Tensor | None:
        """The confidence loss: BCE(confidence logit, the row's expected acceptance sum_v min(p, q), detached),
        CONFIDENCE_WEIGHT each."""
        assert terms is not None  # row_terms'
        confidence = self.confidence_head(hidden_normed, terms[0]).float()
        return CONFIDENCE_WEIGHT * F.binary_cross_entropy_with_logits(confidence, accept.float(), reduction="none")

    def markov_bias(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """prev_ids [...] (target ids) -> markov_w2(markov_w1[prev]) [..., V]."""
        return self.markov_head.bias(self.markov_head.embed(prev_ids))

    def block_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """The Markov-corrected logits [..., V] of block rows: pre-norm hidden [..., H] and each row's previous token
        [...] (training: x_{p+k} at row k; decoding: the anchor, then each proposal)."""
        logits = self.logits(hidden)
        return logits + self.markov_bias(prev_ids).to(logits.dtype)

    def confidence(self, hidden_normed: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """Each row's acceptance-probability logit [...] from norm(h) [..., H] and its previous token [...]."""
        return self.confidence_head(hidden_normed, self.markov_head.embed(prev_ids))

    def markov_steps(self, base_logits: torch.Tensor, anchor: int, choose: Callable[[torch.Tensor], int]) -> list[int]:
        """The sequential stage of a round (vLLM's _sample_sequential): base logits [S, V] of one backbone forward,
        the anchor's token id -> S proposals (target ids), slot k choosing (`choose`, from its corrected logits [V])
        after the bias of the token slot k-1 chose (slot 0: the anchor's)."""
        proposals: list[int] = []
        prev = anchor
        for row in base_logits:
            bias = self.markov_bias(torch.tensor(prev, device=row.device))
            prev = choose(row + bias.to(row.dtype))
            proposals.append(prev)
        return proposals
