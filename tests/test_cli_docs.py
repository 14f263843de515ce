"""docs/cli.md is generated from the CLI; this fails when an option changed and the doc was not regenerated."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cli_reference_is_current():
    spec = importlib.util.spec_from_file_location("gen_cli_docs", ROOT / "scripts" / "gen_cli_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    expected = module.render()
    assert "## `draftsmith prepare`" in expected and "`--max-length`" in expected
    assert (ROOT / "docs" / "cli.md").read_text() == expected, "run: python scripts/gen_cli_docs.py"
