#!/usr/bin/env bash
# The trainer's GPU check (issue 13): 8B-shaped training throughput and peak memory at T 2048 and 8192 (bf16,
# torch.compile off and on), the default target's τ after a few minutes of online training, and EAGLE-3, P-EAGLE
# and DFlash on one store (benchmarks/methods.py: τ, draft ms per round, tokens/s per k; vLLM too where it is
# installed); prints a markdown table for docs/benchmarks.md. Sized for <= 8 minutes on one H200 before the methods
# step, which adds ~4 (three small drafts, the reference decoder at k 2..8; each vLLM engine start ~1 min more).
#
#   bash benchmarks/gpu_check.sh                         # on the GPU machine (device cuda)
#   bash benchmarks/gpu_check.sh --device cpu --tiny     # the rehearsal (CI): the same steps on tiny shapes, < 1 min
#   options: --minutes N (τ training time, default 2), --out DIR (logs and JSON, default a temp dir),
#            --tau-target DIR + --tau-prepared DIR (τ on another target / prepared set)
#
# Nothing is downloaded. Python: $PYTHON, else .venv/bin/python, else python3 (the GPU machine's, with CUDA torch).
# Packages that Python lacks (pydantic, ...) are installed from wheels in .whl/ when that folder exists (prepared
# on a machine with an index: `pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl
# pydantic pydantic-core annotated-types typing-inspection`), into a private --target dir, never into the system.
# The τ step needs the default target and its assets in $DRAFTSMITH_CACHE (default ~/.cache/draftsmith); without
# them it is reported as skipped (the lent H200 has no index to fetch them from, and its 64 MiB carry limit is
# smaller than the 94 MB target).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEVICE=cuda TINY=0 MINUTES=2 OUT="" TAU_TARGET="" TAU_PREPARED=""
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --tiny) TINY=1; shift ;;
    --minutes) MINUTES="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --tau-target) TAU_TARGET="$2"; shift 2 ;;
    --tau-prepared) TAU_PREPARED="$2"; shift 2 ;;
    *) echo "gpu_check.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
