"""The hidden-state store: round trips, dtypes, resume after crashes, refusals, verify, repair, merge."""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil

import pytest
import torch

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.manifest import TargetIdentity
from draftsmith.extract import store

L, H = 3, 16


def _target(**changes) -> TargetIdentity:
    fields = dict(
        path="/targets/tiny",
        architecture="LlamaForCausalLM",
        config_hash="cfg",
        tokenizer_hash="tok",
        num_layers=4,
        hidden_size=H,
        vocab_size=320,
    )
    fields.update(changes)
    return TargetIdentity(**fields)


def _spec(**changes) -> store.StoreSpec:
    fields = dict(
        target=_target(),
        layer_ids=[1, 2, 4],
        hidden_size=H,
        dtype="bf16",
        prepared=store.PreparedRef(path="/data/prepared", fingerprint="fp", num_samples=100),
    )
    fields.update(changes)
    return store.StoreSpec(**fields)


def _samples(n: int = 12, seed: int = 0) -> dict[int, dict]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n):
        T = int(torch.randint(3, 20, (1,), generator=g))
        out[i] = {
            "input_ids": torch.randint(0, 320, (T,), generator=g),
            "loss_mask": torch.rand(T, generator=g) > 0.5,
            "hidden_states": torch.randn(T, L, H, generator=g) * 3,
        }
    return out


def _fill(path, samples, ids=None, spec=None, worker="0/1", shard_bytes=600):
    with store.create_or_resume(path, spec or _spec(), worker=worker, shard_bytes=shard_bytes) as writer:
        done = writer.done_sample_ids()
        for i in ids if ids is not None else samples:
            if i not in done:
                s = samples[i]
                writer.add(i, s["input_ids"], s["loss_mask"], s["hidden_states"])
    return writer


def _assert_equal_to(path, samples, dtype=torch.float32):
    st = store.open(path, dtype=torch.bfloat16)
    assert [int(i) for i in st.sample_ids] == sorted(samples)
    for k in range(len(st)):
        item = st[k]
        ref = samples[item["sample_id"]]
        assert torch.equal(item["input_ids"], ref["input_ids"])
        assert torch.equal(item["loss_mask"], ref["loss_mask"])
        assert torch.equal(item["hidden_states"], ref["hidden_states"].to(torch.bfloat16))
    return st


def test_bf16_round_trip_is_exact_and_ordered_by_sample_id(tmp_path):
    samples = _samples()
    order = [7, 3, 11, 0, 5, 1, 2, 4, 6, 8, 9, 10]
    writer = _fill(tmp_path / "s", samples, ids=order)
    assert writer.shards_written > 2  # small shard_bytes: many shards
    st = _assert_equal_to(tmp_path / "s", samples)
    assert len(st) == 12 and st.layer_ids == [1, 2, 4] and st.aux_layer_ids == [1, 2]
    assert st.lengths.dtype.name == "int64"
    assert st.lengths.tolist() == [len(samples[i]["input_ids"]) for i in range(12)]
    assert st.manifest.kind == "store" and st.manifest.num_tokens == int(st.lengths.sum())
    item = st[-1]
    assert item["sample_id"] == 11 and item["input_ids"].dtype == torch.int64 and item["loss_mask"].dtype == torch.bool
    f32 = store.open(tmp_path / "s")[3]["hidden_states"]
    assert f32.dtype == torch.float32 and f32.shape == (len(samples[3]["input_ids"]), L, H)
    assert st.index_of(5) == 5
    a, b = st[5]["hidden_states"], st[5]["hidden_states"]  # bf16 read as bf16: views of one memory map, no copy
    assert a.data_ptr() == b.data_ptr() and torch.equal(a, b)
    with pytest.raises(IndexError):
        st[12]
    for info in st.manifest.shards:  # manifest ranges and checksums describe the files
        assert (tmp_path / "s" / info.file).stat().st_size == info.num_bytes


