"""Schedule: where each route's row goes in the expert-sorted, tile-padded layout.

    row_source[r] = t·topk + j   for the route (t, j) placed at row r,   −1 for padding
    route_row[t·topk + j] = r    its inverse: the row of each route, −1 for a route with none

Legend: T tokens, topk routes per token, E_l local experts, BLOCK_M the GEMM's M tile.
Rows are grouped by expert (ascending); each expert's rows are padded up to a multiple
of BLOCK_M, so every M tile of a grouped GEMM belongs to exactly one expert; inside an
expert the routes keep ascending t·topk + j. Everything stays on the device: capacities
come from the host (T·topk + E_l·(BLOCK_M − 1) rows at most), counts never leave the GPU.

Three launches, a counting sort without atomics on data (hence deterministic), over
chunks of CHUNK_TOKENS tokens (about the plan's `schedule_routes_per_chunk` routes each):
1. `_count_routes_kernel` (one program per chunk): a histogram of the chunk's expert ids;
   flags ids out of range or repeated within a row.
2. `_scan_counts_kernel` (one program): prefix sums over chunks and experts, the
   per-expert offsets, the tile→expert table and the padding rows.
3. `_place_routes_kernel` (one program per chunk): sorts the chunk's routes by the key
   (expert, t·topk + j), writes each route's source into its row and each route's row
   into its source (route_row, the inverse map: for kernels that leave their rows in the
   sorted layout and a combine that gathers them; `sorted_route_rows` keeps only it).

After the sort, the routes of expert e sit at positions [first_e, first_e + count_e) of
the chunk, in ascending t·topk + j, so the route at position p goes to row
expert_offsets[e] + (routes of e in earlier chunks) + p − first_e. The scan stores the
chunk's part of that sum, `row_base[chunk, e]`; the place kernel adds the rest.
A token with a bad id has none of its routes counted or placed.

Caller contract: `topk_ids` [T, topk] int32/int64 on the device. Outputs are fully
rewritten every call (safe to reuse across calls and under CUDA graphs). Bad ids set bit
ERROR_BAD_EXPERT_ID of `error_flag` and are left out of the schedule. With
`skip_empty_ids` an id of −1 marks an empty entry (no route; the expert-parallel receiver's
unused rows): left out without an error. Without it (the default, the user's ids) −1 is a
bad id like any other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mok.kernels.common import ERROR_BAD_EXPERT_ID, interpreting
from mok.kernels.plan import kernel_plan

_BAD_ID_BIT = tl.constexpr(ERROR_BAD_EXPERT_ID)  # kernels read only constexpr globals


@dataclass(frozen=True, eq=False)
class RoutingSchedule:
    """Device tensors of one schedule and the host-known capacities that sized them."""

    row_source: torch.Tensor  # [capacity_rows] int32: t·topk + j, or −1 for padding
    tile_expert: torch.Tensor  # [max_tiles] int32: local expert of each M tile, −1 past the end
    expert_offsets: torch.Tensor  # [E_l + 1] int32: first padded row of each expert
    expert_counts: torch.Tensor  # [E_l] int32: routes per expert (unpadded)
    num_rows: torch.Tensor  # [1] int32: padded rows in use (= expert_offsets[E_l])
    route_row: torch.Tensor  # [T·topk] int32: the row of each route t·topk + j, −1 for none (a bad or empty id)
    block_m: int
    capacity_rows: int
    num_local_experts: int

    @property
    def max_tiles(self) -> int:
        return self.capacity_rows // self.block_m


@triton.jit
def _chunk_routes(topk_ids_ptr, chunk, num_tokens, topk, num_experts,
                  CHUNK_TOKENS: tl.constexpr, TOPK_PAD: tl.constexpr, SKIP_EMPTY_IDS: tl.constexpr):
    """(ids, placed) [CHUNK_TOKENS, TOPK_PAD] and bad_token [CHUNK_TOKENS] of the chunk: the
    ids as int32, which entries are routes to count and place, which tokens have a bad id
    (out of range or repeated within the row; with SKIP_EMPTY_IDS, −1 is no route, not a
    bad id). A token with a bad id places none of its routes."""
    tokens = chunk * CHUNK_TOKENS + tl.arange(0, CHUNK_TOKENS)
    js = tl.arange(0, TOPK_PAD)
    entry = (tokens < num_tokens)[:, None] & (js < topk)[None, :]
    row_ptrs = topk_ids_ptr + tokens.to(tl.int64) * topk
    ids = tl.load(row_ptrs[:, None] + js[None, :], mask=entry, other=-1).to(tl.int32)
    in_range = (ids >= 0) & (ids < num_experts)
    bad = entry & ~in_range
    if SKIP_EMPTY_IDS:
        bad = bad & (ids != -1)
    # Repeats: compare with each column in turn (re-read from L1), which keeps the work at
    # CHUNK_TOKENS·TOPK_PAD per column whatever topk is.
    for j in range(topk):
        column = tl.load(row_ptrs + j, mask=tokens < num_tokens, other=-1).to(tl.int32)
        bad = bad | (entry & in_range & (ids == column[:, None]) & (js != j)[None, :])
    bad_token = tl.max(bad.to(tl.int32), axis=1) > 0
    placed = entry & in_range & ~bad_token[:, None]
    return ids, placed, bad_token


@triton.jit
def _compare_exchange(keys, ROUTES: tl.constexpr, HALF: tl.constexpr, RUN: tl.constexpr):
    """One step of a bitonic network over keys [ROUTES]: partners HALF apart swap into
    ascending order inside runs of RUN keys whose index has bit log2(RUN) clear, descending
    where it is set."""
    pairs = tl.permute(tl.reshape(keys, (ROUTES // (2 * HALF), 2, HALF)), (0, 2, 1))
    first, second = tl.split(pairs)
    block_start = tl.arange(0, ROUTES // (2 * HALF)) * (2 * HALF)
    ascending = ((block_start // RUN) % 2 == 0)[:, None]
    low, high = tl.minimum(first, second), tl.maximum(first, second)
    pairs = tl.join(tl.where(ascending, low, high), tl.where(ascending, high, low))
    return tl.reshape(tl.permute(pairs, (0, 2, 1)), (ROUTES,))


@triton.jit
def _sort(keys, ROUTES: tl.constexpr, INTERPRETER: tl.constexpr):
    """keys [ROUTES] ascending. `tl.sort` on the GPU; under the interpreter, a bitonic
    network through reshapes (triton 3.6's interpreter runs tl.sort's reductions element by
    element in Python: ~27 s for 1024 keys, seen on CPU)."""
    if INTERPRETER:
        for stage in tl.static_range(1, ROUTES.bit_length()):  # merge sorted runs of 2^(stage-1)
            for level in tl.static_range(stage):
                keys = _compare_exchange(keys, ROUTES, 2 ** (stage - 1 - level), 2 ** stage)
    else:
        keys = tl.sort(keys)
    return keys


@triton.jit
def _count_routes_kernel(
    topk_ids_ptr,  # [T, topk]
    chunk_counts_ptr,  # [num_chunks, EXPERTS_PAD] int32, out
    error_flag_ptr,  # [1] int32
    num_tokens, topk, num_experts,
    CHUNK_TOKENS: tl.constexpr, TOPK_PAD: tl.constexpr, ROUTES: tl.constexpr, EXPERTS_PAD: tl.constexpr,
    SKIP_EMPTY_IDS: tl.constexpr,
):
    chunk = tl.program_id(0)
    ids, placed, bad_token = _chunk_routes(topk_ids_ptr, chunk, num_tokens, topk, num_experts,
                                           CHUNK_TOKENS, TOPK_PAD, SKIP_EMPTY_IDS)
    placed = tl.reshape(placed, (ROUTES,))
    counts = tl.histogram(tl.where(placed, tl.reshape(ids, (ROUTES,)), 0), EXPERTS_PAD, mask=placed)
    tl.store(chunk_counts_ptr + chunk * EXPERTS_PAD + tl.arange(0, EXPERTS_PAD), counts)
    if tl.max(bad_token.to(tl.int32), axis=0) > 0:
        tl.atomic_or(error_flag_ptr, _BAD_ID_BIT)


@triton.jit
def _scan_counts_kernel(
    chunk_counts_ptr,  # [num_chunks, EXPERTS_PAD] int32
    row_base_ptr,  # [num_chunks, EXPERTS_PAD] int32, out: see the module docstring
    row_source_ptr,  # [capacity_rows] int32, out (padding rows only)
    tile_expert_ptr,  # [max_tiles] int32, out
    expert_offsets_ptr,  # [E_l + 1] int32, out
    expert_counts_ptr,  # [E_l] int32, out
    num_rows_ptr,  # [1] int32, out
    num_experts, num_chunks, max_tiles,
    BLOCK_M: tl.constexpr, EXPERTS_PAD: tl.constexpr, CHUNKS_PER_STEP: tl.constexpr,
    EXPERTS_PER_STEP: tl.constexpr, TILES_PER_STEP: tl.constexpr,
):
    """One program: prefix sums over chunks and experts, the tile table, the padding rows."""
    experts = tl.arange(0, EXPERTS_PAD)
    is_expert = experts < num_experts
    totals = tl.zeros((EXPERTS_PAD,), dtype=tl.int32)
    for c0 in range(0, num_chunks, CHUNKS_PER_STEP):
        chunks = c0 + tl.arange(0, CHUNKS_PER_STEP)
        offs = chunks[:, None] * EXPERTS_PAD + experts[None, :]
        counts = tl.load(chunk_counts_ptr + offs, mask=(chunks < num_chunks)[:, None], other=0)
        earlier_chunks = tl.cumsum(counts, axis=0) - counts + totals[None, :]  # routes of e before the chunk
        first_in_chunk = tl.cumsum(counts, axis=1) - counts  # first_e: routes of lower experts in the chunk
        tl.store(row_base_ptr + offs, earlier_chunks - first_in_chunk, mask=(chunks < num_chunks)[:, None])
        totals += tl.sum(counts, axis=0)
    padded = tl.cdiv(totals, BLOCK_M) * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    num_rows = tl.sum(padded, axis=0)
    tl.store(expert_offsets_ptr + experts, padded_start, mask=is_expert)
    tl.store(expert_offsets_ptr + num_experts, num_rows)
    tl.store(expert_counts_ptr + experts, totals, mask=is_expert)
    tl.store(num_rows_ptr, num_rows)
    # Tile → expert: the number of experts whose padded rows end at or before the tile.
    for tile0 in range(0, max_tiles, TILES_PER_STEP):
        tiles = tile0 + tl.arange(0, TILES_PER_STEP)
        first_row = tiles * BLOCK_M
        owner = tl.sum(((first_row[:, None] >= padded_end[None, :]) & is_expert[None, :]).to(tl.int32), axis=1)
        tl.store(tile_expert_ptr + tiles, tl.where(first_row < num_rows, owner, -1), mask=tiles < max_tiles)
    # Padding rows (fewer than BLOCK_M per expert, after its real rows), a block of experts
    # at a time, re-reading what this program stored above.
    tl.debug_barrier()
    pad = tl.arange(0, BLOCK_M)
    for e0 in range(0, num_experts, EXPERTS_PER_STEP):
        block = e0 + tl.arange(0, EXPERTS_PER_STEP)
        in_block = block < num_experts
        start = tl.load(expert_offsets_ptr + block, mask=in_block, other=0)
        count = tl.load(expert_counts_ptr + block, mask=in_block, other=0)
        end = start + tl.cdiv(count, BLOCK_M) * BLOCK_M
        rows = (start + count)[:, None] + pad[None, :]
        tl.store(row_source_ptr + rows, -1, mask=in_block[:, None] & (rows < end[:, None]))


@triton.jit
def _place_routes_kernel(
    topk_ids_ptr,  # [T, topk]
    row_base_ptr,  # [num_chunks, EXPERTS_PAD] int32
    expert_offsets_ptr,  # [E_l + 1] int32
    row_source_ptr,  # [capacity_rows] int32, out (with STORE_ROW_SOURCE)
    route_row_ptr,  # [T·topk] int32, out
    num_tokens, topk, num_experts,
    CHUNK_TOKENS: tl.constexpr, TOPK_PAD: tl.constexpr, ROUTES: tl.constexpr, EXPERTS_PAD: tl.constexpr,
    SKIP_EMPTY_IDS: tl.constexpr, STORE_ROW_SOURCE: tl.constexpr, INTERPRETER: tl.constexpr,
):
    chunk = tl.program_id(0)
    ids, placed, _ = _chunk_routes(topk_ids_ptr, chunk, num_tokens, topk, num_experts,
                                   CHUNK_TOKENS, TOPK_PAD, SKIP_EMPTY_IDS)
    # Key (expert, route in the chunk), routes that are not placed last; keys are distinct.
    expert_key = tl.where(placed, ids, EXPERTS_PAD)
    keys = _sort(tl.reshape(expert_key, (ROUTES,)) * ROUTES + tl.arange(0, ROUTES), ROUTES, INTERPRETER)
    expert = keys // ROUTES
    local = keys % ROUTES
    is_placed = expert < EXPERTS_PAD
    expert = tl.where(is_placed, expert, 0)
    row = (tl.load(expert_offsets_ptr + expert, mask=is_placed, other=0)
           + tl.load(row_base_ptr + chunk * EXPERTS_PAD + expert, mask=is_placed, other=0)
           + tl.arange(0, ROUTES))
    token = chunk * CHUNK_TOKENS + local // TOPK_PAD
    j = local % TOPK_PAD
    source = token * topk + j
    is_entry = (token < num_tokens) & (j < topk)
    tl.store(route_row_ptr + source, tl.where(is_placed, row, -1), mask=is_entry)  # every entry: no fill needed
    if STORE_ROW_SOURCE:
        tl.store(row_source_ptr + row, source, mask=is_placed)


def capacity_rows(num_routes: int, num_local_experts: int, block_m: int) -> int:
    """Padded rows the schedule may need at most: every expert may waste BLOCK_M − 1."""
    return triton.cdiv(num_routes + num_local_experts * (block_m - 1), block_m) * block_m


def _check_topk_ids(topk_ids: torch.Tensor) -> None:
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64) or not topk_ids.is_contiguous():
        raise ValueError(f"topk_ids: expected a contiguous [T, topk] int32/int64 tensor, got {topk_ids.dtype} {tuple(topk_ids.shape)}")


def _count_and_scan(topk_ids, num_experts, block_m, row_source, tile_expert, error_flag, skip_empty_ids):
    """Launches the count and scan kernels (steps 1 and 2); returns (row_base,
    expert_offsets, expert_counts, num_rows, meta), meta being what the place kernel shares.
    Fills the padding rows of `row_source` and all of `tile_expert` ([max_tiles])."""
    num_tokens, topk = topk_ids.shape
    device = topk_ids.device
    experts_pad = triton.next_power_of_2(num_experts)
    topk_pad = triton.next_power_of_2(topk)
    plan = kernel_plan(device)
    # Fewer tokens than a chunk holds: one chunk of just enough (a smaller sort).
    chunk_tokens = max(1, min(plan.schedule_routes_per_chunk // topk_pad, triton.next_power_of_2(num_tokens)))
    num_chunks = triton.cdiv(num_tokens, chunk_tokens)
    if (experts_pad + 1) * chunk_tokens * topk_pad >= 2**31:
        raise ValueError(f"num_local_experts: {num_experts} experts with topk {topk} overflow the schedule's sort keys")

    chunk_counts = torch.empty(num_chunks, experts_pad, dtype=torch.int32, device=device)  # [chunks, E_pad]
    row_base = torch.empty_like(chunk_counts)  # [chunks, E_pad]
    expert_offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=device)  # [E_l + 1]
    expert_counts = torch.empty(num_experts, dtype=torch.int32, device=device)  # [E_l]
    num_rows = torch.empty(1, dtype=torch.int32, device=device)

    meta = dict(CHUNK_TOKENS=chunk_tokens, TOPK_PAD=topk_pad, ROUTES=chunk_tokens * topk_pad, EXPERTS_PAD=experts_pad,
                SKIP_EMPTY_IDS=skip_empty_ids)
    _count_routes_kernel[(num_chunks,)](topk_ids, chunk_counts, error_flag, num_tokens, topk, num_experts, **meta)
    per_step = max(1, plan.schedule_scan_tile_elements // experts_pad)
    _scan_counts_kernel[(1,)](
        chunk_counts, row_base, row_source, tile_expert, expert_offsets, expert_counts, num_rows,
        num_experts, num_chunks, tile_expert.shape[0],
        BLOCK_M=block_m, EXPERTS_PAD=experts_pad, CHUNKS_PER_STEP=per_step,
        EXPERTS_PER_STEP=max(1, plan.schedule_scan_tile_elements // block_m), TILES_PER_STEP=per_step, num_warps=8,
    )
    return row_base, expert_offsets, expert_counts, num_rows, meta


def build_routing_schedule(
    topk_ids: torch.Tensor,  # [T, topk] int32/int64
    num_local_experts: int,
    block_m: int,
    error_flag: torch.Tensor,  # [1] int32
    skip_empty_ids: bool = False,
) -> RoutingSchedule:
    """Builds the schedule (experts ascending, each one's routes in ascending t·topk + j) over
    the rows of `topk_ids` (every expert is local). `skip_empty_ids`: ids of −1 are empty entries, not errors (module docstring)."""
    _check_topk_ids(topk_ids)
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m: expected a power of two, got {block_m}")
    num_tokens, topk = topk_ids.shape
    rows = capacity_rows(num_tokens * topk, num_local_experts, block_m)
    row_source = torch.empty(rows, dtype=torch.int32, device=topk_ids.device)  # [capacity_rows]
    tile_expert = torch.empty(rows // block_m, dtype=torch.int32, device=topk_ids.device)  # [max_tiles]
    route_row = torch.empty(num_tokens * topk, dtype=torch.int32, device=topk_ids.device)  # [T·topk]
    row_base, expert_offsets, expert_counts, num_rows, meta = _count_and_scan(
        topk_ids, num_local_experts, block_m, row_source, tile_expert, error_flag, skip_empty_ids
    )
    _place_routes_kernel[(row_base.shape[0],)](
        topk_ids, row_base, expert_offsets, row_source, route_row, num_tokens, topk, num_local_experts,
        STORE_ROW_SOURCE=True, INTERPRETER=interpreting(), **meta,
    )
    return RoutingSchedule(row_source, tile_expert, expert_offsets, expert_counts, num_rows, route_row, block_m, rows,
                           num_local_experts)


def sorted_route_rows(
    topk_ids: torch.Tensor,  # [T, topk] int32/int64
    num_experts: int,
    error_flag: torch.Tensor,  # [1] int32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(route_row [T·topk] int32, expert_offsets [E + 1] int32): the row of route t·topk + j
    in the expert-sorted layout without padding (experts ascending, then t·topk + j
    ascending), −1 for the routes of a token with bad ids; and each expert's first row.
    It is the inverse of the row_source of a `block_m = 1` schedule, built without the
    tile table (one row per tile would make the single scan program walk every route)."""
    _check_topk_ids(topk_ids)
    num_tokens, topk = topk_ids.shape
    route_row = torch.empty(num_tokens * topk, dtype=torch.int32, device=topk_ids.device)  # [T·topk]
    no_rows = torch.empty(0, dtype=torch.int32, device=topk_ids.device)  # block_m = 1: no padding, no tiles
    row_base, expert_offsets, _, _, meta = _count_and_scan(
        topk_ids, num_experts, 1, no_rows, no_rows, error_flag, False
    )
    _place_routes_kernel[(row_base.shape[0],)](
        topk_ids, row_base, expert_offsets, no_rows, route_row, num_tokens, topk, num_experts,
        STORE_ROW_SOURCE=False, INTERPRETER=interpreting(), **meta,
    )
    return route_row, expert_offsets
