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
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402


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


def tma_descriptor(t, block_shape):
    """A TMA tensor descriptor over `t` (any strides with a unit last stride; a 3-D weight
    [E, rows, cols] is flattened to [E·rows, cols]) loading blocks of `block_shape`.
    Out-of-bounds parts of a block read as zeros. TMA needs 16-byte aligned rows: bf16
    sizes that are multiples of 8, which `mok.validation` requires."""
    if t.dim() == 3:
        t = t.reshape(-1, t.shape[-1])
    return TensorDescriptor.from_tensor(t, list(block_shape))
