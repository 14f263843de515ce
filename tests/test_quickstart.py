"""End to end: a reduced quickstart on the real default assets, then a resume that redoes nothing."""

import json
import shlex
import shutil
import time
from pathlib import Path

import pytest

from draftsmith import quickstart
from draftsmith.config import QuickstartConfig
from draftsmith.core.errors import DraftsmithError
from draftsmith.evaluate.report import RunReport, read_report
from draftsmith.export import serve_commands


def test_serve_commands_are_copy_pasteable(tmp_path):
    served, gpu_only = serve_commands(tmp_path / "target dir", tmp_path / "export dir", k=4).items()
    assert "draftsmith serve" in served[1] and "GPU install of real vLLM" in gpu_only[0]
    program, *args = shlex.split(served[1])
    assert shutil.which(program)  # a shell in this directory finds it (`draftsmith` on PATH, else its path)
    assert args[-2:] == ["serve", str(tmp_path / "export dir")]  # the path with a space is quoted
    cmd = gpu_only[1]
    assert cmd.startswith("vllm serve ") and "--speculative-config" in cmd
    spec = json.loads(shlex.split(cmd)[-1])
    assert spec == {"method": "eagle3", "model": str(tmp_path / "export dir"), "num_speculative_tokens": 4}
    assert shlex.split(cmd)[2] == str(tmp_path / "target dir")


def test_stage_configs_chain_outputs_to_inputs(tmp_path):
    cfgs = quickstart.stage_configs(QuickstartConfig(output=tmp_path, budget="small"), engine="hf")
    assert cfgs["extract"].prepared == cfgs["prepare"].output
    assert cfgs["train"].data == cfgs["extract"].output
    assert cfgs["export"].checkpoint == cfgs["train"].output
    assert cfgs["evaluate"].draft == cfgs["export"].output and cfgs["evaluate"].temperature == 0.0
    # the last step proves the draft in vLLM where vLLM evaluates it (the reference decoder has nothing to compare to)
    assert not cfgs["evaluate"].gate
    assert quickstart.stage_configs(QuickstartConfig(output=tmp_path), engine="vllm")["evaluate"].gate


def test_budget_change_on_an_existing_run_is_refused(tmp_path):
    (tmp_path / quickstart.STATE_NAME).write_text(json.dumps({"finished": {}, "budget": "medium"}))
    with pytest.raises(DraftsmithError, match="--budget medium"):
        quickstart.run(QuickstartConfig(output=tmp_path, budget="small", engine="hf"))


def test_recipe_sections_override_the_budget_and_are_validated(tmp_path):
    cfg = QuickstartConfig(
        output=tmp_path, budget="small", train={"lr": 3e-4, "ttt_steps": 5}, evaluate={"max_new_tokens": 17}
    )
    cfgs = quickstart.stage_configs(cfg, engine="hf")
    assert cfgs["train"].lr == 3e-4 and cfgs["train"].method.depths == 5
    assert (
        cfgs["train"].method.draft_vocab_size == quickstart.BUDGETS["small"].draft_vocab_size
    )  # the rest: the budget's
    assert cfgs["evaluate"].max_new_tokens == 17 and cfgs["evaluate"].draft == cfgs["export"].output
    with pytest.raises(DraftsmithError, match=r"^quickstart section train: option ttt_stepz: Extra inputs"):
        quickstart.stage_configs(QuickstartConfig(output=tmp_path, train={"ttt_stepz": 5}), engine="hf")
    with pytest.raises(DraftsmithError, match="quickstart section train: option --lr: Input should be greater"):
        quickstart.stage_configs(QuickstartConfig(output=tmp_path, train={"lr": -1}), engine="hf")
    with pytest.raises(DraftsmithError, match="section extract: option output is set by the quickstart itself"):
        quickstart.stage_configs(QuickstartConfig(output=tmp_path, extract={"output": "elsewhere"}), engine="hf")


