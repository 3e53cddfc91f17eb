"""Which kernels run, per GPU architecture: one frozen `KernelPlan` of tile sizes, thresholds and
variant flags for each, and `kernel_plan(device)` to pick it.

Every config-choosing function (`gemm.common.gemm_config`, `gemm.dgrad.dgrad_config`,
`gemm.wgrad.wgrad_config`, the quantizers' and the layer's fp8_block choices) and every other launcher's
sizes (the combine, the gathers, the schedule, the expert-parallel copies) read the plan; nothing
else chooses. Records and logs named next to a field are under `benchmarks/results/`, measured on
H200. `override(**fields)` runs a block under a variant of the plan (`python -m mok.bench --variant`).
"""

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch


def _tile(**sizes) -> dataclasses.Field:
    """A field holding a read-only tile config (a plan is frozen, its dicts too)."""
    return dataclasses.field(default_factory=lambda: MappingProxyType(sizes))


@dataclass(frozen=True)
class KernelPlan:
    """The kernel choices of one architecture. Tile fields are read-only dicts of launch meta."""

    # The Gluon warp-specialized GEMMs run (Hopper's wgmma and TMA, `gemm/hopper_*.py`); each
    # `warp_specialized_*` / `cooperative_*` flag below then says whether one GEMM takes them.
    warp_specialized: bool

    # ---- forward GEMMs (`gemm.common.gemm_config`)
    # fp8_block tiles, starting points sized against H200's limits with ptxas
    # (`benchmarks/bench_fp8_gemm.py --sweep` times the alternatives).
    fp8_block_gate_up_tile: Mapping = _tile(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8,
                                            num_stages=3)
    # Not bf16's BLOCK_N = 256: its accumulator plus a fresh dot spill (ptxas).
    fp8_block_down_tile: Mapping = _tile(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4)
    # BLOCK_M as the bf16 interpreter config, so one schedule serves both precisions.
    fp8_block_interpreter_tile: Mapping = _tile(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, GROUP_M=4, num_warps=4,
                                                num_stages=1)
    # bf16 gate/up reads x copied to the sorted layout from this I on: the TMA loads' saving grows
    # with I, the copy's cost does not (record h200-20261130-gate-up-sorted-x.json).
    sorted_x_min_inter: int = 2048
    # Packed gate/up weights take the one-wide-dot path below this I; slower at mixtral-8x7b's
    # I = 14336 (records h200-20261130-packed*.json).
    packed_max_inter: int = 8192
    # The bf16 down GEMM runs persistent up to this reduction (I); slower at I = 14336 (record
    # h200-20261130-persistent.json).
    persistent_down_max_inter: int = 2048
    # Warp-specialized bf16 down GEMM with the ping-pong schedule up to this I: faster at I = 768,
    # slower at 2048 and 14336 (logs h200-20261130-ping-pong-fwd-profile.log, -ping-pong-probe.log).
    ping_pong_down_max_inter: int = 1024
    # Above it the cooperative schedule, off: the H200 measurements disagree (logs
    # h200-20261201-cooperative-probe.log, h200-20261201-warp-specialized-sweep.log).
    cooperative_down: bool = False
    # The fp8_block down GEMM warp-specialized: much faster on both presets, bitwise the Triton
    # kernel's (log h200-20261201-fp8-wide-scalar-scales-sweep.log).
    warp_specialized_fp8_block_down: bool = True
    # The fp8_block gate/up GEMM warp-specialized: faster at every H, bitwise the Triton kernel's
    # (log h200-20261202-gate-up-epilogue-stores-sweep.log).
    warp_specialized_fp8_block_gate_up: bool = True
    # Row tiles per column sweep of the bf16 Triton GEMMs and dgrads; 16 measured slower in the
    # layer (record h200-20261201-ab-gemm-group.json).
    gemm_group_m: int = 8
    # The per-tile bf16 down GEMM and gate/up dgrad compute a short last wave as column halves,
    # bitwise the whole tiles' output (record h200-20261202-tile-waves.json).
    split_last_wave: bool = True

    # ---- dgrads (`gemm.dgrad.dgrad_config`)
    # fp8_block tiles (BLOCK_M is the schedule's), starting points sized like the forward's
    # (`benchmarks/bench_fp8_gemm.py --dgrad` times them).
    dgrad_fp8_block_down_tile: Mapping = _tile(BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4)
    dgrad_fp8_block_gate_up_tile: Mapping = _tile(BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4)
    dgrad_fp8_block_interpreter_tile: Mapping = _tile(BLOCK_N=128, BLOCK_K=128, GROUP_M=4, num_warps=4,
                                                      num_stages=1)
    # The bf16 gate/up dgrad runs persistent from this output width (H) on (record
    # h200-20261130-persistent.json).
    persistent_gate_up_dgrad_min_hidden: int = 6144
    # Warp-specialized bf16 gate/up dgrad up to this I: faster alone at small I, the layer lost at
    # larger I (records h200-20261201-cooperative-ab.json, -fwd-bwd-v13.json).
    cooperative_gate_up_dgrad_max_inter: int = 1024
    # The fp8_block gate/up dgrad warp-specialized: much faster, bitwise the Triton kernel's (log
    # h200-20261201-fp8-wide-scalar-scales-sweep.log).
    warp_specialized_fp8_block_gate_up_dgrad: bool = True
    # The fused Triton fp8_block down dgrad gathers dOut's token rows up to this H, reads a sorted
    # copy above it (log h200-20261201-fp8-down-dgrad-gathered-profile.log).
    gathered_fp8_block_down_dgrad_max_hidden: int = 2048
    # The fp8_block down dgrad as a warp-specialized product GEMM plus an epilogue launch: far
    # faster than the fused Triton kernel (log h200-20261201-fp8-down-dgrad-gathered-product-profile.log).
    warp_specialized_fp8_block_down_dgrad_product: bool = True
    # That product in bf16 (False: fp32, d_gate_up bitwise the fused kernel's): half its bytes, a
    # faster epilogue, room for the TMA stores (log h200-20261203-ab-fp8-block-v31.log).
    fp8_block_down_dgrad_product_bf16: bool = True
    # Rows per step of the fp8_block down dgrad's epilogue on a given product that quantizes d_g, d_u
    # (PRODUCT_GIVEN and QUANTIZED): each row's 128 columns together, so the chunk's d_g, d_u are all
    # live at once. 16 measured fastest of 8 to 64, with or without each chunk's loads issued a chunk
    # ahead (logs h200-20261203-d-gate-up-quantized.log, h200-20261203-epilogue-loads-ahead.log).
    fp8_block_quantized_epilogue_rows: int = 16
    # The bf16 down dgrad prefetches its epilogue's g, u into L2: bitwise the same, a few percent
    # faster (record h200-20261202-down-dgrad-prefetch.json).
    down_dgrad_prefetch_gate_up: bool = True
    # Where I < H the bf16 down dgrad stores w·h for the down wgrad, no w·dOut copy (benchmarks/LOG.md,
    # "Fifteenth round"); False: the w·dOut copy and the forward's h everywhere.
    down_wgrad_reads_weighted_h: bool = True

    # ---- wgrads (`gemm.wgrad.wgrad_config`)
    # fp8_block gate/up: one accumulator over the stacked [d_g | d_u], faster than two (record
    # h200-20261130-fp8-stacked-wgrad.json).
    wgrad_fp8_block_gate_up_tile: Mapping = _tile(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=4,
                                                  STACKED=True)
    # fp8_block down: one 128×128 accumulator, no spills (ptxas); 256 columns would spill.
    wgrad_fp8_block_down_tile: Mapping = _tile(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=4)
    # Under the interpreter: BLOCK_K divides its schedule's block_m (16); whole 128-wide tiles keep
    # its program count low.
    wgrad_fp8_block_interpreter_sizes: Mapping = _tile(BLOCK_M=128, BLOCK_N=128, BLOCK_K=16, num_warps=4,
                                                       num_stages=1)
    # The bf16 down wgrad runs persistent up to this I (faster on qwen3-30b, slower at I ≥ 2048).
    persistent_down_wgrad_max_inter: int = 1024
    # Warp-specialized bf16 down wgrad ping-pong up to this I (log h200-20261130-ping-pong-probe.log).
    ping_pong_down_wgrad_max_inter: int = 1024
    # Above it cooperative: faster on deepseek-v3-slice and mixtral-8x7b (logs
    # h200-20261201-cooperative-probe.log, h200-20261201-warp-specialized-sweep.log).
    cooperative_down_wgrad: bool = True
    # The bf16 gate/up wgrad cooperative at every shape (log h200-20261201-warp-specialized-sweep.log).
    cooperative_gate_up_wgrad: bool = True
    # Row tiles of d_w_down per column sweep: h[e] streams from HBM fewer times on mixtral-8x7b
    # (record h200-20261201-ab-ws-sweep.json).
    down_wgrad_group_m: int = 8
    # Both fp8_block wgrads (without main_grad) warp-specialized: faster, bitwise the Triton kernel's
    # (record h200-20261201-ab-fp8-ws-wgrad.json).
    warp_specialized_fp8_block_wgrad: bool = True

    # ---- warp-specialized tiles and stores (`gemm/hopper_*.py`)
    # Ping-pong: 128×128 per consumer (128×256 spilled), six stages (log h200-20261130-ping-pong-probe.log).
    # Both bf16 tiles walk each row tile's columns in turn (GROUP_M 1; the down wgrad takes
    # `down_wgrad_group_m`).
    ping_pong_tile: Mapping = _tile(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=6, GROUP_M=1)
    # Cooperative: both consumers on one 128×256 tile, four stages (log h200-20261201-cooperative-probe.log).
    cooperative_tile: Mapping = _tile(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_stages=4, GROUP_M=1)
    # fp8_block (cooperative): 128×256, three stages, faster than 128×128 for every fp8_block GEMM
    # (log h200-20261201-fp8-wide-scalar-scales-sweep.log).
    fp8_block_warp_specialized_tile: Mapping = _tile(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_stages=3, GROUP_M=8)
    # The fp8_block wgrads store by TMA under the next tile's MMAs (record
    # h200-20261202-ab-fp8-wgrad-tma-store.json).
    fp8_wgrad_tma_store: bool = True
    # The gathered kernel's fp8_block gate/up outputs and bf16 down dgrad product by TMA stores (log
    # h200-20261203-ab-fp8-block-v31.log).
    gathered_tma_store: bool = True
    # The fp8_block scatter GEMMs' bf16 sorted-layout outputs by TMA stores (log
    # h200-20261203-sorted-outputs.log).
    sorted_tma_store: bool = True
    # The bf16 cooperative wgrads by TMA stores, at 3 stages (log h200-20261202-bf16-wgrad-nostore.log).
    bf16_wgrad_tma_store: bool = True
    # Registers per thread (setmaxnreg) of the consumer warp groups and of the producer, which only
    # issues loads; the default partition (consumer 0) gets what is left of the launch's 168 × 384.
    warp_specialized_consumer_registers: int = 232
    warp_specialized_producer_registers: int = 40
    # Elements per thread along a row of the epilogues' register stores (those without TMA): 8 bf16
    # columns, one 16-byte store.
    warp_specialized_store_vector: int = 8
    # Bytes per thread along a row of the gathered kernel's e4m3 tiles (its cp.async copies into the A
    # tiles, h's register stores): 16, the widest copy; a row's 128 bytes over 8 lanes.
    gathered_byte_vector: int = 16
    # The gathered kernel's producer: a warp group (the byte tiles' layout spreads their rows over 4
    # warps), whose threads gather the token rows into the A tiles by cp.async.
    gathered_producer_threads: int = 128

    # ---- fp8_block quantizers (`quant/fp8_block.py`)
    # Weights by the Gluon kernel on an NVIDIA GPU: faster on every preset, bitwise the Triton
    # kernel's (log h200-20261202-weight-quantizers-gluon.log).
    weights_gluon: bool = True
    weight_gluon_num_warps: int = 4
    # Its rows × 8 columns per thread in `_sorted_t_layouts`: 16 at 4 warps span the block's 128
    # columns, so each thread holds the same elements of the block and of its transpose.
    weight_gluon_rows_per_thread: int = 16
    # Sorted-layout Triton quantizer: 64 columns at 4 warps (log h200-20261130-sorted-t-sweep.log);
    # gathered operands at least this wide (H = 7168) at 32 columns, 2 warps; the interpreter 256 columns.
    sorted_block_w: int = 64
    sorted_num_warps: int = 4
    gathered_narrow_min_width: int = 2049
    gathered_narrow_block_w: int = 32
    gathered_narrow_num_warps: int = 2
    sorted_block_w_interpreter: int = 256
    # The Gluon sorted-layout quantizer on an NVIDIA GPU: 16 rows × 8 columns per thread, 2 warps
    # (log h200-20261202-gluon-sorted-t-sweep.log), 4 on e4m3 operands (log
    # h200-20261203-e4m3-sorted-t-sweep.log).
    sorted_gluon: bool = True
    sorted_gluon_rows_per_thread: int = 16
    sorted_gluon_num_warps: int = 2
    sorted_gluon_num_warps_e4m3: int = 4

    # ---- gather and SwiGLU
    # The bf16 gather runs token-major from this topk on: faster at 8, slower at 2 (log
    # h200-20261130-gather-token-major.log).
    token_major_min_topk: int = 4
    # Its programs: row-major 16 rows × H columns (~8K programs for 131K rows); token-major 16 tokens ×
    # 256 columns per step, 4 warps (8 to 32 tokens, 256 to 1024 columns, 4 or 8 warps all measured
    # within 3% of it on H200).
    gather_rows_per_program: int = 16
    gather_tokens_per_program: int = 16
    # SwiGLU's sigmoid as one PTX sequence (never under the interpreter): mixtral-8x7b's down dgrad
    # faster (benchmarks/LOG.md, "Eighteenth round").
    fast_sigmoid: bool = True

    # ---- the layer's fp8_block recipe (`functional.py`)
    # The backward requantizes the forward's e4m3 x, h down the sorted rows for the wgrads (log
    # h200-20261203-fp8-requantize.log).
    fp8_block_wgrads_requantize: bool = True
    # The down dgrad's epilogue quantizes d_g, d_u itself (record h200-20261203-ab-fp8-block-v32.json).
    fp8_block_d_gate_up_quantized: bool = True
    # On one rank the down GEMM and gate/up dgrad write the sorted layout, the combines gather
    # (records h200-20261203-ab-fp8-block-v33/v34).
    fp8_block_sorted_outputs: bool = True
    # A memory option, off: g, u kept in e4m3 cost more time than the bytes save (log
    # h200-20261204-gate-up-e4m3.log). Needs fp8_block_wgrads_requantize and no swiglu_limit.
    fp8_block_gate_up_e4m3: bool = False
    # Under expert parallelism x (and dOut where gathered) travel as e4m3 + scales; needs
    # fp8_block_wgrads_requantize.
    fp8_block_on_the_wire: bool = True

    # ---- the combine, the schedule, the activation quantizers, the expert-parallel copies
    # The combine's tokens × hidden columns per program, and its warps. H200 (`benchmarks/sweeps/combine.py`,
    # log h200-20261203-combine-sweep.log; ms, y in route slots / in the sorted layout gathered by
    # route_row): qwen3-30b 8×512 0.142 / 0.149, 16×512 0.144 / 0.154, 4×2048 at 8 warps 0.141 / 0.154;
    # deepseek-v3-slice 0.247 / 0.255, 0.251 / 0.262, 0.245 / 0.276.
    combine_block_t: int = 8
    combine_block_h: int = 512
    combine_num_warps: int = 4
    # Routes one count/place program of the schedule handles (a power of two: the place kernel sorts
    # them in registers): 1024 gives 128 programs for qwen3-30b's 16K tokens × topk 8, one per SM.
    schedule_routes_per_chunk: int = 1024
    # The schedule's scan walks [rows, EXPERTS_PAD] tiles of about this many elements.
    schedule_scan_tile_elements: int = 8192
    # The mxfp8 quantizers' largest tile, 64 × 128 elements: 8 KiB of bf16 in, two 8 KiB byte tiles out.
    # Untuned; big enough to amortise the index math, small enough for 4 warps' registers (64 fp32
    # values per thread), both sides multiples of MX_BLOCK so blocks never straddle tiles.
    mxfp8_tile_m: int = 64
    mxfp8_tile_n: int = 128
    # The fp8_block activation quantizer's rows × one 128-wide K block per program (32 scales, 4 KiB of
    # fp8 out). Untuned (memory bound, each element read once): enough programs for any realistic
    # M·K/4096, and few enough under the interpreter.
    fp8_block_activation_block_m: int = 32
    # A push program (peer stores) moves rows × columns per step: big steps keep enough stores in flight
    # over NVLink (a probe on two H200s: 2048-element steps with 4 warps reached half the link rate of
    # 64 KB steps). Untuned beyond that measurement.
    push_rows: int = 16
    push_cols: int = 1024
    push_num_warps: int = 8
    # Item rows × row elements per program of the dispatch's copies (4K elements keep a tile in
    # registers; the copies are bound by memory, untuned).
    copy_elements: int = 4096

    # ---- the interpreter (TRITON_INTERPRET=1, on the CPU)
    # Programs of a persistent launch where there are no SMs to count: a few, so that each program
    # walks several tiles.
    interpreter_programs: int = 3
    # Polls of the arrival wait, where there is no clock and no other rank runs concurrently: the
    # pushes it waits for have either happened already or never will.
    interpreter_polls: int = 4


