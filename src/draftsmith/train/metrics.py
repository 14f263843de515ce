"""Training metrics: summed on the device, reduced over ranks once per log interval, and written out.

`StepStats` keeps, on the device, the logged step's sums (KL, top-1 agreement, expected acceptance, counts) and a
finiteness flag for every micro-batch since the last reduction (its loss, and each sample's hidden states), so a
step never waits for the host. `reduce` (called at every logged, evaluated or saved step) sums them over ranks
in one all-reduce, and a NaN/Inf anywhere stops the run with its step and samples named. `MetricsSink` writes
metrics.jsonl (and TensorBoard when installed), rank 0 only; `Progress` is the rich progress bar.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import _explain_os_error, atomic_write_text
from draftsmith.train import distributed
from draftsmith.train.batches import Batch
from draftsmith.train.objective import TTTResult

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"  # one line per optimizer step: the sample ids rank 0 trained on, in order


@dataclass
class _Pending:
    step: int
    sample_ids: list[int]
    finite_loss: torch.Tensor  # [] bool, on the device
    finite_samples: torch.Tensor  # [B] bool: the samples' hidden states


class StepStats:
    """Device-side sums of the current step and the finiteness of every micro-batch since the last `reduce`."""

    def __init__(self, ttt_steps: int, device: torch.device):
        self.sums = torch.zeros(4, ttt_steps, dtype=torch.float64, device=device)
        self.pending: list[_Pending] = []
        self.tokens = 0  # this rank's tokens since the last reduce (known on the host)

    def new_step(self) -> None:
        self.sums.zero_()

    def add(self, step: int, result: TTTResult, batch: Batch) -> None:
        self.sums += result.sums
        self.tokens += batch.num_tokens
        self.pending.append(_Pending(step, batch.sample_ids, torch.isfinite(result.loss.detach()), batch.finite()))

    def reduce(self, info: distributed.DistInfo, last_good: str | None) -> tuple[torch.Tensor, int]:
        """(this step's sums over all ranks [4, K] on the CPU, tokens of all ranks since the last reduce); one
        all-reduce. Raises DraftsmithError naming the first step and samples with a NaN/Inf."""
        bad = torch.zeros((), device=self.sums.device)
        if self.pending:
            flags = torch.stack([torch.cat((p.finite_loss[None], p.finite_samples)).all() for p in self.pending])
            bad = (~flags).sum().to(bad.dtype)
        tokens = torch.tensor([float(self.tokens)], dtype=torch.float64, device=self.sums.device)
        total = distributed.all_reduce_sum(torch.cat((self.sums.flatten(), bad[None].double(), tokens)), info).cpu()
        sums, n_bad, n_tokens = total[:-2].view_as(self.sums), int(total[-2]), int(total[-1])
        if n_bad:
            self._raise(info, last_good)
        self.pending, self.tokens = [], 0
        return sums, n_tokens

    def _raise(self, info: distributed.DistInfo, last_good: str | None) -> None:
        mine = None
        for p in self.pending:
            samples = [s for s, ok in zip(p.sample_ids, p.finite_samples.tolist(), strict=False) if not ok]
            if samples:
                mine = (p.step, f"sample {samples[0]} has NaN/Inf hidden states", "re-extract or drop that sample")
                break
            if not bool(p.finite_loss):
                mine = (p.step, f"loss is NaN/Inf on samples {p.sample_ids[:8]}", "lower --lr or check the data")
                break
        found = sorted(x for x in distributed.gather_objects(mine, info) if x is not None)
        step, what, fix = found[0]
        raise DraftsmithError(f"step {step}: {what}; stopped (last good checkpoint: {last_good or 'none yet'}); {fix}")


class MetricsSink:
    """metrics.jsonl (and TensorBoard when installed), rank 0 only; a resume drops lines after its step (and a
    line a killed run left half-written)."""

    def __init__(self, path: Path, enabled: bool, keep_through_step: int, tensorboard: bool = True):
        self.path, self.enabled, self._tb = path, enabled, None
        if not enabled:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            kept = [
                line
                for line in path.read_text(encoding="utf-8").splitlines()
                if (step := _step_of(line)) is not None and step <= keep_through_step
            ]
            atomic_write_text(path, "".join(line + "\n" for line in kept))
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - held for the run, closed by close()
        if not tensorboard:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # the `tensorboard` extra: metrics.jsonl holds every value either way
            print(
                f"train: metrics go to {path.name}; TensorBoard logs need pip install 'draftsmith[tensorboard]'",
                file=sys.stderr,
                flush=True,
            )
            return
        self._tb = SummaryWriter(str(path.parent / "tensorboard"))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()  # a line cut off by a full disk is dropped by the resume
        except OSError as err:
            raise _explain_os_error(self.path, err) from None
        if self._tb is not None:
            kind, step = record.get("type", "train"), record["step"]
            for key in ("loss", "acceptance_length", "lr", "tokens_per_s", "grad_norm"):
                if key in record:
                    self._tb.add_scalar(f"{kind}/{key}", record[key], step)
            for k, a in enumerate(record.get("acc", [])):
                self._tb.add_scalar(f"{kind}/acc_{k}", a, step)

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            if self._tb is not None:
                self._tb.close()


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return None


class Progress:
    """A rich progress bar on stderr: step, tokens/s, loss, per-step accuracy (as of the last logged step)."""

    def __init__(self, total: int, enabled: bool):
        self._bar = None
        if not enabled:
            return
        self._bar = RichProgress(
            TextColumn("train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            console=Console(file=sys.stderr),
            transient=False,
        )
        self._task = self._bar.add_task("train", total=total, info="")
        self._bar.start()

    def update(self, step: int, tokens_per_s: float | None = None, stats: dict | None = None, extra: str = "") -> None:
        if self._bar is None:
            return
        if stats is None:
            self._bar.update(self._task, completed=step)
            return
        acc = " ".join(f"{a:.2f}" for a in stats.get("acc", [])[:4])
        self._bar.update(
            self._task,
            completed=step,
            info=f"{tokens_per_s:,.0f} tok/s  loss {stats.get('loss', 0):.3f}  acc {acc}{extra}",
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
