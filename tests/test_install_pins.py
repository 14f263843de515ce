"""draftsmith installs beside every supported vLLM without changing a package that vLLM's environment holds.

For vLLM 0.11.1 (transformers<5, the oldest), 0.16.0 (the last release line on transformers 4.57) and 0.33.0 (the
newest, transformers>=5.16.1,<5.21, torch==2.14.0) this resolves the release's own environment with pip from the
package index (`pip install --dry-run --ignore-installed --report`, what `pip install vllm==X` would install on this
Python and platform), then resolves this checkout with every one of those packages pinned as a constraint. The
check fails when pip finds no such install (a floor in pyproject.toml above what the release allows) or when it
would install another version of a package the environment holds.

Only package metadata is read (no wheel is installed or even downloaded where the index serves metadata files).
The resolved environments are cached under $DRAFTSMITH_CACHE/install-pins/ (one JSON per release, Python and
platform): a fresh machine resolves them once (about 1.5 min, the three in parallel), later runs only resolve
draftsmith (about 30 s).
"""

from __future__ import annotations

import json
import platform
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from draftsmith.core import assets
from draftsmith.core.fsio import atomic_write_json

REPO = Path(__file__).resolve().parents[1]
RELEASES = ("0.11.1", "0.16.0", "0.33.0")
_PIP_TIMEOUT_S = 600

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * _PIP_TIMEOUT_S)]


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _dry_run(requirements: list[str], report: Path, constraints: Path | None = None) -> dict[str, str]:
    """What `pip install` would install into an empty environment: {package: version}, read from pip's report."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--dry-run",
        "--ignore-installed",
        "--progress-bar",
        "off",
        "--disable-pip-version-check",
        "--no-input",
        "--report",
        str(report),
    ]
    if constraints is not None:
        cmd += ["-c", str(constraints)]
    proc = subprocess.run(cmd + requirements, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
    if proc.returncode != 0:
        errors = [
            line
            for line in (proc.stdout + proc.stderr).splitlines()
            if any(word in line for word in ("ERROR", "conflict", "depends on", "requested"))
        ]
        pytest.fail(
            f"pip cannot resolve {' '.join(requirements)}"
            f"{' under ' + str(constraints) if constraints else ''}:\n" + "\n".join(errors[-25:])
        )
    installs = json.loads(report.read_text())["install"]
    return {_canonical(item["metadata"]["name"]): item["metadata"]["version"] for item in installs}


def _environment(release: str, work: Path) -> dict[str, str]:
    """The packages `pip install vllm==release` installs here, resolved once and cached."""
    key = f"vllm-{release}-py{sys.version_info.major}{sys.version_info.minor}-{sys.platform}-{platform.machine()}"
    cached = assets.cache_dir() / "install-pins" / f"{key}.json"
    if cached.is_file():
        packages = json.loads(cached.read_text()).get("packages")
        if isinstance(packages, dict) and packages.get("vllm") == release:
            return packages
    packages = _dry_run([f"vllm=={release}"], work / f"{key}.report.json")
    atomic_write_json(cached, {"requirement": f"vllm=={release}", "packages": packages})
    return packages


@pytest.fixture(scope="module")
def resolutions(tmp_path_factory) -> dict[str, tuple[dict[str, str], dict[str, str]]]:
    """release -> (its environment, what installing this checkout under that environment's pins installs)."""
    work = tmp_path_factory.mktemp("install-pins")

    def resolve(release: str) -> tuple[dict[str, str], dict[str, str]]:
        env = _environment(release, work)
        constraints = work / f"constraints-{release}.txt"
        constraints.write_text("".join(f"{name}=={version}\n" for name, version in sorted(env.items())))
        return env, _dry_run([str(REPO)], work / f"draftsmith-{release}.report.json", constraints)

    with ThreadPoolExecutor(len(RELEASES)) as pool:  # network-bound: the three resolve at once
        return dict(zip(RELEASES, pool.map(resolve, RELEASES), strict=False))


@pytest.mark.parametrize("release", RELEASES)
def test_draftsmith_changes_no_package_of_the_vllm_environment(resolutions, release):
    env, with_draftsmith = resolutions[release]
    assert env["vllm"] == release and "transformers" in env and "torch" in env
    changed = {
        name: (env[name], version) for name, version in with_draftsmith.items() if name in env and env[name] != version
    }
    assert not changed, f"vLLM {release}: installing draftsmith would change {changed}"
    assert "draftsmith" in with_draftsmith
    added = sorted(set(with_draftsmith) - set(env) - {"draftsmith"})
    print(f"vLLM {release} (torch {env['torch']}, transformers {env['transformers']}): draftsmith adds {added}")


def test_the_oldest_release_keeps_transformers_4(resolutions):
    """vLLM 0.11.1's environment has transformers 4.x, and draftsmith installs into it as it is."""
    env, with_draftsmith = resolutions["0.11.1"]
    assert env["transformers"].startswith("4.")
    assert with_draftsmith["transformers"] == env["transformers"] and with_draftsmith["torch"] == env["torch"]
