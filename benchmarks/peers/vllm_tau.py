"""Acceptance length τ of one EAGLE-3 draft directory in vLLM: `python vllm_tau.py REQUEST.json` (draftsmith's venv).

The same measurement as `draftsmith evaluate --engine vllm` (draftsmith.evaluate.vllm_worker): one engine with
`speculative_config={"method": "eagle3", "model": DRAFT, "num_speculative_tokens": k}`, a short untimed warm-up,
then one `generate` over the prompts; τ = 1 + accepted / drafts from vLLM's own `vllm:spec_decode_*` counters
(deltas over the timed call), per-position acceptance = accepted at position i / drafts. It takes any directory
vLLM loads as an EAGLE-3 draft: a draftsmith `export --format vllm` directory or a speculators checkpoint
(speculators_model_type eagle3; vLLM reads its norm_before_fc / norm_before_residual / norm_output flags).

vLLM spawns its engine core, which re-imports the main module: hence a real file with a `__main__` guard.
Request keys: target, draft, k, prompts (token id lists), max_new_tokens, dtype, max_model_len, max_num_seqs,
seed, result (path of the JSON written at the end).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted",
            "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_pos"}


def counters(llm) -> dict:
    out: dict = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    for metric in llm.get_metrics():
        key = COUNTERS.get(metric.name)
        if key is None:
            continue
        if hasattr(metric, "values"):  # a vector: one count per draft position
            per_pos = out[key]
            for i, v in enumerate(metric.values):
                if i < len(per_pos):
                    per_pos[i] += int(v)
                else:
                    per_pos.append(int(v))
        else:
            out[key] += int(metric.value)
    return out


def main(request_file: str) -> None:
    req = json.loads(Path(request_file).read_text(encoding="utf-8"))
    from vllm import LLM, SamplingParams

    llm = LLM(model=req["target"], dtype=req["dtype"], max_model_len=req["max_model_len"], seed=req["seed"],
              enforce_eager=True, disable_log_stats=False, max_num_seqs=req["max_num_seqs"],
              speculative_config={"method": "eagle3", "model": req["draft"], "num_speculative_tokens": req["k"]})
    prompts = [{"prompt_token_ids": ids} for ids in req["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up, untimed
    before = counters(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=req["max_new_tokens"]), use_tqdm=False)
    elapsed = time.perf_counter() - start
    after = counters(llm)
    drafts = after["drafts"] - before["drafts"]
    accepted = after["accepted"] - before["accepted"]
    per_pos_before = before["accepted_per_pos"] + [0] * len(after["accepted_per_pos"])
    per_pos = [a - per_pos_before[i] for i, a in enumerate(after["accepted_per_pos"])][:req["k"]]
    new_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {"tau": 1 + accepted / drafts if drafts else 1.0, "drafts": drafts, "accepted": accepted,
              "acceptance_per_pos": [a / drafts if drafts else 0.0 for a in per_pos],
              "new_tokens": new_tokens, "elapsed_s": elapsed, "tokens_per_s": new_tokens / elapsed,
              "outputs": [list(o.outputs[0].token_ids) for o in outputs]}
    tmp = Path(req["result"]).with_suffix(".tmp")
    tmp.write_text(json.dumps(result), encoding="utf-8")
    os.replace(tmp, req["result"])


if __name__ == "__main__":
    main(sys.argv[1])
