"""`evaluate --concurrency`: the speed-up where the draft is served. `draftsmith serve` with the draft, then with the
target alone, each loaded by vLLM's own `vllm bench serve` at every concurrency; the report's first line says where
the draft stops paying.

The real run uses the small draft benchmarks/specdec.py trains once per machine for the default target (as
tests/test_serve.py does), a training run, so each server also writes its temporary vLLM export.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import as_a_user
from pydantic import ValidationError

from draftsmith.config import EvaluateConfig
from draftsmith.core.errors import DraftsmithError
from draftsmith.evaluate import load, loadgen
from draftsmith.evaluate.report import (
    ConcurrencyRow,
    ConcurrencySweep,
    EvaluationReport,
    RunReport,
    ServedRun,
    charts_available,
    markdown,
    read_report,
)


def _row(c: int, draft_tps: float, alone_tps: float) -> ConcurrencyRow:
    def run(tps: float, tau: float | None) -> ServedRun:
        return ServedRun(
            output_throughput=tps, mean_itl_ms=1000 / tps, mean_ttft_ms=50.0, spec_decode_acceptance_length=tau
        )

    return ConcurrencyRow(
        concurrency=c,
        requests=loadgen.requests_at(c, 8),
        draft=run(draft_tps, 2.4),
        target_alone=run(alone_tps, None),
        speedup=draft_tps / alone_tps,
        identical_outputs="8/8",
    )


def test_concurrency_is_parsed_sorted_and_at_least_one():
    assert EvaluateConfig(concurrency="16,1,4,4").concurrency == [1, 4, 16]
    assert EvaluateConfig().concurrency == []
    with pytest.raises(ValidationError, match="at least 1"):
        EvaluateConfig(concurrency="0,4")


def test_the_draft_stops_paying_at_the_first_concurrency_without_a_gain():
    rows = [_row(16, 95, 100), _row(1, 30, 20), _row(4, 60, 50), _row(64, 210, 200)]
    assert load.stops_paying_at(rows) == 16  # 64 gains again, by noise or batching: the first loss is the answer
    assert load.stops_paying_at([_row(1, 30, 20), _row(4, 60, 50)]) is None
    assert load.stops_paying_at([_row(1, 20, 20)]) == 1  # no gain is no pay


def test_every_prompt_is_sent_and_at_least_two_requests_per_slot():
    assert [loadgen.requests_at(c, 8) for c in (1, 4, 16)] == [8, 8, 32]


def test_the_report_leads_with_tau_and_the_speed_up_at_each_concurrency():
    sweep = ConcurrencySweep(
        k=3,
        dtype="bfloat16",
        load_generator="vllm bench serve (vLLM 0.32.0)",
        max_new_tokens=64,
        rows=[_row(1, 30, 20), _row(4, 60, 50), _row(16, 95, 100)],
        stops_paying_at=16,
    )
    run = RunReport(k=3, tau=2.5, acceptance_per_pos=[0.8, 0.5, 0.2], tokens_per_s=30.0, num_rounds=10)
    report = EvaluationReport(
        engine="hf",
        target="t",
        draft="d",
        prompts="p",
        num_prompts=8,
        max_new_tokens=64,
        temperature=0.0,
        runs=[run],
        concurrency=sweep,
    )
    lines = markdown(report, charts=True).splitlines()
    assert lines[2] == (
        "τ 2.50 at k=3 · speed-up by concurrency (k=3): 1.50x at 1, 1.20x at 4, 0.95x at 16: stops paying at 16"
    )
    assert "| 4 | 8 | 50.0 | 60.0 | 1.20× | 20.0 | 16.7 | 50 | 50 | 2.40 | 8/8 |" in lines
    assert "![speed-up against concurrency](speedup_vs_concurrency.png)" in lines


def test_both_servers_get_the_same_options_and_only_one_the_draft():
    options = load.ServerOptions(
        draft=Path("runs/export"),
        k=3,
        dtype="bfloat16",
        max_model_len=600,
        kv_cache_gb=2,
        tensor_parallel_size=1,
        trust_remote_code=False,
        timeout_s=60,
    )
    with_draft, alone = options.argv(8001, False), options.argv(8001, True)
    assert alone == [*with_draft, "--target-alone"]
    assert with_draft[1:5] == ["-m", "draftsmith", "serve", "runs/export"]
    assert with_draft[with_draft.index("--num-speculative-tokens") + 1] == "3"
    assert with_draft[with_draft.index("--kv-cache-gb") + 1] == "2"


def test_a_server_that_dies_before_serving_is_one_error_with_its_last_lines(tmp_path):
    die = [sys.executable, "-c", "import sys; print('no EAGLE-3 here'); sys.exit(3)"]
    log = tmp_path / "serve.log"
    with pytest.raises(DraftsmithError, match=r"exited with status 3 before it served:\nno EAGLE-3 here") as err:
        with load._server(die, log, port=1, timeout_s=60):
            pytest.fail("served")
    assert str(log) in str(err.value)


# ------------------------------------------------------------------------------------------- real vLLM 0.32


@pytest.mark.slow
@pytest.mark.vllm
def test_the_speed_up_by_concurrency_through_the_real_server_and_vllm_bench_serve(trained_run, tmp_path):
    pytest.importorskip("vllm")
    psutil = pytest.importorskip("psutil")
    from draftsmith.extract.vllm.probe import probe

    if not probe().facts.eagle3_on_platform:
        pytest.skip("EAGLE-3 does not run on this vLLM here (tests/test_vllm_release_engines.py tests the refusal)")
    out = tmp_path / "eval"
    # float32 named: greedy outputs with the draft and without are then the same text, request for request
    args = ["evaluate", "--draft", trained_run, "--concurrency", "4,1", "--k", 3, "--num-prompts", 4]
    args += ["--max-new-tokens", 32, "--no-baseline", "--dtype", "float32", "--vllm-kv-cache-gb", 1, "--output", out]
    args += ["--vllm-args", "--enforce-eager"]  # both servers start without vLLM's graph capture: ~70 s less each here
    done = as_a_user(*args)
    assert done.returncode == 0, done.stderr[-4000:]
    sweep = read_report(out / "report.json").concurrency
    assert sweep is not None and sweep.k == 3 and sweep.load_generator.startswith("vllm bench serve (vLLM 0.")
    assert [r.concurrency for r in sweep.rows] == [1, 4]
    for row in sweep.rows:
        draft, alone = row.draft, row.target_alone
        assert draft.completed == alone.completed == row.requests == max(4, 2 * row.concurrency)
        assert (draft.output_throughput or 0) > 0 and (alone.output_throughput or 0) > 0 and (row.speedup or 0) > 0
        assert (draft.mean_itl_ms or 0) > 0 and (alone.mean_ttft_ms or 0) > 0
        assert (draft.spec_decode_acceptance_length or 0) > 1.0, draft  # the server accepted the draft's tokens
        assert alone.spec_decode_acceptance_length is None  # the target alone drafts nothing
    assert sweep.rows[0].identical_outputs == "4/4"  # greedy, one request at a time: lossless through both
    assert (sweep.stops_paying_at is None) == all((r.speedup or 0) > 1 for r in sweep.rows)
    first = (out / "report.md").read_text().splitlines()[2]
    assert first.startswith("τ ") and "speed-up by concurrency (k=3): " in first and "x at 4" in first
    assert "speed-up by concurrency" in done.stdout + done.stderr
    if charts_available():
        assert (out / "speedup_vs_concurrency.png").stat().st_size > 0
    left = [
        p.info["cmdline"]
        for p in psutil.process_iter(["cmdline"])
        if str(trained_run) in " ".join(p.info["cmdline"] or [])
    ]
    assert left == [], "a server outlived evaluate"
