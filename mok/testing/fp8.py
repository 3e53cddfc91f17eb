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
