"""Faults in every stage (issue 15), each injected by benchmarks/faults.py on a tiny random target: a flipped byte in
a prepared shard, a store shard and a checkpoint's files, NaN hidden states in extraction and a NaN loss in
training, a full disk (a real size-limited tmpfs, filled by another writer mid-stage) during extract, train and
export (the vLLM engine's processes killed during extraction: tests/test_extract_vllm.py). Each must be survived: a one-line error naming the
file, sample or step, nothing half-written left, and the next run ending as an undisturbed one would (no sample
lost or duplicated). kill -9 during training and extraction: tests/test_train_faults.py, tests/test_extract_hf.py.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import atomic_dir, atomic_path
from draftsmith.core.targets import target_identity
from draftsmith.prepare.dataset import write_prepared

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_faults", ROOT / "benchmarks" / "faults.py")
faults = importlib.util.module_from_spec(_spec)
sys.modules["bench_faults"] = faults  # its dataclasses look their module up
_spec.loader.exec_module(faults)


def _prepared(path: Path, target_dir: Path, n: int = 40) -> Path:
    rng = np.random.default_rng(0)
    samples = []
    for length in rng.integers(14, 60, n):
        mask = np.zeros(length, dtype=np.int64)
        mask[length // 3 :] = 1
        samples.append({"input_ids": rng.integers(4, 300, length), "loss_mask": mask})
    write_prepared(path, samples, target_identity(target_dir), chat_template_hash="t", max_length=64)
    return path


@pytest.fixture(scope="module")
def bench(tiny_target_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("faults")
    return faults.Bench(work, _prepared(work / "prepared", tiny_target_dir), token_budget=96, draft_vocab_size=300)


@pytest.mark.parametrize(
    "name",
    [
        "flip-prepared-shard",
        "flip-store-shard",
        "flip-checkpoint-weights",
        "flip-training-state",
        "nan-hidden-states",
        "nan-loss",
        "full-disk-extract",
        "full-disk-train",
        "full-disk-export",
    ],
)
def test_fault_is_survived(bench, name):
    if name.startswith("full-disk") and faults.mount_problem():
        pytest.skip(f"a size-limited tmpfs is needed: {faults.mount_problem()}")
    outcome = faults.run_fault(bench, name)
    assert outcome.injected and outcome.survived, outcome.detail
    assert outcome.lost == 0 and not outcome.traceback, outcome


@pytest.mark.parametrize(
    "failure",
    [
        OSError(28, "No space left on device"),
        RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"),  # safetensors'
    ],
)
def test_a_full_disk_in_any_library_is_one_line_and_leaves_nothing(tmp_path, failure):
    for context in (atomic_dir, atomic_path):
        with pytest.raises(DraftsmithError, match=r"x: no space left on device; free disk space"):
            with context(tmp_path / "x"):
                raise failure
        assert list(tmp_path.iterdir()) == []
    with pytest.raises(KeyError):  # anything else keeps its traceback
        with atomic_dir(tmp_path / "x"):
            raise KeyError("a bug")


def test_nan_states_in_a_fp8_item_are_found_through_its_scales(tmp_path):
    from draftsmith.extract import common

    class Writer:
        path, spec = tmp_path, type("Spec", (), {"layer_ids": [1, 2, 4]})()

    states = torch.zeros(5, 3, 8, dtype=torch.float8_e4m3fn)
    scales = torch.ones(5, 3)
    common.check_finite(Writer(), (7, None, None, states, scales))
    scales[2, 1] = float("inf")
    with pytest.raises(DraftsmithError, match=r"sample 7 has NaN/Inf hidden states \(layer ids \[2\]\)"):
        common.check_finite(Writer(), (7, None, None, states, scales))


def test_a_file_is_hashed_on_its_first_data_read_only(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    from draftsmith.core import tensorfile
    from draftsmith.core.fsio import sha256_file

    path = tmp_path / "f.safetensors"
    save_file({"index": torch.arange(4), "data": torch.ones(64, 8)}, str(path))
    digest, hashed = sha256_file(path), []
    monkeypatch.setattr(tensorfile, "sha256_file", lambda p: hashed.append(p) or sha256_file(p))
    file = tensorfile.TensorFile(path, "rebuild it", sha256=digest)
    file.read("index", verify=False)  # an index read while opening does not wait for the hash
    assert hashed == []
    for a in range(0, 64, 8):
        file.rows("data", a, a + 8)
    file.close()
    file.rows("data", 0, 1)  # opened again in this process: already checked
    assert hashed == [path]
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(DraftsmithError, match=rf"^{path}: sha256 does not match the manifest .*; rebuild it$"):
        tensorfile.TensorFile(path, "rebuild it", sha256=digest).view("data")