def test_fp8_round_trip_error_bound_and_half_the_bytes(tmp_path):
    samples = _samples(8)
    samples[0]["hidden_states"][1, 2] = 0.0  # an all-zero row must survive the scaling
    samples[1]["hidden_states"][0, 0, :4] = torch.tensor([1e-6, -1e4, 3.0, 0.0])  # wide dynamic range in one row
    _fill(tmp_path / "fp8", samples, spec=_spec(dtype="fp8"), shard_bytes=1 << 20)
    _fill(tmp_path / "bf16", samples, shard_bytes=1 << 20)
    st = store.open(tmp_path / "fp8")
    for k in range(len(st)):
        item = st[k]
        x = samples[item["sample_id"]]["hidden_states"]
        y = item["hidden_states"]
        scale = x.abs().amax(dim=-1, keepdim=True) / store.FP8_MAX
        bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10) * 1.001 + 1e-30
        assert ((x - y).abs() <= bound).all(), k
        rel = (x - y).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-12)
        assert rel.max() < 0.05
    assert torch.equal(st[0]["hidden_states"][1, 2], torch.zeros(H))
    size = {d: sum(s.num_bytes for s in store.open(tmp_path / d).manifest.shards) for d in ("fp8", "bf16")}
    assert size["fp8"] < 0.7 * size["bf16"]  # H=16 here: the f32 scales still weigh; at H=576 it is ~0.5
    big = dict(hidden_size=576, target=_target(hidden_size=576))
    assert 0.5 < store.bytes_per_token(_spec(dtype="fp8", **big)) / store.bytes_per_token(_spec(**big)) < 0.51
    bf16 = store.open(tmp_path / "fp8", dtype=torch.bfloat16)[2]["hidden_states"]
    assert bf16.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_storage_dtype_reads_decode_to_the_float32_reads(tmp_path, dtype):
    samples = _samples()
    _fill(tmp_path / "s", samples, spec=_spec(dtype=dtype))
    raw, f32 = store.open(tmp_path / "s", dtype=None), store.open(tmp_path / "s")
    assert raw.storage_dtype == (torch.bfloat16 if dtype == "bf16" else torch.float8_e4m3fn)
    for k in range(len(raw)):
        item, ref = raw[k], f32[k]
        assert item["hidden_states"].dtype == raw.storage_dtype and item["sample_id"] == ref["sample_id"]
        assert torch.equal(item["input_ids"], ref["input_ids"]) and torch.equal(item["loss_mask"], ref["loss_mask"])
        scales = item.get("hidden_scales")
        assert (scales is None) == (dtype == "bf16")
        if scales is not None:
            assert scales.dtype == torch.float32 and scales.shape == item["hidden_states"].shape[:2]
        assert torch.equal(store.decode_hidden_states(item["hidden_states"], scales), ref["hidden_states"])
        data, want_scales = store.encode_hidden_states(samples[item["sample_id"]]["hidden_states"], dtype)
        assert _same_bits(item["hidden_states"], data)  # exactly what was stored
        assert (want_scales is None and scales is None) or torch.equal(scales, want_scales)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_pickles_and_reads_in_dataloader_workers(tmp_path, dtype):
    from draftsmith.core import tensorfile

    samples = _samples()
    _fill(tmp_path / "s", samples, spec=_spec(dtype=dtype))
    for read_as in (torch.float32, None):
        st = store.open(tmp_path / "s", dtype=read_as)
        data = pickle.dumps(st)
        tensorfile._HANDLES.clear()  # as in a fresh (spawned) process: no shard open yet
        clone = pickle.loads(data)
        for i in (0, 5, 11):
            a, b = clone[i], st[i]
            assert a.keys() == b.keys() and all(_same_bits(a[k], b[k]) for k in a if k != "sample_id")
        items = list(torch.utils.data.DataLoader(st, batch_size=None, num_workers=2))
        assert [it["sample_id"] for it in items] == list(range(12))
        for it in items:
            ref = st[it["sample_id"]]
            assert it.keys() == ref.keys() and all(_same_bits(it[k], ref[k]) for k in ref if k != "sample_id")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal for any dtype (it has no fp8 kernel)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def test_resume_skips_done_samples_and_refuses_duplicates(tmp_path):
    samples = _samples()
    _fill(tmp_path / "s", samples, ids=range(5))
    with store.create_or_resume(tmp_path / "s", _spec(), shard_bytes=600) as writer:
        assert writer.done_sample_ids() == set(range(5))
        with pytest.raises(ValueError, match="already in store"):
            writer.add(2, samples[2]["input_ids"], samples[2]["loss_mask"], samples[2]["hidden_states"])
        with pytest.raises(ValueError, match="expected input_ids"):
            writer.add(6, samples[6]["input_ids"], samples[6]["loss_mask"], samples[6]["hidden_states"][:, :2])
    _fill(tmp_path / "s", samples)
    _assert_equal_to(tmp_path / "s", samples)


