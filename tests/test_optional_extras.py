"""Every optional dependency, missing, is one line naming the extra that brings it, never a traceback: matplotlib
(`report`: the evaluation report is written without its charts and says how to get them), `datasets`, Mooncake
(`mooncake`) and TensorBoard (`tensorboard`: metrics.jsonl is written either way). Each is made missing here the way
Python sees an absent package (`sys.modules[name] = None` makes `import name` raise ImportError), whatever this venv
holds. gguf is no extra (a dependency: the embedded default target is a GGUF file), and no module of src/ imports
openai (the test tools use it against `draftsmith serve`)."""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

import pytest

from draftsmith.core.errors import DraftsmithError
from draftsmith.evaluate import report as report_module

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]

REPORT = report_module.EvaluationReport.model_validate(
    {
        "engine": "hf",
        "target": "/t/target",
        "draft": "/t/draft",
        "prompts": "mt-bench",
        "num_prompts": 2,
        "max_new_tokens": 8,
        "temperature": 0.0,
        "baseline": None,
        "runs": [
            {
                "k": 3,
                "tau": 1.5,
                "acceptance_per_pos": [0.4, 0.1, 0.0],
                "tokens_per_s": 10.0,
                "speedup": None,
                "num_rounds": 4,
            }
        ],
    }
)


def _missing(monkeypatch, *names: str) -> None:
    for name in names:
        for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            monkeypatch.delitem(sys.modules, loaded)
        monkeypatch.setitem(sys.modules, name, None)


def test_the_report_without_matplotlib_has_no_charts_and_says_how_to_get_them(monkeypatch, tmp_path):
    assert "matplotlib>=3.8" in EXTRAS["report"] and not any("matplotlib" in r for r in EXTRAS["test"])
    _missing(monkeypatch, "matplotlib")
    assert not report_module.charts_available()
    paths = report_module.write_report(tmp_path, REPORT)
    assert set(paths) == {"json", "markdown"}
    assert not (tmp_path / report_module.ACCEPTANCE_PNG).exists() and not (tmp_path / report_module.TAU_PNG).exists()
    md = (tmp_path / report_module.REPORT_MD).read_text()
    assert f"No charts: {report_module.CHARTS_HINT}." in md and report_module.ACCEPTANCE_PNG not in md
    assert "draftsmith[report]" in report_module.CHARTS_HINT and "| 3 | 1.500 |" in md


def test_the_report_with_matplotlib_has_both_charts(tmp_path):
    pytest.importorskip("matplotlib")
    paths = report_module.write_report(tmp_path, REPORT)
    assert {"acceptance_chart", "tau_chart"} <= set(paths)
    assert all(paths[k].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for k in ("acceptance_chart", "tau_chart"))
    assert "No charts" not in (tmp_path / report_module.REPORT_MD).read_text()


def test_a_datasets_directory_without_datasets_is_one_line(monkeypatch, tmp_path):
    from draftsmith.prepare.readers import Source, _iter_datasets

    _missing(monkeypatch, "datasets")
    with pytest.raises(DraftsmithError) as err:
        next(_iter_datasets(Source(tmp_path / "ds", "dataset")))
    assert "\n" not in str(err.value) and "draftsmith[datasets]" in str(err.value)
    assert str(err.value).startswith(f"{tmp_path / 'ds'}: ")


def test_the_mooncake_spool_without_mooncake_is_one_line(monkeypatch):
    from draftsmith.extract.spool import mooncake

    _missing(monkeypatch, "mooncake")
    with pytest.raises(DraftsmithError) as err:
        mooncake._store_class()
    assert "\n" not in str(err.value) and "draftsmith[mooncake]" in str(err.value)
    assert str(err.value).startswith("--spool mooncake: Mooncake cannot be imported")


def test_training_without_tensorboard_says_so_in_one_line_and_keeps_its_metrics(monkeypatch, tmp_path, capsys):
    from draftsmith.train.metrics import MetricsSink

    assert any(r.startswith("tensorboard") for r in EXTRAS["tensorboard"])
    _missing(monkeypatch, "torch.utils.tensorboard", "tensorboard")
    sink = MetricsSink(tmp_path / "metrics.jsonl", enabled=True, keep_through_step=-1)
    sink.write({"step": 1, "loss": 2.5})
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert lines == ["train: metrics go to metrics.jsonl; TensorBoard logs need pip install 'draftsmith[tensorboard]'"]
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 2.5}\n'
    assert not (tmp_path / "tensorboard").exists()


def test_no_other_optional_import_in_src():
    """The optional packages src/ imports are exactly those above (a new one needs its extra and its one line);
    gguf is a dependency, openai is not imported at all."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("gguf") for d in deps)
    optional = {"matplotlib", "datasets", "mooncake", "tensorboard", "openai", "vllm"}
    seen = set()
    for path in (ROOT / "src" / "draftsmith").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                else []
            )
            for name in names:
                top = "tensorboard" if name.startswith("torch.utils.tensorboard") else name.split(".")[0]
                if top in optional:
                    seen.add(top)
    assert seen == {"matplotlib", "datasets", "mooncake", "tensorboard", "vllm"}, seen
