"""Capture a transformers target's hidden states in vLLM's layer-id convention (see core/layers.py).

Used by the hf extraction backend (a store on disk) and by online training (states straight into the trainer).
Forward hooks on exactly the layers asked for copy their outputs into one preallocated [B, T, L, H] tensor; the
LM head never runs, and layers after the deepest one asked for are not run either. Only the text backbone runs
(core/targets.py finds it: model.model of a causal LM, the language model inside a multimodal wrapper).

A transformers decoder layer returns the residual stream after its own residual additions (a tensor, or a tuple
whose first element it is), for every family draftsmith runs -- Llama, Qwen3, Qwen3-MoE, DeepSeek-V3 (MLA + MoE),
Kimi-K2.5's backbone -- so id k is the output of layer k-1 and id N, taken from the last layer's output, is the
un-normalised state (the backbone applies the final norm after it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from draftsmith.core.targets import text_backbone


class _StopForward(Exception):
    """Raised by the hook of the deepest layer needed, when the layers after it are not needed."""


def capture_hidden_states(  # noqa: C901 - one hook per capture point and the three ways a forward can end
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    layer_ids: Sequence[int],
    *,
    dtype: torch.dtype | None = None,
    past_key_values: object | None = None,
) -> torch.Tensor:
    """Hidden states of `layer_ids` (vLLM convention) for a batch: [B, T, L, H] on the model's device.

    `input_ids` [B, T]; `attention_mask` [B, T] (1 = real token) or None for unpadded / right-padded batches;
    `past_key_values`: a transformers cache holding earlier tokens, which the batch follows (and is added to).
    `dtype` is the dtype of the returned tensor (default: the model's). The last layer id N is un-normalised.
    """
    backbone, layers = text_backbone(model)
    num_layers = len(layers)
    bad = [k for k in layer_ids if not 0 <= k <= num_layers]
    if bad:
        raise ValueError(f"layer ids {bad} out of range 0..{num_layers}")
    first = next(model.parameters())
    B, T = input_ids.shape
    H = int(getattr(getattr(backbone, "config", None), "hidden_size", 0) or 0) or None
    out: torch.Tensor | None = None
    deepest = max(layer_ids)

    def store(j: int, hidden: torch.Tensor) -> None:
        nonlocal out
        if out is None:
            out = torch.empty(
                B, T, len(layer_ids), H or hidden.shape[-1], dtype=dtype or hidden.dtype, device=hidden.device
            )
        out[:, :, j].copy_(hidden)

    def pre_hook(j: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            store(j, args[0] if args else kwargs["hidden_states"])

        return hook

    def post_hook(j: int, stop: bool) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
            store(j, output[0] if isinstance(output, (tuple, list)) else output)
            if stop:
                raise _StopForward

        return hook

    handles = []
    try:
        for j, k in enumerate(layer_ids):
            if k == 0:
                handles.append(layers[0].register_forward_pre_hook(pre_hook(j), with_kwargs=True))
            else:
                stop = k == deepest and k < num_layers
                handles.append(layers[k - 1].register_forward_hook(post_hook(j, stop)))
        with torch.no_grad(), contextlib.suppress(_StopForward):
            backbone(
                input_ids=input_ids.to(first.device),
                attention_mask=None if attention_mask is None else attention_mask.to(first.device),
                past_key_values=past_key_values,
                use_cache=past_key_values is not None,
            )
    finally:
        for handle in handles:
            handle.remove()
    assert out is not None
    return out


def forward_only(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
    """The same decoder-stack forward pass with no capture (the benchmark's baseline)."""
    first = next(model.parameters())
    with torch.no_grad():
        text_backbone(model)[0](
            input_ids=input_ids.to(first.device),
            attention_mask=None if attention_mask is None else attention_mask.to(first.device),
            use_cache=False,
        )
