"""core/hostmem.py: a large freed heap is handed back to the system between training steps, a small one is left."""

from __future__ import annotations

import os

import pytest

from draftsmith.core import hostmem

pytestmark = pytest.mark.skipif(hostmem.free_heap_bytes() is None, reason="needs glibc >= 2.33 (mallinfo2)")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_a_large_fragmented_free_heap_is_returned_and_a_small_one_left():
    blocks = [bytearray(100 * 1024) for _ in range(3000)]  # 293 MB of heap chunks (below glibc's mmap threshold)
    del blocks[::2]  # every other one freed: ~146 MB free between live chunks, none of it at the heap's top
    free = hostmem.free_heap_bytes()
    assert free is not None and free > 120 << 20
    assert not hostmem.trim_freed_heap(threshold=free + (64 << 20))  # below the threshold: left as it is
    before = _rss_mb()
    assert hostmem.trim_freed_heap(threshold=64 << 20)
    assert before - _rss_mb() > 100  # the freed pages between the live chunks went back
    assert len(blocks) == 1500 and all(len(b) == 100 * 1024 for b in blocks)  # the live ones untouched
