#!/usr/bin/env bash
# Check (and optionally do) an install of draftsmith into an existing vLLM environment without changing it.
#   bash scripts/check_beside_vllm.sh              what `pip install <this checkout>` would add or change here
#   bash scripts/check_beside_vllm.sh --install    ... then install it, pinned to what is installed, and verify
# Run it with the environment active (or PYTHON=/path/to/venv/bin/python). It fails (exit 1) when the install
# would change the version of any package already installed; packages it would only add are listed.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
install=0
for arg in "$@"; do
  case "$arg" in
    --install) install=1 ;;
    *) echo "unknown option: $arg (use --install to install after the check)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python}
command -v "$PY" >/dev/null || { echo "no python on PATH; activate your vLLM environment or set PYTHON" >&2; exit 2; }
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
"$PY" -m pip list --format=json --disable-pip-version-check > "$work/before.json"
"$PY" -m pip check --disable-pip-version-check > "$work/check-before.txt" 2>&1 || true
"$PY" - "$work/before.json" "$work/constraints.txt" <<'EOF'
import json, sys
installed = json.load(open(sys.argv[1]))
with open(sys.argv[2], "w") as out:
    for p in installed:
        if p["name"].lower() != "draftsmith":
            out.write(f"{p['name']}=={p['version']}\n")
EOF
"$PY" -c "import vllm, sys; print('vLLM', vllm.__version__, 'in', sys.prefix)" 2>/dev/null \
  || echo "note: vllm is not importable with $PY; checking against this environment anyway"
if ! "$PY" -m pip install --dry-run --disable-pip-version-check --no-input --progress-bar off \
      --report "$work/report.json" "$root" > "$work/pip.log" 2>&1; then
  grep -E "ERROR|conflict|depends on|requested" "$work/pip.log" >&2 || tail -20 "$work/pip.log" >&2
  echo "FAIL: pip cannot resolve draftsmith in this environment" >&2; exit 1
fi
"$PY" - "$work/before.json" "$work/report.json" <<'EOF'
import json, re, sys
canon = lambda n: re.sub(r"[-_.]+", "-", n).lower()
before = {canon(p["name"]): p["version"] for p in json.load(open(sys.argv[1]))}
plan = [(canon(i["metadata"]["name"]), i["metadata"]["version"]) for i in json.load(open(sys.argv[2]))["install"]]
changed = [(n, before[n], v) for n, v in plan if n in before and before[n] != v and n != "draftsmith"]
added = [(n, v) for n, v in plan if n not in before]
for n, v in added:
    print(f"  adds     {n} {v}")
for n, old, new in changed:
    print(f"  CHANGES  {n} {old} -> {new}")
if changed:
    print(f"FAIL: installing draftsmith would change {len(changed)} installed package(s)", file=sys.stderr)
    sys.exit(1)
print(f"OK: draftsmith adds {len(added)} package(s) and changes none of the {len(before)} installed")
EOF
[ "$install" = 1 ] || exit 0
# Install pinned to what is installed (-c): pip refuses rather than change anything, then compare before/after.
"$PY" -m pip install --disable-pip-version-check --no-input -q -c "$work/constraints.txt" "$root"
"$PY" -m pip list --format=json --disable-pip-version-check > "$work/after.json"
"$PY" - "$work/before.json" "$work/after.json" <<'EOF'
import json, sys
before = {p["name"].lower(): p["version"] for p in json.load(open(sys.argv[1]))}
after = {p["name"].lower(): p["version"] for p in json.load(open(sys.argv[2]))}
changed = {n: (v, after.get(n)) for n, v in before.items() if after.get(n) != v and n != "draftsmith"}
if changed:
    sys.exit(f"FAIL: the install changed {changed}")
print(f"installed: {len(after) - len(before)} package(s) added, none changed")
EOF
# pip check: no broken requirement that was not there before (a vLLM environment may already have some)
"$PY" -m pip check --disable-pip-version-check > "$work/check-after.txt" 2>&1 || true
if new="$(grep -vxF -f "$work/check-before.txt" "$work/check-after.txt")"; then
  echo "$new" >&2; echo "FAIL: pip check reports new broken requirements after the install" >&2; exit 1
fi
echo "pip check: nothing new ($(wc -l < "$work/check-before.txt") line(s) before and after)"
"$PY" -c "import draftsmith, transformers, torch; print('draftsmith', draftsmith.__version__, '| transformers', transformers.__version__, '| torch', torch.__version__)"
