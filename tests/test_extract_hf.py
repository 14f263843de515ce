"""The transformers extraction backend: states equal an independent transformers computation, padding is
harmless, resume after interruptions and kill -9 gives the same store, workers and merge, refusals."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_target

from draftsmith.config import ExtractConfig, TrainConfig
from draftsmith.core import capture, layers
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.targets import load_target, target_identity
from draftsmith.extract import common, hf, store
from draftsmith.extract import stage as extract
from draftsmith.prepare.dataset import write_prepared
from draftsmith.train import packing
from draftsmith.train import stage as trainer

NUM_SAMPLES = 24


def _write_set(path: Path, target_dir: Path, n: int = NUM_SAMPLES, seed: int = 0, max_len: int = 60) -> Path:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        T = int(torch.randint(3, max_len, (1,), generator=g))
        samples.append(
            {"input_ids": torch.randint(0, 320, (T,), generator=g), "loss_mask": torch.rand(T, generator=g) > 0.4}
        )
    write_prepared(path, samples, target_identity(target_dir), chat_template_hash="tiny", max_length=max_len)
    return path


@pytest.fixture(scope="module")
def tiny_prepared(tmp_path_factory, tiny_target_dir) -> Path:
    return _write_set(tmp_path_factory.mktemp("prepared") / "set", tiny_target_dir)


@pytest.fixture(scope="module")
def tiny_model(tiny_target_dir):
    return load_target(tiny_target_dir)


def _cfg(prepared: Path, output: Path, **kw) -> ExtractConfig:
    """float32 named: the stores are compared with transformers' fp32 forward, on every CPU kind (what `auto` takes
    is tests/test_hardware.py's)."""
    fields = dict(
        prepared=prepared, output=output, token_budget=160, shard_size_mb=0.02, device="cpu", compute_dtype="float32"
    )
    fields.update(kw)
    return ExtractConfig(**fields)


def _reference(model, input_ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """An independent computation: transformers' own output_hidden_states, one unpadded sample at a time.

    hidden_states[k] (k < N) is the output of decoder layer k-1; transformers (4.x and 5) ties hidden_states[N] to
    the *normalised* last state, so the un-normalised layer N is read from the last decoder layer's own output.
    """
    N = model.config.num_hidden_layers
    last: list[torch.Tensor] = []
    handle = model.model.layers[-1].register_forward_hook(
        lambda _m, _args, out: last.append(out[0] if isinstance(out, tuple) else out)
    )
    try:
        with torch.no_grad():
            tied = model(input_ids[None], output_hidden_states=True).hidden_states
    finally:
        handle.remove()
    untied = {N: last[0]}
    assert torch.allclose(model.model.norm(untied[N]), tied[N], atol=1e-5)  # really the pre-norm state
    assert not torch.allclose(untied[N], tied[N], atol=1e-3)
    return torch.stack([untied[k][0] if k == N else tied[k][0] for k in layer_ids], dim=1)  # [T, L, H]


def _write_branching_set(path: Path, target_dir: Path) -> tuple[Path, int]:
    """An agentic-shaped set: two conversations on one 300-token system prompt, each generation extending its
    conversation's last (a branch, a duplicate with another loss mask), and short samples sharing nothing; with the
    number of its distinct tokens (its prefix trie's nodes, counted here by brute force)."""
    g = torch.Generator().manual_seed(7)

    def tokens(n: int) -> list[int]:
        return torch.randint(20, 320, (n,), generator=g).tolist()

    system = [0, *tokens(299)]
    a, b = system + tokens(40), system + tokens(60)
    a2 = a + tokens(30)
    ids = [a, a2, a2 + tokens(25), a + tokens(33), b, b + tokens(20), list(a2)]
    ids += [[1 + k, *tokens(40 + 7 * k)] for k in range(5)]  # their first token: shared with no other sample
    samples = [{"input_ids": torch.tensor(x), "loss_mask": torch.rand(len(x), generator=g) > 0.5} for x in ids]
    write_prepared(path, samples, target_identity(target_dir), chat_template_hash="tiny", max_length=1024)
    return path, len({tuple(x[: k + 1]) for x in ids for k in range(len(x))})


@pytest.fixture(scope="module")
def branching(tmp_path_factory, tiny_target_dir) -> tuple[Path, Path, int]:
    """The branching set and its store extracted one sample at a time, each whole (no prefix reused)."""
    prepared, distinct = _write_branching_set(tmp_path_factory.mktemp("branching") / "set", tiny_target_dir)
    out = tmp_path_factory.mktemp("whole") / "s"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf, "_new_cache", lambda config: None)
        extract.run(_cfg(prepared, out), show_progress=False)
    return prepared, out, distinct


