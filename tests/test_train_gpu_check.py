"""benchmarks/gpu_check.sh, rehearsed on the CPU (--device cpu --tiny): every step the GPU check runs (training
throughput and memory with compile off and on, τ after online training, the table) works before a GPU is lent."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_rehearsal_runs_every_step_and_prints_the_table(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--device", "cpu", "--tiny", "--out", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    out = proc.stdout
    assert "| shape | T | compile | dtype | tokens/s | peak MB |" in out
    assert "| tiny | 128 | off | fp32 |" in out and "| tiny | 128 | eager | fp32 |" in out
    assert "τ after" in out and "k=2:" in out
    # every drafting method on one store, in the reference decoder (--engines hf on the rehearsal)
    header = "| engine | k | " + " | ".join(f"τ {m}" for m in ("eagle3", "eagle3.1", "peagle", "dflash", "dspark"))
    assert header in out and "| hf | 2 |" in out and "| hf | 3 |" in out


def test_gpu_check_kimi_rehearsal_runs_every_step_and_writes_its_json(tmp_path):
    """`gpu_check.sh --kimi` (the reference job's checks: its draft step, variable T with the compiled graph count,
    the host crossing pageable vs pinned, train + export end to end) on tiny shapes: each step gives a result."""
    import json

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            "bash",
            str(REPO / "benchmarks" / "gpu_check.sh"),
            "--kimi",
            "--device",
            "cpu",
            "--tiny",
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    report = json.loads((tmp_path / "kimi.json").read_text())
    assert report["step"]["chunked"]["tokens_per_s_by_T"]["tiny"]["128"] > 0
    vary = report["vary"]
    assert len(vary["lengths"]) == 6 and 0 < vary["unique_graphs"] < len(vary["lengths"])  # not one per length
    assert report["sink"]["pinned"]["on_host_s"] > 0 and report["sink"]["pageable"]["on_host_s"] > 0
    assert report["train_end_to_end"] is True and (tmp_path / "kimi-export" / "config.json").is_file()
    assert "draftsmith train end to end: ok" in proc.stdout
