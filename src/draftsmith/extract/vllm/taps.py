"""Reading a step's hidden states inside vLLM's model runner: the `direct` and `taps` strategies.

Both are installed in the worker through the worker extension (worker.py) once the engine is up, and differ only in
where a step's states come from:

- **direct** borrows vLLM's own EAGLE-3 support: the aux layers are set on the target with its
  `set_aux_hidden_state_layers` (SupportsEagle3), the runner is told to expect `(hidden_states, aux_hidden_states)`,
  and each step's aux states are read right after the forward pass (from `execute_model_state.aux_hidden_states`
  between `execute_model()` and `sample_tokens()` on a two-phase runner, from what `_model_forward()` returned on a
  one-phase one). The ids vLLM's aux machinery cannot reach for the architecture (id 0 under the "input"
  convention, N where the stack does not append its last output) come from draftsmith's hooks below.
- **taps** needs nothing of vLLM's EAGLE-3 support, so it works on every architecture vLLM runs, SupportsEagle3 or
  not (DeepSeek-V3 and Kimi-K2.5 on vLLM 0.11-0.16, a model on its first day): every store layer comes from
  forward hooks on the decoder stack's own layers. Every vLLM decoder stack runs the same loop, `hidden, residual
  = layer(positions, hidden, residual, ...)` (or `x = layer(...)`), so id k >= 1 is the output of layer k-1 --
  `hidden + residual`, the un-normalised residual stream, or the one tensor a layer returns -- and id 0 is the
  stream entering the first layer (the embeddings as the stack feeds them). The probe read from the source
  (architectures.read_taps) which class is the stack and where the stream enters a layer call.

Then, for both, the batch's rows are cut per request (requests lie back to back, in `input_batch.req_ids` order, each
with `num_scheduled_tokens[req_id]` rows), chunks of a prefill split over several steps are joined, and a request
whose whole prompt has been seen goes to the store sink. A request that shares a prefix (driver.Prompt) starts where
vLLM's prefix cache ends, which must not be past the prefix its parent holds; its rows before that prefix's end are
dropped (its parent has them). Every rank runs the hooks (tensor parallel: each holds the
full stream after vLLM's all-reduce); only the writing rank copies rows off the device. How the driver starts the
engine for them: driver.engine_kwargs and driver.engine_environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import BaseModel

from draftsmith.extract.common import HostStates
from draftsmith.extract.vllm.sink import StoreSink, read_tag

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

    from draftsmith.extract.vllm.architectures import ArchitectureSupport
    from draftsmith.extract.vllm.probe import ProbeFacts


class TapPlan(BaseModel):
    """What the worker hooks, decided on the driver side from the probe's facts (`plan`); sent over collective_rpc."""

    strategy: Literal["direct", "taps"]
    layer_ids: list[int]  # the store's layer ids, in store order
    num_layers: int
    stack_class: str | None  # the decoder stack's class name (the probe's decoder_stack)
    vllm_ids: list[int]  # ids read from vLLM's own aux states (direct)
    hook_ids: list[int]  # ids read by draftsmith's hooks on the stack's layers
    stream_arg: int | str | None = None  # where the stream enters a layer call (id 0's hook)
    two_phase: bool = True


def vllm_aux_ids(
    layer_ids: list[int], num_layers: int, reaches_embeddings: bool, reaches_last: bool
) -> tuple[list[int], list[int]]:
    """Store ids -> (ids vLLM's aux machinery captures, ids draftsmith must hook itself)."""
    own = [k for k in layer_ids if (k == 0 and not reaches_embeddings) or (k == num_layers and not reaches_last)]
    return [k for k in layer_ids if k not in own], own


def plan(
    strategy: str, layer_ids: list[int], num_layers: int, facts: ProbeFacts, support: ArchitectureSupport | None
) -> TapPlan:
    """The plan for `strategy` ("direct" or "taps") from the probe's facts and the architecture's support."""
    if strategy == "direct":
        vllm_ids, hook_ids = vllm_aux_ids(layer_ids, num_layers, facts.reaches_embeddings, facts.reaches_last)
    else:
        vllm_ids, hook_ids = [], list(layer_ids)
    return TapPlan(
        strategy=strategy,
        layer_ids=list(layer_ids),
        num_layers=num_layers,
        stack_class=support.decoder_stack if support is not None else None,
        vllm_ids=vllm_ids,
        hook_ids=hook_ids,
        stream_arg=support.taps.stream_arg if support is not None else None,
        two_phase=bool(facts.two_phase),
    )