def test_samples_sharing_prefixes_compute_and_store_each_distinct_token_once(tmp_path, branching):
    prepared, whole, distinct = branching
    done = extract.run(_cfg(prepared, tmp_path / "s"), show_progress=False).result
    for i in range(2):  # two workers into one store: a run cut in two where longer than half the samples
        extract.run(_cfg(prepared, tmp_path / "w", shard=f"{i}/2"), show_progress=False)
    ref = store.open(whole)
    for path, most in ((tmp_path / "s", distinct + 1), (tmp_path / "w", distinct + 1 + 400)):
        st = store.open(path)  # + 1: the duplicate's own last token; + 400: a cut run's first sample whole
        rows = sum(s.num_rows or s.num_tokens for s in st.manifest.shards)
        assert distinct < rows <= most and rows < 0.45 * st.num_tokens
        assert st.num_tokens == ref.num_tokens and st.sample_ids.tolist() == ref.sample_ids.tolist()
        for k in range(len(st)):  # a chain's forward on one cache equals each sample's whole forward
            x, y = st[k], ref[k]
            assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
            torch.testing.assert_close(x["hidden_states"], y["hidden_states"], rtol=2**-8, atol=1e-5)  # bf16
        assert store.verify_store(path).ok
    assert done.tokens_this_run == distinct + 1


def test_training_on_the_chained_store_packs_trees_and_scores_what_whole_samples_score(
    tmp_path, branching, monkeypatch
):
    """`draftsmith train` on the prefix-chained store trains tree-packed batches (train/packing.py), and its first
    step scores what it scores on the store of whole samples: one batch of every sample either way, the states equal
    within bf16 rounding."""
    prepared, whole, _ = branching
    extract.run(_cfg(prepared, tmp_path / "s"), show_progress=False)
    packed = []
    collate = packing.TreeSampler.collate
    monkeypatch.setattr(packing.TreeSampler, "collate", lambda *a: packed.append(collate(*a)) or packed[-1])
    first = {}
    for name, data in (("tree", tmp_path / "s"), ("padded", whole)):
        options = dict(max_steps=1, token_budget=8192, eval_fraction=0, log_every=1, seed=0)
        trainer.run(TrainConfig(data=data, output=tmp_path / name, device="cpu", precision="fp32", **options))
        first[name] = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])
    (batch,) = packed
    assert batch.input_ids.shape[1] < 0.45 * sum(batch.lengths) and len(batch.lengths) == 12  # distinct rows, about
    tree, padded = first["tree"], first["padded"]
    assert tree["tokens_seen"] == padded["tokens_seen"] == sum(batch.lengths) and padded["loss"] > 0.01
    assert tree["loss"] == pytest.approx(padded["loss"], rel=1e-3)
    assert tree["kl"] == pytest.approx(padded["kl"], rel=1e-3)


