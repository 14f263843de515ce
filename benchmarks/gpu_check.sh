#!/usr/bin/env bash
# The trainer's GPU check (issue 13): 8B-shaped training throughput and peak memory at T 2048 and 8192 (bf16,
# torch.compile off and on), the default target's τ after a few minutes of online training, and the five drafting
# methods on one store (benchmarks/methods.py: τ, draft ms per round, tokens/s per k; vLLM too where it is installed,
# DSpark included on a GPU; with vLLM, the τ draft's speed-up by concurrency through `draftsmith serve`, evaluate --concurrency); prints
# a markdown table for docs/benchmarks.md. Sized for <= 8 minutes on one H200 before the methods
# step, which adds ~6 (five small drafts, the reference decoder at k 2..8; each vLLM engine start ~1 min more).
#
#   bash benchmarks/gpu_check.sh                         # on the GPU machine (device cuda)
#   bash benchmarks/gpu_check.sh --device cpu --tiny     # the rehearsal (CI): the same steps on tiny shapes, < 1 min
#   bash benchmarks/gpu_check.sh --kimi                  # the Kimi-K2.5 reference job's checks instead (~7 min): its
#                                                        # draft step (T 4096, checkpointed, flex and chunked),
#                                                        # variable T in one process with the compiled graph count,
#                                                        # the extraction's host crossing pageable vs pinned, and
#                                                        # `draftsmith train --device cuda` end to end on a tiny
#                                                        # target; JSON in $OUT/kimi.json (rehearsal: add
#                                                        # --device cpu --tiny)
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
DEVICE=cuda TINY=0 KIMI=0 MINUTES=2 OUT="" TAU_TARGET="" TAU_PREPARED=""
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --tiny) TINY=1; shift ;;
    --kimi) KIMI=1; shift ;;
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

# tiny_assets DIR: the tests' tiny random Llama (real tokenizer and chat template) and a random prepared set there
tiny_assets() {
  "$PY" - "$1" <<'EOF'
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
}

if [ "$KIMI" = 1 ]; then
  cd "$REPO"
  if [ "$TINY" = 1 ]; then  # CPU: chunked only (flex has no CPU backward); the eager backend only traces
    STEP=(--shape tiny --seqs 128 --dtype fp32 --steps 1 --warmup 1 --threads 1) KERNELS="chunked" BACKEND=eager
    VARY=(--shape tiny --seqs 128 --vary 6 --dtype fp32 --threads 1) SINK=(--tokens 512 --rounds 1)
  else
    STEP=(--shape kimi --seqs 4096 --dtype bf16 --steps 2 --warmup 1) KERNELS="flex chunked" BACKEND=inductor
    VARY=(--shape kimi --seqs 4096 --vary 12 --dtype bf16) SINK=(--tokens 16384 --rounds 5)
  fi
  # 1. The reference job's draft step: T 4096, activation checkpointing, each TTT attention kernel.
  for kernel in $KERNELS; do
    "$PY" benchmarks/train.py "${STEP[@]}" --device "$DEVICE" --checkpointing --no-naive --kernel "$kernel" \
      2> "$OUT/kimi-step-$kernel.log" | tee "$OUT/kimi-step-$kernel.txt"
  done
  # 2. Micro-batches of random lengths in one process, layers compiled: the graphs dynamo made over them.
  "$PY" benchmarks/train.py "${VARY[@]}" --device "$DEVICE" --checkpointing --compile "$BACKEND" \
    2> "$OUT/kimi-vary.log" | tee "$OUT/kimi-vary.txt"
  # 3. The extraction's host crossing at a Kimi-shaped step: pageable and waiting against pinned on a side stream.
  "$PY" benchmarks/sink.py --copies --device "$DEVICE" "${SINK[@]}" 2> "$OUT/kimi-sink.log" | tee "$OUT/kimi-sink.txt"
  # 4. draftsmith train on this device end to end (online: the tiny target runs in the trainer), then its export.
  tiny_assets "$OUT/tiny"
  set +e
  "$PY" -m draftsmith train --data "$OUT/tiny/prepared" --output "$OUT/kimi-train" --device "$DEVICE" \
    --max-steps 4 --draft-vocab-size 128 --ttt-steps 2 --token-budget 256 > "$OUT/kimi-train.txt" \
    2> "$OUT/kimi-train.log" && "$PY" -m draftsmith export "$OUT/kimi-train" --output "$OUT/kimi-export" \
    >> "$OUT/kimi-train.txt" 2>> "$OUT/kimi-train.log"
  echo "train + export: exit $?" | tee -a "$OUT/kimi-train.txt"
  set -e
  "$PY" - "$OUT" "$(( $(date +%s) - START ))" <<'EOF'
import json, sys
from pathlib import Path
out, seconds = Path(sys.argv[1]), int(sys.argv[2])
def last_json(name):
    path = out / name
    lines = [x for x in path.read_text().splitlines() if x.startswith("{")] if path.exists() else []
    return json.loads(lines[-1]) if lines else None
