"""Makes the artefacts in this directory with draftsmith 0.1.0 as of commit db7d796 (the layout before the stage
packages), so tests/test_legacy_artefacts.py can check that today's code still reads them.

    git worktree add /tmp/old db7d796
    PYTHONPATH=/tmp/old/src python tests/data/legacy-0.1.0/make.py tests/data/legacy-0.1.0

The target is the tests' tiny random Llama (conftest.build_tiny_target, deterministic), rebuilt by the test.
"""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from conftest import build_tiny_target  # noqa: E402
from draftsmith.data.prepare import run as prepare  # noqa: E402

from draftsmith import config as C  # noqa: E402
from draftsmith.export import run as export  # noqa: E402
from draftsmith.extract.stage import run as extract  # noqa: E402
from draftsmith.train.stage import run as train  # noqa: E402

out = Path(sys.argv[1])
work = Path("/tmp/draftsmith-legacy-work")
shutil.rmtree(work, ignore_errors=True)
torch.set_num_threads(1)
target = build_tiny_target(work / "target")
rng = np.random.default_rng(0)
words = "the quick brown fox jumps over lazy dog hello how can i help you today paris is capital".split()
chats = work / "chats.jsonl"
with open(chats, "w") as f:
    for i in range(12):
        f.write(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": " ".join(rng.choice(words, 5))},
                        {"role": "assistant", "content": " ".join(rng.choice(words, 12))},
                    ]
                }
            )
            + "\n"
        )
prepare(
    C.PrepareConfig(
        data=[str(chats)], target=str(target), output=work / "prepared", max_length=48, num_workers=1, shard_samples=8
    )
)
for dt in ("bf16", "fp8"):
    extract(C.ExtractConfig(prepared=work / "prepared", output=work / f"store-{dt}", dtype=dt), show_progress=False)
train(
    C.TrainConfig(
        data=work / "store-bf16",
        output=work / "train",
        max_steps=2,
        token_budget=256,
        ttt_steps=2,
        draft_vocab_size=64,
        warmup_steps=1,
        save_every=2,
        keep_checkpoints=1,
        eval_fraction=0.2,
    )
)
for fmt in ("vllm", "sglang", "speculators"):
    export(C.ExportConfig(checkpoint=work / "train", format=fmt, output=work / f"export-{fmt}", dtype="fp32"))
shutil.rmtree(work / "target")
(work / "chats.jsonl").unlink()
for p in work.iterdir():
    dest = out / p.name
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(p, dest, ignore=shutil.ignore_patterns(".locks", "tensorboard"))
print("written", sorted(p.name for p in out.iterdir()))