def test_a_chain_interrupted_or_repaired_resumes_to_the_very_same_store(tmp_path, branching, monkeypatch):
    prepared, _, _ = branching
    extract.run(_cfg(prepared, tmp_path / "ref"), show_progress=False)
    real, calls = capture.capture_hidden_states, {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 6:  # the batch of short samples, then a chain's fourth sample
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(hf, "capture_hidden_states", interrupted)
    with pytest.raises(KeyboardInterrupt):
        extract.run(_cfg(prepared, tmp_path / "s", shard_size_mb=0.001), show_progress=False)
    monkeypatch.undo()
    assert 0 < len(store.open(tmp_path / "s")) < 12
    extract.run(_cfg(prepared, tmp_path / "s", shard_size_mb=0.001), show_progress=False)
    _assert_stores_identical(tmp_path / "s", tmp_path / "ref")
    manifest = store.open(tmp_path / "s").manifest  # a run's first sample, alone in a shard: everyone's prefix
    shard = next(f for f in manifest.shards if f.num_rows is None and f.num_tokens > 300)
    (tmp_path / "s" / shard.file).write_bytes(b"x" * shard.num_bytes)
    report = store.verify_store(tmp_path / "s", repair=True)
    assert any("which is lost" in p for p in report.problems)
    extract.run(_cfg(prepared, tmp_path / "s"), show_progress=False)
    _assert_stores_identical(tmp_path / "s", tmp_path / "ref")


def _assert_stores_identical(a: Path, b: Path) -> None:
    sa, sb = store.open(a, dtype=torch.bfloat16), store.open(b, dtype=torch.bfloat16)
    assert sa.sample_ids.tolist() == sb.sample_ids.tolist()
    for k in range(len(sa)):
        x, y = sa[k], sb[k]
        assert x["sample_id"] == y["sample_id"]
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        assert torch.equal(x["hidden_states"].view(torch.int16), y["hidden_states"].view(torch.int16)), k


def test_capture_equals_transformers_output_hidden_states(tiny_model):
    ids = torch.randint(0, 320, (1, 37), generator=torch.Generator().manual_seed(1))
    layer_ids = [0, 1, 2, 3, 4]
    got = capture.capture_hidden_states(tiny_model, ids, None, layer_ids)
    assert got.shape == (1, 37, 5, 64) and got.dtype == torch.float32
    torch.testing.assert_close(got[0], _reference(tiny_model, ids[0], layer_ids), rtol=1e-5, atol=1e-5)
    # the last layer is un-normalised, and the final norm + LM head on it give transformers' logits
    with torch.no_grad():
        logits = tiny_model(ids).logits
        torch.testing.assert_close(
            tiny_model.lm_head(tiny_model.model.norm(got[:, :, -1])), logits, rtol=1e-4, atol=1e-4
        )
    # a subset stops early and still matches
    part = capture.capture_hidden_states(tiny_model, ids, None, [2, 0], dtype=torch.bfloat16)
    assert part.dtype == torch.bfloat16
    assert torch.equal(part[0, :, 0], got[0, :, 2].bfloat16()) and torch.equal(part[0, :, 1], got[0, :, 0].bfloat16())
    with pytest.raises(ValueError, match="out of range"):
        capture.capture_hidden_states(tiny_model, ids, None, [5])


def test_right_padding_does_not_change_real_tokens(tiny_model):
    g = torch.Generator().manual_seed(2)
    samples = [{"input_ids": torch.randint(0, 320, (n,), generator=g)} for n in (31, 7, 18, 1)]
    ids, mask = hf.pad_batch(samples)
    assert ids.shape == (4, 31) and mask.sum().item() == 57
    for attention_mask in (None, mask):
        batched = capture.capture_hidden_states(tiny_model, ids, attention_mask, [0, 2, 4])
        for b, s in enumerate(samples):
            alone = capture.capture_hidden_states(tiny_model, s["input_ids"][None], None, [0, 2, 4])
            n = len(s["input_ids"])
            torch.testing.assert_close(batched[b, :n], alone[0], rtol=1e-5, atol=1e-5)


def test_plan_batches_buckets_by_length_within_the_budget():
    import numpy as np

    lengths = np.array([5, 50, 7, 49, 6, 200, 8])
    batches = common.plan_batches(range(7), lengths, token_budget=100)
    assert batches == [[5], [1, 3], [6, 2, 4, 0]]  # longest first; an over-budget sample goes alone
    assert all(len(b) * lengths[b[0]] <= 100 for b in batches[1:])
    assert common.pending_batches(batches, {1, 5, 2}) == [[3], [6, 4, 0]]
    assert common.select_sample_ids(10, "1/3") == [1, 4, 7]
    order, parent = np.arange(7), np.array([-1, 0, 1, 2, 3, 4, -1])
    runs = np.array([0, 300, 400, 200, 300, 300, 0])  # runs 0-1-2 and 3-4-5 (200 < MIN_SHARED), then 6
    picked = [common.select_sample_ids(7, f"{i}/2", None, (order, parent, runs), np.full(7, 900)) for i in (0, 1)]
    assert picked == [[0, 1, 2, 6], [3, 4, 5]]  # every other run, each whole
    one_run = np.array([0, 300, 400, 300, 300, 300, 0])  # longer than half the samples: cut after 4
    picked = [common.select_sample_ids(7, f"{i}/2", None, (order, parent, one_run), np.full(7, 900)) for i in (0, 1)]
    assert picked == [[0, 1, 2, 3, 6], [4, 5]]
    assert common.select_sample_ids(10, "0/2", max_samples=5) == [0, 2, 4]
    assert layers.resolve_layer_ids(None, 30) == [2, 15, 27, 30]
    assert layers.resolve_layer_ids(None, 4) == [1, 2, 4]  # colliding defaults kept once
    assert layers.resolve_layer_ids([3, 1], 4) == [1, 3, 4]
    with pytest.raises(DraftsmithError, match="leave out 4"):
        layers.resolve_layer_ids([1, 4], 4)
    with pytest.raises(DraftsmithError, match="out of range"):
        layers.resolve_layer_ids([9], 4)


def test_chains_make_samples_branching_from_one_prefix_depend_on_it_not_on_each_other():
    import numpy as np

    from draftsmith.prepare.dataset import prefix_tree

    rng = np.random.default_rng(0)
    system, a, b = (rng.integers(1, 999, n) for n in (300, 290, 280))
    samples = [
        np.concatenate(parts)
        for parts in (
            (system, a),  # 0: the root of conversation a
            (system, a, [7, 8]),  # 1, 2, 3: three branches of 0 (2 branches from 1's first 591 tokens)
            (system, a, [7, 9]),
            (system, a, [5]),
            (system, b),  # 4: conversation b shares only the system prompt with a
            (system, b, [4]),  # 5 extends 4
            (system, a, [7, 8]),  # 6: a duplicate of 1
            (rng.integers(1, 999, 400),),  # 7: shares nothing
        )
    ]
    lengths = np.array([len(s) for s in samples])
    runs = common.chains(prefix_tree(samples), lengths, range(len(samples)))
    parents = {i: (parent, shared) for run in runs for i, parent, shared in run}
    assert sorted(len(run) for run in runs) == [1, 7]
    assert parents[7] == (-1, 0)
    assert parents[1] == parents[3] == (0, 590)
    assert parents[2] == parents[6] == (1, 591)  # a duplicate (6) keeps its last token: 2 waits on 1, not on 6
    assert parents[4] == (0, 300) and parents[5] == (4, 580)  # b's root hangs from a's only by the system prompt
    for run in runs:  # a parent comes first in its run and holds the tokens its child shares
        seen = set()
        for i, parent, shared in run:
            assert parent == -1 or (parent in seen and (samples[parent][:shared] == samples[i][:shared]).all())
            seen.add(i)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_store_equals_an_independent_transformers_computation(tmp_path, tiny_prepared, tiny_model, dtype):
    result = extract.run(_cfg(tiny_prepared, tmp_path / "s", dtype=dtype, aux_layer_ids=[0, 1, 3]), show_progress=False)
    assert result.result is not None and result.result.samples_this_run == NUM_SAMPLES
    assert result.result.dtype == dtype and result.summary["dtype"] == dtype  # the CLI's table shows the same
    st = store.open(tmp_path / "s")
    assert st.layer_ids == [0, 1, 3, 4] and len(st) == NUM_SAMPLES and len(st.manifest.shards) > 2
    assert st.manifest.prepared.path == str(tiny_prepared.resolve()) and st.manifest.backend == "hf"
    assert (tmp_path / "s" / "config.yaml").is_file()
    from draftsmith.prepare.dataset import open_prepared

    ds = open_prepared(tiny_prepared)
    assert st.lengths.tolist() == ds.lengths.tolist()
    for k in range(len(st)):
        item = st[k]
        assert torch.equal(item["input_ids"], ds[k]["input_ids"]) and torch.equal(item["loss_mask"], ds[k]["loss_mask"])
        ref = _reference(tiny_model, item["input_ids"], st.layer_ids)
        if dtype == "bf16":  # one bf16 rounding of the fp32 state (batching may move the fp32 value by ~1e-6)
            torch.testing.assert_close(item["hidden_states"], ref, rtol=2**-8, atol=1e-5)
        else:
            scale = ref.abs().amax(-1, keepdim=True) / store.FP8_MAX
            assert (
                (item["hidden_states"] - ref).abs() <= torch.maximum(ref.abs() / 16, scale / 1024) * 1.01 + 1e-5
            ).all()
    assert store.verify_store(tmp_path / "s").ok


def test_rerun_resumes_and_interrupted_run_equals_uninterrupted(tmp_path, tiny_prepared, monkeypatch):
    extract.run(_cfg(tiny_prepared, tmp_path / "ref"), show_progress=False)
    again = extract.run(_cfg(tiny_prepared, tmp_path / "ref"), show_progress=False)
    assert again.result is not None
    assert again.result.samples_this_run == 0 and again.result.samples_already_stored == NUM_SAMPLES

    real = capture.capture_hidden_states
    calls = {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(hf, "capture_hidden_states", interrupted)
    with pytest.raises(KeyboardInterrupt):
        extract.run(_cfg(tiny_prepared, tmp_path / "s"), show_progress=False)
    monkeypatch.undo()
    partial = len(store.open(tmp_path / "s"))
    assert 0 < partial < NUM_SAMPLES
    result = extract.run(_cfg(tiny_prepared, tmp_path / "s"), show_progress=False)
    assert result.result is not None and result.result.samples_already_stored == partial
    _assert_stores_identical(tmp_path / "s", tmp_path / "ref")


def test_full_disk_gives_a_clear_message_and_resume_completes(tmp_path, tiny_prepared, monkeypatch):
    real = store.shards._write_file
    calls = {"n": 0}

    def full(path, data):
        calls["n"] += 1
        if calls["n"] >= 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, data)

    monkeypatch.setattr(store.shards, "_write_file", full)
    with pytest.raises(DraftsmithError, match="no space left on device"):
        extract.run(_cfg(tiny_prepared, tmp_path / "s"), show_progress=False)
    monkeypatch.undo()
    assert len(store.open(tmp_path / "s")) > 0
    extract.run(_cfg(tiny_prepared, tmp_path / "s"), show_progress=False)
    extract.run(_cfg(tiny_prepared, tmp_path / "ref"), show_progress=False)
    _assert_stores_identical(tmp_path / "s", tmp_path / "ref")


def test_workers_fill_one_store_or_separate_stores_that_merge(tmp_path, tiny_prepared):
    for i in range(3):
        extract.run(_cfg(tiny_prepared, tmp_path / "shared", shard=f"{i}/3"), show_progress=False)
        extract.run(_cfg(tiny_prepared, tmp_path / f"w{i}", shard=f"{i}/3"), show_progress=False)
    assert store.open(tmp_path / "w1").sample_ids.tolist() == list(range(1, NUM_SAMPLES, 3))
    merged = store.merge_stores([tmp_path / f"w{i}" for i in range(3)], tmp_path / "merged")
    assert merged.sample_ids.tolist() == list(range(NUM_SAMPLES))
    _assert_stores_identical(tmp_path / "merged", tmp_path / "shared")
    assert store.verify_store(tmp_path / "merged").ok


def test_refuses_a_prepared_set_for_another_target_or_tokenizer(tmp_path, tiny_prepared):
    deeper = build_tiny_target(tmp_path / "deeper", num_layers=5)
    with pytest.raises(DraftsmithError, match="another target or tokenizer.*num_layers|config_hash"):
        extract.run(_cfg(tiny_prepared, tmp_path / "s", target=str(deeper)), show_progress=False)
    other_template = build_tiny_target(tmp_path / "tmpl", chat_template="{{ messages[0]['content'] }}")
    with pytest.raises(DraftsmithError, match="tokenizer_hash"):
        extract.run(_cfg(tiny_prepared, tmp_path / "s", target=str(other_template)), show_progress=False)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(aux_layer_ids=[1, 3]), "layer_ids"),
        (dict(dtype="fp8"), "dtype"),
        (dict(compute_dtype="bfloat16"), "compute_dtype"),
    ],
)
def test_refuses_an_existing_store_made_differently(tmp_path, tiny_prepared, change, words):
    extract.run(_cfg(tiny_prepared, tmp_path / "s", max_samples=4), show_progress=False)
    with pytest.raises(DraftsmithError, match=f"existing store was made differently.*{words}"):
        extract.run(_cfg(tiny_prepared, tmp_path / "s", **change), show_progress=False)
    other = _write_set(tmp_path / "other-set", Path(store.open(tmp_path / "s").manifest.target.path), seed=7)
    with pytest.raises(DraftsmithError, match="prepared set"):
        extract.run(_cfg(other, tmp_path / "s"), show_progress=False)


