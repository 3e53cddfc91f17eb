"""`MoKConfig`: the knobs of a mok layer, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass

PRECISIONS = ("bf16", "mxfp8", "fp8_block")
BACKENDS = ("auto", "triton", "reference")
TRANSPORTS = ("auto", "symmetric", "nccl")

# Rows a precision needs H and I to be multiples of.
SIZE_ALIGNMENT = {"bf16": 8, "mxfp8": 32, "fp8_block": 128}


@dataclass(frozen=True)
class MoKConfig:
    """How a mok layer runs. Frozen and hashable, so it can key workspace caches.

    precision: "bf16" | "mxfp8" | "fp8_block".
    backend: "triton" (fused GPU kernels), "reference" (pure PyTorch, any device), or
        "auto": triton where it supports the call (CUDA tensors), else reference.
    fwd_num_comm_sms / bwd_num_comm_sms: programs of the symmetric transport's push kernels
        in the forward / backward exchanges (32 reach ~90% of NVLink for peer stores on H200).
    overlap_comm_sms: 0, or the SMs an exchange gets while the layer's independent work runs
        beside it on another stream: under expert parallelism the x rows' dispatch beside the
        shared expert's forward, the dOut rows' dispatch beside the shared expert's backward and
        the backward's copies that need no dOut, and the dx rows' return beside the routed
        experts' weight gradients. Those pushes (symmetric transport) then run on that many
        programs, and persistent GEMMs leave that many SMs free meanwhile (a persistent grid
        holds every SM to its end); beside the copies alone (no shared expert) the dOut dispatch
        keeps bwd_num_comm_sms programs. The GEMMs slow by about overlap_comm_sms / SMs while the
        exchange hides; `benchmarks/ep_model.py --overlap-sms` predicts the balance. 0 (the
        default, until measured on two GPUs): each exchange finishes before the next work starts.
    overlap_dispatch_sms / overlap_return_sms: the same for the x rows' dispatch beside the
        gate/up GEMM's tiles of the rank's own tokens too (with the shared expert's forward; where
        the precision's gate/up GEMM reads the received rows as they came: bf16, fp8_block), and
        for the partial y rows' return beside the down GEMM's own tiles (the others' run first).
        Each runs its GEMM in two launches, which as measured on one H200 costs about what it
        hides (docs/expert-parallelism.md); their own counts, because the work beside them is
        short (1/P of a GEMM). 0 (the default, until measured on two GPUs): one launch.
    schedule_capacity_multiplier: worst-case share of all routes one rank may receive,
        relative to an even split; sizes buffers and grids without a host sync. None means
        the exact worst case (every route of every rank to one rank), which never overflows.
        The nccl transport applies it per pair of ranks: each rank may send each peer
        ⌈receive_capacity / P⌉ rows, and never more than T·min(topk, E_l), the most
        routes one rank can have to one peer.
    strict: check device-side error flags (capacity overflow, bad expert ids) right after
        each call, at the cost of a host sync; otherwise they are raised by `check_errors`.
    transport: how the triton backend moves rows between expert-parallel ranks:
        "symmetric" (peer stores into symmetric memory over NVLink, one host), "nccl"
        (`torch.distributed` collectives, any process group) or "auto" (symmetric where
        every GPU of the group can reach its peers' memory, else nccl).
    peer_timeout_s: how long a device-side wait for a peer rank spins before it gives up
        with an error (symmetric transport): a rank that never arrives becomes a Python
        error from `check_errors`, not a hang.
    """

    precision: str = "bf16"
    backend: str = "auto"
    fwd_num_comm_sms: int = 32
    bwd_num_comm_sms: int = 32
    overlap_comm_sms: int = 0
    overlap_dispatch_sms: int = 0
    overlap_return_sms: int = 0
    schedule_capacity_multiplier: float | None = None
    strict: bool = False
    transport: str = "auto"
    peer_timeout_s: float = 30.0

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision: expected one of {PRECISIONS}, got {self.precision!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {self.backend!r}")
        for name in ("fwd_num_comm_sms", "bwd_num_comm_sms"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        for name in ("overlap_comm_sms", "overlap_dispatch_sms", "overlap_return_sms"):
            overlap = getattr(self, name)
            if not isinstance(overlap, int) or isinstance(overlap, bool) or overlap < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {overlap!r}")
        multiplier = self.schedule_capacity_multiplier
        if multiplier is not None and (
            not isinstance(multiplier, (int, float)) or isinstance(multiplier, bool) or not multiplier >= 1.0
        ):
            raise ValueError(f"schedule_capacity_multiplier: expected None or a number >= 1, got {multiplier!r}")
        if not isinstance(self.strict, bool):
            raise TypeError(f"strict: expected a bool, got {type(self.strict).__name__}")
        timeout = self.peer_timeout_s
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout <= 3600:
            raise ValueError(f"peer_timeout_s: expected a number of seconds in (0, 3600], got {timeout!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport: expected one of {TRANSPORTS}, got {self.transport!r}")

    def receive_capacity(self, num_local_tokens: int, topk: int, world_size: int) -> int:
        """Most routes (token rows) one rank may receive in one pass."""
        routes_per_rank = num_local_tokens * topk
        if self.schedule_capacity_multiplier is None:
            return routes_per_rank * world_size
        return min(routes_per_rank * world_size, int(routes_per_rank * self.schedule_capacity_multiplier))
