"""core/vllm_launch.py: the one way to start vLLM -- the KV-cache size every engine gets (the option, else the
environment's, else 2 GiB), a worker's whole environment, an engine's variables on top of the user's, the in-process
engine's executor."""

from __future__ import annotations

import os

from draftsmith.core import vllm_launch


def test_the_option_wins_then_the_environment_then_two_gib():
    var = vllm_launch.KV_CACHE_VAR
    assert vllm_launch.kv_cache(5, {var: "7"}) == {var: "5"}  # an explicit --kv-cache-gb
    assert vllm_launch.kv_cache(None, {var: "7"}) == {}  # the user's environment stays as it is
    assert vllm_launch.kv_cache(None, {var: ""}) == {var: "2"}  # empty is unset to vLLM too
    assert vllm_launch.kv_cache(None, {}) == {var: "2"}


def test_a_worker_inherits_this_environment_with_vllm_quiet_unless_told(monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_TEST_MARK", "x")
    monkeypatch.delenv(vllm_launch.KV_CACHE_VAR, raising=False)
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    env = vllm_launch.worker_environment(3, VLLM_USE_V2_MODEL_RUNNER="0")
    assert env["DRAFTSMITH_TEST_MARK"] == "x" and env[vllm_launch.KV_CACHE_VAR] == "3"
    assert env["VLLM_LOGGING_LEVEL"] == "WARNING" and env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    assert vllm_launch.worker_environment(None)["VLLM_LOGGING_LEVEL"] == "DEBUG"


def test_an_engine_s_variables_come_on_top_of_the_user_s_never_over_them():
    var, bind = vllm_launch.KV_CACHE_VAR, vllm_launch.THREADS_BIND_VAR
    mla = {"VLLM_MLA_DISABLE": "0"}
    env = vllm_launch.engine_environment(4, cpu_workers=2, target_env=mla, environ={})
    assert env[var] == "4" and env["VLLM_MLA_DISABLE"] == "0"
    assert env[bind] == vllm_launch.cpu_thread_binding(2) and "|" in env[bind]  # one group of cores per worker
    assert bind not in vllm_launch.engine_environment(None, cpu_workers=1, environ={})  # one worker: vLLM's own
    users = {var: "9", bind: "0|1", "VLLM_MLA_DISABLE": "1"}
    assert vllm_launch.engine_environment(None, cpu_workers=2, target_env=mla, environ=users) == {}


def test_an_in_process_engine_with_one_worker_runs_it_in_this_process(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert vllm_launch.llm_kwargs({"model": "m"})["distributed_executor_backend"] == "uni"
    two = {"model": "m", "tensor_parallel_size": 2}
    assert "distributed_executor_backend" not in vllm_launch.llm_kwargs(two)  # vLLM's own executor for two
    assert vllm_launch.llm_kwargs({"distributed_executor_backend": "mp"})["distributed_executor_backend"] == "mp"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert "distributed_executor_backend" not in vllm_launch.llm_kwargs({"model": "m"})


def test_the_environment_is_applied_while_the_engine_starts_and_restored_after(monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_TEST_KEPT", "user")
    monkeypatch.delenv("DRAFTSMITH_TEST_NEW", raising=False)
    with vllm_launch.environment({"DRAFTSMITH_TEST_NEW": "1", "DRAFTSMITH_TEST_KEPT": None}):
        assert os.environ["DRAFTSMITH_TEST_NEW"] == "1" and "DRAFTSMITH_TEST_KEPT" not in os.environ
    assert "DRAFTSMITH_TEST_NEW" not in os.environ and os.environ["DRAFTSMITH_TEST_KEPT"] == "user"