def decoder_stack(model: torch.nn.Module, class_name: str | None) -> torch.nn.Module:
    """The module of the probe's decoder-stack class in the vLLM model's tree (inside a multimodal wrapper, its
    language model's); else the first module with `embed_tokens` and `layers`."""
    for module in model.modules():
        if class_name is not None and type(module).__name__ == class_name:
            return module
    for module in model.modules():
        if hasattr(module, "embed_tokens") and hasattr(module, "layers"):
            return module
    raise RuntimeError(f"draftsmith taps: no {class_name or 'decoder stack'} module in {type(model).__name__}")


def _stream(out: Any) -> torch.Tensor:
    """The residual stream a layer hands on: `hidden + residual` for a (hidden, residual) pair (a new tensor, so the
    next layer's in-place fused add cannot change it), else a copy of the one tensor."""
    if isinstance(out, tuple):
        hidden, residual = out[0], out[1] if len(out) > 1 else None
        return hidden + residual if torch.is_tensor(residual) else hidden.clone()
    return out.clone()


class LayerHooks:
    """Forward hooks on the stack's layers capturing store ids in `ids` during one forward pass."""

    def __init__(self, stack: torch.nn.Module, ids: list[int], num_layers: int, stream_arg: int | str | None):
        self.captured: dict[int, torch.Tensor] = {}
        layers: torch.nn.ModuleList = stack.layers  # type: ignore[assignment]  # nn.Module's __getattr__ hides the type
        first = getattr(stack, "start_layer", 0)
        for k in ids:
            if k == 0:
                if stream_arg is None:
                    raise RuntimeError("draftsmith taps: the probe did not find where the stream enters a layer")
                layers[first].register_forward_pre_hook(self._entering(stream_arg), with_kwargs=True)
            elif 1 <= k <= num_layers:
                layers[k - 1].register_forward_hook(self._leaving(k))
            else:
                raise RuntimeError(f"draftsmith taps: layer id {k} outside 0..{num_layers}")

    def _entering(self, arg: int | str):
        def hook(module, args, kwargs):
            stream = args[arg] if isinstance(arg, int) and arg < len(args) else kwargs.get(str(arg))
            self.captured[0] = stream.clone()

        return hook

    def _leaving(self, k: int):
        def hook(module, args, out):
            self.captured[k] = _stream(out)

        return hook

    def take(self) -> dict[int, torch.Tensor]:
        captured, self.captured = self.captured, {}
        return captured


@dataclass
class _Request:
    """A tagged request being prefilled: its rows so far (from `shared` on) as they crossed to the host."""

    sample_id: int
    prompt: list[int]
    parent: int
    shared: int
    at: int  # the next position to be computed (it starts where the prefix cache ends)
    chunks: list[HostStates] = field(default_factory=list)


