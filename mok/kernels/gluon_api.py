"""The Gluon API that mok's Hopper kernels use, one name for each across Triton releases.

Gluon (Triton's tile-level dialect: explicit layouts, shared memory, mbarriers, TMA, wgmma,
warp specialization) is experimental and changes between releases. The kernel files import
every Gluon name from here, so a rename is absorbed in this one module:

- Triton 3.8 named the TMA copies `tma.async_load` / `tma.async_store` and cp.async
  `async_copy.async_load`; 3.9 removed the old names (`async_copy_global_to_shared`,
  `async_copy_shared_to_global`). We take the new name where it exists.

Where Gluon cannot be imported, or (for the Hopper GEMMs) a probe kernel that uses every
construct they need does not compile for the GPU at hand (an older or a future Triton),
`usable()` is False and the callers run their plain Triton kernels instead; it warns once,
naming the Triton version and what falls back. Without Gluon the kernel modules still import: the names here
then stand for `_Absent`, which lets a module define its Gluon kernels and refuses any launch.
"""

from __future__ import annotations

import functools
import warnings

import torch
import triton

__all__ = [
    "gluon", "gl", "async_copy", "mbarrier", "tma", "fence_async_shared", "warpgroup_mma", "warpgroup_mma_wait",
    "GluonTensorDescriptor", "tma_load", "tma_store", "cp_async_load", "usable", "unavailable_reason",
]


class _Absent:
    """Stands for a Gluon name where Gluon is missing: attributes, calls and decorators give
    another stand-in, so a module of Gluon kernels imports; launching one raises."""

    def __getattr__(self, name: str) -> _Absent:
        return self

    def __call__(self, *args, **kwargs) -> _Absent:
        return self

    def __getitem__(self, grid):
        raise RuntimeError(f"Gluon is not available with Triton {triton.__version__}: {_IMPORT_ERROR}")


try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    cp_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    _IMPORT_ERROR = None
except (ImportError, AttributeError) as error:  # no Gluon, or one without a name we use
    _IMPORT_ERROR = f"{type(error).__name__}: {error}"
    gluon = gl = async_copy = mbarrier = tma = _Absent()
    fence_async_shared = warpgroup_mma = warpgroup_mma_wait = GluonTensorDescriptor = _Absent()
    tma_load = tma_store = cp_async_load = _Absent()

if _IMPORT_ERROR is None:

    @gluon.jit
    def _probe_kernel(x_desc, y_desc, x_ptr):
        """Every Gluon construct mok's kernels rely on, in one small kernel: shared memory,
        mbarriers, TMA loads and stores, cp.async, wgmma and a warp-specialized region."""
        block: gl.constexpr = x_desc.block_type.shape
        bufs = gl.allocate_shared_memory(x_desc.dtype, [2] + block, x_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(bars.index(0), count=1)
        gl.warp_specialize([(_probe_consumer, (x_desc, y_desc, bufs, bars)),
                            (_probe_producer, (x_desc, x_ptr, bufs, bars))], [1], [40])
        mbarrier.invalidate(bars.index(0))

    @gluon.jit
    def _probe_producer(x_desc, x_ptr, bufs, bars):
        block: gl.constexpr = x_desc.block_type.shape
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])
        rows = gl.arange(0, block[0], layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, block[1], layout=gl.SliceLayout(0, layout))
        cp_async_load(bufs.index(1), x_ptr + rows[:, None] * block[1] + cols[None, :])
        async_copy.commit_group()
        async_copy.wait_group(0)
        mbarrier.expect(bars.index(0), x_desc.block_type.nbytes)
        tma_load(x_desc, [0, 0], bars.index(0), bufs.index(0))

    @gluon.jit
    def _probe_consumer(x_desc, y_desc, bufs, bars):
        block: gl.constexpr = x_desc.block_type.shape
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, block[1], 16])
        mbarrier.wait(bars.index(0), 0)
        acc = warpgroup_mma(bufs.index(0), bufs.index(1).permute((1, 0)),
                            gl.zeros(block, gl.float32, layout=mma), is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        bufs.index(0).store(acc.to(x_desc.dtype))
        fence_async_shared()
        tma_store(y_desc, [0, 0], bufs.index(0))
        tma.store_wait(0)


def unavailable_reason(device: torch.device, hopper_kernels: bool) -> str | None:
    """Why mok's Gluon kernels cannot run on `device` with this Triton (None: they can). The
    Hopper GEMMs (`hopper_kernels`) also need the probe to compile for the device."""
    if _IMPORT_ERROR is not None:
        return f"Gluon does not import ({_IMPORT_ERROR})"
    if not hopper_kernels:
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    return _probe_reason(index)


# Compiling the probe is host work that torch.compile cannot trace: under a trace the result
# enters the graph as a constant, computed (and cached) outside it.
@torch.compiler.assume_constant_result
def _probe_reason(device_index: int) -> str | None:
    return _probe(torch.cuda.get_device_capability(device_index))


@functools.cache
def _probe(capability: tuple[int, int]) -> str | None:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    block = [64, 64]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    desc = f"tensordesc<bf16[{block[0]},{block[1]}],{layout!r}>"
    signature = {"x_desc": desc, "y_desc": desc, "x_ptr": "*bf16"}
    source = GluonASTSource(_probe_kernel, signature, {}, {(2,): [["tt.divisibility", 16]]})
    major, minor = capability
    try:
        triton.compile(source, target=GPUTarget("cuda", major * 10 + minor, 32), options={"num_warps": 4})
    except Exception as error:  # any failure to build means: use the Triton kernels
        return f"a Gluon probe kernel does not compile ({type(error).__name__}: {str(error).splitlines()[0]})"
    return None


def usable(device: torch.device, what: str, hopper_kernels: bool = False) -> bool:
    """Whether the Gluon kernel for `what` can run on `device` (that it is the right GPU is the
    caller's check). If not, warns once per reason, naming the Triton version and `what`."""
    reason = unavailable_reason(device, hopper_kernels)
    if reason is not None:
        _warn_fallback(reason, what)
    return reason is None


# A cached function's wrapper is what dynamo traces into, so the mark goes on a plain one.
@torch.compiler.assume_constant_result
def _warn_fallback(reason: str, what: str) -> bool:
    """Warns once per (reason, what), outside any torch.compile trace."""
    _warn_once(reason, what)
    return True


@functools.cache
def _warn_once(reason: str, what: str) -> None:
    warnings.warn(f"mok: Triton {triton.__version__}: {reason}; {what} falls back to its plain Triton kernel "
                  f"(correct, slower). mok's Gluon kernels are tested with Triton 3.6 to 3.9.", RuntimeWarning,
                  stacklevel=4)
