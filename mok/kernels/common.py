"""Constants and small helpers shared by the kernel families."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from collections.abc import Iterator

import torch

from mok.kernels.plan import kernel_plan

# Bits of a workspace's error flag (mok.functional turns them into messages).
ERROR_BAD_EXPERT_ID = 1
ERROR_CAPACITY_OVERFLOW = 2
ERROR_PEER_TIMEOUT = 4


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (kernels run on the CPU through NumPy)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# SMs of each CUDA device (by index) that exchanges in flight on another stream hold
# (`sms_left_free`); persistent launches leave them free.
_HELD_SMS: dict[int, int] = {}


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device) -> int:
    """Programs of a persistent launch on `device`: its streaming multiprocessors less those an
    exchange running beside the launch holds (`sms_left_free`); on the CPU (the interpreter) the
    plan's `interpreter_programs`."""
    if device.type != "cuda":
        return kernel_plan(device).interpreter_programs
    index = torch.cuda.current_device() if device.index is None else device.index
    return max(1, _sm_count(index) - _HELD_SMS.get(index, 0))


@contextlib.contextmanager
def sms_left_free(device: torch.device, count: int) -> Iterator[None]:
    """Persistent launches inside the block leave `count` SMs of `device` free: a persistent
    grid fills every SM and holds it to the end (a kernel that needs most of an SM's
    registers cannot share it), so a communication kernel running beside it on another stream
    would otherwise wait for it, or delay its programs by its own length."""
    if device.type != "cuda":
        yield
        return
    index = torch.cuda.current_device() if device.index is None else device.index
    _HELD_SMS[index] = _HELD_SMS.get(index, 0) + count
    try:
        yield
    finally:
        _HELD_SMS[index] -= count


def gate_up_parts(gate_up):
    """The forward's saved g, u as (data, scales): an fp8_block pair (e4m3 [rows, 2, I], fp32
    [rows, 2, I/128], with the plan's `fp8_block_gate_up_e4m3`) as it is, a bf16 tensor or None with scales None."""
    return gate_up if isinstance(gate_up, tuple) else (gate_up, None)


def launch_programs(tiles: int, cfg: dict, device) -> int:
    """Programs of a launch over `tiles` tiles: one per tile, or with the tile-config flag
    cfg["PERSISTENT"] one per SM (at most one per tile), each walking several."""
    return min(tiles, num_sms(device)) if cfg.get("PERSISTENT", False) else tiles


import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from mok.kernels.gluon_api import GluonTensorDescriptor  # noqa: E402


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