def test_read_only_output(tmp_path, tiny_prepared, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(DraftsmithError, match="cannot write here"):
        extract.run(_cfg(tiny_prepared, tmp_path / "s"), show_progress=False)


_KILL_SCRIPT = textwrap.dedent("""
    import os, sys, time, torch
    torch.set_num_threads(int(sys.argv[3]))
    from draftsmith.extract import common, hf
    from draftsmith.extract.stage import run
    from draftsmith.config import ExtractConfig, TrainConfig

    # progress for the parent: one line as each batch starts; with --hold the last batch waits to be killed, so a
    # kill never finds the run finished however fast the machine is
    hold, seen, total = sys.argv[4] == "hold", [0], [0]
    pending, capture = common.pending_batches, hf.capture_hidden_states

    def counted(*args):
        batches = pending(*args)
        total[0] = len(batches)
        print("batches", total[0], flush=True)
        return batches

    def reporting(*args, **kwargs):
        seen[0] += 1
        print("batch", seen[0], flush=True)
        if hold and seen[0] == total[0]:
            time.sleep(600)
        return capture(*args, **kwargs)

    common.pending_batches, hf.capture_hidden_states = counted, reporting
    run(ExtractConfig(prepared=sys.argv[1], output=sys.argv[2], token_budget=96, shard_size_mb=0.005, device="cpu"),
        show_progress=False)
""")


def _stored_samples(path: Path) -> int:
    try:
        return store.read_manifest(path, store.StoreManifest).num_samples
    except DraftsmithError:
        return -1


def _read_until(proc: subprocess.Popen, word: str) -> int:
    """The number on the child's next line starting with `word` (the child reports `batches N`, `batch k`)."""
    while line := proc.stdout.readline():
        if line.startswith(word + " "):
            return int(line.split()[1])
    raise AssertionError(f"the extraction child ended before reporting {word!r}")


@pytest.mark.slow  # four fresh Python processes importing transformers: ~40 s idle, minutes on a busy machine
def test_kill_9_at_random_moments_then_resume_equals_an_uninterrupted_run(tmp_path, tiny_target_dir):
    prepared = _write_set(tmp_path / "set", tiny_target_dir, n=40, seed=3, max_len=90)
    script = tmp_path / "extract_script.py"
    script.write_text(_KILL_SCRIPT)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(store.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }

    children = []

    def start(output: Path, hold: bool) -> subprocess.Popen:
        children.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(script),
                    str(prepared),
                    str(output),
                    str(torch.get_num_threads()),
                    "hold" if hold else "run",
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=(tmp_path / "stderr.txt").open("a"),
                text=True,
            )
        )
        return children[-1]

    try:
        assert_kill_and_resume_equals_a_plain_run(start, tmp_path, prepared)
    finally:
        for child in children:  # a failed check leaves no child waiting to be killed
            if child.poll() is None:
                child.kill()
                child.wait()


