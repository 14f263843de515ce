"""The CLI shell: generated options, config files, one-line errors, not-built stages."""

import pytest
import yaml
from typer.testing import CliRunner

from draftsmith import config
from draftsmith.cli import app
from draftsmith.core.errors import DraftsmithError

runner = CliRunner()


@pytest.mark.parametrize(
    "command", ["prepare", "extract", "train", "export", "evaluate", "quickstart", "doctor", "inspect", "store"]
)
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
    architectures = [
        line.split()[0]
        for line in lines[lines.index(next(line for line in lines if line.startswith("architectures:"))) + 1 : -1]
    ]
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


def _doctor_subprocess(*args: str, code: str | None = None, columns: int = 80):
    """`python -m draftsmith doctor ARGS` (or `python -c CODE`) in a fresh interpreter at `columns` columns, this
    checkout's draftsmith first on its path."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import draftsmith

    src = str(Path(draftsmith.__file__).resolve().parents[1])
    env = {
        **os.environ,
        "COLUMNS": str(columns),
        "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p),
    }
    argv = ["-c", code] if code is not None else ["-m", "draftsmith", "doctor", *args]
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300, env=env)


_MODULES_AFTER_DOCTOR = """
import io, json, sys
from rich.console import Console
from draftsmith import doctor
doctor.run(Console(file=io.StringIO(), width=80))
doctor.run(Console(file=io.StringIO(), width=80), as_json=True)
doctor.run(Console(file=io.StringIO(), width=200), verbose=True)
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} & {"torch", "transformers", "vllm"})))
"""


def test_doctor_at_80_columns_is_one_screen_and_loads_neither_torch_nor_transformers(tmp_path):
    import importlib.metadata
    import json

    from draftsmith.core import hardware

    done = _doctor_subprocess()
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert 10 <= len(lines) <= 40 and max(map(len, lines)) <= 80, done.stdout
    assert not [line for line in lines if line != line.rstrip()], "lines padded to the screen's width"
    cpu, gpus = hardware.cpu_info(), hardware.gpu_names()
    assert lines[1].startswith(f"  CPU {cpu.isa}, ") and ("no GPU" in lines[0]) is (not gpus), done.stdout
    assert ("no bf16 in hardware" in lines[1]) is not (cpu.amx or cpu.avx512_bf16), lines[1]
    assert f"auto precision: {hardware.auto_dtype_name('cuda' if gpus else 'cpu')}" in lines[1], lines[1]
    built = _doctor_subprocess(code=_MODULES_AFTER_DOCTOR)
    assert built.returncode == 0, built.stderr[-2000:]
    assert json.loads(built.stdout.splitlines()[-1]) == []  # the summary, --json and --verbose alike
    # --target reads the target's config with transformers (planning.py), only then; the draft's sizes come from its
    # spec (methods/spec.py), so draftsmith loads no torch for it (transformers 4 imports torch itself with a config)
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": 576,
                "intermediate_size": 1536,
                "num_attention_heads": 9,
                "num_key_value_heads": 3,
                "num_hidden_layers": 30,
                "rms_norm_eps": 1e-5,
                "max_position_embeddings": 8192,
                "vocab_size": 49152,
                "rope_theta": 100000.0,
                "hidden_act": "silu",
            }
        )
    )
    sized = _doctor_subprocess(
        code=_MODULES_AFTER_DOCTOR.replace(
            "doctor.run(Console(file=io.StringIO(), width=80))",
            f"doctor.run(Console(file=io.StringIO(), width=80), target={str(config)!r})",
        )
    )
    transformers_4 = importlib.metadata.version("transformers").startswith("4.")
    loaded = json.loads(sized.stdout.splitlines()[-1]) if sized.returncode == 0 else None
    assert loaded == (["torch", "transformers"] if transformers_4 else ["transformers"]), sized.stderr[-2000:]


def test_doctor_verbose_lists_every_capability_and_json_keeps_its_environment():
    import json

    from draftsmith.doctor import environment_rows

    report = json.loads(runner.invoke(app, ["doctor", "--json"]).stdout)
    names = [cap["name"] for cap in report["vllm"]["capabilities"]]
    assert names, report["vllm"]
    full = _doctor_subprocess("--verbose", columns=1000)  # wide enough that no cell wraps
    assert full.returncode == 0, full.stderr[-2000:]
    missing = [name for name in names if name not in full.stdout]
    assert not missing, f"--verbose lost capability rows: {missing}"
    short = runner.invoke(app, ["doctor"], terminal_width=80).output
    if len(names) > 1:  # a vLLM read: the summary counts the capabilities that are as needed instead of listing them
        assert sum(name in short for name in names) < len(names)
    else:  # none installed (the transformers 4.57.6 stage): its one row is the summary's line
        assert names == ["vLLM"] and "vLLM: not found" in short, short
    keys = {"draftsmith", "python", "platform", "cpu cores", "torch", "transformers", "vllm", "gpus", "cache"}
    assert keys <= set(report["environment"]) and set(report["environment"]) == {k for k, _ in environment_rows()}
    assert all(k in keys or k.startswith("asset: ") for k in report["environment"])


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
    cmd = "vllm serve /models/" + "x" * 90 + ' --speculative-config \'{"method": "eagle3"}\''
    cli._print_result(StageResult(stage="s", output=Path("o"), summary={"a": 1}, commands={"serve it": cmd}))
    lines = cli.console.export_text().splitlines()
    assert cmd in lines and "serve it:" in lines
