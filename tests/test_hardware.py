"""`auto` precision follows the CPU: bf16 where it computes bf16 natively (AVX512-BF16 or AMX), fp32 elsewhere; the
choice is printed and recorded, for training and for hf extraction alike (tiny random target)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import write_random_prepared

from draftsmith.config import ExtractConfig, TrainConfig
from draftsmith.core import devices, hardware
from draftsmith.extract import store
from draftsmith.extract.hf import resolve_compute_dtype
from draftsmith.extract.vllm.dtypes import choose_dtype
from draftsmith.extract.vllm.probe import ProbeFacts, ProbeReport
from draftsmith.methods import artefact
from draftsmith.train import stage as trainer
from draftsmith.train.setup import autocast_dtype, resolved_precision


def _cpuinfo_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.fixture
def probe_cleared():
    hardware.probe.cache_clear()
    yield
    hardware.probe.cache_clear()


@pytest.fixture
def fake_cpu(monkeypatch, probe_cleared):
    """fake_cpu(native): this process's CPU, as /proc/cpuinfo would list it, with (AVX-512 BF16) or without (AVX2
    only) bf16 in hardware: the probe itself reads the flags, as on such a machine."""

    def fake(native: bool) -> None:
        flags = {"avx2", "avx512f", "avx512_bf16"} if native else {"avx2"}
        monkeypatch.setattr(hardware, "_cpuinfo", lambda: ("Some CPU", flags))
        hardware.probe.cache_clear()

    return fake


def test_the_cpuinfo_probe_agrees_with_torchs_own_dispatch_probe(probe_cleared):
    flags = _cpuinfo_flags()
    assert "avx2" in flags  # every machine the project meets is x86-64 with AVX2 at least
    info = hardware.cpu_info()
    assert info.native_bf16 == bool({"avx512_bf16", "amx_bf16"} & flags), (info, sorted(flags & {"avx512_bf16"}))
    # what torch's kernels dispatch on (when this torch can tell): the flags decide the same, without torch
    if hasattr(torch.cpu, "_is_avx512_bf16_supported") and hasattr(torch.cpu, "_is_amx_tile_supported"):
        assert info.avx512_bf16 == torch.cpu._is_avx512_bf16_supported()
        assert info.amx == torch.cpu._is_amx_tile_supported()
    assert info.avx512 == torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    assert set(info.flags) == set(hardware.REPORTED_FLAGS) & flags
    assert info.isa in ("AVX2", "AVX512", "AMX") and info.model and info.model != "unknown CPU"
    assert info.describe().startswith(info.model) and ("natively" in info.why) == info.native_bf16


@pytest.mark.parametrize(
    "flags, native, isa",
    [
        ({"avx2"}, False, "AVX2"),
        ({"avx2", "avx512f"}, False, "AVX512"),
        ({"avx2", "avx512f", "avx512_bf16"}, True, "AVX512"),
        ({"avx2", "avx512f", "amx_tile", "amx_bf16"}, True, "AMX"),
        (set(), False, "baseline"),
    ],
)
def test_the_cpuinfo_flags_decide(monkeypatch, probe_cleared, flags, native, isa):
    monkeypatch.setattr(hardware, "_cpuinfo", lambda: ("Some CPU", flags))
    info = hardware.cpu_info()
    assert info.native_bf16 is native and info.isa == isa and "/proc/cpuinfo" in info.why
    assert hardware.auto_dtype_name("cpu") == ("bfloat16" if native else "float32")
    assert hardware.auto_dtype_name("cuda") == "bfloat16"
    assert devices.auto_dtype("cpu") == (torch.bfloat16 if native else torch.float32)


def test_every_auto_follows_the_cpu_and_explicit_choices_do_not(fake_cpu):
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    for forced, dtype in (("1", torch.bfloat16), ("0", torch.float32)):
        fake_cpu(forced == "1")
        assert hardware.native_bf16() is (forced == "1") and "/proc/cpuinfo" in hardware.cpu_info().why
        assert autocast_dtype(cpu, "auto") == (torch.bfloat16 if forced == "1" else None)
        assert resolved_precision(cpu, "auto") == ("bf16" if forced == "1" else "fp32")
        assert resolve_compute_dtype("auto", cpu) == dtype
        assert choose_dtype("auto", _vllm("cpu")).dtype == str(dtype).removeprefix("torch.")
        # explicit choices and accelerators do not depend on the CPU
        assert autocast_dtype(cpu, "fp32") is None and autocast_dtype(cpu, "bf16") == torch.bfloat16
        assert autocast_dtype(gpu, "auto") == torch.bfloat16 and autocast_dtype(gpu, "fp32") is None
        assert (
            resolve_compute_dtype("float32", cpu) == torch.float32
            and choose_dtype("auto", _vllm("cuda")).dtype == "bfloat16"
        )


def _vllm(platform: str) -> ProbeReport:
    """A vLLM of `platform` whose CPU attention has no ISA-specific kernels (nothing but the CPU decides)."""
    return ProbeReport(
        facts=ProbeFacts(installed=True, platform=platform, cpu_attention_amx_bf16=False),
        capabilities=[],
        architecture="LlamaForCausalLM",
        strategy=None,
        reason="",
    )


@pytest.fixture(scope="module")
def tiny_store(tiny_target_dir, tmp_path_factory) -> Path:
    prepared = write_random_prepared(tmp_path_factory.mktemp("hw") / "prepared", tiny_target_dir, 16, 20, 48)
    out = prepared.parent / "store"
    from draftsmith.extract import stage as extract

    extract.run(
        ExtractConfig(prepared=prepared, output=out, device="cpu", aux_layer_ids=[1, 2, 3]), show_progress=False
    )
    return out


def _train(store_dir: Path, out: Path, **kw) -> TrainConfig:
    cfg = TrainConfig(
        data=store_dir,
        output=out,
        draft_vocab_size=320,
        ttt_steps=2,
        lr=3e-3,
        warmup_steps=1,
        token_budget=128,
        eval_fraction=0.2,
        log_every=1,
        save_every=1000,
        device="cpu",
        seed=0,
        max_steps=4,
        **kw,
    )
    trainer.run(cfg)
    return cfg


def _weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    ckpt = artefact.latest_checkpoint(out)
    return load_file(str(ckpt / "model.safetensors"))


def test_train_auto_is_bf16_on_a_bf16_cpu_printed_and_recorded(tiny_store, tmp_path, fake_cpu, capsys):
    fake_cpu(True)
    _train(tiny_store, tmp_path / "auto-bf16")
    assert "train: bf16 (--precision auto on " in capsys.readouterr().err
    assert yaml.safe_load((tmp_path / "auto-bf16" / "config.yaml").read_text())["precision"] == "bf16"
    manifest = json.loads((artefact.latest_checkpoint(tmp_path / "auto-bf16") / "manifest.json").read_text())
    assert manifest["hyperparameters"]["precision"] == "auto"  # what was asked: a resume elsewhere compares this
    _train(tiny_store, tmp_path / "bf16", precision="bf16")
    fake_cpu(False)
    _train(tiny_store, tmp_path / "auto-fp32")
    assert "train: fp32 (--precision auto on " in capsys.readouterr().err
    assert yaml.safe_load((tmp_path / "auto-fp32" / "config.yaml").read_text())["precision"] == "fp32"
    fake_cpu(True)
    _train(tiny_store, tmp_path / "fp32", precision="fp32")

    auto_bf16, bf16, auto_fp32, fp32 = (_weights(tmp_path / d) for d in ("auto-bf16", "bf16", "auto-fp32", "fp32"))
    names = [k for k, v in fp32.items() if v.is_floating_point() and v.numel() > 1000]
    assert names and all(torch.isfinite(fp32[k]).all() and fp32[k].abs().sum() > 0 for k in names)
    assert all(torch.equal(auto_bf16[k], bf16[k]) for k in fp32)  # auto here is exactly --precision bf16
    assert all(torch.equal(auto_fp32[k], fp32[k]) for k in fp32)  # and fp32 does not depend on the CPU
    changed = [k for k in names if not torch.equal(bf16[k], fp32[k])]
    assert changed, "bf16 autocast trained exactly the fp32 weights: it did not run"
    worst = max((bf16[k].float() - fp32[k].float()).abs().max().item() for k in changed)
    assert worst < 0.05, worst  # 4 steps at lr 3e-3: bf16 rounding, not another run


def test_hf_extract_auto_computes_in_bf16_on_a_bf16_cpu(tiny_target_dir, tmp_path, fake_cpu, capsys):
    from draftsmith.extract import stage as extract

    prepared = write_random_prepared(tmp_path / "prepared", tiny_target_dir, 6, 20, 40)
    stores = {}
    for forced, dtype in (("1", "bfloat16"), ("0", "float32")):
        fake_cpu(forced == "1")
        out = tmp_path / f"store-{dtype}"
        extract.run(
            ExtractConfig(prepared=prepared, output=out, device="cpu", aux_layer_ids=[1, 2, 3]), show_progress=False
        )
        assert f"extract: the target runs in {dtype} (--compute-dtype auto on " in capsys.readouterr().err
        s = store.open(out)
        assert s.manifest.compute_dtype == dtype
        assert s.manifest.backend_info["cpu"]["native_bf16"] is (forced == "1")
        stores[dtype] = torch.cat([s[i]["hidden_states"].float() for i in range(len(s))])
    a, b = stores["bfloat16"], stores["float32"]
    assert a.abs().sum() > 0 and not torch.equal(a, b)
    cos = torch.nn.functional.cosine_similarity(a.flatten(1), b.flatten(1), dim=1)
    assert cos.min() > 0.98, cos.min()


def test_openmp_threads_sleep_where_other_processes_run_and_spin_on_an_idle_cpu(monkeypatch):
    import subprocess
    import sys

    from draftsmith.core import threads

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert threads._others_running() >= 1  # the spinning child is runnable
    finally:
        busy.kill()
        busy.wait()
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delitem(sys.modules, "torch")  # as when the CLI imports draftsmith.train first
    for others, policy in ((2, "PASSIVE"), (None, "PASSIVE"), (0, None)):
        monkeypatch.setattr(threads, "_others_running", lambda o=others: o)
        chosen, why = threads._choose_wait_policy()
        assert chosen == policy and ("sleep" in why) and (("spin" in why) == (policy is None)), (others, why)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert threads._choose_wait_policy() == (None, "OMP_WAIT_POLICY=ACTIVE (set by the environment)")
    # `draftsmith train`: chosen before the stage loads torch, gone after (processes started later keep theirs)
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setattr(threads, "_others_running", lambda: 3)
    threads.choose()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and "3 other runnable tasks" in threads.WAIT_POLICY
    threads.release()
    assert "OMP_WAIT_POLICY" not in os.environ


def test_importing_the_train_stage_samples_and_sets_nothing():
    """Behaviour at the top, not at import: `import draftsmith.train` neither reads /proc/stat nor sets
    OMP_WAIT_POLICY (the CLI chooses it, core/threads.py)."""
    import subprocess
    import sys

    code = (
        "import os\nfrom draftsmith.core import threads\n"
        "def sampled(*a, **k):\n    raise AssertionError('sampled at import')\n"
        "threads._others_running = sampled\n"
        "import draftsmith.train\n"
        "print(os.environ.get('OMP_WAIT_POLICY'), threads.WAIT_POLICY)"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None OpenMP's default (draftsmith.train used without the CLI)"
