"""The prepared data set format: round trip, sharding, memory-mapped reads, damage detection, the split."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch

from draftsmith.core import tensorfile
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.manifest import TargetIdentity
from draftsmith.prepare.dataset import (
    PreparedManifest,
    open_prepared,
    split_indices,
    write_prepared,
)

VOCAB = 50


def _target() -> TargetIdentity:
    return TargetIdentity(
        path="/tmp/t",
        architecture="LlamaForCausalLM",
        config_hash="c",
        tokenizer_hash="t",
        num_layers=4,
        hidden_size=64,
        vocab_size=VOCAB,
    )


def _samples(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(1, 30))
        ids = rng.integers(0, VOCAB, size=length)
        mask = rng.integers(0, 2, size=length)
        out.append({"input_ids": torch.tensor(ids), "loss_mask": mask.tolist()})
    return out


def _write(path, samples, **kw):
    return write_prepared(path, samples, _target(), chat_template_hash="h", max_length=64, **kw)


def test_round_trip_across_shards(tmp_path):
    samples = _samples(23)
    manifest = _write(
        tmp_path / "p", iter(samples), shard_samples=5, skipped={"no assistant turn": 2}, sources=["a.json"]
    )
    assert [s.num_samples for s in manifest.shards] == [5, 5, 5, 5, 3]
    assert [s.first_sample for s in manifest.shards] == [0, 5, 10, 15, 20]
    ds = open_prepared(tmp_path / "p")
    assert isinstance(ds.manifest, PreparedManifest) and ds.manifest.kind == "prepared"
    assert len(ds) == 23 and ds.manifest.skipped == {"no assistant turn": 2} and ds.manifest.sources == ["a.json"]
    for i, s in enumerate(samples):
        item = ds[i]
        assert item["sample_id"] == i
        assert item["input_ids"].dtype == torch.long and item["loss_mask"].dtype == torch.bool
        assert item["input_ids"].tolist() == s["input_ids"].tolist()
        assert item["loss_mask"].tolist() == [bool(x) for x in s["loss_mask"]]
    assert ds[-1]["sample_id"] == 22
    with pytest.raises(IndexError):
        ds[23]
    assert ds.lengths.dtype == np.int64 and ds.lengths.tolist() == [len(s["input_ids"]) for s in samples]
    assert ds.manifest.num_tokens == int(ds.lengths.sum())


def test_truncated_samples_are_counted(tmp_path):
    samples = _samples(5)
    samples[1]["truncated"] = samples[3]["truncated"] = True
    assert _write(tmp_path / "p", samples).num_truncated == 2


def test_token_counts_count_only_loss_masked_tokens(tmp_path):
    samples = _samples(40, seed=3)
    manifest = _write(tmp_path / "p", samples)
    expected = torch.zeros(VOCAB, dtype=torch.long)
    for s in samples:
        ids = s["input_ids"][torch.tensor(s["loss_mask"], dtype=torch.bool)]
        expected += torch.bincount(ids, minlength=VOCAB)
    ds = open_prepared(tmp_path / "p")
    assert torch.equal(ds.token_counts(), expected)
    assert manifest.num_loss_tokens == int(expected.sum())


def test_pickles_and_reads_in_dataloader_workers(tmp_path):
    _write(tmp_path / "p", _samples(30), shard_samples=7)
    ds = open_prepared(tmp_path / "p")
    data = pickle.dumps(ds)
    tensorfile._HANDLES.clear()  # as in a fresh (spawned) process: no file open yet
    clone = pickle.loads(data)
    for i in (0, 3, 29):
        assert torch.equal(clone[i]["input_ids"], ds[i]["input_ids"])
        assert torch.equal(clone[i]["loss_mask"], ds[i]["loss_mask"])
    items = list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2))
    assert [it["sample_id"] for it in items] == list(range(30))
    for it in items:
        assert torch.equal(it["input_ids"], ds[it["sample_id"]]["input_ids"])
        assert torch.equal(it["loss_mask"], ds[it["sample_id"]]["loss_mask"])


def test_failed_write_leaves_nothing(tmp_path):
    def broken():
        yield from _samples(3)
        raise RuntimeError("tokenizer crashed")

    with pytest.raises(RuntimeError):
        _write(tmp_path / "p", broken(), shard_samples=1)
    assert list(tmp_path.iterdir()) == []


def test_no_samples_is_a_clear_error(tmp_path):
    with pytest.raises(DraftsmithError, match="no usable samples.*no assistant turn 4"):
        _write(tmp_path / "p", [], skipped={"no assistant turn": 4})
    assert not (tmp_path / "p").exists()


def test_token_id_outside_vocab_is_refused(tmp_path):
    with pytest.raises(DraftsmithError, match="outside the target's vocabulary"):
        _write(tmp_path / "p", [{"input_ids": [1, VOCAB], "loss_mask": [1, 1]}])


def test_open_rejects_what_is_not_a_prepared_set(tmp_path):
    with pytest.raises(DraftsmithError, match="does not exist"):
        open_prepared(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DraftsmithError, match="not a prepared data set"):
        open_prepared(tmp_path / "empty")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "manifest.json").write_text(json.dumps({"kind": "store"}))
    with pytest.raises(DraftsmithError, match="'store' artefact, expected 'prepared'"):
        open_prepared(tmp_path / "other")


def test_missing_shard_is_named(tmp_path):
    _write(tmp_path / "p", _samples(10), shard_samples=4)
    (tmp_path / "p" / "shard-00001.safetensors").unlink()
    with pytest.raises(DraftsmithError, match="shard-00001.safetensors.*missing"):
        open_prepared(tmp_path / "p")


def test_truncated_shard_is_named(tmp_path):
    _write(tmp_path / "p", _samples(10), shard_samples=4)
    shard = tmp_path / "p" / "shard-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-7])
    with pytest.raises(DraftsmithError, match="shard-00002.safetensors"):
        open_prepared(tmp_path / "p")


def test_shard_or_counts_of_the_wrong_kind_are_named(tmp_path):
    from safetensors.numpy import save_file

    _write(tmp_path / "p", _samples(10), shard_samples=4)
    manifest = json.loads((tmp_path / "p" / "manifest.json").read_text())
    T = manifest["shards"][1]["num_tokens"]
    shard = tmp_path / "p" / "shard-00001.safetensors"
    save_file(
        {
            "input_ids": np.zeros(T, np.int32),
            "loss_mask": np.zeros(T, np.int64),  # mask stored as int64
            "offsets": np.array([0, 1, 2, 3, T]),
        },
        str(shard),
    )
    manifest["shards"][1]["num_bytes"] = 0  # as an older manifest without sizes: the header check must catch it
    (tmp_path / "p" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        DraftsmithError,
        match=rf"shard-00001.safetensors: tensor 'loss_mask' is I64 \[{T}\], "
        rf"expected U8 \[{T}\] .*run `draftsmith prepare` again",
    ):
        open_prepared(tmp_path / "p")

    _write(tmp_path / "q", _samples(10))
    save_file({"counts": np.zeros(VOCAB - 1, np.int64)}, str(tmp_path / "q" / "token_counts.safetensors"))
    with pytest.raises(DraftsmithError, match=rf"token_counts.safetensors: tensor 'counts' is I64 \[{VOCAB - 1}\]"):
        open_prepared(tmp_path / "q").token_counts()


def test_flipped_byte_is_caught_by_verify(tmp_path):
    _write(tmp_path / "p", _samples(10), shard_samples=4)
    shard = tmp_path / "p" / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    open_prepared(tmp_path / "p")  # structure is still fine
    with pytest.raises(DraftsmithError, match="shard-00000.safetensors: sha256"):
        open_prepared(tmp_path / "p", verify=True)


def test_split_indices_is_deterministic_and_disjoint():
    train, held = split_indices(100, 0.1, seed=7)
    assert len(held) == 10 and len(train) == 90
    assert sorted(train + held) == list(range(100))
    assert split_indices(100, 0.1, seed=7) == (train, held)
    assert split_indices(100, 0.1, seed=8) != (train, held)
    assert len(split_indices(5, 0.01)[1]) == 1
    assert split_indices(1, 0.5) == ([0], [])
    assert split_indices(10, 0.0) == (list(range(10)), [])
    with pytest.raises(DraftsmithError):
        split_indices(10, 1.0)


def test_write_replaces_a_prepared_set_but_nothing_else(tmp_path):
    _write(tmp_path / "p", _samples(4))
    _write(tmp_path / "p", _samples(6))
    assert len(open_prepared(tmp_path / "p")) == 6
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    with pytest.raises(DraftsmithError, match="not a prepared data set; refusing"):
        _write(tmp_path / "precious", _samples(2))
    assert (tmp_path / "precious" / "notes.txt").read_text() == "keep me"


def test_resumable_write_continues_after_an_interruption(tmp_path):
    from draftsmith.prepare.dataset import resume_point

    samples = _samples(25, seed=4)
    samples[3]["truncated"] = samples[21]["truncated"] = True
    state = {"n": 0}

    def interrupted():
        for i, s in enumerate(samples):
            if i == 23:
                raise KeyboardInterrupt
            state["n"] = i + 1
            yield s

    with pytest.raises(KeyboardInterrupt):
        _write(tmp_path / "p", interrupted(), shard_samples=10, fingerprint="job", checkpoint=lambda: dict(state))
    assert not (tmp_path / "p").exists()
    assert resume_point(tmp_path / "p", "other job") is None
    saved = resume_point(tmp_path / "p", "job")
    assert saved == {"n": 20}  # the state when the second shard was completed
    manifest = _write(
        tmp_path / "p",
        iter(samples[saved["n"] :]),
        shard_samples=10,
        fingerprint="job",
        checkpoint=lambda: {},
        resume=True,
    )
    assert [s.num_samples for s in manifest.shards] == [10, 10, 5] and manifest.num_truncated == 2
    _write(tmp_path / "ref", samples, shard_samples=10)
    got, ref = open_prepared(tmp_path / "p", verify=True), open_prepared(tmp_path / "ref")
    assert not (tmp_path / ".p.resume").exists() and not (tmp_path / "p" / "resume.json").exists()
    assert torch.equal(got.token_counts(), ref.token_counts())
    assert got.manifest.num_loss_tokens == ref.manifest.num_loss_tokens
    for i in range(25):
        assert torch.equal(got[i]["input_ids"], ref[i]["input_ids"])
    with pytest.raises(DraftsmithError, match="nothing to resume"):
        _write(tmp_path / "q", samples, fingerprint="job", resume=True)
