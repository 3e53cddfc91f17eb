"""Expert-parallel row moves on their own: GB/s of dispatch (x rows out) and combine
(y rows back) per transport and number of communication programs. Run under torchrun:

    torchrun --nproc-per-node 2 benchmarks/bench_dispatch.py [--preset qwen3-30b] [--programs 8,16,32,64]

Per rank: the preset's T tokens, E/P local experts, uniform random routing (seed + rank),
multiplier 1.25 capacity. One plan per transport, then `dispatch(x)` and `combine(y)`
each timed alone (CUDA events around `reps` back-to-back calls, after a barrier; the
slowest rank's time). GB/s per direction counts the bytes of the rows that go to the
other ranks (one per (token, other rank holding one of its experts), H bf16 each), the
same for both transports, though the NCCL transport moves its whole capacity C per peer.
Before the timing, the rows that come back are checked against x.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

import mok
from mok.bench.presets import PRESETS
from mok.testing import make_topk_ids
from mok.testing.timing import back_to_back_ms


def _time_ms(fn, reps: int, group) -> float:
    """The slowest rank's mean time of one call over `reps` back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    dist.barrier(group)
    ms = torch.tensor([back_to_back_ms(fn, reps=reps, device="cuda")], device="cuda")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
    return float(ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3-30b", choices=sorted(PRESETS))
    parser.add_argument("--programs", default="8,16,32,64", help="communication programs (num_comm_sms) to time")
    parser.add_argument("--transports", default="symmetric,nccl")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", help="JSON record to write (rank 0)")
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    group = dist.group.WORLD
    preset = PRESETS[args.preset]
    T, H, E, topk = preset.num_tokens, preset.hidden_size, preset.num_experts, preset.topk
    E_l = E // world_size
    gen = torch.Generator().manual_seed(rank)
    topk_ids = make_topk_ids(T, E, topk, gen).cuda()
    x = torch.randn(T, H, generator=gen).bfloat16().cuda()
    weights = torch.rand(T, topk, generator=gen).cuda()
    reaches = torch.zeros(T, world_size, dtype=torch.bool, device="cuda").scatter_(1, topk_ids // E_l, True)
    remote_rows = int(reaches.sum()) - int(reaches[:, rank].sum())
    remote_bytes = remote_rows * H * 2
    results = []
    for transport in args.transports.split(","):
        for programs in map(int, args.programs.split(",")):
            config = mok.MoKConfig(schedule_capacity_multiplier=1.25, transport=transport,
                                   fwd_num_comm_sms=programs, bwd_num_comm_sms=programs)
            ws = mok.create_workspace(config, group, device="cuda", num_local_tokens=T, hidden_size=H, topk=topk)
            dispatch = mok.build_schedule(ws, config, topk_ids, num_local_experts=E_l).dispatch
            received, _ = dispatch.dispatch(x, weights)
            y_rows = torch.randn(received.shape, generator=gen).bfloat16().cuda()
            # check: the received rows sent back land at their (token, rank) pairs' rows as x's rows
            back = dispatch.combine(received.clone())
            pairs = (dispatch.token_slot >= 0).nonzero().flatten()
            rows = dispatch.token_slot[pairs].long()
            ok = bool(torch.equal(back[rows], x[pairs // world_size])) and int(ws.error_flag) == 0
            dispatch_ms = _time_ms(lambda: dispatch.dispatch(x, weights), args.reps, group)
            combine_ms = _time_ms(lambda: dispatch.combine(y_rows), args.reps, group)
            row = dict(transport=type(ws.transport).__name__, programs=programs, remote_rows=remote_rows,
                       dispatch_ms=dispatch_ms, dispatch_gbps=remote_bytes / dispatch_ms / 1e6,
                       combine_ms=combine_ms, combine_gbps=remote_bytes / combine_ms / 1e6, round_trip_ok=ok)
            results.append(row)
            if rank == 0:
                print(f"{row['transport']:>18} programs {programs:>3}: dispatch {dispatch_ms:6.3f} ms "
                      f"{row['dispatch_gbps']:6.1f} GB/s, combine {combine_ms:6.3f} ms {row['combine_gbps']:6.1f} GB/s, "
                      f"round trip {'ok' if ok else 'WRONG'}", flush=True)
            del ws, dispatch, received, y_rows, back
            mok.clear_workspace_cache()
            if transport == "nccl":
                break  # NCCL picks its own channels: the programs do not apply
    if rank == 0 and args.out:
        record = dict(gpu=torch.cuda.get_device_name(), num_gpus=world_size, torch=torch.__version__,
                      date=datetime.date.today().isoformat(),
                      triton=__import__("triton").__version__, preset=args.preset, tokens=T, hidden=H, experts=E,
                      topk=topk, remote_bytes_per_rank=remote_bytes,
                      command=f"torchrun --nproc-per-node {world_size} benchmarks/bench_dispatch.py {' '.join(sys.argv[1:])}",
                      results=results)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