OUT="${OUT:-$(mktemp -d -t draftsmith-gpu-check-XXXXXX)}"
mkdir -p "$OUT"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PY="$REPO/.venv/bin/python"; else PY=python3; fi
fi
if compgen -G "$REPO/.whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$OUT/site" \
    "$REPO"/.whl/*.whl
  export PYTHONPATH="$OUT/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
START=$(date +%s)

"$PY" - "$DEVICE" <<'EOF' | tee "$OUT/env.txt"
import sys, torch
dev = sys.argv[1]
name = torch.cuda.get_device_name(0) if dev.startswith("cuda") and torch.cuda.is_available() else "cpu"
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, device {name}")
if dev.startswith("cuda") and not torch.cuda.is_available():
    sys.exit("gpu_check.sh: --device cuda but torch sees no GPU (pass --device cpu --tiny for the rehearsal)")
EOF

# 1. Throughput and peak memory of the training step, compile off and on.
if [ "$TINY" = 1 ]; then
  TRAIN_ARGS=(--shape tiny --seqs 128 --device "$DEVICE" --dtype fp32 --steps 1 --warmup 1 --threads 1)
  COMPILE=eager  # traces the layers through dynamo without generating code: seconds, not minutes
else
  TRAIN_ARGS=(--shape 8b --seqs 2048,8192 --device "$DEVICE" --dtype bf16 --steps 3 --warmup 2)
  COMPILE=inductor
fi
"$PY" "$REPO/benchmarks/train.py" "${TRAIN_ARGS[@]}" --no-naive 2> "$OUT/train-eager.log" | tee "$OUT/train-eager.txt"
"$PY" "$REPO/benchmarks/train.py" "${TRAIN_ARGS[@]}" --no-naive --compile "$COMPILE" 2> "$OUT/train-compile.log" \
  | tee "$OUT/train-compile.txt"

# 2. τ of the default target after $MINUTES minutes of online training (reference decoder, MT-bench).
TAU_ARGS=(--device "$DEVICE" --minutes "$MINUTES" --work "$OUT/tau" --k 3)
if [ "$TINY" = 1 ]; then
  "$PY" - "$OUT/tiny" <<'EOF'
import sys
from pathlib import Path
import numpy as np
sys.path.insert(0, "tests")
from conftest import build_tiny_target  # the tests' tiny random Llama with a real tokenizer and chat template
from draftsmith.core.targets import target_identity
from draftsmith.prepare.dataset import write_prepared
out = Path(sys.argv[1])
target = build_tiny_target(out / "target")
rng = np.random.default_rng(0)
samples = [{"input_ids": rng.integers(4, 300, 40), "loss_mask": np.r_[np.zeros(12), np.ones(28)].astype(int)}
           for _ in range(24)]
write_prepared(out / "prepared", samples, target_identity(target), chat_template_hash="t", max_length=64)
EOF
  TAU_TARGET="$OUT/tiny/target" TAU_PREPARED="$OUT/tiny/prepared"
  TAU_ARGS=(--device "$DEVICE" --minutes 0.02 --work "$OUT/tau" --k 2 --draft-vocab 128 --ttt-steps 2
            --token-budget 256 --prompts 1 --max-new-tokens 8 --prompt-set "$OUT/tiny/prepared")
fi
if [ -n "$TAU_PREPARED" ]; then TAU_ARGS+=(--prepared "$TAU_PREPARED"); fi
if [ -n "$TAU_TARGET" ]; then TAU_ARGS+=(--target "$TAU_TARGET"); fi
HAVE_ASSETS=$("$PY" - "$TAU_TARGET" <<'EOF'
import os, sys
from pathlib import Path
if sys.argv[1]:
    print(1); raise SystemExit
cache = Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith"))
print(int(any((cache / "targets").glob("SmolLM2-135M-Instruct*")) and (cache / "files" / "sharegpt-v3").is_dir()))
EOF
)
# with_assets NAME SCRIPT ARGS...: a benchmark of the default assets (skipped in one line without them), its stderr in
# $OUT/NAME.log and its stdout in $OUT/NAME.txt; one thread per process on the --tiny rehearsal
with_assets() {
  local name=$1 script=$2
  shift 2
  if [ "$HAVE_ASSETS" = 1 ]; then
    OMP_NUM_THREADS=$([ "$TINY" = 1 ] && echo 1 || echo "${OMP_NUM_THREADS:-8}") \
      "$PY" "$REPO/benchmarks/$script" "$@" 2> "$OUT/$name.log" | tee "$OUT/$name.txt"
  else
    echo "$name: skipped (no default target in \${DRAFTSMITH_CACHE:-~/.cache/draftsmith}; pass --tau-target)" \
      | tee "$OUT/$name.txt"
  fi
}
with_assets tau tau_vs_tokens.py "${TAU_ARGS[@]}"

# 3. EAGLE-3, P-EAGLE and DFlash: one store, the same training tokens; per k τ, draft time and tokens/s.
if [ "$TINY" = 1 ]; then
  PEAGLE_ARGS=(--device "$DEVICE" --engines hf --work "$OUT/peagle" --prepared "$OUT/tiny/prepared"
               --target "$OUT/tiny/target" --prompt-set "$OUT/tiny/prepared" --k 2,3 --epochs 1 --steps 2
               --draft-vocab 128 --token-budget 256 --prompts 1 --max-new-tokens 8 --dflash-layers 1 --anchors 4)
else
  PEAGLE_ARGS=(--device "$DEVICE" --work "$OUT/peagle" --k 2..8 --vllm-k 2,4,8 --samples 200 --epochs 2
               --prompts 8 --max-new-tokens 128 --dflash-layers 5 --anchors 512)
  if [ -n "$TAU_PREPARED" ]; then PEAGLE_ARGS+=(--prepared "$TAU_PREPARED"); fi
  if [ -n "$TAU_TARGET" ]; then PEAGLE_ARGS+=(--target "$TAU_TARGET"); fi
fi
with_assets peagle methods.py "${PEAGLE_ARGS[@]}"

# 4. The table for docs/benchmarks.md.
"$PY" - "$OUT" "$(( $(date +%s) - START ))" <<'EOF'
import json, sys
from pathlib import Path
out, seconds = Path(sys.argv[1]), int(sys.argv[2])
def last_json(name):
    lines = [x for x in (out / name).read_text().splitlines() if x.startswith("{")]
    return json.loads(lines[-1]) if lines else None
env = (out / "env.txt").read_text().strip()
print(f"\n{env}; gpu_check.sh took {seconds} s\n")
print("| shape | T | compile | dtype | tokens/s | peak MB |")
print("|---|---|---|---|---|---|")
for name in ("train-eager.txt", "train-compile.txt"):
    r = last_json(name)
    if r is None:
        print(f"| {name}: no result | | | | | |"); continue
    for shape, by_t in r["tokens_per_s_by_T"].items():
        for t, tps in by_t.items():
            print(f"| {shape} | {t} | {r['compile'] or 'off'} | {r['dtype']} | {tps:,.0f} | "
                  f"{r['peak_mb_by_T'][shape][t]:,.0f} |")
tau = last_json("tau.txt")
if tau is None:
    print(f"\nτ: {(out / 'tau.txt').read_text().strip()}")
else:
    print(f"\nτ after {tau['train_s']:.0f} s of online training ({tau['tokens']:,} tokens at "
          f"{tau['tokens_per_s']:,.0f} tokens/s): " + ", ".join(f"k={k}: {v:.2f}" for k, v in tau["tau"].items()))
peagle = last_json("peagle.txt")
if peagle is None:
    print(f"\nEAGLE-3, P-EAGLE, DFlash: {(out / 'peagle.txt').read_text().strip() or 'no result (see peagle.log)'}")
else:
    methods = ("eagle3", "peagle", "dflash")
    print(f"\nEAGLE-3 | P-EAGLE | DFlash ({peagle['train']['eagle3']['tokens']} training tokens each, TTT/depths "
          f"{peagle['ttt_steps']}, DFlash block {peagle['dflash']['block_size']} x {peagle['dflash']['layers']} "
          f"layers, {peagle['dtype']}; draft ms = time per round inside the draft):\n")
    print("| engine | k | " + " | ".join(f"{what} {m}" for what in ("τ", "draft ms", "tokens/s") for m in methods)
          + " |")
    print("|---|---|" + "---|" * 9)
    for engine, res in peagle["engines"].items():
        if "error" in res:
            print(f"| {engine} | {res['error']} |" + " |" * 9); continue
        rows = [res["methods"].get(m, {}) for m in methods]
        for k in sorted({k for r in rows for k in r}, key=int):
            cells = [f"{r[k][key]:.3f}" if k in r and r[k].get(key) is not None else "–"
                     for key in ("tau", "draft_ms_per_round", "tokens_per_s") for r in rows]
            print(f"| {engine} | {k} | " + " | ".join(cells) + " |")
EOF
