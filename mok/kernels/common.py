"""Constants and small helpers shared by the kernel families."""

from __future__ import annotations

import os

# Bits of a workspace's error flag (mok.functional turns them into messages).
ERROR_BAD_EXPERT_ID = 1
ERROR_CAPACITY_OVERFLOW = 2
ERROR_PEER_TIMEOUT = 4

# Tokens one schedule program handles; 128 gives ~128 programs for 16K tokens.
TOKENS_PER_CHUNK = 128


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (kernels run on the CPU through NumPy)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def round_to_bf16(x, EMULATE_RNE: tl.constexpr):
    """fp32 → bf16 with round-to-nearest-even. The GPU's conversion already rounds so; the
    interpreter of triton 3.6 truncates instead (seen on CPU: half the values one ulp off),
    so under it we round the bits ourselves first (NaN passes through untouched)."""
    if EMULATE_RNE:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    return x.to(tl.bfloat16)
