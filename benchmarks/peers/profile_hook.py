"""Where a trainer's step time goes, measured the same way for any PyTorch trainer, without touching its code.

`install(out_dir, name)` patches, at run time, the calls every trainer here makes once per optimizer step:
`torch.Tensor.backward`, `torch.nn.utils.clip_grad_norm_` and the optimizers' `step` (AdamW, and Muon when torch
has it). A step ends when `AdamW.step` returns (speculators steps Muon, then AdamW; draftsmith steps AdamW). Over
steps TIMED (after two warm-up steps) it adds up wall time per phase; "forward" is the rest of the step (data,
target head, TTT forward, loss). Over the two steps after that the torch profiler runs, and its operator table
(self CPU time) is written too. Results: OUT/NAME.json and OUT/NAME.txt.
"""

from __future__ import annotations

import json
import os
import time

import torch

WARMUP, TIMED, PROFILED = 2, 4, 2


def install(out_dir: str, name: str) -> None:
    state = {
        "step": 0,
        "t_end": None,
        "phase": {"backward": 0.0, "clip": 0.0, "optimizer": 0.0},
        "step_s": [],
        "prof": None,
        "in_opt": 0,
    }

    def timing() -> bool:  # is the step now running one of the timed ones?
        return WARMUP < state["step"] + 1 <= WARMUP + TIMED

    def timed(fn, phase):
        def wrapper(*args, **kwargs):
            if not timing() or (phase == "optimizer" and state["in_opt"]):
                return fn(*args, **kwargs)
            state["in_opt"] += phase == "optimizer"
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                state["phase"][phase] += time.perf_counter() - t0
                state["in_opt"] -= phase == "optimizer"

        return wrapper

    torch.Tensor.backward = timed(torch.Tensor.backward, "backward")
    torch.nn.utils.clip_grad_norm_ = timed(torch.nn.utils.clip_grad_norm_, "clip")
    if hasattr(torch.optim, "Muon"):
        torch.optim.Muon.step = timed(torch.optim.Muon.step, "optimizer")
    adamw_step = timed(torch.optim.AdamW.step, "optimizer")

    def step(self, *args, **kwargs):
        out = adamw_step(self, *args, **kwargs)
        now = time.perf_counter()
        state["step"] += 1
        if WARMUP < state["step"] <= WARMUP + TIMED and state["t_end"] is not None:
            state["step_s"].append(now - state["t_end"])
        if state["step"] == WARMUP + TIMED:
            _write_timing(out_dir, name, state)
            state["prof"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            state["prof"].__enter__()
        elif state["step"] == WARMUP + TIMED + PROFILED and state["prof"] is not None:
            prof, state["prof"] = state["prof"], None
            prof.__exit__(None, None, None)
            with open(os.path.join(out_dir, f"{name}.txt"), "w", encoding="utf-8") as f:
                f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
        state["t_end"] = time.perf_counter()
        return out

    torch.optim.AdamW.step = step


def _write_timing(out_dir: str, name: str, state: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    total = sum(state["step_s"])
    phase = state["phase"]
    result = {
        "steps": len(state["step_s"]),
        "step_s": round(total / max(len(state["step_s"]), 1), 3),
        **{f"{k}_s": round(v / max(len(state["step_s"]), 1), 3) for k, v in phase.items()},
        "forward_s": round((total - sum(phase.values())) / max(len(state["step_s"]), 1), 3),
        "torch_threads": torch.get_num_threads(),
    }
    with open(os.path.join(out_dir, f"{name}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)
