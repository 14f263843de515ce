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
    q, scales = encode_layers_fp8([x])
    return q.squeeze(-2), scales.squeeze(-1)


def encode_layers_fp8(layers: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 encoding of `layers` (each [..., H], one shape) stacked on a new second-to-last axis: ([..., L, H]
    float8_e4m3fn, [..., L] f32 scales), on their device. One layer gives [..., 1, H]; `encode_hidden_states`
    drops that axis. This is where captured states are copied out of an engine's buffers on the CPU: reading
    each value once and writing its byte is the copy, the stacking and the encoding in one.

    On the CPU the rows go through in blocks that stay in cache (an fp32 temporary of the whole tensor, written
    and read five times, made the encoding 8x slower); on a GPU in one pass. Both compute x / (amax / 448) in
    fp32, clamped, rounded to e4m3, so the bytes do not depend on the device or the block.
    """
    shape, hidden = layers[0].shape, layers[0].shape[-1]
    device = layers[0].device
    q = torch.empty((*shape[:-1], len(layers), hidden), dtype=torch.float8_e4m3fn, device=device)
    scales = torch.empty((*shape[:-1], len(layers)), dtype=torch.float32, device=device)
    rows = q.reshape(-1, len(layers), hidden)  # views of q and scales: writing them fills both
    row_scales = scales.reshape(-1, len(layers))
    block = rows.shape[0] if device.type != "cpu" else max(1, _CPU_BLOCK_VALUES // max(hidden, 1))
    tmp = torch.empty(min(block, rows.shape[0]), hidden, dtype=torch.float32, device=device)
    for k, layer in enumerate(layers):
        x = layer.reshape(-1, hidden)
        for a in range(0, x.shape[0], block):
            b = min(a + block, x.shape[0])
            _encode_rows(x[a:b], rows[a:b, k], row_scales[a:b, k], tmp[: b - a])
    return q, scales


_CPU_BLOCK_VALUES = 1 << 19  # ~2 MiB of fp32 per block: in L2/L3 on the CPUs we run on


def _encode_rows(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, tmp: torch.Tensor) -> None:
    """Rows x [n, H] -> q [n, H] e4m3 and scale [n] f32, written in place (q and scale may be strided views)."""
    amax = x.abs().amax(dim=-1).float()  # exact in x's dtype; NaN in, NaN out (7x faster than vector_norm's inf)
    scale.copy_(torch.where(amax == 0, torch.ones_like(amax), amax / FP8_MAX))
    torch.div(x, scale.unsqueeze(-1), out=tmp)
    q.copy_(tmp.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn))  # contiguous cast, then the strided copy


def decode_hidden_states(
    data: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of `encode_hidden_states`, returning `dtype` on data's device (scales on the same device).

    No copy when bf16 is stored and asked for.
    """
    if scales is None:
        return data if data.dtype == dtype else data.to(dtype)
    return (data.to(torch.float32) * scales.unsqueeze(-1)).to(dtype)
