"""The E4M3 format written out from its bit layout, independent of torch's float8 casts,
so tests of the quantizers have a reference that shares no code with them."""

from __future__ import annotations

import math

import torch


def e4m3_decode(byte: int) -> float:
    """E4M3 (fn variant: bias 7, no inf, S.1111.111 NaN) byte -> value."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * mantissa * 2.0**-9
    return sign * (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)


# Values of bytes 0..126: 0 … 448, increasing (the non-negative finite codes).
E4M3_POSITIVE_VALUES = torch.tensor([e4m3_decode(b) for b in range(0x7F)], dtype=torch.float64)


def sorted_column_blocks(expert_offsets: torch.Tensor, block_m: int) -> list[tuple[int, int, int]]:
    """(first row, end row, scale row) of every 1×128 column block of a sorted-layout operand as
    `mok.kernels.quant.fp8_block.quantize_fp8_block_sorted_t` forms them: per expert, 128 rows
    at a time from its first row (the last block ragged); scale row = first row / gcd(block_m, 128)."""
    offsets = expert_offsets.tolist()
    scale_rows = math.gcd(block_m, 128)
    return [
        (r0, min(r0 + 128, end), r0 // scale_rows)
        for start, end in zip(offsets[:-1], offsets[1:])
        for r0 in range(start, end, 128)
    ]


def dequantize_sorted_t(q_t: torch.Tensor, scale_t: torch.Tensor, expert_offsets: torch.Tensor,
                        block_m: int) -> torch.Tensor:
    """[rows, W] fp32 from q_t [W, rows] e4m3 and scale_t [rows / S, W]: each column block's
    elements times its scale, transposed back; rows no expert owns are 0."""
    q_t, scale_t = q_t.cpu(), scale_t.cpu()
    out = torch.zeros(q_t.shape[1], q_t.shape[0])
    for r0, r1, slot in sorted_column_blocks(expert_offsets.cpu(), block_m):
        out[r0:r1] = (q_t[:, r0:r1].float() * scale_t[slot][:, None]).T
    return out
