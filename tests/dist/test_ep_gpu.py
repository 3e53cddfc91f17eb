"""The triton backend under expert parallelism on GPUs (two ranks, NCCL group), through
both transports: the EP reference's numbers at the bf16 accuracy bars, no host sync, bitwise
the same run to run, across capacities and across transports (both place every row at
the same received position and build the same schedule), through `MoKMoE`; the same in
mxfp8 and fp8_block at their bars (also with both ranks on one GPU, over gloo); and a rank
that skips a call makes the other raise instead of hanging. Skipped without 2 GPUs (the
one-GPU case without a GPU).
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.distributed as dist

import mok
from mok.reference import ep_moe_backward, ep_moe_forward
from mok.testing import assert_close_to_reference, make_inputs, make_topk_ids
from mok.testing.distributed import run_distributed

TRANSPORTS = ("nccl", "symmetric")
MULTIPLIERS = (None, 1.25)
LOW_PRECISIONS = ("mxfp8", "fp8_block")


def _equal_results(a, b) -> bool:
    (out_a, grads_a), (out_b, grads_b) = a, b
    return torch.equal(out_a, out_b) and all(torch.equal(x, y) for x, y in zip(grads_a, grads_b))


def _rank_inputs(rank: int, world_size: int, T: int, H: int, I: int, E_l: int, topk: int, I_s: int, seed: int):
    """This rank's tokens (global expert ids), its E_l routed experts, the shared expert and
    d_out, on its GPU; and the functional API's arguments after the schedule."""
    g = make_inputs(T, H, I, E_l * world_size, topk, I_s, seed=seed, device="cuda", signed_weights=True)
    experts = slice(rank * E_l, (rank + 1) * E_l)
    routed = tuple(w[experts].contiguous() for w in (g.w_gate, g.w_up, g.w_down))
    shared = (g.ws_gate, g.ws_up, g.ws_down)
    d_out = torch.randn(T, H, device="cuda", generator=torch.Generator("cuda").manual_seed(rank)).bfloat16()
    return g, routed, shared, d_out, (g.x, g.topk_weights, *shared, *routed)


def _two_steps(config, group, g, args, d_out, num_local_experts: int, no_host_sync: bool):
    """(two forward + backward results, the error flag, the workspace) on a new workspace,
    after a first step that compiles the kernels; `no_host_sync`: the two under
    set_sync_debug_mode("error")."""
    (num_tokens, hidden), topk = g.x.shape, g.topk_ids.shape[1]
    ws = mok.create_workspace(config, group, device="cuda", num_local_tokens=num_tokens, hidden_size=hidden, topk=topk)

    def step():
        schedule = mok.build_schedule(ws, config, g.topk_ids, num_local_experts=num_local_experts)
        out, ctx = mok.forward(config, ws, schedule, *args)
        return out, mok.backward(config, ws, schedule, ctx, d_out, *args)

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error" if no_host_sync else 0)
    try:
        runs = [step(), step()]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return runs, int(ws.error_flag.item()), ws