def test_an_exception_drops_only_the_unflushed_buffer(tmp_path):
    samples = _samples()
    with pytest.raises(KeyboardInterrupt):
        with store.create_or_resume(tmp_path / "s", _spec(), shard_bytes=10**9) as writer:
            for i in range(4):
                writer.add(i, samples[i]["input_ids"], samples[i]["loss_mask"], samples[i]["hidden_states"])
            writer.flush()
            writer.add(4, samples[4]["input_ids"], samples[4]["loss_mask"], samples[4]["hidden_states"])
            raise KeyboardInterrupt
    assert store.open(tmp_path / "s").sample_ids.tolist() == [0, 1, 2, 3]
    _fill(tmp_path / "s", samples)
    _assert_equal_to(tmp_path / "s", samples)


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(layer_ids=[1, 3, 4]), "layer_ids"),
        (dict(dtype="fp8"), "dtype"),
        (dict(target=_target(config_hash="other")), "config_hash"),
        (dict(target=_target(tokenizer_hash="other")), "tokenizer_hash"),
        (
            dict(prepared=store.PreparedRef(path="/data/prepared", fingerprint="changed", num_samples=100)),
            "prepared set",
        ),
        (dict(backend="vllm"), "backend"),
        (dict(compute_dtype="bfloat16"), "compute_dtype"),
    ],
)
def test_existing_store_of_another_kind_is_refused(tmp_path, change, words):
    samples = _samples(3)
    _fill(tmp_path / "s", samples)
    with pytest.raises(DraftsmithError, match=words) as err:
        store.create_or_resume(tmp_path / "s", _spec(**change))
    assert "another --output" in str(err.value)
    # the refused attempt changed nothing and left no lock behind
    _fill(tmp_path / "s", samples)
    _assert_equal_to(tmp_path / "s", samples)


