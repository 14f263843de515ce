"""Write a draftsmith hidden-state store out in speculators 0.9.0's on-disk training format (runs in the peer's venv).

    python speculators_data.py STORE OUT --order 3,0,7,... [--n-train N]

speculators' trainer (`speculators.train.data.ArrowDataset` + `hs_connectors.FileTransfer`) reads a data directory:

    OUT/                          `datasets.Dataset.save_to_disk`, torch format: input_ids (int64 [T]),
                                  loss_mask (int64 [T], 1 = assistant token), seq_len (int)
    OUT/hidden_states/hs_{i}.safetensors   row i: hidden_states [T, L, H] (aux layers, then the last layer),
                                  token_ids int64 [T] (must equal row i's input_ids)
    OUT/token_freq.pt             {token id: count of loss-masked occurrences}, from which it builds its own
                                  draft vocabulary (d2t-N.npy / t2d-N.npy are cached there on first use)

Its train / validation split is by row order (the first int(n * train_data_ratio) rows train), so the rows are
written in the order given by --order: draftsmith's training samples first, its held-out samples last, and
`train_data_ratio` = (n_train + 0.5) / n makes both trainers hold out exactly the same samples.

The store is read through its documented file format (docs/formats.md, "Hidden-state store"): manifest.json lists
the shards; each shard holds hidden_states [T, L, H] (bf16, or F8_E4M3 with hidden_scales [T, L]), input_ids,
loss_mask, offsets [S + 1] and sample_ids [S]. The states are written as stored (bf16), so both trainers read the
same numbers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def read_store(store: Path) -> dict[int, dict[str, torch.Tensor]]:
    """sample id -> {input_ids int64 [T], loss_mask int64 [T], hidden_states [T, L, H] (bf16)}."""
    manifest = json.loads((store / "manifest.json").read_text())
    if manifest.get("kind") != "store":
        raise SystemExit(f"{store}: not a draftsmith hidden-state store (kind {manifest.get('kind')!r})")
    samples: dict[int, dict[str, torch.Tensor]] = {}
    for shard in manifest["shards"]:
        with safe_open(str(store / shard["file"]), framework="pt") as f:
            hs = f.get_tensor("hidden_states")
            if "hidden_scales" in set(f.keys()):  # fp8 store: value = float(e4m3) * scale, per token and layer
                hs = (hs.float() * f.get_tensor("hidden_scales").float()[..., None]).to(torch.bfloat16)
            ids, mask = f.get_tensor("input_ids").long(), f.get_tensor("loss_mask").long()
            offsets, sample_ids = f.get_tensor("offsets").tolist(), f.get_tensor("sample_ids").tolist()
        for j, sid in enumerate(sample_ids):
            a, b = offsets[j], offsets[j + 1]
            samples[int(sid)] = {
                "input_ids": ids[a:b].clone(),
                "loss_mask": mask[a:b].clone(),
                "hidden_states": hs[a:b].clone(),
            }
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--order", required=True, help="comma-separated sample ids, in the order of the rows")
    args = parser.parse_args()
    from datasets import Dataset

    order = [int(x) for x in args.order.split(",") if x.strip()]
    samples = read_store(args.store)
    missing = [s for s in order if s not in samples]
    if missing:
        raise SystemExit(f"{args.store}: samples {missing[:5]} are not in the store")
    hs_dir = args.out / "hidden_states"
    hs_dir.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    freq: dict[int, int] = {}
    for i, sid in enumerate(order):
        s = samples[sid]
        save_file(
            {"hidden_states": s["hidden_states"].contiguous(), "token_ids": s["input_ids"].contiguous()},
            str(hs_dir / f"hs_{i}.safetensors"),
        )
        rows["input_ids"].append(s["input_ids"].tolist())
        rows["loss_mask"].append(s["loss_mask"].tolist())
        rows["seq_len"].append(int(s["input_ids"].numel()))
        ids, counts = s["input_ids"][s["loss_mask"].bool()].unique(return_counts=True)
        for t, c in zip(ids.tolist(), counts.tolist(), strict=False):
            freq[t] = freq.get(t, 0) + c
    ds = Dataset.from_dict(rows)
    ds.set_format(type="torch")  # as speculators' prepare_data leaves it (ArrowDataset compares torch tensors)
    ds.save_to_disk(str(args.out))
    torch.save(freq, args.out / "token_freq.pt")
    print(json.dumps({"rows": len(order), "tokens": sum(rows["seq_len"]), "out": str(args.out)}))


if __name__ == "__main__":
    main()
