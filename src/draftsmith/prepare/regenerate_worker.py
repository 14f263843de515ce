"""Generate answers with vLLM in a process of its own: `python -m draftsmith.prepare.regenerate_worker`.

vLLM may start processes with `spawn`, which re-imports the main module, so it must run from a real file with a
`__main__` guard. `regenerate_engines.py` starts this file once per run and talks to it over its stdin and stdout,
one JSON object a line, each a message below (written and read through these models, never as loose dicts):

    stdin, first line   the engine: `EngineOrder`
    stdout, once ready  `Ready` (the vLLM version)
    stdin, any time     a request: `Request` (id, prompt token ids, max_tokens, seed)
    stdout, as they end `Finished`: the requests that ended, each `Output` (id, token ids, stop or length)

Requests go into vLLM's engine as they arrive (`LLMEngine.add_request` + `step`, the loop `LLM.generate` runs), so
continuous batching keeps the batch full: the next turn of a conversation is asked for as soon as its previous
answer is back, while the other conversations keep generating (the prompts come rendered and tokenised:
regenerate_conversations.py). Everything else printed here (vLLM's own logs) goes to stderr, which the parent writes
to a log file.

The worker dies with its parent (PR_SET_PDEATHSIG) and runs vLLM's engine core in this same process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), so a `kill -9` of `draftsmith regenerate` leaves no engine behind.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from typing import Literal

import torch
from pydantic import BaseModel

from draftsmith.core import processes, vllm_launch

Dtype = Literal["float32", "bfloat16", "float16"]


class EngineOrder(BaseModel):
    """vLLM's `LLM(...)` arguments as they are (the target's directory its `model`), then the sampling."""

    model: str
    dtype: Dtype
    max_model_len: int
    seed: int
    tensor_parallel_size: int
    trust_remote_code: bool
    stop_token_ids: list[int]
    temperature: float
    top_p: float


class Ready(BaseModel):
    vllm_version: str


class Request(BaseModel):
    id: int
    prompt: list[int]  # token ids, rendered with the target's chat template
    max_tokens: int
    seed: int


class Output(BaseModel):
    id: int
    token_ids: list[int]
    finish_reason: str  # "stop" (an end-of-turn token, the last of token_ids) or "length"


class Finished(BaseModel):
    outputs: list[Output]


def _read_requests(inbox: queue.Queue) -> None:
    for line in sys.stdin:
        inbox.put(Request.model_validate_json(line))
    inbox.put(None)  # stdin closed: the parent is done (or gone)


def main() -> None:
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)  # vLLM prints to stdout too: keep the reply channel for replies only
    processes.die_with_parent()  # elsewhere than Linux the parent closes stdin on exit, which ends the loop below
    if os.getppid() == 1:  # the parent died before that call
        sys.exit(1)
    engine = EngineOrder.model_validate_json(sys.stdin.readline())
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm
    from vllm import SamplingParams
    from vllm.outputs import RequestOutput
    from vllm.sampling_params import RequestOutputKind

    on_cpu = not torch.cuda.is_available()
    llm = vllm_launch.start_llm(
        dict(
            **engine.model_dump(exclude={"stop_token_ids", "temperature", "top_p"}),
            enforce_eager=on_cpu,
            disable_log_stats=True,
        ),
        vllm_launch.engine_environment(cpu_workers=engine.tensor_parallel_size if on_cpu else 1),
    )
    core = llm.llm_engine
    replies.write(Ready(vllm_version=vllm.__version__).model_dump_json() + "\n")
    inbox: queue.Queue = queue.Queue()
    threading.Thread(target=_read_requests, args=(inbox,), daemon=True).start()
    sampled = engine.temperature > 0
    while True:
        waiting = [inbox.get()] if not core.has_unfinished_requests() else []
        while True:
            try:
                waiting.append(inbox.get_nowait())
            except queue.Empty:
                break
        for request in waiting:
            if request is None:
                return
            params = SamplingParams(
                temperature=engine.temperature,
                top_p=engine.top_p,
                max_tokens=request.max_tokens,
                seed=request.seed if sampled else None,
                stop_token_ids=engine.stop_token_ids,
                detokenize=False,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            core.add_request(str(request.id), {"prompt_token_ids": request.prompt}, params)
        finished = []
        for out in core.step():
            assert isinstance(out, RequestOutput)  # what a generating engine's step returns
            if out.finished:
                finished.append(
                    Output(
                        id=int(out.request_id),
                        token_ids=list(out.outputs[0].token_ids),
                        finish_reason=out.outputs[0].finish_reason,
                    )
                )
        if finished:
            replies.write(Finished(outputs=finished).model_dump_json() + "\n")


if __name__ == "__main__":
    main()