# H100 / H200: the warp-specialized GEMMs and every measured choice.
HOPPER = KernelPlan(warp_specialized=True)
# Any other CUDA GPU, a Hopper whose Triton cannot build the Gluon GEMMs, and the interpreter: the
# Triton kernels with Hopper's thresholds (nothing else is measured yet).
GENERIC = KernelPlan(warp_specialized=False)

_OVERRIDES: dict = {}


def kernel_plan(device: torch.device | None = None) -> KernelPlan:
    """The plan for `device` (None: the current CUDA device, or the interpreter's without one):
    HOPPER where the warp-specialized GEMMs build (compute capability 9, Gluon usable, no
    interpreter), else GENERIC; with `override`'s fields."""
    from mok.kernels.gemm import hopper_common  # it reads the plan too

    hopper = (hopper_common.available_here() if device is None
              else hopper_common.warp_specialized_available(device))
    plan = HOPPER if hopper else GENERIC
    return dataclasses.replace(plan, **_OVERRIDES) if _OVERRIDES else plan


def check_fields(fields: Mapping) -> None:
    """Raises ValueError naming any of `fields` that KernelPlan does not have."""
    names = {f.name for f in dataclasses.fields(KernelPlan)}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise ValueError(f"KernelPlan has no field {', '.join(map(repr, unknown))}; fields: {', '.join(sorted(names))}")


@contextlib.contextmanager
def override(**fields) -> Iterator[None]:
    """Runs the block with these fields replaced in every plan `kernel_plan` returns, then restores
    the previous ones, whatever happens inside."""
    check_fields(fields)
    previous = dict(_OVERRIDES)
    _OVERRIDES.update(fields)
    try:
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(previous)
