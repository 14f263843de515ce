"""benchmarks/methods.py's measuring parts, without training or an engine: the k lists, each method's store layers
and training shape (a block method's block: DFlash k + 1, DSpark k), the timers (a nested call counted once, the
draft's forwards counted, a DSpark draft's Markov head timed), the worker swap that times vLLM's drafting step (only
the evaluation worker is rerouted; only the timed generate call is counted), the methods vLLM does not serve (asked,
recorded, not started), and the side-by-side table."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from draftsmith.evaluate import vllm_runner, vllm_worker
from draftsmith.evaluate.specdec import DecodeStats

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_methods", ROOT / "benchmarks" / "methods.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_parse_ks():
    assert bench.parse_ks("2..8") == [2, 3, 4, 5, 6, 7, 8]
    assert bench.parse_ks("4, 2,2,6..7") == [2, 4, 6, 7]
    with pytest.raises(SystemExit, match="--k 0,2"):
        bench.parse_ks("0,2")


def test_module_timer_counts_the_outermost_call_and_the_drafts_forwards():
    class Draft(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            time.sleep(0.02)
            return self.fc(x)  # nested: inside the draft's own timed forward

    draft = Draft()
    timer = bench.ModuleTimer([draft, draft.fc])
    x = torch.zeros(1, 4)
    draft(x)
    draft(x)
    draft.fc(x)  # on its own (the reference decoder fuses aux states this way): timed, not a forward
    assert timer.forwards == 2
    assert 0.04 <= timer.seconds < 0.5
    timer.reset()
    assert (timer.seconds, timer.forwards) == (0.0, 0)
    timer.remove()
    draft(x)
    assert timer.forwards == 0


def test_span_timer_between_marks():
    timer = bench.SpanTimer()
    with timer.span():
        time.sleep(0.01)  # the warm-up: before the first mark
    timer.mark()
    for _ in range(3):
        with timer.span():
            time.sleep(0.01)
    timer.mark()
    seconds, calls = timer.between_marks()
    assert calls == 3 and 0.03 <= seconds < 0.3
    assert bench.SpanTimer().between_marks() is None


def test_only_the_evaluation_worker_is_started_through_the_benchmark(monkeypatch):
    started = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, *a, **kw: started.append(list(cmd)) or "done")
    with bench.timed_vllm_worker():
        assert vllm_runner.subprocess.TimeoutExpired is subprocess.TimeoutExpired
        vllm_runner.subprocess.run([sys.executable, "-m", bench.WORKER_MODULE, "r.json"], timeout=5)
        vllm_runner.subprocess.run([sys.executable, "-c", "import vllm"])
    assert vllm_runner.subprocess is subprocess
    assert started[0] == [sys.executable, str(ROOT / "benchmarks" / "methods.py"), "--vllm-job", "r.json"]
    assert started[1] == [sys.executable, "-c", "import vllm"]


def test_vllm_job_times_the_drafting_step_of_the_timed_call_only(tmp_path, monkeypatch):
    class GPUModelRunner:  # stands in for vLLM's: the wrapper patches the class, whatever instance runs
        device = torch.device("cpu")
        drafter = types.SimpleNamespace(parallel_drafting=True)

        def propose_draft_token_ids(self, *args):
            time.sleep(0.005)
            return [[1, 2]]

    fake = types.ModuleType("vllm.v1.worker.gpu_model_runner")
    fake.GPUModelRunner = GPUModelRunner
    for name in ("vllm", "vllm.v1", "vllm.v1.worker"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu_model_runner", fake)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")

    def fake_main(request_file):  # what vllm_worker.run does: warm-up, read counters, timed generate, read again
        runner = GPUModelRunner()
        runner.propose_draft_token_ids()
        vllm_worker.read_spec_metrics(None)
        for _ in range(4):
            assert runner.propose_draft_token_ids() == [[1, 2]]
        vllm_worker.read_spec_metrics(None)
        request = json.loads(Path(request_file).read_text())
        Path(request["result"]).write_text("{}")

    monkeypatch.setattr(vllm_worker, "main", fake_main)
    monkeypatch.setattr(vllm_worker, "read_spec_metrics", lambda llm: {})
    request = tmp_path / "k4.request.json"
    request.write_text(json.dumps({"result": str(tmp_path / "k4.result.json")}))
    bench.vllm_job(str(request))
    timing = json.loads(bench.timing_path(tmp_path / "k4.result.json").read_text())
    assert timing["draft_calls"] == 4 and 0.02 <= timing["draft_s"] < 0.5
    assert timing["parallel_drafting"] is True
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # the engine ran in the timed process


def test_rows_and_the_side_by_side_table():
    stats = DecodeStats(k=2, num_new_tokens=30, elapsed_s=3.0, num_rounds=10, num_accepted=8, accepted_per_pos=[5, 3])
    row = bench.per_k_row(stats, base_tps=5.0, draft_s=0.25, draft_calls=None, forwards=10, lossless=True)
    assert row["tau"] == 1.8 and row["acceptance_per_pos"] == [0.5, 0.3]
    assert row["speedup"] == 2.0 and row["round_ms"] == 300.0 and row["draft_ms_per_round"] == 25.0
    assert row["draft_forwards_per_round"] == 1.0 and row["lossless"] is True
    assert bench.per_k_row(stats, 5.0, draft_s=0.24, draft_calls=12)["draft_ms_per_round"] == 20.0  # vLLM's steps
    untimed = bench.per_k_row(stats, base_tps=None, draft_s=None, draft_calls=None)
    assert untimed["speedup"] is None and untimed["draft_ms_per_round"] is None
    results = {
        "hf": {
            "target_alone_tokens_per_s": 5.0,
            "num_prompts": 2,
            "dtype": "float32",
            "methods": {"eagle3": {"2": row}, "peagle": {"2": untimed}},
        },
        "vllm": {"error": "skipped: vLLM is not installed (or does not import)"},
    }
    text = bench.table(results, {"hf": [2], "vllm": [2]}, ("eagle3", "peagle", "dflash"))
    lines = text.splitlines()
    assert lines[0].startswith("hf: target alone 5.00 tokens/s, 2 prompts, float32")
    assert lines[2].split("|")[1].split() == ["1.800", "1.800", "–"]  # no DFlash run at this k
    assert lines[2].split("|")[2].split() == ["25.00", "–", "–"]
    assert lines[2].split("|")[4].strip() == "yes/–/–"
    assert lines[-1] == "vllm: skipped: vLLM is not installed (or does not import)"


def test_every_method_is_measured():
    from draftsmith.methods import NAMES as REGISTRY

    assert set(bench.METHODS) == set(REGISTRY) and set(bench.SHORT) == set(bench.METHODS)
    assert len(set(bench.SHORT.values())) == len(bench.SHORT)


def test_block_methods_propose_k_a_round():
    assert bench.block_size("dflash", 4) == 5  # the anchor and 4 masks
    assert bench.block_size("dspark", 4) == 4  # every row proposes
    assert bench.block_size("eagle3", 4) is None and bench.block_size("peagle", 4) is None
    assert bench.train_shape("dspark", 4, 2, 16, 2048) == dict(num_layers=2, block_size=4, anchors_per_sample=16)
    assert bench.train_shape("dflash", 4, 2, 16, 2048) == dict(num_layers=2, block_size=5, anchors_per_sample=16)
    assert bench.train_shape("eagle3.1", 4, 2, 16, 2048) == dict(ttt_steps=4, draft_vocab_size=2048)
    from draftsmith.config import TrainConfig
    from draftsmith.methods import method

    for name in ("dflash", "dspark"):  # train sizes the block's proposals as the benchmark does
        cfg = TrainConfig(data="store", output="out", method=name, **bench.train_shape(name, 4, 2, 16, 2048))
        assert cfg.method.depths == 4
        assert method(name).round_tokens(types.SimpleNamespace(block_size=cfg.method.block_size), 4) == 4


def test_the_store_holds_the_layers_each_draft_reads():
    from draftsmith.core.layers import dflash_aux_layer_ids, resolve_layer_ids

    layers = bench.store_layers(bench.METHODS, 24, 2)
    eagle = resolve_layer_ids(None, 24)[:-1]
    assert layers["dflash"] == layers["dspark"] == dflash_aux_layer_ids(24, 2)
    assert layers["eagle3"] == layers["eagle3.1"] == layers["peagle"] == eagle
    assert bench.store_layers(("dspark",), 24, 3) == {"dspark": dflash_aux_layer_ids(24, 3)}


def test_the_markov_head_is_draft_time():
    class Markov(nn.Module):
        def __init__(self):
            super().__init__()
            self.markov_w1, self.markov_w2 = nn.Embedding(4, 2), nn.Linear(2, 4)

    draft = types.SimpleNamespace(fc=nn.Linear(2, 2))
    assert bench.timed_modules(draft) == [draft, draft.fc]
    draft.markov_head = Markov()
    assert bench.timed_modules(draft)[2:] == [draft.markov_head.markov_w1, draft.markov_head.markov_w2]


def test_methods_vllm_cannot_serve_are_recorded_not_started(tmp_path, monkeypatch):
    from draftsmith import evaluate

    asked = []

    def verdict(target, what, *, method, dtype):
        asked.append((method, dtype))
        why = "the probe could not tell whether vLLM 0.32.0 serves dspark" if method == "dspark" else None
        return vllm_runner.VllmVerdict("0.32.0", why, why and f"{what}: {why}")

    monkeypatch.setattr(vllm_runner, "engine_dtype", lambda target, asked: types.SimpleNamespace(dtype="float32"))
    monkeypatch.setattr(vllm_runner, "vllm_verdict", verdict)
    assert bench.vllm_not_served(tmp_path, ["eagle3", "dspark"], "float32") == {
        "dspark": "the probe could not tell whether vLLM 0.32.0 serves dspark"
    }
    assert asked == [("eagle3", "float32"), ("dspark", "float32")]

    def no_engine(cfg):
        raise AssertionError("no engine starts for a method vLLM does not serve")

    monkeypatch.setattr(evaluate, "run", no_engine)
    monkeypatch.setattr(bench, "vllm_not_served", lambda target, methods, dtype: {m: "not here" for m in methods})
    result = bench.vllm_engine(tmp_path, tmp_path, {"dspark": tmp_path / "x"}, "mt-bench", 1, [4], 8, "float32", 60)
    assert result["methods"] == {"dspark": {"not_served": "not here"}}
    assert result["error"] == "skipped: vLLM serves none of dspark"
    assert bench.table({"vllm": result}, {"vllm": [4]}, ("dflash", "dspark")).splitlines() == [
        "vllm: skipped: vLLM serves none of dspark",
        "vllm: dspark not served: not here",
    ]


def test_a_method_not_served_is_a_line_under_the_table():
    stats = DecodeStats(k=4, num_new_tokens=30, elapsed_s=3.0, num_rounds=10, num_accepted=8, accepted_per_pos=[5, 3])
    row = bench.per_k_row(stats, base_tps=5.0, draft_s=0.25, draft_calls=12)
    results = {
        "vllm": {
            "target_alone_tokens_per_s": 5.0,
            "num_prompts": 2,
            "dtype": "float32",
            "methods": {"dflash": {"4": row}, "dspark": {"not_served": "vLLM 0.32.0 has no dspark method"}},
        }
    }
    lines = bench.table(results, {"vllm": [4]}, ("dflash", "dspark")).splitlines()
    assert lines[2].split("|")[1].split() == ["1.800", "–"]
    assert lines[-1] == "vllm: dspark not served: vLLM 0.32.0 has no dspark method"
