"""Layer ids: the one place that knows what "layer k" of a target means, its defaults and its checks.

The convention is vLLM's (since 0.18), used everywhere in draftsmith -- stores, checkpoints, exports, the CLI:

    0        the embeddings (the input of decoder layer 0)
    k        the output of decoder layer k-1: the residual stream `hidden + residual`, before the final norm
    N        the last decoder layer's output, un-normalised (N = num_hidden_layers)

transformers' `output_hidden_states[k]` is the same tensor for k < N; its entry N has gone through the final norm,
so id N is taken from the last decoder layer's output instead (core/capture.py, evaluate/specdec.py). A store keeps
the aux ids (ascending) and then N, so the trainer can rebuild the target's distribution through its final norm and
lm_head; a draft fuses the aux ids in that order. SGLang numbers layers one lower (its id k = output of layer k).

Which ids a served draft may read depends on how the serving engine takes the target's aux states
(`check_servable_layer_ids`): vLLM runs every multi-head latent attention model (DeepSeek-V2/V3, Kimi-K2,
Kimi-K2.5's language model) through one decoder stack that takes them before each layer, so id 0 is not among them.
"""

from __future__ import annotations

from collections.abc import Sequence

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.target_config import text_config


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's usual low / middle / high taps, in vLLM's convention."""
    return [2, num_layers // 2, num_layers - 3]


def dflash_aux_layer_ids(num_layers: int, count: int = 5) -> list[int]:
    """A DFlash draft's target layers, spread as the reference DFlash drafts spread them: `count` outputs of decoder
    layers 1 .. N-3 evenly (one: the middle layer's), in vLLM's convention (the reference's `target_layer_ids` + 1;
    Qwen3-8B, 36 layers: target layers 1, 9, 17, 25, 33 = ids 2, 10, 18, 26, 34). On a shallow target the spread
    collides: each id is kept once."""
    if count == 1:
        return [num_layers // 2 + 1]
    start, end = 1, max(num_layers - 3, 1)
    return sorted({int(round(start + i * (end - start) / (count - 1))) + 1 for i in range(count)})


def check_layer_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    bad = [i for i in layer_ids if not 0 <= i <= num_layers]
    if bad:
        raise DraftsmithError(f"aux layer ids {bad} out of range: the target has layer ids 0..{num_layers}")
    if len(set(layer_ids)) != len(layer_ids):
        raise DraftsmithError(f"aux layer ids {layer_ids} contain duplicates")
    return sorted(layer_ids)


def reaches_embeddings_when_served(config: dict) -> bool:
    """Whether vLLM's EAGLE-3 path can hand a draft aux id 0 (the embeddings) of this target (its config.json).

    Not for multi-head latent attention targets (a `kv_lora_rank` in the text config): vLLM serves them all through
    its DeepSeek-V2 decoder stack, which appends `hidden_states + residual` before each layer it is asked for and
    has no residual yet before layer 0 (it would compute `hidden_states + None`). tests/test_vllm_probe.py checks
    this rule against what the probe reads in the installed vLLM's source for every tested family.
    """
    return "kv_lora_rank" not in text_config(config)


def check_servable_layer_ids(layer_ids: Sequence[int], config: dict, where: str) -> None:
    """Refuse, in one line, aux layer ids a draft for this target (its config.json) could not be served with."""
    if 0 in layer_ids and not reaches_embeddings_when_served(config):
        num_layers = int(text_config(config).get("num_hidden_layers") or 0)
        architecture = (config.get("architectures") or ["this target"])[0]
        defaults = sorted({i for i in default_aux_layer_ids(num_layers) if 0 < i < num_layers})
        raise DraftsmithError(
            f"{where}: aux layer ids {sorted(layer_ids)} include 0 (the embeddings), which vLLM cannot hand an "
            f"EAGLE-3 draft of {architecture} (multi-head latent attention: its aux states are taken before each "
            f"decoder layer, none before layer 0); use ids 1..{num_layers}, e.g. the defaults "
            f"{','.join(map(str, defaults))} (--aux-layer-ids, or a store extracted with them)"
        )


def resolve_layer_ids(aux_layer_ids: Sequence[int] | None, num_layers: int) -> list[int]:
    """The store's layer ids: the aux ids (default 2, N//2, N-3) sorted, then N."""
    if aux_layer_ids:
        aux = check_layer_ids([int(i) for i in aux_layer_ids], num_layers)
    else:  # on a very shallow target the defaults collide (N=4: 2, 2, 1): keep each once
        aux = check_layer_ids(sorted({i for i in default_aux_layer_ids(num_layers) if 0 <= i < num_layers}), num_layers)
    if num_layers in aux:
        raise DraftsmithError(
            f"aux layer ids {aux}: leave out {num_layers} (the last layer); the store always keeps it"
        )
    return aux + [num_layers]