def _layer_worker(rank: int, world_size: int) -> list[str]:
    """qwen3-like rank shares (E_l = 16, topk = 8, T = 4096 + 512·rank) plus a shared expert,
    for the exact worst-case capacity (C = 8·T_max) and for multiplier 1.25 (C = 5·T_max
    against about 4·T routes per peer), through each transport. Collectives first,
    comparisons after."""
    torch.cuda.set_device(rank)
    group = dist.group.WORLD
    T, H, I, E_l, topk, I_s = 4096 + 512 * rank, 2048, 768, 16, 8, 512
    g, routed, shared, d_out, args = _rank_inputs(rank, world_size, T, H, I, E_l, topk, I_s, seed=rank)
    results = {}
    for transport in TRANSPORTS:
        for multiplier in MULTIPLIERS:
            config = mok.MoKConfig(backend="triton", schedule_capacity_multiplier=multiplier, transport=transport)
            runs, flags, ws = _two_steps(config, group, g, args, d_out, E_l, no_host_sync=True)
            results[transport, multiplier] = (runs, flags, type(ws.transport).__name__)
    layers = {}
    for transport in TRANSPORTS:
        layer = mok.MoKMoE(H, I, E_l * world_size, topk, I_s, ep_group=group, device="cuda",
                           config=mok.MoKConfig(backend="triton", transport=transport))
        with torch.no_grad():
            for name, w in zip(("w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down"), (*routed, *shared)):
                getattr(layer, name).copy_(w)
        x = g.x.clone().requires_grad_()
        layer(x, g.topk_ids, g.topk_weights).backward(d_out)
        layers[transport] = (x.grad, layer.w_down.grad)
    ref_args = (g.x, g.topk_ids, g.topk_weights, *routed, *shared)
    ref_out = ep_moe_forward(*ref_args, group=group)
    ref = ep_moe_backward(d_out, *ref_args, group=group)

    failures = []
    ctx = f"P={world_size} {rank=} {T=} {H=} {I=} {E_l=} {topk=} {I_s=}"
    first = results[TRANSPORTS[0], None][0][0]
    for (transport, multiplier), (runs, flags, transport_class) in results.items():
        where = f"transport={transport} ({transport_class}) schedule_capacity_multiplier={multiplier} {ctx}"
        (out, grads), again = runs
        try:
            assert transport_class.lower().startswith(transport), f"got the wrong transport {where}"
            assert flags == 0, f"error flag {flags} {where}"
            assert _equal_results(runs[0], again), f"results differ run to run {where}"
            assert _equal_results(runs[0], first), f"results differ from nccl's at the exact capacity {where}"
            assert_close_to_reference(out, ref_out, name="out", context=where)
            for name, got, expected in zip(ref._fields, grads, ref):
                assert_close_to_reference(got, expected, name=name, context=where, check_cosine=True)
        except AssertionError as err:
            failures.append(str(err))
    for transport, (d_x, d_w_down) in layers.items():
        _, grads = results[transport, None][0][0]
        if not (torch.equal(d_x, grads.d_x) and torch.equal(d_w_down, grads.d_w_down)):
            failures.append(f"MoKMoE(ep_group=..., transport={transport}) gradients differ from the functional API's {ctx}")
    return failures



def _assert_no_failures(worker, timeout_s: int, backend: str) -> None:
    """Runs `worker` on two ranks; every message a rank returns is a failure."""
    failures = run_distributed(worker, 2, timeout_s=timeout_s, backend=backend)
    reports = [f"[rank {r}] {msg}" for r, msgs in enumerate(failures) for msg in msgs]
    assert not reports, "\n\n".join(reports)

@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_ep_two_ranks_both_transports():
    _assert_no_failures(_layer_worker, timeout_s=600, backend="nccl")


def _low_precision_worker(rank: int, world_size: int) -> list[str]:
    """mxfp8 and fp8_block under expert parallelism (E_l = 8, topk = 4, T = 2048 + 256·rank,
    a bf16 shared expert) at multiplier 1.25: the EP reference's numbers at the
    low-precision bars (the shared expert's gradients at bf16's), bitwise the same run to
    run. On NCCL, one GPU per rank, through each transport: also no host sync and bitwise
    the same across transports. On gloo both ranks share GPU 0 and exchange through the
    NCCL-fallback transport (gloo stages CUDA tensors through the host, so no sync check), and
    bf16 runs too (on two GPUs `_layer_worker` has it). Each also with the exchanges beside other
    work on a side stream (overlap_comm_sms = 4; bf16 and fp8_block: the gate/up GEMM's own tiles
    before the peers' rows, four a local expert) and the y return beside the down GEMM's own tiles
    (overlap_dispatch_sms = 4, overlap_return_sms = 8): bitwise the same. Collectives first, comparisons
    after."""
    one_gpu = dist.get_backend() == "gloo"
    torch.cuda.set_device(0 if one_gpu else rank)
    transports = ("nccl",) if one_gpu else TRANSPORTS
    group = dist.group.WORLD
    T, H, I, E_l, topk, I_s = 2048 + 256 * rank, 1024, 512, 8, 4, 256
    g, routed, shared, d_out, args = _rank_inputs(rank, world_size, T, H, I, E_l, topk, I_s, seed=10 + rank)
    results = {}
    for precision in (*LOW_PRECISIONS, "bf16") if one_gpu else LOW_PRECISIONS:
        for transport in transports:
            for overlap in (0, 4):
                config = mok.MoKConfig(backend="triton", precision=precision, schedule_capacity_multiplier=1.25,
                                       transport=transport, overlap_comm_sms=overlap,
                                       overlap_dispatch_sms=overlap, overlap_return_sms=2 * overlap)
                results[precision, transport, overlap] = _two_steps(config, group, g, args, d_out, E_l,
                                                                    no_host_sync=not one_gpu)[:2]
    # the reference on the CPU (gloo's collectives take CPU tensors everywhere)
    ref_args = tuple(t.cpu() for t in (g.x, g.topk_ids, g.topk_weights, *routed, *shared))
    ref_out = ep_moe_forward(*ref_args, group=group)
    ref = ep_moe_backward(d_out.cpu(), *ref_args, group=group)

    failures = []
    ctx = f"P={world_size} {rank=} {T=} {H=} {I=} {E_l=} {topk=} {I_s=} {one_gpu=}"
    for (precision, transport, overlap), (runs, flags) in results.items():
        where = f"precision={precision} transport={transport} overlap_comm_sms={overlap} {ctx}"
        (out, grads), again = runs
        try:
            assert flags == 0, f"error flag {flags} {where}"
            assert _equal_results(runs[0], again), f"results differ run to run {where}"
            assert _equal_results(runs[0], results[precision, transports[0], 0][0][0]), \
                f"results differ from the {transports[0]} transport's without overlap {where}"
            assert_close_to_reference(out.cpu(), ref_out, precision, name="out", context=where)
            for name, got, expected in zip(ref._fields, grads, ref):
                bar = "bf16" if name.startswith("d_ws_") else precision  # the shared expert stays bf16
                assert_close_to_reference(got.cpu(), expected, bar, name=name, context=where, check_cosine=True)
        except AssertionError as err:
            failures.append(str(err))
    return failures


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_gpu_ep_two_ranks_low_precisions(backend):
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("one GPU per rank: needs 2 GPUs")
    _assert_no_failures(_low_precision_worker, timeout_s=600, backend=backend)