@triton.jit
def prefetch_to_l2(ptrs, mask):
    """A hint to bring the lines holding `ptrs` (where `mask`) into L2: nothing waits for it
    and no register holds the data. PTX inline assembly, so not under the interpreter."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; }",
        "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
    )


@triton.jit
def column_halves(x):
    """(x[:, :N/2], x[:, N/2:]) of a 2-D tile. Free on an MMA accumulator: each thread
    holds columns of both halves."""
    return tl.split(tl.permute(tl.reshape(x, (x.shape[0], 2, x.shape[1] // 2)), (0, 2, 1)))


@triton.jit
def tile_coordinates(pid, max_m_tiles, num_n_tiles, GROUP_M: tl.constexpr):
    """(m_tile, n_tile) of program `pid`, walking GROUP_M row tiles per column sweep so
    consecutive programs reuse the same weight tiles from L2."""
    tiles_per_group = GROUP_M * num_n_tiles
    group = pid // tiles_per_group
    first_m = group * GROUP_M
    group_rows = min(max_m_tiles - first_m, GROUP_M)
    m_tile = first_m + (pid % tiles_per_group) % group_rows
    n_tile = (pid % tiles_per_group) // group_rows
    return m_tile, n_tile


@triton.jit
def last_wave_tile_coordinates(pid, num_m_tiles, num_n_tiles, num_sms, GROUP_M: tl.constexpr, SPLIT: tl.constexpr):
    """(m_tile, n_tile, half) of program `pid` of a launch of one program per tile
    (`tile_coordinates` order) whose last wave, if SPLIT and at most half full, runs as
    column halves: half −1 is the whole tile, 0 or 1 its left or right half; m_tile −1 means
    no work (programs past the tiles).

    At one program per SM the tiles run in waves of num_sms, and a last wave of a few tiles
    costs a whole tile's time with most SMs idle (H200, mixtral-8x7b's down GEMM: 133 M
    tiles × 16 column tiles = 16 waves and 16 tiles, 7.8% slower than 132 M tiles). Its
    `last` tiles split in halves take 2·last ≤ num_sms programs and about half a tile's
    time. The launch must hold num_sms // 2 programs beyond its tiles for them."""
    num_tiles = num_m_tiles * num_n_tiles
    whole = num_tiles  # tiles computed whole: programs [0, whole)
    if SPLIT:
        last = num_tiles % num_sms
        whole = tl.where(2 * last <= num_sms, num_tiles - last, num_tiles)
    beyond = pid - whole
    tile = tl.where(beyond < 0, pid, whole + beyond // 2)
    half = tl.where(beyond < 0, -1, beyond % 2)
    valid = tile < num_tiles
    m_tile, n_tile = tile_coordinates(tl.where(valid, tile, 0), tl.maximum(num_m_tiles, 1), num_n_tiles, GROUP_M)
    return tl.where(valid, m_tile, -1), n_tile, tl.where(valid, half, -1)


@triton.jit
def expert_tile_coordinates(pid, m_dim, n_dim, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(expert, m0, n0) of program `pid` over an [E_l, m_dim, n_dim] output, expert
    outermost so consecutive programs reread the same expert rows from L2, and within an
    expert GROUP_M row tiles per column sweep (`tile_coordinates`; 1: row tile by row tile).
    A wide n_dim wants GROUP_M > 1: mixtral-8x7b's down wgrad (56 column tiles of 256, h[e]
    58 MB) at 1 has the SMs on two or three row tiles at once, each pass over h[e] from HBM."""
    num_m_tiles = tl.cdiv(m_dim, BLOCK_M)
    num_n_tiles = tl.cdiv(n_dim, BLOCK_N)
    tiles_per_expert = num_m_tiles * num_n_tiles
    m_tile, n_tile = tile_coordinates(pid % tiles_per_expert, num_m_tiles, num_n_tiles, GROUP_M)
    return pid // tiles_per_expert, m_tile * BLOCK_M, n_tile * BLOCK_N


_THREAD_STATE = threading.local()


def _make_cuda_context_current(device_index: int) -> None:
    """Makes the device's primary CUDA context current on this thread, once per thread.

    Creating a TMA descriptor is a driver call that needs a current context. A thread
    that has run no CUDA work yet has none: PyTorch's autograd threads skip cudaSetDevice
    when the device index already matches, so the first descriptor of a backward failed
    with "invalid device context" (seen on H200). Triton's launcher does the same at
    launch time, but descriptors are made before that. Driver calls only: no stream work,
    so it is safe under CUDA-graph capture."""
    done = getattr(_THREAD_STATE, "cuda_context_devices", None)
    if done is None:
        done = _THREAD_STATE.cuda_context_devices = set()
    if device_index in done:
        return
    libcuda = ctypes.CDLL("libcuda.so.1")

    def check(status: int) -> None:
        if status != 0:
            raise RuntimeError(f"CUDA driver error {status} while making device {device_index}'s context current")

    context = ctypes.c_void_p()
    check(libcuda.cuCtxGetCurrent(ctypes.byref(context)))
    if not context.value:
        device = ctypes.c_int()
        check(libcuda.cuDeviceGet(ctypes.byref(device), device_index))
        check(libcuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device))
        check(libcuda.cuCtxSetCurrent(context))
    done.add(device_index)


def tma_descriptor(t, block_shape, shared_layout=None):
    """A TMA tensor descriptor over `t` (any strides with a unit last stride; a 3-D weight
    [E, rows, cols] is flattened to [E·rows, cols]) loading blocks of `block_shape`.
    Out-of-bounds parts of a block read as zeros. TMA needs 16-byte aligned rows: bf16
    sizes that are multiples of 8, which `mok.validation` requires (fp8_block's multiples
    of 128 give e4m3 rows of 128 bytes). With `shared_layout` (a Gluon shared-memory
    layout), a descriptor for a Gluon kernel."""
    if t.is_cuda:
        _make_cuda_context_current(t.device.index)
    if t.dim() == 3:
        t = t.reshape(-1, t.shape[-1])
    if shared_layout is not None:
        return GluonTensorDescriptor.from_tensor(t, list(block_shape), shared_layout)
    return TensorDescriptor.from_tensor(t, list(block_shape))


def tma_descriptor_pair(first, block_shape):
    """A TMA descriptor over `first` and the tensor of the same shape that starts where it
    ends (the caller checks that one does), as one [2, *first.shape] tensor, loading blocks
    of `block_shape` (leading 2: one box holds a block of each)."""
    if first.is_cuda:
        _make_cuda_context_current(first.device.index)
    shape = [2, *first.shape]
    strides = [first.numel(), *first.stride()]
    return TensorDescriptor(first, shape, strides, list(block_shape))
