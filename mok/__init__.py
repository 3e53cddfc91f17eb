"""mok: a fused Mixture-of-Experts training layer (dispatch, SwiGLU experts, combine).

Three levels, each usable alone: the `MoKMoE` module, the functional API in
`mok.functional`, and the individual kernels in `mok.ops`. `mok.reference` is the
definition of correct.
"""

from mok.config import MoKConfig
from mok.functional import (
    ForwardContext,
    Gradients,
    MoKError,
    Schedule,
    Workspace,
    backward,
    build_schedule,
    check_errors,
    clear_workspace_cache,
    create_workspace,
    expert_counts,
    forward,
    get_workspace,
    moe,
    pack_gate_up,
    recompute_forward_context,
)
from mok.fp8_block import fp8_block_dequantize, fp8_block_quantize
from mok.module import MoKMoE
from mok.mxfp8 import mxfp8_dequantize, mxfp8_quantize

__version__ = "0.1.0"

__all__ = [
    "ForwardContext",
    "Gradients",
    "MoKConfig",
    "MoKError",
    "MoKMoE",
    "Schedule",
    "Workspace",
    "backward",
    "build_schedule",
    "check_errors",
    "clear_workspace_cache",
    "create_workspace",
    "expert_counts",
    "forward",
    "fp8_block_dequantize",
    "fp8_block_quantize",
    "get_workspace",
    "moe",
    "mxfp8_dequantize",
    "mxfp8_quantize",
    "pack_gate_up",
    "recompute_forward_context",
]
