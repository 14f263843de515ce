"""`draftsmith doctor --target DIR --online-rate R`: the online spool rows through the CLI (no vLLM started)."""

from __future__ import annotations

import json

from families import PUBLISHED
from typer.testing import CliRunner

from draftsmith.cli import app

runner = CliRunner()


def _kimi(tmp_path):
    (tmp_path / "kimi").mkdir()
    (tmp_path / "kimi" / "config.json").write_text(json.dumps(PUBLISHED["kimi_k25"]))
    return str(tmp_path / "kimi")


def test_doctor_json_carries_the_spool_row(tmp_path):
    result = runner.invoke(
        app, ["doctor", "--target", _kimi(tmp_path), "--online-rate", "20000", "--tokens", "50000000", "--json"]
    )
    assert result.exit_code == 0, result.output
    sizes = json.loads(result.stdout)["target"]["sizes"]
    assert sizes["online spool (20,000 tok/s, 60 s lead)"] == (
        "85.5 GiB bf16 / 42.8 GiB fp8: --spool-gb 85.5 (--spool-dtype fp8: --spool-gb 42.8); "
        "vs the offline store of 50,000,000 tokens: 2.61 TiB bf16 / 1.3 TiB fp8"
    )
    assert sizes["store bytes per token"].startswith("bf16 57,349, fp8 28,693")


def test_a_bad_online_rate_is_one_line(tmp_path):
    kimi = _kimi(tmp_path)
    for args, words in (
        (["--online-rate", "0"], "--online-rate 0: must be > 0"),
        (["--online-rate", "-3", "--json"], "--online-rate -3: must be > 0"),
        (["--online-rate", "100", "--spool-lead-s", "0"], "--spool-lead-s 0: must be > 0"),
    ):
        result = runner.invoke(app, ["doctor", "--target", kimi, *args])
        assert result.exit_code != 0 and words in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1, result.output  # nothing printed before it
    result = runner.invoke(app, ["doctor", "--online-rate", "100"])
    assert result.exit_code != 0 and "give --target too" in result.output
