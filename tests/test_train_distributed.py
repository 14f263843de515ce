"""torchrun --nproc-per-node 2 (gloo, CPU): DDP / FSDP2 gradients equal one process on the combined batch, the
trainer gives one process's loss curve under both with gradient accumulation, and only rank 0 writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from draftsmith.config import TrainConfig

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")

_GRAD_SCRIPT = textwrap.dedent("""
    import gc, sys, torch
    from draftsmith.config import TrainConfig
    from draftsmith.train import distributed, stage as trainer
    from draftsmith.train.objective import TTTModel
    from draftsmith.train.unrolled import step_counts
    sys.path.insert(0, sys.argv[3])
    from test_train_distributed import make_problem

    torch.set_num_threads(1)
    info = distributed.init("cpu", sys.argv[1])
    draft, head, batches, cfg = make_problem()
    model = distributed.wrap(TTTModel(draft), info)
    mine = batches[info.rank::info.world_size]
    norm = distributed.all_reduce_sum(sum(step_counts(b.loss_mask, cfg.method.depths) for b in mine), info)
    for j, b in enumerate(mine):
        with distributed.grad_sync(model, info, j == len(mine) - 1):  # one reduction, after the last micro-batch
            (trainer.forward(model, head, b, cfg, torch.float32, norm, True).loss * info.world_size).backward()
    assert not any(p.requires_grad for n, p in model.named_parameters() if "embed_tokens" in n)
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name.replace("module.", "").replace("draft.", "")] = g.detach().clone()
    if info.rank == 0:
        torch.save(grads, sys.argv[2])
    # Release the wrapped model (DDP's reducer, FSDP's state) before the process group goes, as the trainer does by
    # returning from train(): a global one is freed at interpreter exit, after the group, and gloo then aborts
    # ("terminate called without an active exception") now and then.
    del model, draft, grads, batches, mine
    gc.collect()
    distributed.shutdown(info)
