"""Row moves between the ranks of an expert-parallel group through peer pointers
(symmetric memory over NVLink), and the one sync pattern they need.

    push:   dst_rank(i).buffer[dst_row(i)] = src[src_row(i)]     for every item i with a row
            BY_SLOT   (items r, e.g. (token, rank) pairs, `index` = the item's send slot s = p·C + c):
                      dst_rank = s // C, dst_row = my_rank·C + s % C, src_row = r // routes_per_row
            BY_RETURN (items are received rows i = p·C + c, `index` = the row on the source):
                      dst_rank = i // C, dst_row = index[i],            src_row = i
            −1 in `index` (or a row past the destination): the item moves nothing (an empty
            row, or an item past the capacity).
            `destinations` "self" or "peers": only the items to this rank, or to the others;
            a kind pushed as both (each with the same G) is received as one "all" push.
    wait:   until every peer's pushes of this kind have landed here.

Legend: P ranks, C rows one rank may send one peer (the capacity), W the row width
(H for token rows), G the programs of a push (the communication SMs). Every rank of a
group launches its pushes with the same G; the buffers are the same offsets into each
rank's symmetric allocation, reached through per-rank base pointers (`*_peer_ptrs`,
[P] int64 on the device).

The sync pattern ("my writes visible to peers", then "peers' writes visible to me"):
each program of a push, after its last store, adds 1 to `arrivals[kind, my_rank]` on
every rank with a system-scope release; `wait_arrivals` polls its own
`arrivals[kind, :]` with system-scope acquires until each peer's count reaches
`expected[kind, p] + G`, then advances `expected`. Counts only grow (no reset, so no
race between a reset and the next push; a capture of the launches in a CUDA graph
replays correctly because the target lives on the device). The wait is bounded: past
`timeout_s` it sets ERROR_PEER_TIMEOUT in the error flag and returns; once that bit is
set, later waits return at once (the ranks are out of step, the caller must raise).

"Safe to overwrite": a push may only target a buffer whose previous contents the
receiver has consumed. The transport orders its exchanges so that every push follows a
wait that implies it (see `mok/transport/symmetric.py`); nothing here checks it.

Determinism: every destination element is written by one program of one rank; the
counters are the only atomics and carry no data.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok.kernels.common import ERROR_PEER_TIMEOUT, interpreting
from mok.kernels.plan import kernel_plan

_TIMEOUT_BIT = tl.constexpr(ERROR_PEER_TIMEOUT)  # kernels read only constexpr globals


@triton.jit
def _global_time_ns(INTERPRETER: tl.constexpr):
    if INTERPRETER:
        return tl.full([], 0, tl.int64)
    else:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def peer_row_starts(peer_ptrs, rank, row, row_stride, mask, DTYPE: tl.constexpr):
    """Address of row `row` (× row_stride elements of DTYPE) of each item's buffer on rank
    `rank` (peer_ptrs [P] int64, masked items read rank 0's base). Every buffer is 256-byte
    aligned on every rank; saying so lets the stores go out as 16-byte vectors. A base
    loaded from memory has no known alignment otherwise, and the 2-byte stores that gave
    halved the push rate (record h200-20261130-qwen3-30b-ep2-dispatch.json has the fixed rate)."""
    base = tl.load(peer_ptrs + rank, mask=mask, other=0).to(tl.pointer_type(DTYPE))
    return tl.multiple_of(base, 16) + row.to(tl.int64) * row_stride


# `push_rows`' destinations, as the kernel's DESTINATIONS
_DESTINATIONS = {"all": 0, "self": 1, "peers": 2}


@triton.jit
def _is_destination(rank, my_rank, DESTINATIONS: tl.constexpr):
    """Whether `rank` is one of the push's destinations (DESTINATIONS: 0 all, 1 this rank, 2 the others)."""
    if DESTINATIONS == 1:
        return rank == my_rank
    elif DESTINATIONS == 2:
        return rank != my_rank
    else:
        return rank >= 0


@triton.jit
def signal_peers(arrivals_peer_ptrs, arrival_slot, num_ranks, my_rank, BLOCK_P: tl.constexpr,
                 DESTINATIONS: tl.constexpr = 0):
    """My writes visible to peers: every destination rank's arrivals[arrival_slot] += 1,
    released at system scope after all of this program's stores."""
    tl.debug_barrier()  # every thread of the program has issued its stores
    ranks = tl.arange(0, BLOCK_P)
    is_rank = (ranks < num_ranks) & _is_destination(ranks, my_rank, DESTINATIONS)
    base = tl.load(arrivals_peer_ptrs + ranks, mask=is_rank, other=0).to(tl.pointer_type(tl.int32))
    tl.atomic_add(base + arrival_slot, 1, mask=is_rank, sem="release", scope="sys")


@triton.jit
def _push_rows_kernel(
    # rows
    src_ptr,  # [*, W] local rows
    index_ptr,  # [N] int32: send slot (BY_SLOT) or the row on the source (BY_RETURN), −1: nothing
    dst_peer_ptrs,  # [P] int64: each rank's destination buffer [*, W], src's dtype
    # sync
    arrivals_peer_ptrs,  # [P] int64: each rank's arrival counters [kinds, P] int32
    arrival_slot,  # kind·P + my_rank
    error_flag_ptr,  # [1] int32
    # sizes and strides
    num_items, width, my_rank, num_ranks, capacity, routes_per_row, num_dst_rows,
    stride_src, stride_dst,
    # meta
    BY_SLOT: tl.constexpr, DESTINATIONS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_P: tl.constexpr,
):
    if (tl.load(error_flag_ptr) & _TIMEOUT_BIT) != 0:
        return  # out of step with the peers: whatever this would move is stale, and nobody waits for it
    cols_step = tl.arange(0, BLOCK_W)
    for block in range(tl.program_id(0), tl.cdiv(num_items, BLOCK_R), tl.num_programs(0)):
        items = block * BLOCK_R + tl.arange(0, BLOCK_R)
        in_range = items < num_items
        index = tl.load(index_ptr + items, mask=in_range, other=-1)
        if BY_SLOT:
            dst_rank = index // capacity
            dst_row = my_rank * capacity + index % capacity
            src_row = items // routes_per_row
        else:
            dst_rank = items // capacity
            dst_row = index
            src_row = items
        # a row past the buffer could only come from garbage
        moves = (index >= 0) & (dst_row < num_dst_rows) & _is_destination(dst_rank, my_rank, DESTINATIONS)
        dst_rows = peer_row_starts(dst_peer_ptrs, dst_rank, dst_row, stride_dst, moves, src_ptr.dtype.element_ty)[:, None]
        src_rows = src_ptr + src_row.to(tl.int64)[:, None] * stride_src
        for col0 in range(0, width, BLOCK_W):
            cols = col0 + cols_step
            col_ok = (cols < width)[None, :]
            values = tl.load(src_rows + cols[None, :], mask=moves[:, None] & col_ok)
            tl.store(dst_rows + cols[None, :], values, mask=moves[:, None] & col_ok)
    signal_peers(arrivals_peer_ptrs, arrival_slot, num_ranks, my_rank, BLOCK_P, DESTINATIONS)


@triton.jit
def _wait_arrivals_kernel(
    arrivals_ptr,  # [kinds, P] int32: this rank's counters (peers add to them)
    expected_ptr,  # [kinds, P] int32: arrivals consumed so far (local memory)
    error_flag_ptr,  # [1] int32
    kind, num_ranks, arrivals_per_peer, timeout_ns, max_polls,
    BLOCK_P: tl.constexpr, INTERPRETER: tl.constexpr,
):
    """Peers' writes visible to me: wait until arrivals[kind, p] ≥ expected[kind, p] + G
    for every p (acquire, system scope), bounded by timeout_ns (and max_polls)."""
    ranks = tl.arange(0, BLOCK_P)
    is_rank = ranks < num_ranks
    counters = kind * num_ranks + ranks
    target = tl.load(expected_ptr + counters, mask=is_rank, other=0) + arrivals_per_peer
    if (tl.load(error_flag_ptr) & _TIMEOUT_BIT) == 0:
        start = _global_time_ns(INTERPRETER)
        arrived = tl.atomic_add(arrivals_ptr + counters, 0, mask=is_rank, sem="acquire", scope="sys")
        # the difference, not the values, is compared: counts may wrap around
        waiting = tl.sum((is_rank & (arrived - target < 0)).to(tl.int32), axis=0)
        polls = tl.full([], 1, tl.int64)
        while (waiting > 0) & (_global_time_ns(INTERPRETER) - start < timeout_ns) & (polls < max_polls):
            arrived = tl.atomic_add(arrivals_ptr + counters, 0, mask=is_rank, sem="acquire", scope="sys")
            waiting = tl.sum((is_rank & (arrived - target < 0)).to(tl.int32), axis=0)
            polls += 1
        if waiting > 0:
            tl.atomic_or(error_flag_ptr, _TIMEOUT_BIT)
    tl.store(expected_ptr + counters, target, mask=is_rank)


# --------------------------------------------------------------------------- launchers


def _check_peer_ptrs(name: str, ptrs: torch.Tensor, num_ranks: int, device: torch.device) -> None:
    if ptrs.shape != (num_ranks,) or ptrs.dtype != torch.int64 or ptrs.device != device:
        raise ValueError(f"{name}: expected a [{num_ranks}] int64 tensor of per-rank addresses on {device}, got "
                         f"{ptrs.dtype} {list(ptrs.shape)} on {ptrs.device}")


def push_rows(
    src: torch.Tensor,  # [*, W]
    index: torch.Tensor,  # [N] int32
    dst_peer_ptrs: torch.Tensor,  # [P] int64
    stride_dst: int,
    arrivals_peer_ptrs: torch.Tensor,  # [P] int64
    kind: int,
    error_flag: torch.Tensor,  # [1] int32
    *,
    num_dst_rows: int,
    my_rank: int,
    capacity: int,
    by_slot: bool,
    num_programs: int,
    routes_per_row: int = 1,
    destinations: str = "all",
) -> None:
    """Pushes rows into peers' buffers of `num_dst_rows` rows as the module docstring says, then
    signals `kind`'s arrival on every rank (`destinations`: "all", "self" or "peers", those
    ranks only). Every rank must push each kind with the same `num_programs` (the receivers
    count the programs). Does nothing once `error_flag` holds a timeout."""
    num_ranks = dst_peer_ptrs.shape[0]
    device = src.device
    for name, ptrs in (("dst_peer_ptrs", dst_peer_ptrs), ("arrivals_peer_ptrs", arrivals_peer_ptrs)):
        _check_peer_ptrs(name, ptrs, num_ranks, device)
    if src.dim() != 2 or src.stride(1) != 1 or src.device != device:
        raise ValueError(f"src: expected a 2-D tensor with unit column stride on {device}, got shape "
                         f"{list(src.shape)} strides {src.stride()} on {src.device}")
    if index.dim() != 1 or index.dtype != torch.int32 or not index.is_contiguous() or index.device != device:
        raise ValueError(f"index: expected a contiguous 1-D int32 tensor on {device}, got {index.dtype} "
                         f"{list(index.shape)} on {index.device}")
    if not 0 <= my_rank < num_ranks or capacity < 1 or num_programs < 1 or routes_per_row < 1:
        raise ValueError(f"expected 0 <= my_rank < P={num_ranks} and positive capacity, num_programs and "
                         f"routes_per_row; got {my_rank=} {capacity=} {num_programs=} {routes_per_row=}")
    if destinations not in _DESTINATIONS:
        raise ValueError(f"destinations: expected one of {tuple(_DESTINATIONS)}, got {destinations!r}")
    width = src.shape[1]
    plan = kernel_plan(device)
    _push_rows_kernel[(num_programs,)](
        src, index, dst_peer_ptrs,
        arrivals_peer_ptrs, kind * num_ranks + my_rank, error_flag,
        index.shape[0], width, my_rank, num_ranks, capacity, routes_per_row, num_dst_rows,
        src.stride(0), stride_dst,
        BY_SLOT=by_slot, DESTINATIONS=_DESTINATIONS[destinations],
        BLOCK_R=plan.push_rows, BLOCK_W=min(triton.next_power_of_2(width), plan.push_cols),
        BLOCK_P=triton.next_power_of_2(num_ranks), num_warps=plan.push_num_warps,
    )


def wait_arrivals(
    arrivals: torch.Tensor,  # [kinds, P] int32 (this rank's, in symmetric memory)
    expected: torch.Tensor,  # [kinds, P] int32 (local)
    error_flag: torch.Tensor,  # [1] int32
    kind: int,
    arrivals_per_peer: int,
    timeout_s: float,
) -> None:
    """Waits (on the device, in stream order) until every peer's `arrivals_per_peer`
    programs of push `kind` have signalled; past `timeout_s` sets ERROR_PEER_TIMEOUT."""
    if arrivals.dim() != 2 or arrivals.dtype != torch.int32 or expected.shape != arrivals.shape \
            or expected.dtype != torch.int32 or not (arrivals.is_contiguous() and expected.is_contiguous()):
        raise ValueError(f"arrivals, expected: expected two contiguous [kinds, P] int32 tensors, got "
                         f"{arrivals.dtype} {list(arrivals.shape)} and {expected.dtype} {list(expected.shape)}")
    if not 0 <= kind < arrivals.shape[0] or arrivals_per_peer < 1 or not timeout_s > 0:
        raise ValueError(f"expected 0 <= kind < {arrivals.shape[0]}, arrivals_per_peer >= 1 and timeout_s > 0, "
                         f"got {kind=} {arrivals_per_peer=} {timeout_s=}")
    num_ranks = arrivals.shape[1]
    interpreter = interpreting()
    _wait_arrivals_kernel[(1,)](
        arrivals, expected, error_flag, kind, num_ranks, arrivals_per_peer,
        int(timeout_s * 1e9), kernel_plan(arrivals.device).interpreter_polls if interpreter else 2**62,
        BLOCK_P=triton.next_power_of_2(num_ranks), INTERPRETER=interpreter, num_warps=1,
    )
