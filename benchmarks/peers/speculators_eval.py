"""Held-out step-k accuracy of speculators-format EAGLE-3 drafts, one definition for every draft (peer's venv).

    python speculators_eval.py --data PEER_DATA --rows 120,121,... --target TARGET DRAFT_DIR [DRAFT_DIR ...]

Each draft directory is loaded with speculators' own `Eagle3DraftModel.from_pretrained` (a speculators checkpoint,
or draftsmith's `export --format speculators`, which carries norm_before_residual / norm_before_fc / norm_output
as the model needs them), and run over the held-out rows of the benchmark's data (speculators' format, see
speculators_data.py) with speculators' own TTT forward: teacher-forced input tokens, the draft's own hidden
state fed from step to step, document-masked causal attention plus the diagonal of the earlier steps.

Accuracy, draftsmith's definition (`draftsmith.train.unrolled`): tokens x_0..x_{T-1}; at step k the draft at position
t predicts x_{t+k+2}; it is right when its top-1 (mapped to a target id) equals the target's top-1 over the FULL
vocabulary at position t+k+1 (layer N -> final norm -> lm_head), counted where loss_mask[t+k+2] (the predicted
token is the assistant's). Unconditional per step (step k is scored even where step k-1 was wrong).

speculators' own validation metric (`full_acc_k`) differs: the target's top-1 over the draft vocabulary only,
the mask of the token before the predicted one (loss_mask[t+k+1]), and cumulative (right at every step 0..k).
It is printed beside ours as `acc_own_metric`, computed by speculators' code on the same rows.
Last line: JSON {draft dir: {"acc": [...], "count": [...], "acc_own_metric": [...]}}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors import safe_open


def target_head(target: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """(final norm weight, lm_head weight [V, H], embedding [V, H], eps) of the target, fp32."""
    cfg = json.loads((target / "config.json").read_text())
    want = {"model.norm.weight": None, "lm_head.weight": None, "model.embed_tokens.weight": None}
    files = sorted(target.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in set(f.keys()) & set(want):
                want[key] = f.get_tensor(key).float()
    head = want["lm_head.weight"] if want["lm_head.weight"] is not None else want["model.embed_tokens.weight"]
    return want["model.norm.weight"], head, want["model.embed_tokens.weight"], float(cfg.get("rms_norm_eps", 1e-5))


def load_draft(path: Path, embedding: torch.Tensor):
    from speculators.models.eagle3.core import Eagle3DraftModel

    config = Eagle3DraftModel.config_class.from_pretrained(str(path))
    config.transformer_layer_config._attn_implementation = "sdpa"  # what the trainer ran with on CPU
    model = Eagle3DraftModel.from_pretrained(str(path), config=config)
    # Both trainers keep the target's embedding frozen. A checkpoint without embed_tokens (draftsmith's exports:
    # vLLM takes the target's) comes out of from_pretrained with an all-zero embedding under transformers 5.19
    # (speculators only fills it from the verifier when it is NaN), and speculators' own checkpoints store it
    # rounded to bf16: give both the target's exact embedding, as in training.
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embedding)
    return model.float().eval()


@torch.no_grad()
def evaluate(model, rows: list[dict], norm_w: torch.Tensor, head: torch.Tensor, eps: float, ttt_steps: int) -> dict:
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3.data import shift_batch

    loss_config = resolve_loss_config("kl_div", "eager")
    correct, count = torch.zeros(ttt_steps, dtype=torch.float64), torch.zeros(ttt_steps, dtype=torch.float64)
    own = {}
    d2t = model.d2t.long()
    for row in rows:
        ids, mask, hs = row["input_ids"], row["loss_mask"], row["hidden_states"].float()
        t = ids.numel()
        sample = {
            "input_ids": ids,
            "hidden_states": hs[:, :-1].flatten(1),
            "verifier_last_hidden_states": hs[:, -1],
            "loss_mask": mask,
            "lengths": torch.tensor([t]),
            "position_ids": torch.arange(t),
        }
        b = shift_batch(sample)  # the trainer's own alignment: x_{i+1}, g_i, y_{i+1}, l_{i+1}
        draft_tokens, _, metrics = model(
            hidden_states=b["hidden_states"][None],
            input_ids=b["input_ids"][None],
            document_ids=torch.zeros(1, t - 1, dtype=torch.long),
            loss_mask=b["loss_mask"][None],
            position_ids=b["position_ids"][None],
            verifier_last_hidden_states=b["verifier_last_hidden_states"][None],
            ttt_steps=ttt_steps,
            ttt_step_loss_decay=1.0,
            loss_config=loss_config,
        )
        for key, value in metrics.items():
            own[key] = own.get(key, 0.0) + float(value)
        # target top-1 over the full vocabulary at every position j (predicts x_{j+1})
        last = hs[:, -1]
        x = last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + eps) * norm_w
        tgt = torch.cat([(x[i : i + 256] @ head.T).argmax(-1) for i in range(0, t, 256)])
        for k in range(ttt_steps):
            n = t - k - 2  # positions t' = 0..T-k-3 (shifted index i = t')
            if n <= 0:
                continue
            pred = draft_tokens[k][0, :n].long()
            pred = pred + d2t[pred]  # draft id -> target id
            scored = mask[k + 2 : k + 2 + n].bool()
            correct[k] += (pred[scored] == tgt[k + 1 : k + 1 + n][scored]).sum()
            count[k] += scored.sum()
    acc = (correct / count.clamp(min=1)).tolist()
    own_acc = [own[f"full_acc_{k}_sum"] / max(own[f"full_acc_{k}_total"], 1.0) for k in range(ttt_steps)]
    return {
        "acc": [round(a, 5) for a in acc],
        "count": [int(c) for c in count.tolist()],
        "acc_own_metric": [round(a, 5) for a in own_acc],
    }


def read_rows(data: Path, indices: list[int]) -> list[dict]:
    from datasets import load_from_disk

    ds = load_from_disk(str(data))
    rows = []
    for i in indices:
        with safe_open(str(data / "hidden_states" / f"hs_{i}.safetensors"), framework="pt") as f:
            hs, token_ids = f.get_tensor("hidden_states"), f.get_tensor("token_ids").long()
        item = ds[i]
        ids = torch.as_tensor(item["input_ids"]).long()
        if not torch.equal(ids, token_ids):
            raise SystemExit(f"{data}: row {i}: hidden-state file and dataset disagree on the tokens")
        rows.append({"input_ids": ids, "loss_mask": torch.as_tensor(item["loss_mask"]).long(), "hidden_states": hs})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafts", nargs="+", type=Path)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--rows", required=True, help="comma-separated row indices (the held-out rows)")
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = read_rows(args.data, [int(x) for x in args.rows.split(",") if x.strip()])
    norm_w, head, embedding, eps = target_head(args.target)
    out = {str(d): evaluate(load_draft(d, embedding), rows, norm_w, head, eps, args.ttt_steps) for d in args.drafts}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
