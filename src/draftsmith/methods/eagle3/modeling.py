"""The EAGLE-3 draft model (vLLM `Eagle3LlamaForCausalLM` compatible weights); Eagle 3.1 and P-EAGLE drafts are
this module built from their specs.

    features  = fc(cat(aux_1, aux_2, aux_3))                 # [B, T, 3H] -> [B, T, H], step 0 only
    layer 0   : x = cat(input_layernorm(embed(ids)), hidden_norm(h))   # [B, T, 2H] into q/k/v
                h = h + attn(x); h = h + mlp(post_attention_layernorm(h))
    layer i>0 : a plain pre-norm Llama layer over h
    logits    = lm_head(norm(h))                             # draft vocabulary; h (pre-norm) feeds the next step

vLLM's loader maps the `midlayer.` of its files to `layers.0.` (methods/layers.py has the names every draft shares).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from draftsmith.core import targets
from draftsmith.methods.attention import KVCache
from draftsmith.methods.layers import MLP, Attention, DraftModule, RMSNorm, RotaryEmbedding
from draftsmith.methods.spec import DraftSpec


class DecoderLayer(nn.Module):
    """Layer 0 reads cat(input_layernorm(embed), hidden_norm(h)) (2H) with residual h; later layers are plain Llama."""

    def __init__(self, spec: DraftSpec, layer_idx: int):
        super().__init__()
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.layer_idx = layer_idx
        self.first = first = layer_idx == 0
        self.input_layernorm = RMSNorm(h, eps)
        if first:
            self.hidden_norm = RMSNorm(h, eps)
        self.self_attn = Attention(spec, 2 * h if first else h)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(spec)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        mode: str,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """rows (training): the positions (of [B*T]) anything downstream reads; the MLP, position-wise, runs on those
        alone and the others keep the attention's output (nothing reads them)."""
        if self.first:
            x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)  # [B, T, 2H]
        else:
            x = self.input_layernorm(hidden)
        hidden = hidden + self.self_attn(x, cos, sin, cache, self.layer_idx, mode)
        if rows is None:
            return hidden + self.mlp(self.post_attention_layernorm(hidden))
        flat = hidden.flatten(0, 1)
        update = self.mlp(self.post_attention_layernorm(flat.index_select(0, rows)))
        return flat.index_add(0, rows, update).view_as(hidden)


def ttt_layer_call(
    layer: DecoderLayer,
    *inputs: *tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, KVCache, str],
    checkpointed: bool = False,
) -> torch.Tensor:
    """`layer(*inputs)` (embeds, hidden, cos, sin, cache, mode), optionally under activation checkpointing.

    Checkpointed, the layer's activations (projections, attention, MLP) are dropped after the forward and
    recomputed during the backward; only its inputs, its output and the (k, v) it appends to the cache are kept.
    The layer appends to its layer's entries in `cache`, a side effect a recomputation must not repeat, so the
    checkpointed call runs on a private cache holding this layer's earlier entries (the same tensors) and the
    new (k, v) is appended to the real cache afterwards. Only for modes whose cache grows by one entry per call
    ("ttt", "naive"); without grad there is nothing to save, so the call is plain.
    """
    if not (checkpointed and torch.is_grad_enabled()):
        return layer(*inputs)
    embeds, hidden, cos, sin, cache, mode = inputs
    if mode not in ("ttt", "naive"):
        raise ValueError(f"checkpointing a layer call needs a TTT cache (one entry per call), not mode {mode!r}")
    idx = layer.layer_idx
    earlier = [x for kv in cache.entries(idx) for x in kv]  # flat (k_0, v_0, k_1, v_1, ...)

    def run(
        embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *flat: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        private = cache.fork(idx, [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)])
        out = layer(embeds, hidden, cos, sin, private, mode)
        k, v = private.entries(idx)[-1]
        return out, k, v

    out, k, v = checkpoint(run, embeds, hidden, cos, sin, *earlier, use_reentrant=False)
    cache.append(idx, k, v)
    return out


