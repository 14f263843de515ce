"""The direct strategy: tap the target inside vLLM's model runner, for vLLMs without `extract_hidden_states`.

Installed in the worker through the worker extension (worker.py) once the engine is up:

1. the aux layers are set on the target with its `set_aux_hidden_state_layers` (SupportsEagle3) and the runner is
   told to expect `(hidden_states, aux_hidden_states)` from the model;
2. each step's aux states are read right after the forward pass: from `execute_model_state.aux_hidden_states`
   between `execute_model()` and `sample_tokens()` where the runner is two-phase, from what the runner's
   `_model_forward()` returned where it is one-phase;
3. the batch's rows are cut per request (requests lie back to back, in `input_batch.req_ids` order, each with
   `num_scheduled_tokens[req_id]` rows), chunks of a prefill split over several steps are joined, and a request
   whose whole prompt has been seen goes to the store sink.

Ids vLLM's aux machinery cannot reach for the architecture (the probe reads which: id 0 under the "input"
convention, and N where the stack does not append its last output) are tapped here with forward hooks on the
decoder stack's embedding and last layer (`hidden + residual`, the un-normalised stream). The decoder stack is
found in the vLLM model's module tree (the module holding `embed_tokens` and `layers`; inside a multimodal
wrapper, its language model's).

Which of these applies comes from the probe (layer reach, two-phase), not from a version number. The driver
runs this strategy with the model uncompiled (the taps are set after start-up, when a compiled graph would
already be fixed), async scheduling off, prefix caching off (a cached prefix skips its forward pass), and on the
V1 model runner where vLLM has a switch for it.
"""

from __future__ import annotations

from typing import Any

import torch

from draftsmith.extract.vllm.sink import SAMPLE_ID_KEY, StoreSink


def vllm_aux_ids(layer_ids: list[int], num_layers: int, reaches_embeddings: bool,
                 reaches_last: bool) -> tuple[list[int], list[int]]:
    """Store ids -> (ids vLLM's aux machinery captures, ids draftsmith must tap itself)."""
    own = [k for k in layer_ids if (k == 0 and not reaches_embeddings) or (k == num_layers and not reaches_last)]
    return [k for k in layer_ids if k not in own], own


def decoder_stack(model: Any) -> Any:
    """The vLLM model's decoder stack: the first module (pre-order) with `embed_tokens` and `layers`."""
    for module in model.modules():
        if hasattr(module, "embed_tokens") and hasattr(module, "layers"):
            return module
    raise RuntimeError(f"draftsmith direct: no module with embed_tokens and layers in {type(model).__name__}")


class _Tap:
    def __init__(self, runner: Any, sink: StoreSink, layer_ids: list[int], num_layers: int, reaches_embeddings: bool,
                 reaches_last: bool, two_phase: bool):
        self.runner = runner
        self.sink = sink
        self.layer_ids = list(layer_ids)
        self.two_phase = two_phase
        self.requests: dict[str, tuple[int, list[int], list[torch.Tensor]]] = {}
        self.last_aux: list[torch.Tensor] | None = None
        self.own: dict[int, torch.Tensor] = {}
        model = runner.get_model()
        aux_ids, own_ids = vllm_aux_ids(self.layer_ids, num_layers, reaches_embeddings, reaches_last)
        self.aux_ids, self.own_ids = aux_ids, own_ids
        if aux_ids:
            model.set_aux_hidden_state_layers(tuple(aux_ids))
            runner.use_aux_hidden_state_outputs = True
        for k in own_ids:  # ids vLLM does not reach: the embeddings and / or the last layer's output
            self._hook(model, k, num_layers)

    def _hook(self, model: Any, k: int, num_layers: int) -> None:
        inner = decoder_stack(model)
        if k == 0:
            inner.embed_tokens.register_forward_hook(lambda m, a, out: self.own.__setitem__(0, out))
        else:
            def last(m, a, out):  # decoder layers return (hidden, residual): the stream is their sum
                self.own[k] = out[0] + out[1] if isinstance(out, tuple) and out[1] is not None else (
                    out[0] if isinstance(out, tuple) else out)
            inner.layers[num_layers - 1].register_forward_hook(last)

    # --------------------------------------------------------------------- per step
    def states_of_step(self) -> list[torch.Tensor] | None:
        """The step's captured layers, in store order, each [tokens, H]."""
        if self.two_phase:
            state = getattr(self.runner, "execute_model_state", None)
            aux = None if state is None else state.aux_hidden_states
        else:
            aux, self.last_aux = self.last_aux, None
        if self.aux_ids and aux is None:
            return None
        by_id = dict(zip(self.aux_ids, aux or []))
        by_id.update(self.own)
        self.own = {}
        return [by_id[k] for k in self.layer_ids]

    def after_execute(self, scheduler_output: Any) -> None:
        for new in getattr(scheduler_output, "scheduled_new_reqs", []) or []:
            params = getattr(new, "sampling_params", None)
            extra = getattr(params, "extra_args", None) or {}
            sample_id = extra.get(SAMPLE_ID_KEY, (extra.get("kv_transfer_params") or {}).get(SAMPLE_ID_KEY))
            if sample_id is not None:
                self.requests[new.req_id] = (int(sample_id), list(new.prompt_token_ids), [])
        counts = scheduler_output.num_scheduled_tokens
        if not counts:
            return
        layers = self.states_of_step()
        if layers is None:
            return
        batch = self.runner.input_batch
        offset = 0
        for req_id in list(batch.req_ids)[: batch.num_reqs]:
            n = int(counts.get(req_id, 0))
            entry = self.requests.get(req_id)
            if entry is not None and n:
                sample_id, prompt, chunks = entry
                seen = sum(c.shape[0] for c in chunks)
                take = min(n, len(prompt) - seen)
                if take > 0:
                    if self.sink.writes:
                        chunk = torch.stack([h[offset:offset + take] for h in layers], dim=1)  # [take, L, H]
                        chunks.append(chunk.to("cpu", copy=True))
                    else:
                        chunks.append(torch.empty(take, 0))
                if seen + max(take, 0) >= len(prompt):
                    del self.requests[req_id]
                    states = torch.cat(chunks) if self.sink.writes else torch.empty(0)
                    self.sink.put(sample_id, prompt, states)
            offset += n


def install(runner: Any, sink: StoreSink, *, layer_ids: list[int], num_layers: int, reaches_embeddings: bool,
            reaches_last: bool, two_phase: bool) -> _Tap:
    """Tap `runner` (vLLM's GPUModelRunner or a subclass, e.g. the CPU runner) so finished prompts reach `sink`."""
    tap = _Tap(runner, sink, layer_ids, num_layers, reaches_embeddings, reaches_last, two_phase)
    execute_model = runner.execute_model

    def tapped_execute_model(scheduler_output, *args, **kwargs):
        out = execute_model(scheduler_output, *args, **kwargs)
        tap.after_execute(scheduler_output)
        return out

    runner.execute_model = tapped_execute_model
    if not two_phase:
        model_forward = runner._model_forward

        def tapped_model_forward(*args, **kwargs):
            out = model_forward(*args, **kwargs)
            if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], list):
                tap.last_aux = out[1]
            return out

        runner._model_forward = tapped_model_forward
    return tap