def _shared_gpu_symmetric_worker(rank: int, world_size: int) -> list[str]:
    """Both ranks on GPU 0 (gloo group) through the symmetric transport, if symmetric memory
    lets two processes share a device (else one message starting "unsupported"): bf16 with a
    shared expert against the EP reference; steps under set_sync_debug_mode("error"), without
    and with the exchanges beside other work (every overlap_*_sms), bitwise the first; and the
    latter captured in a CUDA graph, whose replay gives it again."""
    torch.cuda.set_device(0)
    group = dist.group.WORLD
    T, H, I, E_l, topk, I_s = 512 + 64 * rank, 512, 256, 4, 4, 256
    g, routed, shared, d_out, args = _rank_inputs(rank, world_size, T, H, I, E_l, topk, I_s, seed=20 + rank)
    config = mok.MoKConfig(backend="triton", transport="symmetric")
    overlap = dataclasses.replace(config, overlap_comm_sms=4, overlap_dispatch_sms=4, overlap_return_sms=8)
    try:
        ws = mok.create_workspace(config, group, device="cuda", num_local_tokens=T, hidden_size=H, topk=topk)
    except Exception as err:  # noqa: BLE001 - the answer to "does symmetric memory allow it"
        return [f"unsupported: {type(err).__name__}: {str(err).splitlines()[0]}"]
    ws_overlap = mok.create_workspace(overlap, group, device="cuda", num_local_tokens=T, hidden_size=H, topk=topk)

    def step(config=config, ws=ws):
        schedule = mok.build_schedule(ws, config, g.topk_ids, num_local_experts=E_l)
        out, ctx = mok.forward(config, ws, schedule, *args)
        return out, mok.backward(config, ws, schedule, ctx, d_out, *args)

    first = step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = step()
        beside = step(overlap, ws_overlap)  # exchanges on the side stream, beside the shared expert and the wgrads
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(overlap, ws_overlap)
    graph.replay()
    torch.cuda.synchronize()
    flags = int(ws.error_flag.item()) | int(ws_overlap.error_flag.item())
    ref_args = tuple(t.cpu() for t in (g.x, g.topk_ids, g.topk_weights, *routed, *shared))
    ref_out = ep_moe_forward(*ref_args, group=group)
    ref = ep_moe_backward(d_out.cpu(), *ref_args, group=group)
    where = f"P={world_size} {rank=} {T=} {H=} {I=} {E_l=} {topk=} {I_s=} (both ranks on GPU 0)"
    failures = []
    try:
        assert flags == 0, f"error flag {flags} {where}"
        assert _equal_results(first, again), f"the step under sync debug mode differs from the first {where}"
        assert _equal_results(first, beside), f"the overlaps (4, 8 SMs) differ from none {where}"
        assert _equal_results(first, captured), f"the CUDA graph's replay (with the overlaps) differs {where}"
        out, grads = first
        assert_close_to_reference(out.cpu(), ref_out, name="out", context=where)
        for name, got, expected in zip(ref._fields, grads, ref):
            assert_close_to_reference(got.cpu(), expected, name=name, context=where, check_cosine=True)
    except AssertionError as err:
        failures.append(str(err))
    return failures


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_symmetric_transport_two_ranks_on_one_gpu():
    failures = run_distributed(_shared_gpu_symmetric_worker, 2, timeout_s=600, backend="gloo")
    unsupported = [msg for msgs in failures for msg in msgs if msg.startswith("unsupported")]
    if unsupported:
        pytest.skip(f"symmetric memory does not let two processes share a GPU here: {unsupported[0]}")
    reports = [f"[rank {r}] {msg}" for r, msgs in enumerate(failures) for msg in msgs]
    assert not reports, "\n\n".join(reports)


