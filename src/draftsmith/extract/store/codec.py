"""Hidden states <-> their storage dtype: bf16, or fp8 e4m3 with one float32 scale per (token, layer) row.

Both functions run on whatever device their tensors are on, so a trainer may read a store in its storage dtype
(`draftsmith.extract.store.open(path, dtype=None)`), move the bf16 or fp8 rows and scales to the GPU, and decode there.
"""

from __future__ import annotations

import torch

from draftsmith.extract.store.schema import StorageDtype

FP8_MAX = 448.0  # largest finite float8_e4m3fn value
TORCH_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
SAFETENSORS_DTYPES: dict[str, str] = {"bf16": "BF16", "fp8": "F8_E4M3"}  # as safetensors names them in a header


def encode_hidden_states(x: torch.Tensor, dtype: StorageDtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[..., H] float -> (storage tensor, per-row scale [...] f32 for fp8, else None), on x's device.

    fp8: each (token, layer) row is scaled so its largest magnitude maps to 448 (e4m3's max), then rounded to
    e4m3 (3 mantissa bits: relative error <= 2^-4 for normal values, absolute <= 2^-10 * scale below 2^-6).
    A non-finite row keeps a non-finite scale, so `verify` still finds it.
    """
    if dtype == "bf16":
        return x.to(torch.bfloat16), None
    if dtype != "fp8":
        raise ValueError(f"unknown storage dtype {dtype!r}")
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / FP8_MAX)
    q = (xf / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def decode_hidden_states(data: torch.Tensor, scales: torch.Tensor | None,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `encode_hidden_states`, returning `dtype` on data's device (scales on the same device).

    No copy when bf16 is stored and asked for.
    """
    if scales is None:
        return data if data.dtype == dtype else data.to(dtype)
    return (data.to(torch.float32) * scales.unsqueeze(-1)).to(dtype)
