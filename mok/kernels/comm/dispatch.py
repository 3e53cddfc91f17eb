"""Dispatch: the row copies on either side of an expert-parallel exchange (the exchange
itself is the transport's, the plan that gives every row its slot `transport.common`'s).

    pack:      send[slot(r)] = src[r // routes_per_row]     for every item r with a slot
    unpack:    dst[r] = recv[slot(r)],  0 for an item without a slot

Legend: items r are (token, rank) pairs t·P + p (token rows: routes_per_row = P) or routes
t·topk + j (per-route values: routes_per_row = 1); slot(r) the item's send row, −1 for none;
W the width of a copied row (H for token rows, 1 for router weights).

Caller contract: an item without a slot (past the capacity, a bad id, no route there) is
never written anywhere, and unpack gives it zeros, so memory stays untouched. Rows of the
send buffer no item fills are left unwritten; the receiver's schedule never reads them.
Determinism: every output element is written by one program, no atomics on data.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok.kernels.plan import kernel_plan


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


# --------------------------------------------------------------------------- launchers


def _copy_grid(num_routes: int, width: int, device: torch.device) -> tuple[tuple[int, int], int, int]:
    """(grid, rows, row elements) of a copy: the plan's `copy_elements` per program."""
    elements = kernel_plan(device).copy_elements
    block_w = min(triton.next_power_of_2(width), elements)
    block_r = max(1, elements // block_w)
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
    grid, block_r, block_w = _copy_grid(num_routes, src.shape[1], src.device)
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
    grid, block_r, block_w = _copy_grid(num_routes, width, recv.device)
    _unpack_rows_kernel[grid](
        recv, route_slot, dst, num_routes, width, recv.stride(0), dst.stride(0),
        BLOCK_R=block_r, BLOCK_W=block_w, num_warps=4,
    )
    return dst
