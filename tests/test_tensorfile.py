"""The shared safetensors reader: dtypes (fp8, bool), rows without copies, one-line errors, pickling, handles."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from safetensors.torch import save_file

from draftsmith.core import tensorfile
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.tensorfile import TensorFile

REMEDY = "do the thing again"


@pytest.fixture()
def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "states": torch.randn(40, 3, 8, generator=g).to(torch.bfloat16),
        "fp8": (torch.randn(40, 3, 8, generator=g) * 50).to(torch.float8_e4m3fn),
        "mask": torch.rand(40, generator=g) > 0.5,
        "ids": torch.randint(0, 1000, (40,), generator=g, dtype=torch.int32),
        "offsets": torch.tensor([0, 7, 40], dtype=torch.int64),
    }


@pytest.fixture()
def path(tmp_path, tensors):
    file = tmp_path / "t.safetensors"
    save_file(tensors, str(file), metadata={"format": "test", "n": "3"})
    return file


def test_dtypes_shapes_metadata_and_reads(path, tensors):
    f = TensorFile(path, REMEDY)
    assert f.metadata == {"format": "test", "n": "3"} and f.size == path.stat().st_size
    assert f.tensors == {
        "states": ("BF16", (40, 3, 8)),
        "fp8": ("F8_E4M3", (40, 3, 8)),
        "mask": ("BOOL", (40,)),
        "ids": ("I32", (40,)),
        "offsets": ("I64", (3,)),
    }
    for name, ref in tensors.items():
        whole = f.read(name)
        assert whole.dtype == ref.dtype and torch.equal(whole.view(torch.uint8), ref.view(torch.uint8)), name
        part = f.rows(name, 5, 9) if ref.shape[0] > 9 else f.rows(name, 1, 3)
        want = ref[5:9] if ref.shape[0] > 9 else ref[1:3]
        assert part.dtype == ref.dtype and torch.equal(part.view(torch.uint8), want.view(torch.uint8)), name
    assert f.rows("states", 40, 40).shape == (0, 3, 8)
    assert f.expect("states", "BF16", (None, 3, 8)) == (40, 3, 8)


def test_rows_are_views_of_the_mapped_file_and_read_is_a_copy(path):
    f = TensorFile(path, REMEDY)
    a, b = f.rows("states", 2, 6), f.rows("states", 2, 6)
    assert a.data_ptr() == b.data_ptr()  # no copy per read
    handle = tensorfile._HANDLES.get(f._key)[0]
    assert handle.get_tensor("states").data_ptr() == f.view("states").data_ptr()  # safe_open maps, never copies
    owned = f.read("offsets")
    assert owned.untyped_storage().nbytes() == 3 * 8


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda p: p.unlink(), "file is missing"),
        (lambda p: p.write_bytes(p.read_bytes()[:-5]), "not a readable file"),
        (lambda p: p.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage"), "not a readable file"),
        (lambda p: p.write_bytes(b""), "not a readable file"),
        (lambda p: p.write_bytes(b"\xff" * 8 + b"{}"), "not a readable file"),
    ],
)
def test_damaged_files_give_one_line_naming_the_file_and_the_remedy(path, damage, words):
    damage(path)
    with pytest.raises(DraftsmithError) as err:
        TensorFile(path, REMEDY)
    message = str(err.value)
    assert message.startswith(f"{path}: ") and words in message and message.endswith(REMEDY)
    assert "\n" not in message


def test_size_against_a_manifest_and_tensor_expectations(path):
    with pytest.raises(DraftsmithError, match=r"bytes, expected 12 \(truncated or replaced shard file\); do the"):
        TensorFile(path, REMEDY, what="shard file", expected_bytes=12)
    f = TensorFile(path, REMEDY, what="shard file", expected_bytes=path.stat().st_size)
    with pytest.raises(DraftsmithError, match=r"tensor 'ids' is I32 \[40\], expected I64 \[\*\] \(damaged shard"):
        f.expect("ids", "I64", (None,))
    with pytest.raises(DraftsmithError, match=r"tensor 'states' is BF16 \[40, 3, 8\], expected BF16 \[40, 3, 9\]"):
        f.expect("states", "BF16", (40, 3, 9))
    with pytest.raises(DraftsmithError, match=r"tensor 'nope' is missing .*do the thing again$"):
        f.expect("nope", "I64", (None,))
    with pytest.raises(DraftsmithError, match="tensor 'nope' is missing"):
        f.rows("nope", 0, 1)


def test_pickles_without_a_handle_and_refuses_a_replaced_file(path, tensors):
    f = TensorFile(path, REMEDY)
    f.rows("ids", 0, 4)
    clone = pickle.loads(pickle.dumps(f))
    assert len(pickle.dumps(f)) < 1000  # names, shapes and the file's identity: no data, no handle
    assert torch.equal(clone.rows("ids", 3, 9), tensors["ids"][3:9])
    f.close()  # as in a process that has not opened it yet
    save_file({"ids": torch.zeros(40, dtype=torch.int32)}, str(path))  # replaced since it was checked
    with pytest.raises(DraftsmithError, match="changed on disk since it was first opened"):
        clone.rows("ids", 0, 4)


def test_handles_are_per_process_and_bounded(path, tensors, monkeypatch):
    monkeypatch.setattr(tensorfile._HANDLES, "capacity", 2)
    files = []
    for k in range(4):
        copy = path.with_name(f"c{k}.safetensors")
        copy.write_bytes(path.read_bytes())
        files.append(TensorFile(copy, REMEDY))
    assert len(tensorfile._HANDLES.open) == 2  # least recently used closed first
    for f in files:  # closed ones open again on demand
        assert torch.equal(f.rows("ids", 0, 5), tensors["ids"][:5])
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a forked child (a DataLoader worker) starts with no handle of its parent's
        ok = not tensorfile._HANDLES.open and torch.equal(files[0].rows("ids", 0, 5), tensors["ids"][:5])
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1"