""")


def make_problem():
    """A deterministic draft, target head and four batches of different lengths (shared with the torchrun script)."""
    from draftsmith.config import TrainConfig
    from draftsmith.methods.eagle3.modeling import Eagle3Draft
    from draftsmith.methods.spec import DraftSpec
    from draftsmith.train.batches import collate
    from draftsmith.train.objective import TargetHead

    torch.manual_seed(0)
    cfg = DraftSpec(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=2,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        target_hidden_size=32,
        vocab_size=60,
        draft_vocab_size=30,
        aux_layer_ids=[1, 2, 3],
    )
    draft = Eagle3Draft(cfg)
    draft.init_weights(0)
    draft.set_draft_vocab(torch.arange(0, 60, 2))
    norm = torch.nn.RMSNorm(32, eps=1e-5)
    head = TargetHead(norm, torch.randn(60, 32), draft.draft_to_target)
    gen = torch.Generator().manual_seed(1)
    batches = []
    for i, n in enumerate([9, 14, 6, 11]):
        items = [
            {
                "input_ids": torch.randint(0, 60, (n - j,), generator=gen),
                "loss_mask": torch.rand(n - j, generator=gen) > 0.3,
                "hidden_states": torch.randn(n - j, 4, 32, generator=gen),
                "sample_id": 10 * i + j,
            }
            for j in range(2)
        ]
        batches.append(collate(items, 3))
    return draft, head, batches, TrainConfig(ttt_steps=3, device="cpu")


def _single_process_grads():
    from draftsmith.train import stage as trainer
    from draftsmith.train.objective import TTTModel
    from draftsmith.train.unrolled import step_counts

    draft, head, batches, cfg = make_problem()
    model = TTTModel(draft)
    norm = sum(step_counts(b.loss_mask, cfg.method.depths) for b in batches)
    for b in batches:
        trainer.forward(model, head, b, cfg, torch.float32, norm, True).loss.backward()
    return {n.replace("draft.", ""): p.grad for n, p in model.named_parameters() if p.grad is not None}


def _torchrun(args: list[str], tmp_path: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", *args]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_process_gradients_equal_the_combined_batch(tmp_path, strategy):
    script = tmp_path / "grads.py"
    script.write_text(_GRAD_SCRIPT)
    _torchrun([str(script), strategy, str(tmp_path / "grads.pt"), str(REPO / "tests")], tmp_path)
    got = torch.load(tmp_path / "grads.pt", weights_only=True)
    expected = _single_process_grads()
    assert got.keys() == expected.keys() and "fc.weight" in got
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=1e-5, msg=name)


def _train_script(tmp_path: Path, prepared: Path, out: Path, **options) -> Path:
    script = tmp_path / f"train-{out.name}.py"
    script.write_text(
        textwrap.dedent(f'''
        import sys
        from draftsmith.config import TrainConfig
        from draftsmith.train.stage import run
        r = run(TrainConfig(data="{prepared}", output="{out}", **{options!r}))
        sys.stdout.write(f"RESULT {{r.summary['steps']}}\\n")  # one write: the two ranks' lines never interleave
    ''')
    )
    return script


def _losses(run: Path) -> list[tuple[int, int, float]]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [(m["step"], m["tokens_seen"], m["loss"]) for m in lines if m["type"] == "train"]


@pytest.mark.parametrize("method", ["eagle3", "peagle", "dflash"])
def test_ddp_fsdp2_and_one_process_give_the_same_loss_curve(tiny_target_dir, tmp_path, method):
    """Four optimizer steps of 4 micro-batches each: one process with --grad-accum 4, two with --grad-accum 2
    (every rank reads every other batch of the same packing, so each step sees the same samples). P-EAGLE too: its
    mask_hidden is one more parameter of the root module (sharded by FSDP2 with fc and the head)."""
    import numpy as np

    from draftsmith.core.targets import target_identity
    from draftsmith.prepare.dataset import write_prepared
    from draftsmith.train.stage import run

    rng = np.random.default_rng(3)
    samples = [
        {"input_ids": rng.integers(4, 300, n), "loss_mask": (rng.random(n) > 0.3).astype(int)}
        for n in rng.integers(12, 30, 48)
    ]
    prepared = tmp_path / "prep"
    write_prepared(prepared, samples, target_identity(tiny_target_dir), chat_template_hash="t", max_length=64)
    shape = (
        dict(block_size=4, anchors_per_sample=8, num_layers=2)
        if method == "dflash"
        else dict(ttt_steps=3, draft_vocab_size=300)
    )
    common = dict(
        token_budget=64,
        max_steps=4,
        eval_fraction=0.0,
        log_every=1,
        lr=3e-3,
        warmup_steps=1,
        device="cpu",
        save_every=1000,
        method=method,
        precision="fp32",  # named: the curves agree to 1e-5, which bf16 autocast over other reduction orders need not
        **shape,
    )
    torch.set_num_threads(1)
    run(TrainConfig(data=prepared, output=tmp_path / "one", grad_accum=4, **common))
    one = _losses(tmp_path / "one")
    assert [s for s, _, _ in one] == [1, 2, 3, 4]
    for strategy in ("ddp", "fsdp2"):
        out = tmp_path / strategy
        script = _train_script(tmp_path, prepared, out, grad_accum=2, distributed=strategy, **common)
        assert _torchrun([str(script)], tmp_path).stdout.count("RESULT 4") == 2
        two = _losses(out)
        assert [(s, t) for s, t, _ in two] == [(s, t) for s, t, _ in one], strategy  # the same tokens per step
        np.testing.assert_allclose([x for _, _, x in two], [x for _, _, x in one], rtol=1e-5, err_msg=strategy)
    assert one[-1][2] < one[0][2]  # it trains


def test_auto_picks_ddp_for_a_one_layer_draft_and_fsdp2_for_a_huge_head():
    from draftsmith.train import distributed

    draft, _, _, _ = make_problem()
    assert distributed.choose_strategy("auto", draft, 30) == "ddp"
    assert distributed.choose_strategy("auto", draft, 131072) == "fsdp2"
    assert distributed.choose_strategy("fsdp2", draft, 30) == "fsdp2"


def test_torchrun_trainer_end_to_end_rank0_writes(tiny_target_dir, tmp_path):
    import numpy as np

    from draftsmith.core.targets import target_identity
    from draftsmith.prepare.dataset import write_prepared

    rng = np.random.default_rng(0)
    samples = [
        {"input_ids": rng.integers(4, 300, 20), "loss_mask": np.r_[np.zeros(8), np.ones(12)].astype(int)}
        for _ in range(12)
    ]
    write_prepared(tmp_path / "prep", samples, target_identity(tiny_target_dir), chat_template_hash="t", max_length=64)
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(f'''
        import sys
        from draftsmith.config import TrainConfig
        from draftsmith.train.stage import run
        r = run(TrainConfig(data="{tmp_path / "prep"}", output="{tmp_path / "run"}", draft_vocab_size=300,
                            ttt_steps=2, token_budget=40, max_steps=3, eval_fraction=0.2, log_every=1, device="cpu"))
        sys.stdout.write(f"RESULT {{r.summary['steps']}}\\n")  # one write: the two ranks' lines never interleave
    ''')
    )
    proc = _torchrun([str(script)], tmp_path)
    assert proc.stdout.count("RESULT 3") == 2
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if m["type"] == "train"] == [1, 2, 3]  # one writer: no duplicate lines
    from draftsmith.methods.artefact import latest_checkpoint, load_checkpoint

    _, manifest = load_checkpoint(latest_checkpoint(tmp_path / "run"))
    assert manifest.step == 3
    _, best = load_checkpoint(tmp_path / "run")  # the run directory resolves to best/
    assert best.best_acceptance_length is not None
