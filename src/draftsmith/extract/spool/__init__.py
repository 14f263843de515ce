"""The online spool: where live vLLM engines hand the trainer the hidden states it needs next
(`draftsmith train --engine vllm`), bounded, in chunks of consecutive optimizer steps.

    chunks.py     the plan's chunks, their names and sizes, the statuses, and the two roles a transport plays
    directory.py  a directory (local disk, /dev/shm, or a filesystem every node mounts): the default
    mooncake.py   a Mooncake store (`--spool mooncake` / `mooncake://HOST:PORT[/RUN]`): engines and trainers on
                  different nodes, no shared filesystem

`open_spool` picks the transport from `--spool`.
"""

from __future__ import annotations

from draftsmith.extract.spool.chunks import (
    EVAL_CHUNK,
    STALL_S,
    Chunk,
    ChunkInfo,
    EngineSide,
    FeedJob,
    FeedStatus,
    Plan,
    TrainerSide,
    TrainerStatus,
    TransportLost,
    chunk_bytes,
    chunk_name,
    pack_steps,
    wait_for_space,
)
from draftsmith.extract.spool.directory import ENGINE_LOCK, TRAINER_LOCK, Spool, disk_bytes, free_bytes, store_info

__all__ = [
    "Chunk",
    "ChunkInfo",
    "ENGINE_LOCK",
    "EVAL_CHUNK",
    "EngineSide",
    "FeedJob",
    "FeedStatus",
    "Plan",
    "STALL_S",
    "Spool",
    "TRAINER_LOCK",
    "TrainerSide",
    "TrainerStatus",
    "TransportLost",
    "chunk_bytes",
    "chunk_name",
    "disk_bytes",
    "free_bytes",
    "pack_steps",
    "store_info",
    "wait_for_space",
]
