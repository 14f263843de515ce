"""core/engine_env.py: the KV-cache size every engine draftsmith starts gets -- the option, else the environment's,
else 2 GiB -- and a worker's whole environment."""

from __future__ import annotations

from draftsmith.core import engine_env


def test_the_option_wins_then_the_environment_then_two_gib():
    var = engine_env.KV_CACHE_VAR
    assert engine_env.kv_cache(5, {var: "7"}) == {var: "5"}  # an explicit --kv-cache-gb
    assert engine_env.kv_cache(None, {var: "7"}) == {}  # the user's environment stays as it is
    assert engine_env.kv_cache(None, {var: ""}) == {var: "2"}  # empty is unset to vLLM too
    assert engine_env.kv_cache(None, {}) == {var: "2"}


def test_a_worker_inherits_this_environment_with_vllm_quiet_unless_told(monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_TEST_MARK", "x")
    monkeypatch.delenv(engine_env.KV_CACHE_VAR, raising=False)
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    env = engine_env.worker_environment(3, VLLM_USE_V2_MODEL_RUNNER="0")
    assert env["DRAFTSMITH_TEST_MARK"] == "x" and env[engine_env.KV_CACHE_VAR] == "3"
    assert env["VLLM_LOGGING_LEVEL"] == "WARNING" and env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    assert engine_env.worker_environment(None)["VLLM_LOGGING_LEVEL"] == "DEBUG"
