"""A stand-in for the image processor Kimi-K2.5 ships as remote code (its kimi_k25_vision_processing.py), copied into
the tiny Kimi-K2.5 checkpoint by tests/families.py.

vLLM 0.16 loads a Kimi-K2.5 checkpoint's image processor with trust_remote_code=True even for text-only prompts,
and profiles the vision tower with dummy media it sizes through `media_tokens_calculator`. This one sizes media on
the patch grid of media_proc_cfg (patch_size pixels a patch, merge_kernel_size^2 patches a token) and returns zero
pixels as torch tensors: enough for an engine to start and run text prompts, not for real images.
"""

from __future__ import annotations

import math

import torch
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature


class KimiK25VisionProcessor(BaseImageProcessor):
    model_type = "kimi_k25"

    def __init__(self, media_proc_cfg: dict | None = None, **kwargs):
        super().__init__(**kwargs)
        self.media_proc_cfg = dict(media_proc_cfg or {})
        self.num_frames_per_chunk = self.media_proc_cfg.get("temporal_merge_kernel_size", 4)

    def _grid(self, media: dict) -> tuple[int, int]:
        """(patches high, patches wide) of an {"type": "image", "image": PIL} or {"type": "video_chunk",
        "video_chunk": [PIL, ...]} item, whole merge kernels, at most in_patch_limit patches."""
        patch, merge = self.media_proc_cfg.get("patch_size", 14), self.media_proc_cfg.get("merge_kernel_size", 2)
        frames = [media["image"]] if "image" in media else list(media["video_chunk"])
        width, height = frames[0].size
        rows = max(merge, math.ceil(height / patch / merge) * merge)
        cols = max(merge, math.ceil(width / patch / merge) * merge)
        limit = self.media_proc_cfg.get("in_patch_limit", 16384)
        while rows * cols > limit:
            rows, cols = max(merge, rows // 2 // merge * merge), max(merge, cols // 2 // merge * merge)
        return rows, cols

    def media_tokens_calculator(self, media: dict) -> int:
        rows, cols = self._grid(media)
        merge = self.media_proc_cfg.get("merge_kernel_size", 2)
        return rows * cols // (merge * merge)

    def preprocess(self, medias, return_tensors=None, **kwargs) -> BatchFeature:
        medias = medias if isinstance(medias, list) else [medias]
        patch = self.media_proc_cfg.get("patch_size", 14)
        grids = [(1 if "image" in m else len(m["video_chunk"]), *self._grid(m)) for m in medias]
        patches = sum(t * rows * cols for t, rows, cols in grids)
        return BatchFeature(
            data={
                "pixel_values": torch.zeros(patches, 3, patch, patch),
                "grid_thws": torch.tensor(grids, dtype=torch.int64),
            }
        )
