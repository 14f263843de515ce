"""Run one vLLM generation job in its own process: `python -m draftsmith.evaluate.vllm_worker REQUEST.json`.

vLLM starts its engine core with the `spawn` method, which re-imports the main module, so it must be started
from a real file with a `__main__` guard; `vllm_runner.py` launches this file and reads back RESULT.json.
Everything vLLM-specific about the evaluation lives here and in vllm_runner.py (STYLE.md, habit 5).

The request names the target, the draft (or none, for the baseline), k, the prompts as token ids and the
sampling settings. The result holds each prompt's output token ids, the wall time of the timed `generate`
call (a short warm-up run before it is not timed), and the deltas of the `vllm:spec_decode_*` counters that
`LLM.get_metrics()` reports over the timed call.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

SPEC_METRICS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "num_accepted_tokens_per_pos",
}


def read_spec_metrics(llm) -> dict:
    """Sum the spec-decode counters (over engines / label sets); per-position counts as a list."""
    out: dict = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "num_accepted_tokens_per_pos": []}
    for metric in llm.get_metrics():
        key = SPEC_METRICS.get(metric.name)
        if key is None:
            continue
        if hasattr(metric, "values"):  # Vector
            per_pos = out[key]
            for i, v in enumerate(metric.values):
                if i < len(per_pos):
                    per_pos[i] += int(v)
                else:
                    per_pos.append(int(v))
        else:
            out[key] += int(metric.value)
    return out


def _delta(after: dict, before: dict) -> dict:
    out = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    b = before["num_accepted_tokens_per_pos"] + [0] * len(after["num_accepted_tokens_per_pos"])
    out["num_accepted_tokens_per_pos"] = [a - b[i] for i, a in enumerate(after["num_accepted_tokens_per_pos"])]
    return out


def main(request_file: str) -> None:
    request = json.loads(Path(request_file).read_text(encoding="utf-8"))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(request.get("kv_cache_gb", 2))))
    import vllm
    from vllm import LLM, SamplingParams

    kwargs: dict = dict(model=request["target"], dtype=request["dtype"], max_model_len=request["max_model_len"],
                        seed=request["seed"], disable_log_stats=False, enforce_eager=request.get("enforce_eager", True),
                        trust_remote_code=request.get("trust_remote_code", False), max_num_seqs=request.get("max_num_seqs", 1))
    if request.get("draft"):
        kwargs["speculative_config"] = {"method": "eagle3", "model": request["draft"],
                                        "num_speculative_tokens": request["k"]}
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=request["temperature"], max_tokens=request["max_new_tokens"],
                            seed=request["seed"] if request["temperature"] > 0 else None)
    prompts = [{"prompt_token_ids": ids} for ids in request["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up, not timed
    before = read_spec_metrics(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    after = read_spec_metrics(llm)
    result = {
        "vllm_version": vllm.__version__,
        "elapsed_s": elapsed,
        "outputs": [list(o.outputs[0].token_ids) for o in outputs],
        "spec": _delta(after, before),
    }
    tmp = Path(request["result"]).with_suffix(".tmp")
    tmp.write_text(json.dumps(result), encoding="utf-8")
    os.replace(tmp, request["result"])


if __name__ == "__main__":
    main(sys.argv[1])