class RunnerTaps:
    """The installed taps of one worker: a step's states by store id, cut per request into the sink."""

    def __init__(self, runner: Any, sink: StoreSink, plan: TapPlan):
        self.runner, self.sink, self.plan = runner, sink, plan
        self.requests: dict[str, _Request] = {}
        self.last_aux: list[torch.Tensor] | None = None
        model = runner.get_model()
        if plan.vllm_ids:
            model.set_aux_hidden_state_layers(tuple(plan.vllm_ids))
            runner.use_aux_hidden_state_outputs = True
        self.hooks = (
            LayerHooks(decoder_stack(model, plan.stack_class), plan.hook_ids, plan.num_layers, plan.stream_arg)
            if plan.hook_ids
            else None
        )

    def states_of_step(self) -> list[torch.Tensor] | None:
        """The step's captured layers, in store order, each [tokens, H]; None when the step ran no forward."""
        by_id = self.hooks.take() if self.hooks is not None else {}
        if self.plan.vllm_ids:
            if self.plan.two_phase:
                state = getattr(self.runner, "execute_model_state", None)
                aux = None if state is None else state.aux_hidden_states
            else:
                aux, self.last_aux = self.last_aux, None
            if aux is None:
                return None
            by_id.update(zip(self.plan.vllm_ids, aux, strict=False))
        if any(k not in by_id for k in self.plan.layer_ids):
            return None
        return [by_id[k] for k in self.plan.layer_ids]

    def _admit(self, scheduler_output: SchedulerOutput) -> None:
        """Note the step's new tagged requests; each starts where vLLM's prefix cache ends for it."""
        for new in getattr(scheduler_output, "scheduled_new_reqs", []) or []:
            extra = getattr(getattr(new, "sampling_params", None), "extra_args", None) or {}
            tag = read_tag(extra) or read_tag(extra.get("kv_transfer_params"))
            if tag is None:
                continue
            sample_id, parent, shared = tag
            if new.num_computed_tokens > shared:
                raise RuntimeError(
                    f"draftsmith taps: vLLM's prefix cache gave sample {sample_id} {new.num_computed_tokens} tokens, "
                    f"more than the {shared} it shares with sample {parent}"
                )
            at = new.num_computed_tokens
            self.requests[new.req_id] = _Request(sample_id, list(new.prompt_token_ids), parent, shared, at)

    def after_execute(self, scheduler_output: SchedulerOutput) -> None:
        self._admit(scheduler_output)
        counts = scheduler_output.num_scheduled_tokens
        if not counts:
            return
        layers = self.states_of_step()
        ran = sum(map(int, counts.values()))
        if layers is None and self.hooks is not None and ran:
            # the forward ran tokens past our hooks (a compiled or captured graph): say so now, not after the
            # sink's wait for samples that will never come (the driver adds the --backend hf hint where it fits)
            stack = self.plan.stack_class or "decoder stack"
            raise RuntimeError(
                f"draftsmith taps: a step ran {ran} tokens and the hooks on {stack}'s layers "
                f"{', '.join(map(str, self.plan.hook_ids))} did not all fire: the model's forward "
                "does not pass through its layer modules here (a compiled or captured graph); "
                "extract with another --vllm-strategy that doctor offers"
            )
        if layers is None:
            return
        batch = self.runner.input_batch
        rows = min(h.shape[0] for h in layers)
        scheduled = sum(int(counts.get(r, 0)) for r in list(batch.req_ids)[: batch.num_reqs])
        if rows < scheduled:  # a token-sharded stream (sequence-parallel MoE): rows on other ranks
            raise RuntimeError(
                f"draftsmith taps: a layer's stream holds {rows} rows for {scheduled} scheduled "
                "tokens (sharded across ranks by sequence-parallel MoE); extract without expert "
                "parallelism"
            )
        offset = 0
        for req_id in list(batch.req_ids)[: batch.num_reqs]:
            n = int(counts.get(req_id, 0))
            r = self.requests.get(req_id)
            if r is not None and n:
                take, skip = min(n, len(r.prompt) - r.at), max(0, r.shared - r.at)  # the parent's rows: skipped
                if take > skip:
                    r.chunks.append(self.sink.to_host([h[offset + skip : offset + take] for h in layers]))
                r.at += max(take, 0)
                if r.at >= len(r.prompt):
                    del self.requests[req_id]
                    self.sink.put(r.sample_id, r.prompt, r.chunks, r.parent, r.shared)
            offset += n


def install(runner: Any, sink: StoreSink, tap_plan: TapPlan) -> RunnerTaps:
    """Tap `runner` (vLLM's GPUModelRunner or a subclass, e.g. the CPU runner) so finished prompts reach `sink`."""
    taps = RunnerTaps(runner, sink, tap_plan)
    execute_model = runner.execute_model

    def tapped_execute_model(scheduler_output, *args, **kwargs):
        if taps.hooks is not None:
            taps.hooks.take()  # nothing of an earlier forward (a dummy run) is kept
        out = execute_model(scheduler_output, *args, **kwargs)
        taps.after_execute(scheduler_output)
        return out

    runner.execute_model = tapped_execute_model
    if tap_plan.vllm_ids and not tap_plan.two_phase:
        model_forward = runner._model_forward

        def tapped_model_forward(*args, **kwargs):
            out = model_forward(*args, **kwargs)
            if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], list):
                taps.last_aux = out[1]
            return out

        runner._model_forward = tapped_model_forward
    return taps
