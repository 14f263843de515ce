"""One safetensors file, read through `safetensors.safe_open`: the shard reader of the prepared set and the store.

`TensorFile(path, remedy)` opens a file once to check it (safetensors validates the header: JSON, dtypes,
offsets, and that the data covers the file exactly) and keeps what it found as plain data: the file's identity,
every tensor's dtype and shape, the metadata. Reading goes through a `safe_open` handle that lives in a small
per-process cache, never in the object, so a `TensorFile` (and a reader holding many) pickles into DataLoader
worker processes as a few strings and numbers; each process opens the file on its first read, and a file replaced
since it was checked is refused there instead of read.

With `framework="pt"` on the CPU, `safe_open` maps the file into one torch storage (`UntypedStorage.from_file`):
`get_tensor` is a view of the page cache, not a copy. `rows(name, a, b)` slices that view (a few microseconds;
a `get_slice` read costs some 20), so reading a sample copies nothing; `read(name)` returns an owned copy, for the
small tensors a reader keeps. Views share the process's mapping of the file: copy one before changing it in place.

With `sha256` (the manifest's checksum) the file's bytes are hashed once, on the first read of a data tensor in a
process (a file checked before a fork, e.g. by the DataLoader's parent, is not hashed again in its workers): a
flipped byte anywhere is refused there, and reads after it cost nothing more. Small index tensors read while opening
(`read(name, verify=False)`) do not wait for the hash.

Every problem with a file is one `DraftsmithError` line: the path, what is wrong, then the caller's `remedy`
(e.g. "run `draftsmith prepare` again").
"""

from __future__ import annotations

import abc
import collections.abc
import contextlib
import os
import threading
from pathlib import Path
from typing import overload

import torch
from safetensors import SafetensorError, safe_open

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import sha256_file

MAX_OPEN_FILES = 64  # safe_open handles kept per process (least recently used closed first)

TensorInfo = tuple[str, tuple[int, ...]]  # safetensors dtype name ("BF16", "F8_E4M3", "I32", "BOOL", ...), shape


