"""Dispatch: where each route travels under expert parallelism, and the row copies on
either side of the exchange (the exchange itself is the transport's, not a kernel's).

    slot(t, j) = p·C + c     p = e(t,j) // E_l, the rank that holds the route's expert;
                             c = the route's place among this rank's routes to p, ordered
                             by (local expert e(t,j) % E_l, t·topk + j); −1 when c ≥ C
    pack:      send[slot(r)] = src[r // routes_per_row]          (r = t·topk + j)
    unpack:    dst[r] = recv[slot(r)],  0 for a route without a slot
    receive:   expert_ids[c·P + p] = recv_ids[p, c]               (source p's c-th row)
               error_flag |= recv_ids[p, C] for every source p    (the sources' flags)

Legend: T tokens of this rank, topk routes per token, r = t·topk + j a route, e(t,j) its
global expert, E_l local experts per rank, P ranks, C the send capacity (rows one rank
may send one peer), W the width of a copied row (H for token rows, 1 for per-route
values such as router weights).

The send buffer is P blocks of C rows, one per destination, so an exchange with equal
splits moves it: no counts travel to the host. Ordering routes by (local expert, t·topk
+ j) inside a block is ordering them by (global expert, t·topk + j), which is the
schedule's counting sort over all E = E_l·P experts (`schedule.sorted_route_rows`); a
route's place in its block is its sorted row minus the first row of the block's first
expert. Because a route's rows go out and come back at the same slot, the slot is all
the return trip needs: no route index travels.

On the receiving rank, rows arrive source-major (source p's rows at p·C + c). The
receiver's schedule is built over the interleaved order c·P + p, so that inside each
expert, ascending order takes the sources round-robin; `receive_expert_ids`
writes the ids in that order. Each source appends its error flag to the ids it sends, so
every rank's flag ends up holding every rank's routing errors and all ranks raise alike.

Caller contract: `route_slots` flags routes past the capacity with ERROR_CAPACITY_OVERFLOW
and gives them no slot (−1); bad expert ids are flagged by the schedule's kernels and get
no slot either. Such routes are never written anywhere, and unpack gives them zeros, so
the rest of the layer stays exact and memory stays untouched. Rows of the send buffer no
route fills are left unwritten; their expert id is −1, so the receiver skips them.
Determinism: every output element is written by one program, no atomics on data.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok.kernels.common import ERROR_CAPACITY_OVERFLOW
from mok.kernels.schedule import sorted_route_rows

_OVERFLOW_BIT = tl.constexpr(ERROR_CAPACITY_OVERFLOW)  # kernels read only constexpr globals

# Routes per program of the slot kernel, and route rows × row elements per program of the
# copies (4K elements keep a tile in registers; the copies are bound by memory, untuned).
_ROUTES_PER_PROGRAM = 1024
_COPY_ELEMENTS = 4096


@triton.jit
def _route_slots_kernel(
    # pointers
    topk_ids_ptr,  # [T·topk] global expert ids
    route_row_ptr,  # [T·topk] int32: sorted row over all experts, −1 for a bad token
    expert_offsets_ptr,  # [E + 1] int32: first sorted row of each global expert
    route_slot_ptr,  # [T·topk] int32, out
    send_expert_ptr,  # [P·C] int32, out (pre-filled with −1)
    send_route_ptr,  # [P·C] int32, out (pre-filled with −1)
    error_flag_ptr,  # [1] int32
    # sizes
    num_routes, num_local_experts, send_capacity,
    # meta
    BLOCK_R: tl.constexpr,
):
    routes = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = routes < num_routes
    row = tl.load(route_row_ptr + routes, mask=in_range, other=-1)
    has_row = row >= 0
    expert = tl.load(topk_ids_ptr + routes, mask=has_row, other=0).to(tl.int32)
    dest = expert // num_local_experts
    first_row = tl.load(expert_offsets_ptr + dest * num_local_experts, mask=has_row, other=0)
    place = row - first_row
    fits = has_row & (place < send_capacity)
    slot = tl.where(fits, dest * send_capacity + place, -1)
    tl.store(route_slot_ptr + routes, slot, mask=in_range)
    tl.store(send_expert_ptr + slot, expert - dest * num_local_experts, mask=fits)
    tl.store(send_route_ptr + slot, routes, mask=fits)
    if tl.max((has_row & ~fits).to(tl.int32), axis=0) > 0:
        tl.atomic_or(error_flag_ptr, _OVERFLOW_BIT)


@triton.jit
def _pack_rows_kernel(
    src_ptr, route_slot_ptr, send_ptr,
    num_routes, width, routes_per_row,
    stride_src, stride_send,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """send[slot(r)] = src[r // routes_per_row] for the routes with a slot."""
    routes = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    slot = tl.load(route_slot_ptr + routes, mask=routes < num_routes, other=-1)
    mask = (slot >= 0)[:, None] & (cols < width)[None, :]
    src_rows = (routes // routes_per_row).to(tl.int64)[:, None]
    values = tl.load(src_ptr + src_rows * stride_src + cols[None, :], mask=mask)
    tl.store(send_ptr + slot.to(tl.int64)[:, None] * stride_send + cols[None, :], values, mask=mask)


@triton.jit
def _unpack_rows_kernel(
    recv_ptr, route_slot_ptr, dst_ptr,
    num_routes, width,
    stride_recv, stride_dst,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """dst[r] = recv[slot(r)], zeros for a route without a slot."""
    routes = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    in_range = routes < num_routes
    slot = tl.load(route_slot_ptr + routes, mask=in_range, other=-1)
    col_ok = (cols < width)[None, :]
    values = tl.load(recv_ptr + slot.to(tl.int64)[:, None] * stride_recv + cols[None, :],
                     mask=(slot >= 0)[:, None] & col_ok, other=0.0)
    tl.store(dst_ptr + routes.to(tl.int64)[:, None] * stride_dst + cols[None, :], values,
             mask=in_range[:, None] & col_ok)


@triton.jit
def _bitwise_or(a, b):
    return a | b


@triton.jit
def _receive_expert_ids_kernel(
    recv_ids_ptr,  # [P, C + 1] int32: each source's ids, then its error flag
    expert_ids_ptr,  # [C·P] int32, out
    error_flag_ptr,  # [1] int32
    world_size, send_capacity, stride_recv,
    BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr,
):
    places = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    sources = tl.arange(0, BLOCK_P)
    is_source = sources < world_size
    mask = (places < send_capacity)[:, None] & is_source[None, :]
    ids = tl.load(recv_ids_ptr + sources[None, :] * stride_recv + places[:, None], mask=mask)
    tl.store(expert_ids_ptr + places[:, None] * world_size + sources[None, :], ids, mask=mask)
    if tl.program_id(0) == 0:
        flags = tl.load(recv_ids_ptr + sources * stride_recv + send_capacity, mask=is_source, other=0)
        peers_flags = tl.reduce(flags, 0, _bitwise_or)
        if peers_flags != 0:
            tl.atomic_or(error_flag_ptr, peers_flags)


# --------------------------------------------------------------------------- launchers


def _check_error_flag(error_flag: torch.Tensor, device: torch.device) -> None:
    if error_flag.shape != (1,) or error_flag.dtype != torch.int32 or error_flag.device != device:
        raise ValueError(f"error_flag: expected a [1] int32 tensor on {device}, got {error_flag.dtype} "
                         f"{list(error_flag.shape)} on {error_flag.device}")


def route_slots(
    topk_ids: torch.Tensor,  # [T, topk] int32/int64 global expert ids
    num_local_experts: int,
    world_size: int,
    send_capacity: int,
    error_flag: torch.Tensor,  # [1] int32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(route_slot [T·topk] int32, send_expert [P·C] int32, send_route [P·C] int32): each
    route's row in the send buffer (−1: beyond capacity or a bad id), and the local expert
    id and the route t·topk + j each send row carries (−1: an empty row)."""
    for name, value in (("num_local_experts", num_local_experts), ("world_size", world_size),
                        ("send_capacity", send_capacity)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    _check_error_flag(error_flag, topk_ids.device)
    num_experts = num_local_experts * world_size
    route_row, expert_offsets = sorted_route_rows(topk_ids, num_experts, error_flag)  # validates topk_ids
    num_routes = route_row.shape[0]
    route_slot = torch.empty(num_routes, dtype=torch.int32, device=topk_ids.device)  # [T·topk]
    send_expert = torch.full((world_size * send_capacity,), -1, dtype=torch.int32, device=topk_ids.device)  # [P·C]
    send_route = torch.full_like(send_expert, -1)  # [P·C]
    _route_slots_kernel[(triton.cdiv(num_routes, _ROUTES_PER_PROGRAM),)](
        topk_ids, route_row, expert_offsets, route_slot, send_expert, send_route, error_flag,
        num_routes, num_local_experts, send_capacity,
        BLOCK_R=_ROUTES_PER_PROGRAM, num_warps=4,
    )
    return route_slot, send_expert, send_route


def _copy_grid(num_routes: int, width: int) -> tuple[tuple[int, int], int, int]:
    block_w = min(triton.next_power_of_2(width), _COPY_ELEMENTS)
    block_r = max(1, _COPY_ELEMENTS // block_w)
    return (triton.cdiv(num_routes, block_r), triton.cdiv(width, block_w)), block_r, block_w


def _check_rows(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.dim() != 2 or t.stride(1) != 1 or t.device != device:
        raise ValueError(f"{name}: expected a 2-D tensor with unit column stride on {device}, "
                         f"got shape {list(t.shape)} strides {t.stride()} on {t.device}")


def _check_route_slot(route_slot: torch.Tensor) -> None:
    if route_slot.dim() != 1 or route_slot.dtype != torch.int32 or not route_slot.is_contiguous():
        raise ValueError(f"route_slot: expected a contiguous 1-D int32 tensor, got {route_slot.dtype} "
                         f"{list(route_slot.shape)}")


def pack_rows(
    src: torch.Tensor,  # [T·topk / routes_per_row, W]
    route_slot: torch.Tensor,  # [T·topk] int32
    routes_per_row: int,
    num_send_rows: int,
) -> torch.Tensor:
    """send [num_send_rows, W] of src's dtype: row slot(r) holds src[r // routes_per_row]
    (routes_per_row = topk for token rows, 1 for per-route rows); rows no route fills are
    left unwritten."""
    _check_route_slot(route_slot)
    _check_rows("src", src, route_slot.device)
    num_routes = route_slot.shape[0]
    if not isinstance(routes_per_row, int) or routes_per_row < 1 or src.shape[0] * routes_per_row != num_routes:
        raise ValueError(f"src: expected {num_routes} / routes_per_row={routes_per_row} rows (one per token or "
                         f"per route of route_slot), got {src.shape[0]}")
    send = torch.empty(num_send_rows, src.shape[1], dtype=src.dtype, device=src.device)  # [P·C, W]
    grid, block_r, block_w = _copy_grid(num_routes, src.shape[1])
    _pack_rows_kernel[grid](
        src, route_slot, send, num_routes, src.shape[1], routes_per_row, src.stride(0), send.stride(0),
        BLOCK_R=block_r, BLOCK_W=block_w, num_warps=4,
    )
    return send


def unpack_rows(
    recv: torch.Tensor,  # [P·C, W]
    route_slot: torch.Tensor,  # [T·topk] int32
) -> torch.Tensor:
    """[T·topk, W] of recv's dtype: row r holds recv[slot(r)], zeros for a route without a slot."""
    _check_route_slot(route_slot)
    _check_rows("recv", recv, route_slot.device)
    num_routes, width = route_slot.shape[0], recv.shape[1]
    dst = torch.empty(num_routes, width, dtype=recv.dtype, device=recv.device)  # [T·topk, W]
    grid, block_r, block_w = _copy_grid(num_routes, width)
    _unpack_rows_kernel[grid](
        recv, route_slot, dst, num_routes, width, recv.stride(0), dst.stride(0),
        BLOCK_R=block_r, BLOCK_W=block_w, num_warps=4,
    )
    return dst


def receive_expert_ids(
    recv_ids: torch.Tensor,  # [P, C + 1] int32 (rows may be strided)
    error_flag: torch.Tensor,  # [1] int32
) -> torch.Tensor:
    """expert_ids [C·P, 1] int32: row c·P + p holds the local expert id of source p's c-th
    row (−1: empty), the layout the receiver's schedule reads; ORs the sources' error
    flags (the last column) into `error_flag`."""
    if recv_ids.dim() != 2 or recv_ids.dtype != torch.int32 or recv_ids.stride(1) != 1 or recv_ids.shape[1] < 2:
        raise ValueError(f"recv_ids: expected a [P, C + 1] int32 tensor with C >= 1 and unit column stride, got "
                         f"{recv_ids.dtype} {list(recv_ids.shape)} strides {recv_ids.stride()}")
    _check_error_flag(error_flag, recv_ids.device)
    world_size, send_capacity = recv_ids.shape[0], recv_ids.shape[1] - 1
    expert_ids = torch.empty(send_capacity * world_size, 1, dtype=torch.int32, device=recv_ids.device)  # [C·P, 1]
    block_p = triton.next_power_of_2(world_size)
    block_c = max(1, _COPY_ELEMENTS // block_p)
    _receive_expert_ids_kernel[(triton.cdiv(send_capacity, block_c),)](
        recv_ids, expert_ids, error_flag, world_size, send_capacity, recv_ids.stride(0), BLOCK_C=block_c, BLOCK_P=block_p, num_warps=4,
    )
    return expert_ids