steps = {p.stem.removeprefix("kimi-step-"): last_json(p.name) for p in sorted(out.glob("kimi-step-*.txt"))}
train = (out / "kimi-train.txt").read_text()
report = {"env": (out / "env.txt").read_text().strip(), "seconds": seconds, "step": steps,
          "vary": last_json("kimi-vary.txt"), "sink": last_json("kimi-sink.txt"),
          "train_end_to_end": "exit 0" in train and (out / "kimi-export").is_dir()}
(out / "kimi.json").write_text(json.dumps(report, indent=1))
print(f"\n{report['env']}; gpu_check.sh --kimi took {seconds} s\n")
for kernel, r in steps.items():
    if r is None:
        print(f"draft step, {kernel}: no result (see kimi-step-{kernel}.log)"); continue
    for shape, by_t in r["tokens_per_s_by_T"].items():
        for t, tps in by_t.items():
            print(f"draft step {shape} T {t} {kernel} {r['dtype']} checkpointed: {tps:,.0f} tokens/s, "
                  f"peak {r['peak_mb_by_T'][shape][t]:,.0f} MB")
v = report["vary"]
print("variable T: no result" if v is None else
      f"variable T ({len(v['lengths'])} lengths {min(v['lengths'])}..{max(v['lengths'])}, compiled {v['compile']}): "
      f"{v['unique_graphs']} graphs, {v['tokens_per_s']:,.0f} tokens/s")
k = report["sink"]
print("host crossing: no result" if k is None else
      f"host crossing of {k['tokens']} tokens ({k['fp8_mb']} MB fp8) on {k['device']}: pageable "
      f"{k['pageable']['on_host_s'] * 1e3:.1f} ms (step held {k['pageable']['step_held_s'] * 1e3:.1f}), pinned "
      f"{k['pinned']['on_host_s'] * 1e3:.1f} ms (step held {k['pinned']['step_held_s'] * 1e3:.1f}): "
      f"{k['pinned_vs_pageable']}x")
print(f"draftsmith train end to end: {'ok' if report['train_end_to_end'] else 'FAILED (see kimi-train.log)'}")
print(f"JSON: {out / 'kimi.json'}")
EOF
  exit 0
fi

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
  tiny_assets "$OUT/tiny"
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

# 2b. That draft where it is served: the speed-up by concurrency through `draftsmith serve` with and without it, each
# loaded by vLLM's `vllm bench serve` (evaluate --concurrency); only where vLLM is installed beside CUDA torch.
if [ "$TINY" = 0 ] && [ -d "$OUT/tau/export" ] && "$PY" -c "import vllm" 2> /dev/null; then
  "$PY" -m draftsmith evaluate --draft "$OUT/tau/export" --concurrency 1,4,16,64 --k 3 --num-prompts 40 \
    --max-new-tokens 128 --no-baseline --output "$OUT/concurrency" 2> "$OUT/concurrency.log" \
    | tee "$OUT/concurrency.txt" || echo "concurrency: failed (see concurrency.log)" | tee -a "$OUT/concurrency.txt"
else
  echo "concurrency: skipped (no vLLM here, or no τ draft)" | tee "$OUT/concurrency.txt"
fi

# 3. Every drafting method (EAGLE-3, Eagle 3.1, P-EAGLE, DFlash, DSpark): one store, the same training tokens; per k
# τ, draft time and tokens/s (vLLM: the methods it serves; on a GPU that includes DSpark).
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
    print(f"\nmethods: {(out / 'peagle.txt').read_text().strip() or 'no result (see peagle.log)'}")
else:
    methods = tuple(peagle["train"])  # those benchmarks/methods.py trained: all five by default
    first = peagle["train"][methods[0]]["tokens"]
    blocks = ", ".join(f"{m} block {peagle[m]['block_size']} x {peagle[m]['layers']} layers"
                       for m in ("dflash", "dspark") if m in peagle)
    print(f"\n{' | '.join(methods)} ({first} training tokens each, TTT/depths {peagle['ttt_steps']}, {blocks}, "
          f"{peagle['dtype']}; draft ms = time per round inside the draft; –: not run or not served):\n")
    print("| engine | k | " + " | ".join(f"{what} {m}" for what in ("τ", "draft ms", "tokens/s") for m in methods)
          + " |")
    print("|---|---|" + "---|" * (3 * len(methods)))
    for engine, res in peagle["engines"].items():
        if "error" in res:
            print(f"| {engine} | {res['error']} |" + " |" * (3 * len(methods))); continue
        for m, r in res["methods"].items():
            if "not_served" in r:
                print(f"| {engine} | {m} not served: {r['not_served']} |" + " |" * (3 * len(methods)))
        rows = [{k: v for k, v in res["methods"].get(m, {}).items() if k != "not_served"} for m in methods]
        for k in sorted({k for r in rows for k in r}, key=int):
            cells = [f"{r[k][key]:.3f}" if k in r and r[k].get(key) is not None else "–"
                     for key in ("tau", "draft_ms_per_round", "tokens_per_s") for r in rows]
            print(f"| {engine} | {k} | " + " | ".join(cells) + " |")
EOF
