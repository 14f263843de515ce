"""Each drafting method's typed options (methods/<name>/__init__.py, derived by the registry): `TrainConfig.method`
holds the chosen method's options and no other method's; flags and YAML give them flat, the resolved config nests
them, both read back; an option of another method is refused in one line; a checkpoint's flat record (older runs)
compares with a nested config."""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from draftsmith.cli import app
from draftsmith.config import TrainConfig, load_config, save_resolved_config
from draftsmith.core.errors import DraftsmithError
from draftsmith.methods.dflash import DFlashOptions
from draftsmith.methods.dspark import DSparkOptions
from draftsmith.methods.eagle3 import Eagle3Options
from draftsmith.methods.peagle import PEagleOptions
from draftsmith.train.setup import _changed_hyperparameters


def test_the_registry_derives_the_names_options_and_vllm_needs_from_the_packages():
    from typing import get_args

    from draftsmith import methods
    from draftsmith.extract.vllm.probe import ProbeFacts

    assert set(get_args(methods.MethodName)) == set(methods.NAMES)  # the one hand-spelt copy, held to PACKAGES
    assert methods.DEFAULT_METHOD in methods.NAMES and set(methods.OPTIONS) == set(methods.NAMES)
    for name in methods.NAMES:
        loaded = methods.method(name)
        assert loaded.name == name and loaded.vllm_needs == methods.NEEDS[name]
        for need in loaded.vllm_needs:  # each reads one fact of the probe by attribute, and that one only
            read = {f for f in ProbeFacts.model_fields if need.fact(ProbeFacts.model_construct(**{f: True})) is True}
            assert len(read) == 1 and need.fact(ProbeFacts()) is None, (name, read)
    assert [m.name for m in methods.all_methods()] == list(methods.NAMES)


def test_each_method_holds_its_own_options_and_what_a_round_trains():
    assert TrainConfig().method == Eagle3Options(draft_vocab_size=32000, ttt_steps=7, step_weight=0.8)
    assert TrainConfig(method="dflash").method.draft_vocab_size is None  # the target's whole vocabulary
    assert TrainConfig(method="dflash", draft_vocab_size=64).method.draft_vocab_size == 64
    peagle = TrainConfig(method="peagle", ttt_steps=4, cod_ratio=0.5).method
    assert isinstance(peagle, PEagleOptions) and (peagle.depths, peagle.cod_ratio, peagle.cod_floor) == (4, 0.5, 0.2)
    dflash, dspark = (
        TrainConfig(method="dflash", block_size=8).method,
        TrainConfig(method="dspark", block_size=8).method,
    )
    assert type(dflash) is DFlashOptions and type(dspark) is DSparkOptions
    assert not hasattr(dflash, "ttt_steps") and not hasattr(dflash, "cod_ratio")  # no field that changes meaning
    assert (dflash.depths, dspark.depths) == (7, 8)  # DFlash's anchor row proposes nothing, DSpark's does
    assert math.isclose(dflash.depth_weight**7, math.exp(-1.0), rel_tol=1e-12)  # loss decay 7: e^-1 at depth 7
    assert TrainConfig(method="dflash").num_layers == 5 and TrainConfig(method="peagle").num_layers == 1
    assert TrainConfig(method="dflash", num_layers=2).num_layers == 2


def test_flat_and_nested_forms_are_one_config_and_the_resolved_file_reads_back(tmp_path):
    flat = TrainConfig(method="dflash", block_size=6, loss_decay=3.0)
    nested = TrainConfig(method={"name": "dflash", "block_size": 6, "loss_decay": 3.0})
    assert flat == nested
    # a flat option overrides the nested one, as a flag overrides the file
    assert TrainConfig(method={"name": "dflash", "block_size": 6}, block_size=9).method.block_size == 9
    save_resolved_config(flat, tmp_path)
    text = (tmp_path / "config.yaml").read_text()
    assert "method:\n  name: dflash\n  block_size: 6\n" in text
    assert load_config(TrainConfig, tmp_path / "config.yaml", {}) == flat
    flagged = load_config(TrainConfig, tmp_path / "config.yaml", {"block_size": 10, "anchors_per_sample": None})
    assert flagged.method.block_size == 10 and flagged.method.loss_decay == 3.0


def test_another_methods_option_is_refused_in_one_line(tmp_path):
    runner = CliRunner()
    got = runner.invoke(app, ["train", "--method", "dflash", "--cod-ratio", "0.3", "--output", str(tmp_path / "o")])
    assert got.exit_code != 0 and "Traceback" not in got.output
    assert (
        "--cod-ratio is an option of --method peagle; --method dflash takes --block-size, --anchors-per-sample, "
        "--loss-decay" in got.output
    )
    got = runner.invoke(app, ["train", "--method", "dflash", "--block-size", "1", "--output", str(tmp_path / "o")])
    assert "option --block-size: Input should be greater than or equal to 2 (got 1)" in got.output
    got = runner.invoke(app, ["train", "--ttt-steps", "3", "--block-size", "8", "--output", str(tmp_path / "o")])
    assert (
        "--block-size is an option of --method dflash / dspark; --method eagle3 takes --draft-vocab-size" in got.output
    )
    got = runner.invoke(app, ["train", "--method", "dspark", "--draft-vocab-size", "64", "--output", str(tmp_path)])
    assert "--draft-vocab-size is an option of --method eagle3 / eagle3.1 / peagle / dflash;" in got.output
    recipe = tmp_path / "train.yaml"
    recipe.write_text("method: eagle3\nloss_decay: 2.0\n")
    with pytest.raises(DraftsmithError, match=r"train.yaml: --loss-decay is an option of --method dflash / dspark"):
        load_config(TrainConfig, recipe, {})
    recipe.write_text("method: dflsh\n")
    with pytest.raises(DraftsmithError, match=r"train.yaml: key method: .*'eagle3', 'eagle3.1', 'peagle', 'dflash'"):
        load_config(TrainConfig, recipe, {})


def test_a_checkpoints_flat_record_compares_with_the_nested_config():
    cfg = TrainConfig(data="store", output="out", method="dflash", block_size=8)
    flat = cfg.model_dump(mode="json")
    flat.update(flat.pop("method") | {"method": "dflash"})  # what checkpoints before typed options recorded
    flat.update(ttt_steps=7, step_weight=0.87, cod_ratio=0.8)  # the other methods' fields they also held
    assert "block_size" in flat and _changed_hyperparameters(flat, cfg) == []
    assert _changed_hyperparameters(cfg.model_dump(mode="json"), cfg) == []
    assert _changed_hyperparameters(flat, TrainConfig(data="store", output="out", method="dflash")) == [
        "block_size: 8 -> 16"
    ]
    assert _changed_hyperparameters(flat, TrainConfig(data="store", output="out", method="dspark", block_size=8)) == [
        "method: 'dflash' -> 'dspark'"
    ]