class _Handles:
    """This process's open files: (path, identity) -> (safe_open handle, whole-tensor views taken from it)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.lock = threading.Lock()
        self.open: collections.OrderedDict[tuple, tuple[safe_open, dict[str, torch.Tensor]]] = collections.OrderedDict()

    def get(self, key: tuple) -> tuple[safe_open, dict[str, torch.Tensor]] | None:
        # no lock on this path (once per read): each OrderedDict call is atomic under the GIL, and a key another
        # thread evicts meanwhile only skips the recency update
        entry = self.open.get(key)
        if entry is not None:
            with contextlib.suppress(KeyError):
                self.open.move_to_end(key)
        return entry

    def put(self, key: tuple, handle: safe_open) -> tuple[safe_open, dict[str, torch.Tensor]]:
        with self.lock:
            entry = self.open.setdefault(key, (handle, {}))
            self.open.move_to_end(key)
            while len(self.open) > self.capacity:
                self.open.popitem(last=False)
            return entry

    def drop(self, key: tuple) -> None:
        with self.lock:
            self.open.pop(key, None)

    def clear(self) -> None:
        # a forked child (a DataLoader worker) opens its own handles; the lock may be held by a parent thread
        self.lock = threading.Lock()
        self.open.clear()


_HANDLES = _Handles(MAX_OPEN_FILES)
os.register_at_fork(after_in_child=_HANDLES.clear)
_VERIFIED: set[tuple] = set()  # (path, identity) of the files whose sha256 matched (kept across a fork)


class Samples(collections.abc.Sequence[dict]):
    """A set of samples read by position: `s[i]` (negative counts from the end, as in a list) and `s[a:b]`."""

    what = "a set"  # named in the IndexError of a sample out of range ("a store")

    @abc.abstractmethod
    def sample(self, i: int) -> dict:
        """The sample at position 0 <= i < len(self)."""

    @overload
    def __getitem__(self, i: int) -> dict: ...
    @overload
    def __getitem__(self, i: slice) -> list[dict]: ...

    def __getitem__(self, i: int | slice) -> dict | list[dict]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i, n = int(i), len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {i} out of range for {self.what} of {n} samples")
        return self.sample(i)


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class TensorFile:
    """A checked safetensors file: `tensors` (name -> (dtype, shape)), `metadata`, `size`; reads by name.

    `what` names the file in messages ("shard file"); `remedy` says what to do about a damaged one.
    `expected_bytes` (from a manifest) turns a file of another size into a "truncated or replaced" error;
    `sha256` (from a manifest) is checked on the first data read in each process.
    """

    def __init__(
        self,
        path: Path,
        remedy: str,
        *,
        what: str = "file",
        expected_bytes: int | None = None,
        sha256: str | None = None,
    ):
        self.path = Path(path)
        self.remedy = remedy
        self.what = what
        self.sha256 = sha256
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise self.error(f"{what} is missing") from None
        except OSError as err:
            raise self.error(f"not a readable {what} ({err.strerror or err})") from None
        self.size = int(st.st_size)
        if expected_bytes is not None and self.size != expected_bytes:
            raise self.error(f"{self.size} bytes, expected {expected_bytes} (truncated or replaced {what})")
        self._key = (str(self.path), *_identity(st))
        handle = self._entry()[0]
        self.metadata: dict[str, str] = dict(handle.metadata() or {})
        self.tensors: dict[str, TensorInfo] = {}
        for name in handle.keys():  # noqa: SIM118 - a safetensors handle, not a dict
            info = handle.get_slice(name)
            self.tensors[name] = (info.get_dtype(), tuple(int(d) for d in info.get_shape()))

    def error(self, problem: str) -> DraftsmithError:
        """The one-line error for a problem with this file."""
        return DraftsmithError(f"{self.path}: {problem}; {self.remedy}")

    def _open(self) -> safe_open:
        try:
            st = os.stat(self.path)
            if _identity(st) != self._key[1:]:
                raise self.error(f"changed on disk since it was first opened (replaced or rewritten {self.what})")
            return safe_open(str(self.path), framework="pt", device="cpu")
        except FileNotFoundError:
            raise self.error(f"{self.what} is missing") from None
        except (OSError, SafetensorError) as err:
            reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
            raise self.error(f"not a readable {self.what} ({reason})") from None

    def _entry(self) -> tuple[safe_open, dict[str, torch.Tensor]]:
        return _HANDLES.get(self._key) or _HANDLES.put(self._key, self._open())

    def close(self) -> None:
        """Let this process's handle go (the next read opens the file again)."""
        _HANDLES.drop(self._key)

    # -- checking
    def expect(self, name: str, dtype: str, shape: tuple[int | None, ...]) -> tuple[int, ...]:
        """The shape of tensor `name` after checking its dtype and shape (None: any size in that dimension)."""
        info = self.tensors.get(name)
        if info is None:
            raise self.error(f"tensor {name!r} is missing (damaged {self.what})")
        got_dtype, got_shape = info
        if (
            got_dtype != dtype
            or len(got_shape) != len(shape)
            or any(want is not None and want != got for want, got in zip(shape, got_shape, strict=False))
        ):
            want = "[" + ", ".join("*" if d is None else str(d) for d in shape) + "]"
            raise self.error(
                f"tensor {name!r} is {got_dtype} {list(got_shape)}, expected {dtype} {want} (damaged {self.what})"
            )
        return got_shape

    def verify(self) -> None:
        """Hash the file against `sha256` (once per process and file version); DraftsmithError when it differs."""
        if self.sha256 is None or self._key in _VERIFIED:
            return
        try:
            digest = sha256_file(self.path)
        except OSError as err:
            raise self.error(f"not a readable {self.what} ({err.strerror or err})") from None
        if digest != self.sha256:
            raise self.error(f"sha256 does not match the manifest (a flipped byte: damaged or replaced {self.what})")
        _VERIFIED.add(self._key)

    # -- reading
    def view(self, name: str, verify: bool = True) -> torch.Tensor:
        """The whole tensor as a view of this process's mapping of the file (no copy; do not modify it).
        The first view of a tensor in a process checks the file's sha256 first, unless `verify=False`."""
        handle, views = _HANDLES.get(self._key) or self._entry()
        tensor = views.get(name)
        if tensor is None:
            if name not in self.tensors:
                raise self.error(f"tensor {name!r} is missing (damaged {self.what})")
            if verify:
                self.verify()
            tensor = views[name] = handle.get_tensor(name)
        return tensor

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows start..stop-1 of a tensor (a view: no copy, do not modify it)."""
        return self.view(name)[start:stop]

    def read(self, name: str, verify: bool = True) -> torch.Tensor:
        """A (small) tensor read whole into memory of its own (`verify=False`: without waiting for the sha256)."""
        return self.view(name, verify).clone()

    def __repr__(self) -> str:
        return f"TensorFile({str(self.path)!r}, tensors={sorted(self.tensors)})"
