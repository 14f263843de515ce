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


def test_doctor_sizes_the_store_of_a_prepared_set_by_its_distinct_tokens(tmp_path, tiny_target_dir):
    """Agentic samples share prefixes: the store extract writes holds their distinct tokens, beside the one context
    per generation row (1,000 + 1,500 tokens, of which 1,000 are the first sample's again)."""
    import torch

    from draftsmith.core.targets import target_identity
    from draftsmith.prepare.dataset import write_prepared

    first = torch.randint(5, 200, (1000,))
    samples = [
        {"input_ids": x, "loss_mask": torch.ones(len(x), dtype=torch.bool)} for x in (first, first.repeat(2)[:1500])
    ]
    write_prepared(tmp_path / "set", samples, target_identity(tiny_target_dir), chat_template_hash="t", max_length=2048)
    result = runner.invoke(app, ["doctor", "--target", _kimi(tmp_path), "--prepared", str(tmp_path / "set"), "--json"])
    assert result.exit_code == 0, result.output
    sizes = json.loads(result.stdout)["target"]["sizes"]
    assert sizes["store for 2,500 tokens"].startswith("bf16 137 MiB, fp8 68.4 MiB")  # 2,500 x 57,349 bytes
    assert sizes["store for 1,500 distinct tokens"] == "bf16 82 MiB, fp8 41 MiB: what extract writes (1.7x less)"