def _symmetric_bytes_worker(rank: int, world_size: int) -> list[str]:
    """The symmetric transport's own count of the bytes a rank pushes (`peer_bytes`, what the
    benchmark records) against a count from every rank's topk_ids in plain torch: x and dOut
    rows once per (own token, other rank it reaches), y and dx partial rows once per (other
    rank's token reaching this rank), one fp32 per route each way, and the plan's blocks."""
    torch.cuda.set_device(rank)
    group = dist.group.WORLD
    T, H, E_l, topk = 1000 + 100 * rank, 256, 4, 3
    ids = make_topk_ids(T, E_l * world_size, topk, torch.Generator().manual_seed(rank)).cuda()
    config = mok.MoKConfig(backend="triton", transport="symmetric")
    ws = mok.create_workspace(config, group, device="cuda", num_local_tokens=T, hidden_size=H, topk=topk)
    dispatch = mok.build_schedule(ws, config, ids, num_local_experts=E_l).dispatch
    got = dispatch.peer_bytes(H, with_backward=True)
    most = 1000 + 100 * (world_size - 1)
    padded = torch.full((most, topk), -1, dtype=ids.dtype, device="cuda")
    padded[:T] = ids
    every = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(every, padded, group=group)
    out_pairs = in_pairs = out_routes = in_routes = 0
    for source, source_ids in enumerate(every):
        source_ids = source_ids[(source_ids >= 0).all(1)].cpu()
        dest = source_ids // E_l  # [T_source, topk]
        reaches = torch.zeros(dest.shape[0], world_size, dtype=torch.bool).scatter_(1, dest, True)
        if source == rank:
            out_pairs = int(reaches.sum()) - int(reaches[:, rank].sum())
            out_routes = int((dest != rank).sum())
        else:
            in_pairs += int(reaches[:, rank].sum())
            in_routes += int((dest == rank).sum())
    capacity = ws.transport.token_capacity()
    plan_words = -(-(capacity * topk + 1) // 1024) * 1024  # k_l = topk here
    expected = (world_size - 1) * plan_words * 4 + 2 * (out_pairs + in_pairs) * H * 2 + (out_routes + in_routes) * 4
    ctx = f"P={world_size} {rank=} {T=} {H=} {E_l=} {topk=} {out_pairs=} {in_pairs=}"
    return [] if got == expected else [f"peer_bytes {got} != {expected} counted from the ids {ctx}"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_symmetric_peer_bytes_count_once_per_token_and_rank():
    _assert_no_failures(_symmetric_bytes_worker, timeout_s=300, backend="nccl")


def _absent_rank_worker(rank: int, world_size: int) -> tuple[str, float]:
    """Rank 1 creates the workspace but skips the layer call; rank 0 calls it and must get
    a Python error from check_errors within the timeout (plus launch time), not a hang.
    Rank 1 stays alive until then (its memory is the target of rank 0's stores)."""
    torch.cuda.set_device(rank)
    group = dist.group.WORLD
    T, H, I, E_l, topk = 256, 256, 128, 2, 2
    config = mok.MoKConfig(backend="triton", transport="symmetric", peer_timeout_s=2.0)
    ws = mok.create_workspace(config, group, device="cuda", num_local_tokens=T, hidden_size=H, topk=topk)
    message, seconds = "", 0.0
    if rank == 0:
        g = make_inputs(T, H, I, E_l * world_size, topk, 0, seed=0, device="cuda")
        routed = tuple(w[:E_l].contiguous() for w in (g.w_gate, g.w_up, g.w_down))
        start = time.monotonic()
        schedule = mok.build_schedule(ws, config, g.topk_ids, num_local_experts=E_l)
        mok.forward(config, ws, schedule, g.x, g.topk_weights, None, None, None, *routed)
        try:
            mok.check_errors(ws)
        except RuntimeError as err:
            message = str(err)
        seconds = time.monotonic() - start
    dist.barrier()
    return message, seconds


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_absent_rank_raises_instead_of_hanging():
    (message, seconds), _ = run_distributed(_absent_rank_worker, 2, timeout_s=120, backend="nccl")
    assert "did not arrive" in message, f"rank 0 got {message!r}"
    assert seconds < 60, f"rank 0 raised after {seconds:.1f} s"