class Eagle3Draft(DraftModule):
    def __init__(self, spec: DraftSpec):
        super().__init__(spec)
        h = spec.hidden_size
        if spec.fc_norm:  # Eagle 3.1: each captured layer's states normed before fc
            self.fc_norm = nn.ModuleList(
                RMSNorm(spec.target_hidden_size, spec.rms_norm_eps) for _ in spec.aux_layer_ids
            )
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_hidden_layers))
        self.norm = RMSNorm(h, spec.rms_norm_eps)
        self.lm_head = nn.Linear(h, spec.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(spec)
        if spec.mask_token_id is not None:  # P-EAGLE: the aux features every parallel slot reads (vLLM's mask_hidden)
            self.mask_hidden = nn.Parameter(torch.zeros(1, len(spec.aux_layer_ids) * spec.target_hidden_size))
        # d2t[i] = target_id(i) - i (what vLLM reads); t2d: which target ids are in the draft vocabulary. Over the
        # target's whole vocabulary both are the identity and not saved: vLLM's Eagle-3 model then has no d2t and
        # refuses one in the weights.
        whole = spec.draft_vocab_size == spec.vocab_size
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.int64), persistent=not whole)
        self.register_buffer("t2d", torch.full((spec.vocab_size,), whole, dtype=torch.bool), persistent=not whole)

    @classmethod
    def from_target(
        cls,
        spec: DraftSpec,
        target: nn.Module,
        draft_to_target: torch.Tensor,
        lm_head_init: str = "target",
        seed: int = 0,
    ) -> Eagle3Draft:
        """A fresh draft: frozen embedding copied from the target, lm_head from the target's draft-vocab rows."""
        draft = cls(spec)
        draft.init_weights(seed)
        draft.set_draft_vocab(draft_to_target)
        draft.set_target(targets.embed_tokens(target).weight)
        if lm_head_init == "target":
            draft.head_from_target(targets.lm_head(target).weight)
        return draft

    def set_target(self, embed_weight: torch.Tensor, head_weight: torch.Tensor | None = None) -> None:
        """The target's embedding (frozen, never saved); the head is the draft's own (its lm_head)."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed_weight)

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, num_aux * H_target] (aux layers concatenated in id order) -> [B, T, H]; Eagle 3.1 norms each
        layer's chunk first (vLLM's combine_hidden_states)."""
        if self.spec.fc_norm:
            chunks = aux_hidden.chunk(len(self.fc_norm), dim=-1)
            aux_hidden = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=False)], dim=-1)
        return self.fc(aux_hidden)

    def feedback(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the next step reads of this step's pre-norm output [..., H]: itself, or (Eagle 3.1, norm_output)
        the normed output the lm_head reads (vLLM's aux_output)."""
        return self.norm(hidden).to(hidden.dtype) if self.spec.norm_output else hidden

    def mask_features(self) -> torch.Tensor:
        """P-EAGLE: fc(mask_hidden) [1, H], the fused features of every parallel slot (vLLM fuses it the same way)."""
        return self.fuse(self.mask_hidden)

    def forward_hidden(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache | None = None,
        *,
        checkpointed: bool = False,
        rows: list[torch.Tensor | None] | None = None,
        mode: str = "decode",
    ) -> torch.Tensor:
        """One draft step up to the pre-norm hidden state [B, T, H] (what the next step reads). input_ids [B, T],
        hidden [B, T, H] (fused features or the previous step's output).

        cache: `KVCache(num_layers)` kept across calls (None: a fresh one). mode "ttt" (training), "naive" (the
        explicit-mask reference) or "decode" (the K/V cache grows along the sequence). checkpointed (training
        modes): each layer's activations are recomputed in the backward instead of kept (`ttt_layer_call`).
        rows (training, not checkpointed): per layer, the positions whose output is read downstream, or None.
        """
        if cache is None:
            cache = KVCache(len(self.layers))
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rotary(position_ids, hidden.dtype)
        for i, layer in enumerate(self.layers):
            if rows is not None and rows[i] is not None and not checkpointed:
                hidden = layer(embeds, hidden, cos, sin, cache, mode, rows[i])
            else:
                hidden = ttt_layer_call(layer, embeds, hidden, cos, sin, cache, mode, checkpointed=checkpointed)  # type: ignore[arg-type]  # self.layers holds DecoderLayers (a ModuleList yields Module)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [..., H] -> logits over the draft vocabulary [..., Vd]."""
        return self.lm_head(self.norm(hidden))

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache | None = None,
        mode: str = "decode",
        logits_to_keep: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step: (logits over the draft vocabulary [B, T, Vd], the hidden state [B, T, H] the next step
        reads: `feedback` of the pre-norm output). logits_to_keep > 0: logits of the last that many positions only
        (as in transformers)."""
        hidden = self.forward_hidden(input_ids, hidden, position_ids, cache, mode=mode)
        return self.logits(hidden[:, -logits_to_keep:]), self.feedback(hidden)
