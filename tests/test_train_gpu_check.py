"""benchmarks/gpu_check.sh, rehearsed on the CPU (--device cpu --tiny): every step the GPU check runs (training
throughput and memory with compile off and on, τ after online training, the table) works before a GPU is lent."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_rehearsal_runs_every_step_and_prints_the_table(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--device", "cpu", "--tiny", "--out",
                           str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    out = proc.stdout
    assert "| shape | T | compile | dtype | tokens/s | peak MB |" in out
    assert "| tiny | 128 | off | fp32 |" in out and "| tiny | 128 | eager | fp32 |" in out
    assert "τ after" in out and "k=2:" in out
