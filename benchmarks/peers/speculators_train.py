"""Run speculators 0.9.0's own trainer on a CPU (runs in the peer's venv): patch at run time, then call its entry point.

    STEP_LOG=steps.jsonl python speculators_train.py --verifier-name-or-path ... --data-path ... [its own flags]

speculators' trainer assumes an accelerator. Nothing in its files is edited; before its entry point
(`speculators.train.cli.main(TrainConfig.resolve(argv))`, what `python -m speculators.train` runs) this launcher:
  - forces the device to "cpu": `Trainer` moves the model and every batch to `get_local_rank()` (the int 0, i.e.
    cuda:0), and the checkpointer maps loads to `get_current_device()` ("cuda:0" without an accelerator);
  - makes `Trainer` autocast with device type "cpu" (it picks "cuda" when `torch.accelerator` finds none);
  - makes `torch.accelerator.synchronize` a no-op when there is no accelerator (its step timer calls it).
The benchmark passes `--draft-attn-impl sdpa --loss-implementation eager` (flex attention and the Triton-fused loss
need a GPU) and `--hidden-states-dtype` bfloat16 (its default, and its autocast dtype) where the CPU computes bf16
natively, float32 where it does not.

STEP_LOG (a path) receives one JSON line per optimizer step, {"type": "train", "step", "tokens_seen", "loss",
"acc": [full_acc_k]}, and one per validation pass, {"type": "eval", ...}: tokens_seen counts each packed sample at
its full length (speculators' shift drops one token per sample), so it equals draftsmith's count for the same
samples. PROFILE=DIR: phase times and a torch profiler table written there (profile_hook.py).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import torch


def _patch_for_cpu() -> None:
    from speculators.train import checkpointer, trainer

    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda *args, **kwargs: None
    trainer.get_local_rank = lambda: "cpu"
    checkpointer.get_current_device = lambda: "cpu"
    original_init = trainer.Trainer.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.device_type = "cpu"  # autocast("cpu", hidden_states_dtype): bf16 on a bf16 CPU; float32 is a no-op

    trainer.Trainer.__init__ = init


class _StepLog(logging.Handler):
    """speculators.metrics records -> STEP_LOG lines; counts tokens from the batches the model sees."""

    def __init__(self, path: str):
        super().__init__()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the process
        self.tokens = 0
        self.step = 0

    def count(self, document_ids: torch.Tensor) -> None:
        doc = document_ids.reshape(-1)
        real = int((doc != -1).sum())
        # shifted samples are one token shorter than the stored ones: add one per packed sample
        self.tokens += real + (int(doc.max()) + 1 if real else 0)

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.msg
        if not isinstance(msg, dict):
            return
        if "train" in msg:
            self.step += 1
            m = msg["train"]
            acc = [m[k] for k in sorted((k for k in m if k.startswith("full_acc_")), key=lambda k: int(k[9:]))]
            line = {
                "type": "train",
                "step": self.step,
                "tokens_seen": self.tokens,
                "loss": m.get("loss"),
                "acc": acc,
                "epoch": msg.get("epoch"),
                "lr": msg.get("lr"),
                "time": time.time(),
            }
        elif "val" in msg:
            line = {
                "type": "eval",
                "step": self.step,
                "epoch": msg.get("epoch"),
                "time": time.time(),
                **{k: v for k, v in msg["val"].items() if isinstance(v, (int, float))},
            }
        else:
            return
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()


def _install_step_log(path: str) -> None:
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.train import cli

    handler = _StepLog(path)
    original_setup = cli.setup_metric_logger

    def setup(*args, **kwargs):  # its dictConfig resets the metrics logger's handlers: attach ours afterwards
        original_setup(*args, **kwargs)
        logging.getLogger("speculators.metrics").addHandler(handler)

    cli.setup_metric_logger = setup
    original_forward = Eagle3DraftModel.forward

    def forward(self, *args, **kwargs):
        if self.training and kwargs.get("document_ids") is not None:
            handler.count(kwargs["document_ids"])
        return original_forward(self, *args, **kwargs)

    Eagle3DraftModel.forward = forward


def main() -> None:
    _patch_for_cpu()
    if os.environ.get("STEP_LOG"):
        _install_step_log(os.environ["STEP_LOG"])
    if os.environ.get("PROFILE"):  # phase times + torch profiler table (profile_hook.py, beside this file)
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import profile_hook

        profile_hook.install(os.environ["PROFILE"], "speculators")
    from speculators.train.cli import main as train_main
    from speculators.train.config import TrainConfig

    train_main(TrainConfig.resolve(sys.argv[1:]))


if __name__ == "__main__":
    main()
