"""Handing glibc's freed heap back between training steps on a CPU.

A step that allocates and frees a few GiB of activations (a block method at the peers' defaults: 8,192 block rows)
leaves glibc's heaps fragmented: after the first step glibc's dynamic mmap threshold has grown to the freed tensors'
size, later tensors come from heaps it seldom returns, and the process's peak RSS sat ~700 MB above the live tensors
(docs/benchmarks.md, "DFlash at the peers' defaults: memory"). `malloc_trim(0)` returns the free pages inside the
heaps, not only at their top. It is called only when the heaps hold more than TRIM_FREE_BYTES free, since the next
step faults the pages back in: a block method's step at the peers' defaults leaves 1.1-1.6 GB free (a 14 s step,
which does not notice), the quickstart's EAGLE-3 step 0.25-0.42 GB (trimming those cost it 13 % of its tokens/s).
Nothing here where the C library is not glibc (mallinfo2: glibc >= 2.33).
"""

from __future__ import annotations

import ctypes
import sys

TRIM_FREE_BYTES = 1 << 30  # free heap bytes above which a step's end hands them back
# struct mallinfo2's fields, in order (each a size_t)
_MALLINFO2 = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2]


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):  # musl, an older glibc
        return None
    return libc


_LIBC = _glibc()


def free_heap_bytes() -> int | None:
    """Bytes glibc holds free in its heaps (all arenas: mallinfo2's fordblks), None where that cannot be read."""
    return None if _LIBC is None else int(_LIBC.mallinfo2().fordblks)


def trim_freed_heap(threshold: int = TRIM_FREE_BYTES) -> bool:
    """malloc_trim(0) when glibc's heaps hold more than `threshold` bytes free; whether it was called."""
    free = free_heap_bytes()
    if _LIBC is None or free is None or free <= threshold:
        return False
    _LIBC.malloc_trim(0)
    return True