def test_online_trains_from_the_prepared_set(tmp_path):
    cfgs = quickstart.stage_configs(QuickstartConfig(output=tmp_path, online=True), engine="hf")
    assert cfgs["train"].data == cfgs["prepare"].output
    (tmp_path / quickstart.STATE_NAME).write_text(json.dumps({"finished": {}, "budget": "small", "online": False}))
    with pytest.raises(DraftsmithError, match="--online False"):
        quickstart.run(QuickstartConfig(output=tmp_path, online=True, engine="hf"))


def test_method_peagle_changes_the_train_stage_only(tmp_path):
    default = quickstart.stage_configs(QuickstartConfig(output=tmp_path), engine="vllm")
    peagle = quickstart.stage_configs(QuickstartConfig(output=tmp_path, method="peagle"), engine="vllm")
    assert default["train"].method.name == "eagle3" and peagle["train"].method.name == "peagle"
    # the budget's shapes, with a parallel depth trained for every evaluated k (small: k 5)
    assert peagle["train"].method.depths == max(default["evaluate"].k) == 5 > default["train"].method.depths
    assert peagle["train"].model_copy(update={"method": default["train"].method}) == default["train"]
    assert all(peagle[s] == default[s] for s in default if s != "train")  # export / evaluate read the draft
    with pytest.raises(DraftsmithError, match=r"^quickstart section train: option method is the quickstart's own"):
        quickstart.stage_configs(QuickstartConfig(output=tmp_path, train={"method": "peagle"}), engine="hf")
    (tmp_path / quickstart.STATE_NAME).write_text(json.dumps({"finished": {}, "budget": "small", "method": "eagle3"}))
    with pytest.raises(DraftsmithError, match="was started with --method eagle3"):
        quickstart.run(QuickstartConfig(output=tmp_path, method="peagle", engine="hf"))