def assert_kill_and_resume_equals_a_plain_run(start, tmp_path: Path, prepared: Path) -> None:
    rng = random.Random(1234)
    out = tmp_path / "s"
    partial_after_kill = []
    for _ in range(3):  # kill at a random batch of the work left, a random fraction of a batch into it
        before = max(_stored_samples(out), 0)
        proc = start(out, hold=True)
        batches = _read_until(proc, "batches")
        assert batches >= 2, batches
        for _ in range(rng.randint(2, max(2, batches // 2))):  # and leave work for the next run
            _read_until(proc, "batch")
        deadline = time.monotonic() + 240
        while _stored_samples(out) <= before and time.monotonic() < deadline:
            time.sleep(0.005)  # this run has stored a shard (the last batch waits for the kill: never finished)
        time.sleep(rng.uniform(0.0, 0.05))
        assert proc.poll() is None, "the extraction child finished before it was killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=240)
        partial_after_kill.append(_stored_samples(out))
    assert partial_after_kill == sorted(partial_after_kill) and partial_after_kill[0] > 0, partial_after_kill
    assert partial_after_kill[-1] < 40, partial_after_kill  # every kill landed mid-extraction
    final = start(out, hold=False)
    final.communicate(timeout=240)
    assert final.returncode == 0, (tmp_path / "stderr.txt").read_text()[-2000:]
    assert store.verify_store(out).ok and store.verify_store(out).orphans == []
    extract.run(
        ExtractConfig(prepared=prepared, output=tmp_path / "ref", token_budget=96, shard_size_mb=0.005, device="cpu"),
        show_progress=False,
    )
    _assert_stores_identical(out, tmp_path / "ref")


@pytest.mark.slow
def test_default_target_store_equals_transformers(tmp_path, default_target_dir, sharegpt_file):
    from draftsmith.config import PrepareConfig
    from draftsmith.prepare import stage as prepare

    prepare.run(PrepareConfig(data=[str(sharegpt_file)], max_samples=3, max_length=96, output=tmp_path / "p"))
    extract.run(
        # float32 named: compared with transformers' fp32 forward below
        ExtractConfig(
            prepared=tmp_path / "p", output=tmp_path / "s", device="cpu", token_budget=512, compute_dtype="float32"
        ),
        show_progress=False,
    )
    st = store.open(tmp_path / "s")
    assert st.layer_ids == [2, 15, 27, 30] and st.manifest.hidden_size == 576
    model = load_target(default_target_dir)
    for k in range(len(st)):
        item = st[k]
        ref = _reference(model, item["input_ids"], st.layer_ids)
        torch.testing.assert_close(item["hidden_states"], ref, rtol=2**-7, atol=1e-3)
    assert store.verify_store(tmp_path / "s").ok


def test_a_store_the_disk_cannot_hold_is_refused_before_the_target_loads(tmp_path, tiny_prepared, monkeypatch):
    import collections
    import shutil

    from draftsmith.core import sizing

    loaded = []
    monkeypatch.setattr(hf, "load_target", lambda *a, **k: loaded.append(1))
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, (1 << 30) - 20_000, 20_000))
    with pytest.raises(
        DraftsmithError,
        match=r"--output .*: the store of 24 samples \([\d,]+ tokens x 3 layers x 64 "
        r"in bf16\) needs .* GiB but only .* GiB are free there",
    ) as err:
        extract.run(_cfg(tiny_prepared, tmp_path / "s"), show_progress=False)
    assert "\n" not in str(err.value) and not loaded
    from draftsmith.prepare.dataset import open_prepared

    tokens = int(open_prepared(tiny_prepared).lengths.sum())
    needed = sizing.store_bytes(tokens, 64, 3, "bf16", samples=NUM_SAMPLES)
    monkeypatch.undo()
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, 0, int(needed * 1.03)))
    extract.run(_cfg(tiny_prepared, tmp_path / "s"), show_progress=False)  # just enough room: it runs
    assert len(store.open(tmp_path / "s")) == NUM_SAMPLES
