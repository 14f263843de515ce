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


def test_budget_change_on_an_existing_run_is_refused(tmp_path):
    (tmp_path / quickstart.STATE_NAME).write_text(json.dumps({"finished": {}, "budget": "medium"}))
    with pytest.raises(DraftsmithError, match="--budget medium"):
        quickstart.run(QuickstartConfig(output=tmp_path, budget="small", engine="hf"))


def test_recipe_sections_override_the_budget_and_are_validated(tmp_path):
    cfg = QuickstartConfig(output=tmp_path, budget="small", train={"lr": 3e-4, "ttt_steps": 5},
                           evaluate={"max_new_tokens": 17})
    cfgs = quickstart.stage_configs(cfg, engine="hf")
    assert cfgs["train"].lr == 3e-4 and cfgs["train"].ttt_steps == 5
    assert cfgs["train"].draft_vocab_size == quickstart.BUDGETS["small"].draft_vocab_size  # the rest: the budget's
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
    assert default["train"].method == "eagle3" and peagle["train"].method == "peagle"
    # the budget's shapes, with a parallel depth trained for every evaluated k (small: k 5)
    assert peagle["train"].ttt_steps == max(default["evaluate"].k) == 5 > default["train"].ttt_steps
    assert peagle["train"].model_copy(update={"method": "eagle3", "ttt_steps": default["train"].ttt_steps}) == \
        default["train"]
    assert all(peagle[s] == default[s] for s in default if s != "train")  # export / evaluate read the draft
    with pytest.raises(DraftsmithError, match=r"^quickstart section train: option method is the quickstart's own"):
        quickstart.stage_configs(QuickstartConfig(output=tmp_path, train={"method": "peagle"}), engine="hf")
    (tmp_path / quickstart.STATE_NAME).write_text(json.dumps({"finished": {}, "budget": "small", "method": "eagle3"}))
    with pytest.raises(DraftsmithError, match="was started with --method eagle3"):
        quickstart.run(QuickstartConfig(output=tmp_path, method="peagle", engine="hf"))


@pytest.mark.parametrize("recipe", sorted((Path(__file__).parents[1] / "recipes").glob("*.yaml")),
                         ids=lambda p: p.name)
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


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    cfg = QuickstartConfig(output=tmp_path_factory.mktemp("quickstart") / "qs", budget="tiny", engine="hf", k=[1, 3])
    return cfg, quickstart.run(cfg)


@pytest.mark.slow
def test_tiny_quickstart_end_to_end_and_resume(tiny_run):
    cfg, result = tiny_run
    out = cfg.output
    for artefact in ("prepared/manifest.json", "store/manifest.json", "export/config.json",
                     "export/model.safetensors", "eval/report.json", "eval/report.md",
                     "eval/acceptance_per_position.png", "quickstart.json", "config.yaml"):
        assert (out / artefact).is_file(), artefact
    report = json.loads((out / "eval" / "report.json").read_text())
    taus = {r["k"]: r["tau"] for r in report["runs"]}
    assert set(taus) == {1, 3} and taus[3] > 1.0
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
def test_quickstart_export_loads_in_vllm(tiny_run, tmp_path):
    pytest.importorskip("vllm")
    from draftsmith.config import EvaluateConfig
    from draftsmith.evaluate import run as evaluate

    cfg, _ = tiny_run
    result = evaluate(EvaluateConfig(draft=cfg.output / "export", engine="vllm", output=tmp_path / "vllm-eval",
                                     num_prompts=1, max_new_tokens=16, k=[3], baseline=False))
    report = json.loads((tmp_path / "vllm-eval" / "report.json").read_text())
    assert report["runs"][0]["k"] == 3 and report["runs"][0]["tau"] >= 1.0
    assert result.summary["engine"] == "vllm"


def test_tau_for_k_not_run_is_read_off_the_longest_run():
    runs = [{"k": 3, "tau": 2.1, "speedup": 1.4, "acceptance_per_pos": [0.6, 0.3, 0.2]},
            {"k": 5, "tau": 2.3, "speedup": None, "acceptance_per_pos": [0.62, 0.33, 0.2, 0.1, 0.05]}]
    lines = quickstart.tau_lines(runs)
    assert list(lines) == ["k=1", "k=2", "k=3", "k=4", "k=5"]
    assert lines["k=1"] == "τ 1.62 (read off the k=5 run)" and lines["k=2"] == "τ 1.95 (read off the k=5 run)"
    assert lines["k=3"] == "τ 2.10, speed-up 1.40x; acceptance per position 0.60 0.30 0.20"  # measured, as is
    assert lines["k=4"].startswith("τ 2.25 (read off") and lines["k=5"].startswith("τ 2.30; acceptance")


def test_tau_lines_of_a_peagle_draft_mark_the_k_past_its_trained_depths():
    runs = [{"k": 4, "tau": 1.9, "speedup": None, "acceptance_per_pos": [0.5, 0.3, 0.1, 0.0]}]
    lines = quickstart.tau_lines(runs, depths_trained=3)
    assert lines["k=3"] == "τ 1.90 (read off the k=4 run)"
    assert lines["k=4"] == "τ 1.90; acceptance per position 0.50 0.30 0.10 0.00 — past the 3 depths trained"
    assert quickstart.tau_lines(runs)["k=4"] == "τ 1.90; acceptance per position 0.50 0.30 0.10 0.00"


def test_evaluation_uses_vllm_exactly_when_it_is_installed(monkeypatch):
    from draftsmith.evaluate import vllm_runner

    monkeypatch.setattr(vllm_runner, "vllm_available", lambda: "0.32.0")
    assert quickstart._evaluation_engine("auto") == ("vllm", "vLLM 0.32.0")
    assert quickstart._evaluation_engine("vllm")[0] == "vllm"
    assert quickstart._evaluation_engine("hf") == ("hf", "reference decoder (asked for)")
    monkeypatch.setattr(vllm_runner, "vllm_available", lambda: None)
    assert quickstart._evaluation_engine("auto") == ("hf", "reference decoder (vLLM is not installed)")
    with pytest.raises(DraftsmithError, match="--engine vllm: vLLM is not installed"):
        quickstart._evaluation_engine("vllm")
    # a finished evaluation's engine is read from the state, without probing vLLM again
    monkeypatch.setattr(vllm_runner, "vllm_available", lambda: pytest.fail("probed vLLM after the evaluation"))
    finished = {"finished": {"evaluate": {}}, "engine": {"engine": "vllm", "why": "vLLM 0.32.0"}}
    assert quickstart._evaluation_engine("auto", finished) == ("vllm", "vLLM 0.32.0")


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