@pytest.mark.parametrize("recipe", sorted((Path(__file__).parents[1] / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_recipe_loads_with_config(recipe, tmp_path):
    from draftsmith.config import load_config

    cfg = load_config(QuickstartConfig, recipe, {"output": tmp_path})
    cfgs = quickstart.stage_configs(cfg, engine="vllm")
    assert cfgs["evaluate"].draft == cfgs["export"].output
    assert (cfgs["train"].data == cfgs["prepare"].output) == cfg.online


def test_the_quickstart_recipe_is_the_default_run():
    from draftsmith.config import load_config

    recipe = load_config(QuickstartConfig, Path(__file__).parents[1] / "recipes" / "quickstart.yaml", {})
    assert quickstart.stage_configs(recipe, "vllm") == quickstart.stage_configs(QuickstartConfig(), "vllm")


def test_method_dflash_extracts_its_layers_and_trains_its_blocks(tmp_path, default_target_dir):
    default = quickstart.stage_configs(QuickstartConfig(output=tmp_path), engine="vllm")
    dflash = quickstart.stage_configs(QuickstartConfig(output=tmp_path, method="dflash"), engine="vllm")
    block, layers, anchors = quickstart.BUDGETS["small"].dflash
    assert block == max(default["evaluate"].k) + 1  # a round of block - 1 tokens: the budget's k
    train = dflash["train"]
    options = train.method
    assert (options.name, options.block_size, train.num_layers, options.anchors_per_sample, options.depths) == (
        "dflash",
        block,
        layers,
        anchors,
        block - 1,
    )
    assert dflash["extract"].aux_layer_ids == [2, 28] and default["extract"].aux_layer_ids is None  # 30 layers
    assert train.token_budget == default["train"].token_budget and train.epochs == default["train"].epochs
    assert all(dflash[s] == default[s] for s in ("prepare", "export", "evaluate"))  # they read the draft


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The quickstart at the tiny budget with every default but the engine (precision and dtypes `auto`: bf16 on a CPU
    that computes it natively), evaluated by the reference decoder: each evaluation in vLLM is an engine start per k
    (its gate in vLLM: test_quickstart_export_passes_its_gate_in_vllm_and_its_drifted_copy_fails)."""
    cfg = QuickstartConfig(output=tmp_path_factory.mktemp("quickstart") / "qs", budget="tiny", engine="hf", k=[1, 3])
    return cfg, quickstart.run(cfg)


@pytest.mark.slow
def test_tiny_quickstart_end_to_end_and_resume(tiny_run):
    cfg, result = tiny_run
    out = cfg.output
    for artefact in (
        "prepared/manifest.json",
        "store/manifest.json",
        "export/config.json",
        "export/model.safetensors",
        "eval/report.json",
        "eval/report.md",
        "eval/acceptance_per_position.png",
        "eval/tau_by_domain.png",
        "quickstart.json",
        "config.yaml",
    ):
        assert (out / artefact).is_file(), artefact
    report = read_report(out / "eval" / "report.json")
    assert result.result == report  # the quickstart returns its evaluation's report
    taus = {r.k: r.tau for r in report.runs}
    assert set(taus) == {1, 3} and taus[3] > 1.0
    assert [(d.name, d.num_prompts) for d in report.domains] == [("chat", 1), ("code", 1), ("math", 1), ("agentic", 1)]
    assert (
        result.summary["τ by domain (k=3)"].startswith("chat ") and ", agentic " in result.summary["τ by domain (k=3)"]
    )
    served, gpu_only = result.commands.values()
    assert served.endswith(f"draftsmith serve {out / 'export'}") and gpu_only.startswith("vllm serve")
    state = json.loads((out / "quickstart.json").read_text())
    assert set(state["finished"]) == set(quickstart.STAGES)

    # Killed after training: only export and evaluate run again; the rest is reused as it is.
    del state["finished"]["export"], state["finished"]["evaluate"]
    (out / "quickstart.json").write_text(json.dumps(state))
    store_manifest = (out / "store" / "manifest.json").read_text()
    again = quickstart.run(cfg)
    assert (out / "store" / "manifest.json").read_text() == store_manifest
    assert again.summary["data"] == result.summary["data"]

    # A finished run started again redoes nothing.
    t0 = time.perf_counter()
    quickstart.run(cfg)
    assert time.perf_counter() - t0 < 30


@pytest.mark.slow
@pytest.mark.vllm
def test_quickstart_export_passes_its_gate_in_vllm_and_its_drifted_copy_fails(tiny_run, tmp_path, monkeypatch):
    """The quickstart's export (a weak draft: τ near 1.2) through its last step, `evaluate --gate`, with every default
    (dtype `auto`: bf16 where this CPU computes it and vLLM has the kernels): it passes; a copy whose config.json has
    the aux layer ids shifted by one fails naming that key, though the acceptance of so weak a draft could not tell."""
    pytest.importorskip("vllm")
    from test_gate import alter, shift_layer

    from draftsmith.evaluate import gate
    from draftsmith.evaluate import run as evaluate
    from draftsmith.extract.vllm.probe import probe

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in the worker process: most of a start on a CPU
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    cfg, _ = tiny_run
    gated = quickstart.stage_configs(cfg, engine="vllm")["evaluate"]
    assert gated.gate and gated.dtype == "auto"

    def gate_of(draft, name):
        update = {"draft": draft, "output": tmp_path / name, "baseline": False, "k": [3], "num_prompts": 1}
        return gated.model_copy(update=update)  # one prompt of each of the suite's four domains: ~80 rounds

    result = evaluate(gate_of(cfg.output / "export", "gate"))
    report = read_report(tmp_path / "gate" / "report.json")
    assert report.gate is not None and result.result is not None
    [check] = report.gate.checks
    assert report.gate.passed and result.result.engine == "vllm" and report.runs[0].num_rounds > 40
    assert result.result.gate is not None and result.result.gate.checks[0].k == 3
    assert result.result.gate.checks[0].verdict.startswith("gate passed: vLLM 0.")
    # the quickstart's suite: every domain decoded in one vLLM engine, a row each, the whole their sum
    assert sorted(p.name for p in (tmp_path / "gate" / "vllm").glob("*.log")) == ["k3.log"]
    assert [(d.name, d.num_prompts) for d in report.domains] == [("chat", 1), ("code", 1), ("math", 1), ("agentic", 1)]
    whole, parts = report.runs[0], [d.runs[0] for d in report.domains]
    assert all(p.num_rounds > 0 and p.tokens_per_s > 0 for p in parts) and whole.num_accepted > 0
    assert whole.num_rounds == sum(p.num_rounds for p in parts)
    assert whole.num_accepted == sum(p.num_accepted for p in parts)
    assert whole.per_prompt == [c for p in parts for c in p.per_prompt]
    if probe().facts.per_request_spec_steps:  # vLLM's rounds by segment; SmolLM2 writes neither reasoning nor calls
        assert whole.by_segment is not None and whole.by_segment["content"].rounds == whole.num_rounds
    drifted = alter(cfg.output / "export", tmp_path / "drifted", shift_layer)
    with pytest.raises(
        gate.GateFailed, match="^gate failed: config.json changed since export: eagle_aux_hidden_st"
    ) as err:
        evaluate(gate_of(drifted, "drifted"))
    assert "as trained, and vLLM 0." in str(err.value) and "reads it" in str(err.value)
    assert str(tmp_path / "drifted" / "report.md") in str(err.value)
    report = read_report(tmp_path / "drifted" / "report.json")  # written before the verdict
    assert report.gate is not None and not report.gate.passed
    [check] = report.gate.checks
    assert check.config_drift and check.config_drift[0].startswith("eagle_aux_hidden_state_layer_ids")
    assert check.not_read_by_vllm == []  # this vLLM reads the key (each other key: test_gate's fast tests)


def test_tau_for_k_not_run_is_read_off_the_longest_run():
    runs = [
        RunReport(k=3, tau=2.1, speedup=1.4, acceptance_per_pos=[0.6, 0.3, 0.2], tokens_per_s=1.0),
        RunReport(k=5, tau=2.3, speedup=None, acceptance_per_pos=[0.62, 0.33, 0.2, 0.1, 0.05], tokens_per_s=1.0),
    ]
    lines = quickstart.tau_lines(runs)
    assert list(lines) == ["k=1", "k=2", "k=3", "k=4", "k=5"]
    assert lines["k=1"] == "τ 1.62 (read off the k=5 run)" and lines["k=2"] == "τ 1.95 (read off the k=5 run)"
    assert lines["k=3"] == "τ 2.10, speed-up 1.40x; acceptance per position 0.60 0.30 0.20"  # measured, as is
    assert lines["k=4"].startswith("τ 2.25 (read off") and lines["k=5"].startswith("τ 2.30; acceptance")


def test_tau_lines_of_a_peagle_draft_mark_the_k_past_its_trained_depths():
    runs = [RunReport(k=4, tau=1.9, speedup=None, acceptance_per_pos=[0.5, 0.3, 0.1, 0.0], tokens_per_s=1.0)]
    lines = quickstart.tau_lines(runs, depths_trained=3)
    assert lines["k=3"] == "τ 1.90 (read off the k=4 run)"
    assert lines["k=4"] == "τ 1.90; acceptance per position 0.50 0.30 0.10 0.00 — past the 3 depths trained"
    assert quickstart.tau_lines(runs)["k=4"] == "τ 1.90; acceptance per position 0.50 0.30 0.10 0.00"


NO_EAGLE3_HERE = "not on cpu (the CPU model runner refuses speculative decoding)"


def _probe_says(monkeypatch, *, installed=True, version="0.32.0", eagle3=True, parallel_drafting=True):
    """The probe as evaluate and quickstart call it, reading a vLLM with these facts; returns the calls' log."""
    from draftsmith.evaluate import vllm_runner
    from draftsmith.extract.vllm.probe import (
        EAGLE3_ROW,
        Capability,
        ProbeFacts,
        ProbeReport,
    )
    from draftsmith.methods.peagle import ROW as PARALLEL_DRAFTING_ROW

    facts = ProbeFacts(
        installed=installed,
        version=version if installed else None,
        platform="cpu",
        eagle3_on_platform=eagle3,
        parallel_drafting=parallel_drafting,
    )
    report = ProbeReport(
        facts=facts,
        architecture="LlamaForCausalLM",
        strategy="direct",
        reason="",
        capabilities=[
            Capability(name=EAGLE3_ROW, found="yes" if eagle3 else NO_EAGLE3_HERE, ok=eagle3, meaning=""),
            Capability(
                name=PARALLEL_DRAFTING_ROW,
                found="yes" if parallel_drafting else "no SpeculativeConfig.parallel_drafting",
                ok=parallel_drafting,
                meaning="",
            ),
        ],
    )
    calls = []
    monkeypatch.setattr(vllm_runner, "probe", lambda **kw: calls.append(kw) or report)
    return calls


def test_the_evaluation_engine_is_one_that_can_decode_the_draft_here(monkeypatch, tmp_path, tiny_target_dir):
    def engine(engine, method="eagle3", state=None):
        cfg = QuickstartConfig(output=tmp_path, target=str(tiny_target_dir), engine=engine, method=method)
        return quickstart._evaluation_engine(cfg, state)

    calls = _probe_says(monkeypatch, eagle3=True, parallel_drafting=False)
    assert engine("auto") == engine("vllm") == ("vllm", "vLLM 0.32.0")
    assert calls[0]["architecture"] == "LlamaForCausalLM"  # the target's, from its config.json
    assert engine("hf") == ("hf", "reference decoder (asked for)") and len(calls) == 2  # hf: no probe
    # --method peagle needs parallel drafting too
    assert engine("auto", "peagle") == (
        "hf",
        (
            "reference decoder (vLLM 0.32.0 has no parallel drafting for this "
            "P-EAGLE draft: no SpeculativeConfig.parallel_drafting)"
        ),
    )
    with pytest.raises(
        DraftsmithError,
        match=r"^--engine vllm: vLLM 0\.32\.0 has no parallel drafting for this "
        r"P-EAGLE draft \(no SpeculativeConfig\.parallel_drafting\); use a vLLM",
    ):
        engine("vllm", "peagle")
    _probe_says(monkeypatch, version="0.16.0", eagle3=False)
    assert engine("auto") == (
        "hf",
        (f"reference decoder (vLLM 0.16.0 cannot run EAGLE-3 speculative decoding here: {NO_EAGLE3_HERE})"),
    )
    _probe_says(monkeypatch, installed=False)
    assert engine("auto") == ("hf", "reference decoder (vLLM is not installed)")
    with pytest.raises(DraftsmithError, match="^--engine vllm needs vLLM, which is not installed"):
        engine("vllm")
    # a finished evaluation's engine is read from the state, without probing vLLM again
    calls = _probe_says(monkeypatch)
    finished = {"finished": {"evaluate": {}}, "engine": {"engine": "hf", "why": "reference decoder (asked for)"}}
    assert engine("auto", state=finished) == ("hf", "reference decoder (asked for)") and not calls


class _Stop(Exception):
    pass


def _stages_stop_at_once(monkeypatch):
    """Every stage of the quickstart raises _Stop when it is run: a test sees what happened before the first."""
    import types

    def run(cfg):
        raise _Stop(type(cfg).__name__)

    for stage in list(quickstart._STAGE_MODULES):
        monkeypatch.setitem(quickstart._STAGE_MODULES, stage, types.SimpleNamespace(run=run))


def test_auto_says_before_the_first_stage_which_engine_will_evaluate_and_why(monkeypatch, tmp_path, tiny_target_dir):
    import io

    from rich.console import Console

    _probe_says(monkeypatch, version="0.16.0", eagle3=False)
    _stages_stop_at_once(monkeypatch)
    console = Console(file=io.StringIO(), width=400)
    with pytest.raises(_Stop, match="PrepareConfig"):
        quickstart.run(QuickstartConfig(output=tmp_path, target=str(tiny_target_dir), budget="tiny"), console)
    printed = console.file.getvalue()
    assert (
        f"evaluation engine: reference decoder (vLLM 0.16.0 cannot run EAGLE-3 speculative decoding here: "
        f"{NO_EAGLE3_HERE})" in printed
    )
    assert printed.index("evaluation engine:") < printed.index("prepare")


def test_engine_vllm_that_cannot_decode_here_is_refused_before_any_stage_runs(monkeypatch, tmp_path, tiny_target_dir):
    _probe_says(monkeypatch, version="0.16.0", eagle3=False)
    _stages_stop_at_once(monkeypatch)
    out = tmp_path / "qs"
    with pytest.raises(DraftsmithError) as err:
        quickstart.run(QuickstartConfig(output=out, target=str(tiny_target_dir), budget="tiny", engine="vllm"))
    message = str(err.value)
    assert "\n" not in message and message.startswith(
        f"--engine vllm: vLLM 0.16.0 cannot run EAGLE-3 speculative decoding here ({NO_EAGLE3_HERE}); "
    )
    assert message.endswith("or use the reference decoder (--engine hf)")
    assert sorted(p.name for p in out.iterdir()) == []  # no stage output, no state, no resolved config


def test_eta_is_not_thrown_off_by_a_quick_first_stage_and_follows_a_slow_long_one():
    budget = quickstart.BUDGETS["small"]
    rest = ["extract", "train", "export", "evaluate"]
    planned = quickstart._eta(budget, {"finished": {}}, rest)
    assert planned == sum(budget.expected_s[1:])
    after_quick_prepare = quickstart._eta(budget, {"finished": {"prepare": {"seconds": 2.0}}}, rest)
    assert 0.9 * planned < after_quick_prepare < planned  # a 2 s prepare (10 s expected) once said 1 min of 12
    slow = {"prepare": {"seconds": 10.0}, "extract": {"seconds": 2.0 * budget.expected_s[1]}}
    after_slow_extract = quickstart._eta(budget, {"finished": slow}, rest[1:])
    assert 1.5 * sum(budget.expected_s[2:]) < after_slow_extract < 2.0 * sum(budget.expected_s[2:])


def test_a_target_too_big_for_the_reference_decoder_ends_after_export_where_vllm_cannot_decode(
    monkeypatch, tmp_path, tiny_target_dir
):
    """vLLM refuses the draft here and the target does not fit one device (Kimi-K2.5 beside vLLM 0.16): the
    quickstart says so before its first stage and ends with the export and the command that evaluates it."""
    import io
    import types

    from rich.console import Console

    from draftsmith.config import StageResult
    from draftsmith.core import targets

    _probe_says(monkeypatch, version="0.16.0", eagle3=False)
    monkeypatch.setattr(targets, "hf_backend_hint", lambda target: "")  # 2 x its checkpoint > this device
    ran = []

    def run(cfg):
        ran.append(type(cfg).__name__)
        return StageResult(stage="x", output=tmp_path, summary={})

    for stage in list(quickstart._STAGE_MODULES):
        monkeypatch.setitem(quickstart._STAGE_MODULES, stage, types.SimpleNamespace(run=run))
    monkeypatch.setattr(quickstart, "_summary", lambda cfg, configs, state, why, report: ({"evaluation": why}, {}))
    console = Console(file=io.StringIO(), width=400)
    result = quickstart.run(
        QuickstartConfig(output=tmp_path / "qs", target=str(tiny_target_dir), budget="tiny"), console
    )
    assert ran == ["PrepareConfig", "ExtractConfig", "TrainConfig", "ExportConfig"]
    assert result.summary["evaluation"] == (
        f"none here: vLLM 0.16.0 cannot run EAGLE-3 speculative decoding here: {NO_EAGLE3_HERE}, and the target "
        "does not fit one device for the reference decoder; the run stops after export (evaluate the export where a "
        "vLLM that can decode it is installed)"
    )
    assert "evaluation engine: none here: " in console.file.getvalue()
