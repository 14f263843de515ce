"""The CLI shell: generated options, config files, one-line errors, not-built stages."""

import pytest
import yaml
from typer.testing import CliRunner

from draftsmith import config
from draftsmith.cli import app
from draftsmith.core.errors import DraftsmithError

runner = CliRunner()


@pytest.mark.parametrize("command", ["prepare", "extract", "train", "export", "evaluate", "quickstart", "doctor",
                                     "inspect", "store"])
def test_every_command_has_help(command):
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output


def test_prepare_help_lists_config_fields():
    out = runner.invoke(app, ["prepare", "--help"], terminal_width=200).output
    for flag in ("--config", "--data", "--target", "--max-length", "--overflow", "--output"):
        assert flag in out


def test_yaml_then_flags(tmp_path):
    cfg_file = tmp_path / "prep.yaml"
    cfg_file.write_text(yaml.safe_dump({"max_length": 512, "overflow": "drop", "data": ["a.json", "b.jsonl"]}))
    cfg = config.load_config(config.PrepareConfig, cfg_file, {"max_length": 1024, "overflow": None})
    assert cfg.max_length == 1024 and cfg.overflow == "drop" and cfg.data == ["a.json", "b.jsonl"]
    assert config.load_config(config.PrepareConfig, None, {"data": "x.json, y.json"}).data == ["x.json", "y.json"]


def test_bad_config_values_are_one_line_errors(tmp_path):
    with pytest.raises(DraftsmithError, match="--max-length"):
        config.load_config(config.PrepareConfig, None, {"max_length": 3})
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_lenght: 10\n")
    with pytest.raises(DraftsmithError, match="bad.yaml.*max_lenght"):
        config.load_config(config.PrepareConfig, bad, {})
    bad.write_text("- just\n- a list\n")
    with pytest.raises(DraftsmithError, match="mapping"):
        config.load_config(config.PrepareConfig, bad, {})
    with pytest.raises(DraftsmithError, match="does not exist"):
        config.load_config(config.PrepareConfig, tmp_path / "missing.yaml", {})


def test_cli_prints_user_errors_without_traceback():
    result = runner.invoke(app, ["prepare", "--max-length", "3"])
    assert result.exit_code == 1
    assert "error:" in result.output and "Traceback" not in result.output


def test_invalid_choice_is_rejected_by_the_cli():
    result = runner.invoke(app, ["extract", "--backend", "tensorrt"])
    assert result.exit_code == 2


def test_shard_syntax_is_checked():
    with pytest.raises(DraftsmithError, match="i/n"):
        config.load_config(config.ExtractConfig, None, {"shard": "3"})
    with pytest.raises(DraftsmithError, match="0 <= i < n"):
        config.load_config(config.ExtractConfig, None, {"shard": "4/4"})
    assert config.parse_shard("1/4") == (1, 4)


def test_resolved_config_is_written(tmp_path):
    cfg = config.PrepareConfig(max_length=100)
    config.save_resolved_config(cfg, tmp_path)
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["max_length"] == 100


def test_inspect_on_a_non_artefact_is_a_user_error(tmp_path):
    result = runner.invoke(app, ["inspect", str(tmp_path)])
    assert result.exit_code == 1 and "not a draftsmith artefact" in result.output


def test_doctor_fits_one_screen_and_verbose_shows_the_full_tables():
    import importlib.util
    import re

    from draftsmith.extract.vllm.probe import TESTED_ARCHITECTURES

    result = runner.invoke(app, ["doctor"], terminal_width=80)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) <= 40 and max(map(len, lines)) <= 80, result.output
    for word in ("Python", "torch", "transformers", "vllm", "default assets cached", "--verbose"):
        assert word in result.output
    if importlib.util.find_spec("vllm") is not None:
        assert re.search(r"^  strategy: (connector|direct) for LlamaForCausalLM", result.output, re.M)
        assert "compute dtype (auto): " in result.output
    architectures = [line.split()[0] for line in lines[lines.index(next(
        line for line in lines if line.startswith("architectures:"))) + 1:-1]]
    assert architectures == list(TESTED_ARCHITECTURES)  # one line each
    assert " INFO " not in result.output and " WARNING " not in result.output  # vLLM is read, never started
    full = runner.invoke(app, ["doctor", "--verbose"], terminal_width=200)
    assert full.exit_code == 0 and "asset: sharegpt-v3" in full.output
    assert "vLLM extraction capabilities (found by inspection)" in full.output


def test_doctor_json_is_one_object_with_the_probe_facts():
    import importlib.util
    import json

    from draftsmith.extract.vllm.probe import TESTED_ARCHITECTURES

    result = runner.invoke(app, ["doctor", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # stdout holds the JSON object and nothing else
    assert set(report) == {"draftsmith", "environment", "vllm", "architectures"}
    facts = report["vllm"]["facts"]
    assert facts["installed"] is (importlib.util.find_spec("vllm") is not None)
    assert facts["async_scheduling_resolved"] is None  # no runtime step unless --runtime
    assert [a["architecture"] for a in report["architectures"]] == list(TESTED_ARCHITECTURES)
    if facts["installed"]:
        assert report["environment"]["vllm"] == facts["version"] == report["vllm"]["version"]
        assert report["vllm"]["source"].endswith("vllm") and report["vllm"]["strategy"] in ("connector", "direct")
        assert report["vllm"]["usable"][report["vllm"]["strategy"]] is True
        assert all(a["vLLM class"] != "not registered" for a in report["architectures"])


def test_python_dash_m_runs_the_cli():
    """`torchrun -m draftsmith train ...` relies on the package being runnable as a module."""
    import subprocess
    import sys

    from draftsmith import __version__

    out = subprocess.run([sys.executable, "-m", "draftsmith", "version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == __version__, out.stderr[-2000:]


def test_commands_are_printed_whole_below_the_table(monkeypatch):
    """A serve command wrapped or cut by the table's width would not paste; it goes out on one line."""
    import io
    from pathlib import Path

    from rich.console import Console

    from draftsmith import cli
    from draftsmith.config import StageResult

    monkeypatch.setattr(cli, "console", Console(width=60, record=True, file=io.StringIO()))
    cmd = "vllm serve /models/" + "x" * 90 + " --speculative-config '{\"method\": \"eagle3\"}'"
    cli._print_result(StageResult(stage="s", output=Path("o"), summary={"a": 1}, commands={"serve it": cmd}))
    lines = cli.console.export_text().splitlines()
    assert cmd in lines and "serve it:" in lines
