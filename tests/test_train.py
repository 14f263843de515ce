"""The trainer: offline (store) and online (target inside) training on a tiny random target, checkpoints, resume,
and the faults the issue lists."""

from __future__ import annotations

import errno
import json
import os

import numpy as np
import pytest
import torch

from draftsmith.config import ExtractConfig, TrainConfig
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.targets import target_identity
from draftsmith.methods import artefact
from draftsmith.prepare.dataset import open_prepared, write_prepared
from draftsmith.train import checkpoint
from draftsmith.train import stage as trainer
from draftsmith.train.batches import OnlineSource, TokenBudgetSampler, fetch


def _samples(n: int, seed: int = 0, vocab: int = 320, lo: int = 12, hi: int = 40) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(lo, hi))
        ids = rng.integers(4, vocab, size=length)
        mask = np.zeros(length, dtype=np.int64)
        mask[length // 3 :] = 1  # the "assistant" part
        out.append({"input_ids": ids, "loss_mask": mask})
    return out


def _sharpen(source, dest, scale: float = 200.0):
    """A random target is nearly uniform (its argmax is noise): scale its lm_head so it has real preferences."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.save_pretrained(dest)
    AutoTokenizer.from_pretrained(source).save_pretrained(dest)
    return dest


@pytest.fixture(scope="module")
def sharp_target_dir(tiny_target_dir, tmp_path_factory):
    return _sharpen(tiny_target_dir, tmp_path_factory.mktemp("sharp-target"))


@pytest.fixture(scope="module")
def prepared_dir(sharp_target_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("train") / "prepared"
    write_prepared(path, _samples(24), target_identity(sharp_target_dir), chat_template_hash="tiny", max_length=64)
    return path


@pytest.fixture(scope="module")
def store_dir(prepared_dir, sharp_target_dir):
    from draftsmith.extract import stage as extract

    out = prepared_dir.parent / "store"
    extract.run(  # float32 named: the online source's fp32 states are compared with it, on every CPU kind
        ExtractConfig(
            prepared=prepared_dir,
            output=out,
            target=str(sharp_target_dir),
            device="cpu",
            aux_layer_ids=[1, 2, 3],
            compute_dtype="float32",
        ),
        show_progress=False,
    )
    return out


def _cfg(data, out, **kw) -> TrainConfig:
    base = dict(
        data=data,
        output=out,
        draft_vocab_size=320,
        ttt_steps=3,
        lr=3e-3,
        warmup_steps=2,
        token_budget=256,
        eval_fraction=0.15,
        log_every=1,
        save_every=1000,
        device="cpu",
        seed=0,
    )
    base.update(kw)
    return TrainConfig(**base)


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------------------- sampler


def test_sampler_packs_within_budget_is_deterministic_and_splits_by_rank():
    lengths = np.random.default_rng(0).integers(5, 100, size=200)
    s = TokenBudgetSampler(range(200), lengths, token_budget=300, seed=1)
    batches = s.batches(0)
    assert all(len(b) * max(lengths[b]) <= 300 for b in batches)
    assert sorted(i for b in batches for i in b) == list(range(200))  # every sample once per epoch
    assert batches == TokenBudgetSampler(range(200), lengths, 300, seed=1).batches(0)
    assert batches != s.batches(1)
    r0 = TokenBudgetSampler(range(200), lengths, 300, seed=1, rank=0, world_size=2).batches(0)
    r1 = TokenBudgetSampler(range(200), lengths, 300, seed=1, rank=1, world_size=2).batches(0)
    assert len(r0) == len(r1) and not {i for b in r0 for i in b} & {i for b in r1 for i in b}


def test_sample_longer_than_budget_and_empty_set_are_refused():
    with pytest.raises(DraftsmithError, match="sample 2 has 90 tokens, more than --token-budget 64"):
        TokenBudgetSampler(range(3), np.array([10, 20, 90]), token_budget=64)
    with pytest.raises(DraftsmithError, match="empty"):
        TokenBudgetSampler([], np.array([10]), token_budget=64)


# ---------------------------------------------------------------------------------------------- offline / online


def test_offline_and_online_give_the_same_batch_and_loss(sharp_target_dir, prepared_dir, store_dir):
    from draftsmith.core.targets import final_norm, lm_head, load_target
    from draftsmith.extract import store as store_mod
    from draftsmith.train.objective import TargetHead, TTTModel
    from draftsmith.train.setup import initial_draft, open_data, split

    store = store_mod.open(store_dir, dtype=None)  # as the trainer reads it: bf16 views, decoded in the step
    prepared = open_prepared(prepared_dir)
    cfg = _cfg(store_dir, prepared_dir.parent / "unused")
    s = open_data(cfg, torch.device("cpu"))
    ids = [0, 3, 5]
    offline = fetch(store, [store.index_of(i) for i in ids], cfg.method.depths)
    online = OnlineSource(load_target(sharp_target_dir), store.layer_ids)(fetch(prepared, ids, cfg.method.depths))
    assert torch.equal(offline.input_ids, online.input_ids) and torch.equal(offline.loss_mask, online.loss_mask)
    assert offline.hidden_states.dtype == torch.bfloat16 and online.hidden_states.dtype == torch.float32
    real = offline.loss_mask | (offline.input_ids != 0)
    # the store keeps bf16: the online fp32 states round to the stored ones
    torch.testing.assert_close(online.hidden_states.bfloat16()[real], offline.hidden_states[real], atol=1e-2, rtol=1e-2)
    draft, _, _ = initial_draft(cfg, s, split(s, cfg)[0])
    head = TargetHead(final_norm(s.target), lm_head(s.target).weight, draft.draft_to_target)
    model = TTTModel(draft)
    rounded = type(online)(**{**online.__dict__, "hidden_states": online.hidden_states.bfloat16()})
    with torch.no_grad():
        a, b, exact = (
            trainer.forward(model, head, x, cfg, torch.float32, None, True) for x in (offline, online, rounded)
        )
    torch.testing.assert_close(a.loss, b.loss, rtol=2e-2, atol=0)
    torch.testing.assert_close(a.loss, exact.loss, rtol=1e-6, atol=0)  # same states -> same loss
    assert torch.equal(a.count, b.count)


def test_overfitting_a_few_samples_drives_step0_accuracy_up(sharp_target_dir, tmp_path):
    path = tmp_path / "prep"
    write_prepared(
        path,
        _samples(2, seed=5, lo=20, hi=24),
        target_identity(sharp_target_dir),
        chat_template_hash="t",
        max_length=64,
    )
    out = tmp_path / "run"
    result = trainer.run(
        _cfg(
            path,
            out,
            eval_fraction=0.0,
            max_steps=60,
            lr=1e-2,
            ttt_steps=1,
            warmup_steps=0,
            schedule="constant",
            clip=0.0,
            log_every=1,
        )
    )
    train = _metrics(out)
    assert train[-1]["acc"][0] > 0.95, train[-1]
    assert train[0]["acc"][0] < 0.5  # it really learned (step 1)
    assert result.summary["steps"] == 60
    _, manifest = artefact.load_checkpoint(out)
    assert manifest.step == 60 and manifest.draft.aux_layer_ids == [1, 2]  # shallow target: default ids kept once


def test_offline_training_improves_and_checkpoint_round_trips(store_dir, tmp_path):
    out = tmp_path / "run"
    result = trainer.run(_cfg(store_dir, out, epochs=4, eval_every=None))
    evals = [m for m in _metrics(out) if m["type"] == "eval"]
    assert len(evals) == 4  # one evaluation per epoch
    train = [m for m in _metrics(out) if m["type"] == "train"]
    assert train[-1]["loss"] < 0.7 * train[0]["loss"]  # random-token samples: held-out accuracy cannot rise here
    assert result.summary["best acceptance length (sim.)"] == max(e["acceptance_length"] for e in evals)
    tensors, manifest = artefact.load_checkpoint(out)  # best/
    assert manifest.kind == "checkpoint" and manifest.draft.aux_layer_ids == [1, 2, 3]
    assert manifest.best_acceptance_length == result.summary["best acceptance length (sim.)"]
    assert manifest.draft.draft_vocab_size == 320 and manifest.data_kind == "store"
    assert tensors["fc.weight"].shape == (64, 192) and "embed_tokens.weight" not in tensors
    latest = artefact.latest_checkpoint(out)
    d2, m2 = artefact.load_checkpoint(latest)
    assert m2.step == result.summary["steps"]
    assert "optimizer" in checkpoint.load_training_state(latest)
    assert (out / "config.yaml").is_file()


def test_offline_training_never_loads_the_targets_decoder_layers(store_dir, tmp_path, monkeypatch):
    from draftsmith.core import targets

    monkeypatch.setattr(targets, "load_target", lambda *a, **k: pytest.fail("loaded the whole target"))
    result = trainer.run(_cfg(store_dir, tmp_path / "run", max_steps=2))
    assert result.summary["steps"] == 2


def test_resume_after_a_crash_gives_the_same_loss_curve(prepared_dir, tmp_path, monkeypatch):
    cfg = dict(max_steps=7, save_every=3, noise_std=0.05, eval_every=4, grad_accum=2, ttt_steps=2)
    full = tmp_path / "full"
    trainer.run(_cfg(prepared_dir, full, **cfg))
    crashed = tmp_path / "crashed"
    real_lr_at = trainer.lr_at

    def crash(step, *args):  # the schedule is read at the start of every step: step 6 never runs
        if step == 5:
            raise KeyboardInterrupt
        return real_lr_at(step, *args)

    monkeypatch.setattr(trainer, "lr_at", crash)
    with pytest.raises(KeyboardInterrupt):
        trainer.run(_cfg(prepared_dir, crashed, **cfg))
    monkeypatch.setattr(trainer, "lr_at", real_lr_at)
    assert artefact.latest_checkpoint(crashed).name == "step-00000003"
    result = trainer.run(_cfg(prepared_dir, crashed, **cfg))
    assert result.summary["resumed from"].endswith("step-00000003")
    a = [(m["type"], m["step"], m["loss"]) for m in _metrics(full)]
    b = [(m["type"], m["step"], m["loss"]) for m in _metrics(crashed)]
    assert [x[:2] for x in a] == [x[:2] for x in b]
    np.testing.assert_allclose([x[2] for x in a], [x[2] for x in b], rtol=1e-6)


def test_resume_with_changed_hyperparameters_is_refused_unless_forced(prepared_dir, tmp_path):
    out = tmp_path / "run"
    trainer.run(_cfg(prepared_dir, out, max_steps=2))
    with pytest.raises(DraftsmithError, match=r"other hyper-parameters \(lr: 0.003 -> 0.001"):
        trainer.run(_cfg(prepared_dir, out, max_steps=3, lr=1e-3))
    with pytest.warns(UserWarning, match="changed hyper-parameters"):
        result = trainer.run(_cfg(prepared_dir, out, max_steps=3, lr=1e-3, force=True))
    assert result.summary["steps"] == 3
    with pytest.raises(DraftsmithError, match="already holds a training run"):
        trainer.run(_cfg(prepared_dir, out, max_steps=3, resume=False))


def test_resume_of_a_checkpoint_from_before_an_option_existed(prepared_dir, tmp_path):
    out = tmp_path / "run"
    trainer.run(_cfg(prepared_dir, out, max_steps=2))
    manifest_file = artefact.latest_checkpoint(out) / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    del manifest["hyperparameters"]["lm_head_init"]  # as written by a version without that option
    manifest_file.write_text(json.dumps(manifest))
    result = trainer.run(_cfg(prepared_dir, out, max_steps=2))  # not refused as "other hyper-parameters"
    assert result.summary["steps"] == 2 and "resumed from" in result.summary


def test_a_store_trains_a_draft_of_some_of_its_layers_as_a_store_of_those_alone(
    store_dir, prepared_dir, sharp_target_dir, tmp_path
):
    """One store serves several methods (EAGLE-3's layers, DFlash's spread): --aux-layer-ids picks a subset, and
    training reads exactly what a store of those layers alone gives."""
    from draftsmith.extract import stage as extract

    only = tmp_path / "store13"
    extract.run(  # as store_dir was made (float32 named), so that the two stores' states are the same numbers
        ExtractConfig(
            prepared=prepared_dir,
            output=only,
            target=str(sharp_target_dir),
            device="cpu",
            aux_layer_ids=[1, 3],
            compute_dtype="float32",
        ),
        show_progress=False,
    )
    subset, alone = tmp_path / "subset", tmp_path / "alone"
    trainer.run(_cfg(store_dir, subset, aux_layer_ids=[3, 1], max_steps=3))
    trainer.run(_cfg(only, alone, max_steps=3))
    a, b = ([m["loss"] for m in _metrics(x) if m["type"] == "train"] for x in (subset, alone))
    assert len(a) == 3 and a == b
    tensors, manifest = artefact.load_checkpoint(subset)
    assert manifest.draft.aux_layer_ids == [1, 3] and tensors["fc.weight"].shape[1] == 2 * 64
    for name, value in artefact.load_checkpoint(alone)[0].items():
        torch.testing.assert_close(tensors[name], value)


# ---------------------------------------------------------------------------------------------- faults


def test_store_for_other_layers_or_target_is_refused(store_dir, tmp_path):
    with pytest.raises(
        DraftsmithError, match=r"holds aux layers \[1, 2, 3\] but --aux-layer-ids asks for \[1, 2, 4\] \(\[4\] not"
    ):
        trainer.run(_cfg(store_dir, tmp_path / "a", aux_layer_ids=[1, 2, 4]))
    from conftest import build_tiny_target

    other = build_tiny_target(tmp_path / "other", hidden_size=32)
    with pytest.raises(DraftsmithError, match="was made for another target"):
        trainer.run(_cfg(store_dir, tmp_path / "b", target=str(other)))


def test_nan_features_stop_naming_step_and_sample_and_keep_the_checkpoint(store_dir, tmp_path, monkeypatch):
    from draftsmith.extract import store as store_mod

    out = tmp_path / "run"
    real_open = store_mod.open

    class Poisoned:
        def __init__(self, store):
            self._s = store

        def __getattr__(self, name):
            return getattr(self._s, name)

        def __len__(self):
            return len(self._s)

        reads = 0

        def __getitem__(self, i):
            item = self._s[i]
            if item["sample_id"] == 7:
                Poisoned.reads += 1
            if item["sample_id"] == 7 and Poisoned.reads > 2:  # read to count the vocabulary, fine in epoch 0
                item["hidden_states"] = item["hidden_states"].clone()
                item["hidden_states"][3, 0, 5] = float("nan")
            return item

    monkeypatch.setattr(store_mod, "open", lambda p, dtype=torch.float32: Poisoned(real_open(p, dtype)))
    Poisoned.reads = 0
    with pytest.raises(DraftsmithError, match=r"step \d+: sample 7 has NaN/Inf hidden states") as err:
        trainer.run(_cfg(store_dir, out, epochs=3, save_every=1, eval_fraction=0.0))
    last = artefact.latest_checkpoint(out)
    assert last is not None and str(last) in str(err.value)
    artefact.load_checkpoint(last)  # the last good checkpoint is whole


def test_nan_loss_stops(prepared_dir, tmp_path, monkeypatch):
    from draftsmith.train import objective

    real = objective.ttt_forward

    def bad(*a, **k):
        r = real(*a, **k)
        r.loss = r.loss * float("nan")
        return r

    monkeypatch.setattr(objective, "ttt_forward", bad)
    with pytest.raises(DraftsmithError, match=r"step 1: loss is NaN/Inf on samples \["):
        trainer.run(_cfg(prepared_dir, tmp_path / "run", max_steps=2))


def test_disk_full_while_checkpointing_keeps_the_last_good_one(prepared_dir, tmp_path, monkeypatch):
    out = tmp_path / "run"
    calls = {"n": 0}
    real_save = torch.save

    def save(obj, f, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(DraftsmithError, match="no space left on device.*last good checkpoint is .*step-00000002"):
        trainer.run(_cfg(prepared_dir, out, max_steps=6, save_every=2, eval_fraction=0.0))
    assert [p.name for p in artefact.list_checkpoints(out)] == ["step-00000002"]
    assert not list((out / "checkpoints").glob(".*partial*"))
    artefact.load_checkpoint(artefact.latest_checkpoint(out))


def test_data_that_is_not_a_store_or_prepared_set(tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(DraftsmithError, match="must be a hidden-state store"):
        trainer.run(_cfg(tmp_path / "x", tmp_path / "run"))


# ---------------------------------------------------------------------------------------------- --init-from


def test_init_from_an_export_continues_from_its_weights_and_vocabulary(prepared_dir, sharp_target_dir, tmp_path):
    from draftsmith import export
    from draftsmith.config import ExportConfig
    from draftsmith.methods.artefact import load_draft
    from draftsmith.methods.layers import draft_tensors

    first = tmp_path / "first"
    trainer.run(_cfg(prepared_dir, first, max_steps=3, draft_vocab_size=200))
    export.run(ExportConfig(checkpoint=first, output=tmp_path / "export", dtype="fp32"))
    exported = load_draft(tmp_path / "export")

    second = tmp_path / "second"  # a learning rate too small to move anything: the start is the export itself
    result = trainer.run(
        _cfg(
            prepared_dir,
            second,
            max_steps=1,
            lr=1e-20,
            warmup_steps=0,
            schedule="constant",
            init_from=tmp_path / "export",
        )
    )
    assert result.summary["started from"] == str(tmp_path / "export")
    again, manifest = artefact.load_checkpoint(artefact.latest_checkpoint(second))
    assert manifest.draft.draft_vocab_size == 200  # the draft's own vocabulary, not --draft-vocab-size 320
    assert again.keys() == exported.tensors.keys()
    for name, tensor in exported.tensors.items():
        torch.testing.assert_close(again[name], tensor, msg=name)
    from draftsmith.train.setup import initial_draft, open_data, split

    cfg = _cfg(prepared_dir, tmp_path / "x", draft_vocab_size=200)
    source = open_data(cfg, torch.device("cpu"))
    fresh = initial_draft(cfg, source, split(source, cfg)[0])[0]
    assert not torch.equal(draft_tensors(fresh.state_dict())["fc.weight"], exported.tensors["fc.weight"])


def test_init_from_a_draft_for_other_layers_or_target_or_nothing_is_refused(prepared_dir, tmp_path):
    first = tmp_path / "first"
    trainer.run(_cfg(prepared_dir, first, max_steps=1, aux_layer_ids=[1, 2, 3]))
    with pytest.raises(DraftsmithError, match=r"fuses aux layers \[1, 2, 3\].*gives \[1, 2\]; pass --aux-layer-ids"):
        trainer.run(_cfg(prepared_dir, tmp_path / "a", init_from=first))
    with pytest.raises(DraftsmithError, match="1 decoder layer"):
        trainer.run(_cfg(prepared_dir, tmp_path / "b", init_from=first, aux_layer_ids=[1, 2, 3], num_layers=2))
    with pytest.raises(DraftsmithError, match="does not exist"):
        trainer.run(_cfg(prepared_dir, tmp_path / "c", init_from=tmp_path / "missing"))
    from conftest import build_tiny_target

    other = build_tiny_target(tmp_path / "other", hidden_size=32)
    other_prepared = tmp_path / "other-prepared"
    write_prepared(other_prepared, _samples(8), target_identity(other), chat_template_hash="t", max_length=64)
    with pytest.raises(
        DraftsmithError, match=r"--init-from .*: draft was built for another target \(hidden size 64 != 32"
    ):
        trainer.run(_cfg(other_prepared, tmp_path / "d", init_from=first, aux_layer_ids=[1, 2, 3]))


# ---------------------------------------------------------------------------------------------- split and vocabulary


def test_held_out_split_has_its_own_seed_is_recorded_and_read_back_by_evaluate(prepared_dir, tmp_path):
    from draftsmith import export
    from draftsmith.config import ExportConfig
    from draftsmith.core.targets import load_tokenizer
    from draftsmith.evaluate.prompts import held_out_split, load_prompts
    from draftsmith.methods.artefact import load_draft
    from draftsmith.prepare.dataset import split_indices

    out = tmp_path / "run"
    trainer.run(_cfg(prepared_dir, out, max_steps=1, eval_fraction=0.25, split_seed=5, seed=1))
    _, manifest = artefact.load_checkpoint(artefact.latest_checkpoint(out))
    assert (manifest.eval_fraction, manifest.split_seed) == (0.25, 5)
    export.run(ExportConfig(checkpoint=out, output=tmp_path / "export"))
    source = load_draft(tmp_path / "export")
    split = held_out_split(None, None, source.training)
    assert split == {"eval_fraction": 0.25, "split_seed": 5}
    assert held_out_split(0.5, 2, source.training) == {"eval_fraction": 0.5, "split_seed": 2}  # given: as given
    prompts = load_prompts(str(prepared_dir), load_tokenizer(manifest.target.path), **split)
    held = split_indices(24, 0.25, 5)[1]
    assert held != split_indices(24, 0.25, 1)[1]  # not the training seed's split
    assert {p.id for p in prompts} <= {f"sample-{i}" for i in held} and prompts


def test_draft_vocabulary_is_counted_on_the_training_split_only(sharp_target_dir, tmp_path):
    from draftsmith.prepare.dataset import split_indices

    samples = _samples(20, seed=3, vocab=60)
    held = split_indices(20, 0.2, 0)[1]
    for i in held:  # tokens 300..309 appear in the held-out samples alone, more often than any other
        samples[i]["input_ids"][-10:] = np.arange(300, 310)
        samples[i]["input_ids"] = np.concatenate([samples[i]["input_ids"], np.arange(300, 310).repeat(4)])
        samples[i]["loss_mask"] = np.concatenate([samples[i]["loss_mask"], np.ones(40, dtype=np.int64)])
    path = tmp_path / "prep"
    write_prepared(path, samples, target_identity(sharp_target_dir), chat_template_hash="t", max_length=128)
    out = tmp_path / "run"
    trainer.run(_cfg(path, out, max_steps=1, eval_fraction=0.2, draft_vocab_size=64))
    tensors, _ = artefact.load_checkpoint(artefact.latest_checkpoint(out))
    in_vocab = set((torch.arange(64) + tensors["d2t"]).tolist())
    assert not in_vocab & set(range(300, 310))
    assert set(range(4, 60)) <= in_vocab  # the training split's tokens


def test_probes_log_real_acceptance_and_the_last_equals_evaluate_of_the_final_draft(prepared_dir, tmp_path):
    """train --probe-every: the current draft decoded in a real engine (the reference decoder here) at every probe
    and at the end, logged beside the held-out evaluation; the last probe is `evaluate` of the final checkpoint."""
    from draftsmith import evaluate
    from draftsmith.config import EvaluateConfig

    out = tmp_path / "run"
    probing = dict(probe_every=3, probe_engine="hf", probe_num_prompts=3, probe_max_new_tokens=12)
    trainer.run(_cfg(prepared_dir, out, max_steps=4, lr=1e-2, **probing))
    probes = [m for m in _metrics(out) if m["type"] == "probe"]
    assert [p["step"] for p in probes] == [3, 4]
    for p in probes:
        assert p["engine"] == "hf" and p["prompts"] == f"{prepared_dir} (3)" and p["k"] == 3
        assert len(p["acc"]) == 3 and p["seconds"] > 0
        assert (out / "probe" / f"step-{p['step']}" / "report.json").is_file()
    assert probes[0]["acceptance_length"] != probes[1]["acceptance_length"]  # the draft changed between them
    final = evaluate.run(
        EvaluateConfig(
            draft=artefact.latest_checkpoint(out),
            prompts="held-out",
            num_prompts=3,
            max_new_tokens=12,
            baseline=False,
            device="cpu",
            output=tmp_path / "eval",
        )
    ).result.runs[0]
    assert final.num_rounds > 0
    assert (final.tau, final.acceptance_per_pos) == (probes[-1]["acceptance_length"], probes[-1]["acc"])


def test_a_probe_that_fails_is_one_line_and_training_goes_on(prepared_dir, tmp_path, capfd):
    out = tmp_path / "run"
    probing = dict(probe_every=2, probe_engine="hf", probe_prompts=str(tmp_path / "missing.jsonl"))
    trainer.run(_cfg(prepared_dir, out, max_steps=2, **probing))
    said = [line for line in capfd.readouterr().err.splitlines() if "probe" in line]
    assert len(said) == 1 and "the probe at step 2 failed" in said[0] and "missing.jsonl" in said[0], said
    assert "training goes on" in said[0] and str(out / "probe" / "step-2.log") in said[0]
    assert not [m for m in _metrics(out) if m["type"] == "probe"]
    assert artefact.latest_checkpoint(out).name.endswith("2")