def test_other_directories_are_refused(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hi")
    with pytest.raises(DraftsmithError, match="not a hidden-state store"):
        store.create_or_resume(tmp_path / "junk", _spec())
    (tmp_path / "file").write_text("x")
    with pytest.raises(DraftsmithError, match="not a directory"):
        store.create_or_resume(tmp_path / "file", _spec())
    (tmp_path / "prep").mkdir()
    (tmp_path / "prep" / "manifest.json").write_text(json.dumps({"kind": "prepared"}))
    with pytest.raises(DraftsmithError, match="not a hidden-state store"):
        store.create_or_resume(tmp_path / "prep", _spec())
    with pytest.raises(DraftsmithError, match="does not exist"):
        store.open(tmp_path / "nothing")


def test_two_live_writers_of_one_slice_are_refused_but_slices_share_a_store(tmp_path):
    samples = _samples()
    w0 = store.create_or_resume(tmp_path / "s", _spec(), worker="0/2", shard_bytes=600)
    with pytest.raises(DraftsmithError, match="already writing worker 0/2"):
        store.create_or_resume(tmp_path / "s", _spec(), worker="0/2")
    w1 = store.create_or_resume(tmp_path / "s", _spec(), worker="1/2", shard_bytes=600)
    for i in samples:  # interleaved writes from two writers into one manifest
        w = w0 if i % 2 == 0 else w1
        w.add(i, samples[i]["input_ids"], samples[i]["loss_mask"], samples[i]["hidden_states"])
    w0.close()
    w1.close()
    st = _assert_equal_to(tmp_path / "s", samples)
    assert {s.writer for s in st.manifest.shards} == {"s0of2", "s1of2"}
    assert store.verify_store(tmp_path / "s").ok


def _full_disk_once(monkeypatch, name="_write_file"):
    real = getattr(store.shards, name)
    calls = {"n": 0}

    def failing(path, data):
        calls["n"] += 1
        if calls["n"] == 2:
            if name == "_write_file":  # data: the shard's pieces, header first
                whole = b"".join(bytes(piece) for piece in data)
                with open(path, "wb") as f:
                    f.write(whole[: len(whole) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, data)

    monkeypatch.setattr(store.shards, name, failing)


def test_full_disk_gives_a_clear_message_and_a_correct_resume(tmp_path, monkeypatch):
    samples = _samples()
    _full_disk_once(monkeypatch)
    with pytest.raises(DraftsmithError, match="no space left on device.*run the same command again"):
        _fill(tmp_path / "s", samples)
    assert not list((tmp_path / "s" / "shards").glob(".*tmp"))  # no half-written temp file left
    monkeypatch.undo()
    assert 0 < len(store.open(tmp_path / "s")) < 12
    assert store.verify_store(tmp_path / "s").ok
    _fill(tmp_path / "s", samples)
    _assert_equal_to(tmp_path / "s", samples)


def test_crash_between_shard_rename_and_manifest_update_adopts_the_orphan(tmp_path, monkeypatch):
    samples = _samples()
    real = store.writer.write_manifest
    calls = {"n": 0}

    def failing(directory, manifest):
        calls["n"] += 1
        if calls["n"] == 3:  # 1: create, 2: first shard, 3: second shard
            raise OSError(errno.ENOSPC, "no space")
        return real(directory, manifest)

    monkeypatch.setattr(store.writer, "write_manifest", failing)
    with pytest.raises(OSError):
        _fill(tmp_path / "s", samples)
    monkeypatch.undo()
    report = store.verify_store(tmp_path / "s")
    assert report.ok and len(report.orphans) == 1
    writer = store.create_or_resume(tmp_path / "s", _spec(), shard_bytes=600)
    assert any("adopted" in note for note in writer.recovered)
    writer.close()
    assert store.verify_store(tmp_path / "s").orphans == []
    _fill(tmp_path / "s", samples)
    _assert_equal_to(tmp_path / "s", samples)


def test_damaged_orphans_and_temp_files_of_dead_writers_are_removed(tmp_path):
    samples = _samples()
    _fill(tmp_path / "s", samples, ids=range(6))
    shards = tmp_path / "s" / "shards"
    (shards / ".part-s3of4-000000.safetensors.abc.tmp").write_bytes(b"half")
    (shards / "part-s3of4-000000.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    good = sorted(shards.glob("part-s0of1-*"))[0]
    (shards / "part-s5of9-000000.safetensors").write_bytes(good.read_bytes())  # a copy: its samples are in already
    writer = store.create_or_resume(tmp_path / "s", _spec(), worker="1/4")
    writer.close()
    assert sum("removed orphan" in n for n in writer.recovered) == 2
    assert sorted(p.name for p in shards.iterdir()) == sorted(p.name for p in shards.glob("part-s0of1-*"))
    _fill(tmp_path / "s", samples)
    _assert_equal_to(tmp_path / "s", samples)


def test_read_only_output_directory(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.access(ro, os.W_OK):  # running as root: permissions do not stop us, so simulate the kernel's answer
        real_mkdir = type(ro).mkdir

        def mkdir(self, *args, **kwargs):
            if str(self).startswith(str(ro)):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
            return real_mkdir(self, *args, **kwargs)

        monkeypatch.setattr(type(ro), "mkdir", mkdir)
    with pytest.raises(DraftsmithError, match="cannot write here.*writable --output"):
        store.create_or_resume(ro / "store", _spec())


def test_corrupted_shards_are_found_by_verify_and_open_and_repaired(tmp_path):
    samples = _samples()
    _fill(tmp_path / "s", samples)
    files = sorted((tmp_path / "s" / "shards").glob("part-*"))
    # flipped bytes inside the tensor data: cheap checks pass, the checksum does not
    data = bytearray(files[0].read_bytes())
    data[-40] ^= 0xFF
    files[0].write_bytes(bytes(data))
    report = store.verify_store(tmp_path / "s")
    assert not report.ok and report.bad_shards == [f"shards/{files[0].name}"]
    assert "sha256 does not match" in report.problems[0]
    # flipped byte in the header: open refuses, naming the shard
    head = bytearray(files[2].read_bytes())
    head[12] = ord("}")
    files[2].write_bytes(bytes(head))
    with pytest.raises(DraftsmithError, match=files[2].name):
        store.open(tmp_path / "s")
    assert len(store.verify_store(tmp_path / "s").bad_shards) == 2
    # truncated: open refuses at once
    files[1].write_bytes(files[1].read_bytes()[:-7])
    with pytest.raises(DraftsmithError, match="truncated"):
        store.open(tmp_path / "s")
    # repair drops the three shards; extract again recomputes exactly their samples
    repaired = store.verify_store(tmp_path / "s", repair=True)
    assert len(repaired.repaired) == 3
    assert store.verify_store(tmp_path / "s").ok
    _fill(tmp_path / "s", samples)
    _assert_equal_to(tmp_path / "s", samples)


def test_manifest_count_mismatch_is_reported(tmp_path):
    _fill(tmp_path / "s", _samples())
    path = tmp_path / "s" / "manifest.json"
    data = json.loads(path.read_text())
    data["num_samples"] += 1
    path.write_text(json.dumps(data))
    report = store.verify_store(tmp_path / "s")
    assert not report.ok and "manifest totals" in report.problems[0]
    with pytest.raises(DraftsmithError, match="totals do not match"):
        store.open(tmp_path / "s")
    data["num_samples"] -= 1
    data["shards"][0]["num_tokens"] += 1
    path.write_text(json.dumps(data))
    assert any("manifest says" in p for p in store.verify_store(tmp_path / "s").problems)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_verify_reports_nan_and_inf_tokens(tmp_path, dtype):
    samples = _samples()
    samples[4]["hidden_states"][2, 1, 5] = float("nan")
    samples[9]["hidden_states"][0, 0, 0] = float("inf")
    samples[9]["hidden_states"][1, 2, 3] = float("-inf")
    _fill(tmp_path / "s", samples, spec=_spec(dtype=dtype))
    report = store.verify_store(tmp_path / "s")
    assert not report.ok and not report.problems
    assert report.nonfinite_tokens == 3 and report.nonfinite_samples == [4, 9]
    assert "NaN/Inf" in report.__rich__()


def test_merge_of_worker_stores_equals_one_store(tmp_path):
    samples = _samples()
    _fill(tmp_path / "a", samples, ids=[i for i in samples if i % 2 == 0], worker="0/2")
    _fill(tmp_path / "b", samples, ids=[i for i in samples if i % 2 == 1], worker="1/2")
    merged = store.merge_stores([tmp_path / "a", tmp_path / "b"], tmp_path / "m")
    assert len(merged) == 12
    _assert_equal_to(tmp_path / "m", samples)
    assert store.verify_store(tmp_path / "m").ok
    copied = store.merge_stores([tmp_path / "a", tmp_path / "b"], tmp_path / "m2", link=False)
    assert copied.manifest.num_tokens == merged.manifest.num_tokens
    with pytest.raises(DraftsmithError, match="sample 0 is also in"):
        store.merge_stores([tmp_path / "a", tmp_path / "m"], tmp_path / "m3")
    _fill(tmp_path / "c", samples, ids=[1], spec=_spec(layer_ids=[0, 2, 4]))
    with pytest.raises(DraftsmithError, match="layer_ids"):
        store.merge_stores([tmp_path / "a", tmp_path / "c"], tmp_path / "m4")
    with pytest.raises(DraftsmithError, match="already exists"):
        store.merge_stores([tmp_path / "a"], tmp_path / "m")
    assert not (tmp_path / "m3").exists() and not (tmp_path / "m4").exists()


def test_a_shard_is_written_from_the_tensors_memory_as_safetensors_lays_it_out(tmp_path):
    """write_shard streams the tensors' own bytes (no bytes object of the whole shard) and hashes them as they go:
    the file parses to the same header as safetensors' own writer gives (its metadata as a dict: safetensors' order
    of it varies run to run), its data region is byte for byte safetensors', and the sha256 and size it returns are
    the file's."""
    import hashlib
    import struct

    from safetensors import safe_open
    from safetensors.torch import save

    spec = _spec()
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "hidden_states": torch.randn(9, 2, spec.hidden_size, generator=gen).to(torch.float8_e4m3fn),
        "hidden_scales": torch.rand(9, 2, generator=gen),
        "input_ids": torch.arange(9, dtype=torch.int32),
        "loss_mask": torch.arange(9) % 3 > 0,
        "offsets": torch.tensor([0, 4, 9]),
        "sample_ids": torch.tensor([5, 2]),
    }
    sha256, size = store.shards.write_shard(tmp_path / "s.safetensors", tensors, spec)
    ours, reference = (tmp_path / "s.safetensors").read_bytes(), save(tensors, store.shards.shard_metadata(spec))
    assert (sha256, size) == (hashlib.sha256(ours).hexdigest(), len(ours)) and size == len(reference)
    header = struct.unpack("<Q", ours[:8])[0]
    assert header == struct.unpack("<Q", reference[:8])[0]
    assert json.loads(ours[8 : 8 + header]) == json.loads(reference[8 : 8 + header])
    assert ours[8 + header :] == reference[8 + header :] and len(ours) - 8 - header > 9 * 2 * spec.hidden_size
    in_parts = {**tensors, "hidden_states": [tensors["hidden_states"][:4], tensors["hidden_states"][4:]]}
    assert store.shards.write_shard(tmp_path / "p.safetensors", in_parts, spec) == (sha256, size)  # the same file
    with safe_open(tmp_path / "s.safetensors", "pt") as f:
        assert f.metadata()["spec_fingerprint"] == spec.fingerprint()
        for name, tensor in tensors.items():
            assert torch.equal(f.get_tensor(name).view(torch.uint8), tensor.view(torch.uint8)), name


def test_fp8_encoding_in_cache_sized_blocks_equals_the_whole_tensor_formula_bit_for_bit():
    """encode_layers_fp8 (the copy out of an engine's buffers: layers in, [T, L, H] e4m3 out, in blocks of rows on
    the CPU) gives the bytes of the plain formula -- x / (amax / 448) in fp32 over the stacked tensor, clamped,
    rounded -- across block boundaries, for zero rows and for NaN/Inf rows (whose scale stays non-finite)."""
    from draftsmith.extract.store.codec import _CPU_BLOCK_VALUES, FP8_MAX, encode_layers_fp8

    hidden = 4096
    rows = 2 * _CPU_BLOCK_VALUES // hidden + 37  # three blocks, the last one short
    gen = torch.Generator().manual_seed(0)
    layers = [(torch.randn(rows, hidden, generator=gen) * (10**k)).to(torch.bfloat16) for k in range(-2, 2)]
    layers[0][3] = 0
    layers[1][rows - 1, 5] = float("nan")
    layers[2][200, 9] = float("inf")
    x = torch.stack(layers, dim=1).float()
    amax = x.abs().amax(dim=-1)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / FP8_MAX)
    expected = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q, scales = encode_layers_fp8(layers)
    assert q.shape == (rows, 4, hidden) and scales.shape == (rows, 4)
    assert torch.equal(q.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(scales.nan_to_num(posinf=-1.0), scale.nan_to_num(posinf=-1.0))
    assert scales[3, 0] == 1.0 and scales[rows - 1, 1].isnan() and scales[200, 2].isinf()
    assert q.view(torch.uint8).float().std() > 10  # not a tensor of one byte


def _branching(seed: int = 1) -> tuple[dict[int, dict], dict[int, tuple[int, int]]]:
    """Samples 0-5 with (parent, shared): 1 and 3 extend 0's first 6 and 4 tokens, 2 extends 1's first 8 (6 of
    them 0's), 5 extends 2 (rows from three samples); 4 shares nothing. A child's shared states are its parent's."""
    samples, prefixes = _samples(6, seed), {1: (0, 6), 2: (1, 8), 3: (0, 4), 5: (2, 10)}
    samples[0] = {k: torch.cat([v, v, v]) for k, v in samples[0].items()}  # 9 tokens or more
    for i, (p, n) in prefixes.items():  # then 3 to 19 tokens of its own
        own = _samples(1, seed + 10 + i)[0]
        samples[i] = {k: torch.cat([samples[p][k][:n], own[k]]) for k in own}
    return samples, prefixes


def _fill_chained(path, samples, prefixes, ids=None, spec=None, worker="0/1"):
    with store.create_or_resume(path, spec or _spec(), worker=worker, shard_bytes=400) as writer:
        for i in ids if ids is not None else samples:
            if i not in writer.done_sample_ids():
                s, (p, n) = samples[i], prefixes.get(i, (-1, 0))
                writer.add(i, s["input_ids"], s["loss_mask"], s["hidden_states"][n:], None, p, n)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_samples_sharing_prefixes_store_each_state_once_and_read_back_whole(tmp_path, dtype):
    samples, prefixes = _branching()
    _fill_chained(tmp_path / "c", samples, prefixes, spec=_spec(dtype=dtype))
    _fill(tmp_path / "w", samples, spec=_spec(dtype=dtype))
    chained, whole = store.open(tmp_path / "c", dtype=None), store.open(tmp_path / "w", dtype=None)
    assert len(chained.manifest.shards) > 2 and chained.manifest.num_tokens == whole.manifest.num_tokens
    rows = sum(s.num_rows or s.num_tokens for s in chained.manifest.shards)
    assert rows == whole.manifest.num_tokens - sum(n for _, n in prefixes.values())  # 28 rows fewer
    for k in range(len(whole)):  # fp8 encodes row by row: the same bytes, read through the parents
        assert all(torch.equal(chained[k][f], whole[k][f]) for f in whole[k] if f != "sample_id")
    assert store.verify_store(tmp_path / "c").ok
    with pytest.raises(ValueError, match="not stored before it"):
        _fill_chained(tmp_path / "x", samples, prefixes, ids=[2], spec=_spec(dtype=dtype))


def test_a_lost_prefix_drops_the_samples_sharing_it_until_extract_computes_them_again(tmp_path):
    samples, prefixes = _branching()
    _fill_chained(tmp_path / "m", samples, prefixes, ids=[0, 1, 3, 4], worker="0/2")
    _fill_chained(tmp_path / "m", samples, prefixes, ids=[2, 5], worker="1/2")  # parents stored by another writer
    _assert_equal_to(tmp_path / "m", samples)
    manifest = json.loads((tmp_path / "m" / "manifest.json").read_text())
    shutil.copytree(tmp_path / "m", tmp_path / "n")
    (tmp_path / "n" / "manifest.json").write_text(json.dumps({**manifest, "shards": manifest["shards"][1:]}))
    with pytest.raises(DraftsmithError, match="sample 0, whose states others share, is not in the store"):
        store.open(tmp_path / "n")
    first = tmp_path / "m" / manifest["shards"][0]["file"]  # holds sample 0
    first.write_bytes(first.read_bytes()[:-3] + b"xyz")
    report = store.verify_store(tmp_path / "m", repair=True)
    assert len(report.bad_shards) > 1 and any("sample 0, which is lost" in p for p in report.problems)
    assert store.verify_store(tmp_path / "m").ok
    assert sorted(int(i) for i in store.open(tmp_path / "m").sample_ids) == [4]
    _fill_chained(tmp_path / "m", samples, prefixes, ids=[0, 1, 3, 4, 2, 5])  # extract again: they come back
    _assert_equal_to(tmp_path / "m", samples)
