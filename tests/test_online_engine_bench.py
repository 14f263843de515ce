"""benchmarks/online_engine.py's measuring parts, without an engine: the disk sampler sees a peak that is gone by
the end, the summary parser reads the table the CLI really prints, and a failed CLI call becomes its one line."""

from __future__ import annotations

import importlib.util
import io
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from draftsmith import cli
from draftsmith.config import StageResult

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_online_engine", ROOT / "benchmarks" / "online_engine.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_disk_peak_sees_a_transient_peak(tmp_path):
    root = tmp_path / "spool"
    sampler = bench.DiskPeak(root, interval=0.005)
    sampler.start()
    time.sleep(0.05)  # the directory does not exist yet: 0, no error
    (root / "chunk-a").mkdir(parents=True)
    (root / "chunk-a" / "x.bin").write_bytes(b"\0" * 300_000)
    (root / "chunk-b").mkdir()
    (root / "chunk-b" / "y.bin").write_bytes(b"\0" * 200_000)
    time.sleep(0.2)
    (root / "chunk-a" / "x.bin").unlink()  # consumed
    time.sleep(0.05)
    sampler.stop()
    assert sampler.peak == 500_000
    assert sampler.last == 200_000 == bench.tree_bytes(root)
    assert sampler.samples > 10
    assert bench.tree_bytes(tmp_path / "missing") == 0


def test_parse_summary_reads_the_cli_table(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=out, width=250))
    summary = {
        "mode": "online (vLLM engines, spool)",
        "tokens": 123_456,
        "tokens/s": 291.4,
        "extraction tokens/s": 12_345.6,
        "spool peak (bytes)": 21_323_776,
        "layer ids": "2,15,27",
        "per-step acc": [0.1, 0.2],
    }
    cli._print_result(StageResult(stage="train", output=Path("/tmp/run"), summary=summary))
    parsed = bench.parse_summary(out.getvalue())
    assert parsed["mode"] == "online (vLLM engines, spool)"
    assert parsed["tokens"] == 123_456 and parsed["spool peak (bytes)"] == 21_323_776
    assert parsed["tokens/s"] == 291.4
    assert parsed["extraction tokens/s"] == 12_346  # the CLI prints big floats as whole numbers
    assert parsed["layer ids"] == "2,15,27"  # not a number with thousands separators
    assert parsed["output"] == "/tmp/run"


def test_failure_line_of_a_usage_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "draftsmith", "train", "--data", str(tmp_path), "--no-such-flag"],
        capture_output=True,
        text=True,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert proc.returncode != 0
    assert bench.failure_line(proc.stderr, proc.returncode) == "No such option: --no-such-flag"
    assert (
        bench.failure_line("progress...\nerror: --spool-gb 0.01: too small\n", 1) == "error: --spool-gb 0.01: too small"
    )
    assert bench.failure_line("", 3) == "exit status 3, nothing on stderr"
