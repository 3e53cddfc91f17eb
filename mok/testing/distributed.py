"""Run a function on N local processes joined in a process group, for multi-rank tests.

    results = run_distributed(fn, world_size, *args)   # fn(rank, world_size, *args) in every rank

Each rank is a new process that inherits no state or threads from the caller: by default
a fork of multiprocessing's 'forkserver', a single-threaded server that imports torch once
per caller process (importing torch costs seconds of CPU, which 'spawn' would pay for every
rank of every call); `start_method="spawn"` gives fully fresh interpreters. The ranks join
through a FileStore in a private temporary directory (no TCP port to pick, so concurrent
test runs cannot collide) into a default process group (gloo unless `backend` says otherwise).
`fn` and `args` must be picklable: a module-level function, tensors, numbers. What `fn`
returns comes back per rank, pickled (tensors as plain copies).

Failures never hang the caller: an exception in any rank, a rank that dies without
reporting, or a run past `timeout_s` stops every rank and raises `RuntimeError` with
each failed rank's traceback. The collectives themselves time out after `timeout_s` too,
so a rank waiting on a dead peer ends on its own. Children run one intra-op thread each
(CI machines have few cores and N processes share them).
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_lib
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_distributed"]

# Seconds the parent keeps collecting reports after the first failure, so that the
# tracebacks of ranks failing at about the same time (often the real cause) are shown too.
_FAILURE_GRACE_S = 3.0


def _child(
    fn: Callable, rank: int, world_size: int, init_file: str, backend: str, timeout_s: float, args: tuple, reports
) -> None:
    """Body of one rank: join the group, run fn, report (rank, ok, pickled result or traceback)."""
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        reports.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 -- any failure, including SystemExit, must reach the parent
        reports.put((rank, False, traceback.format_exc()))


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    backend: str = "gloo",
    start_method: str = "forkserver",
) -> list[Any]:
    """Runs fn(rank, world_size, *args) on `world_size` processes; returns their results by rank.

    Raises RuntimeError naming the failed ranks, with their tracebacks, if any rank raises,
    dies, or the whole run takes longer than `timeout_s` seconds (process start included).
    """
    if world_size < 1:
        raise ValueError(f"world_size: expected ≥ 1, got {world_size}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # The server imports torch once per parent process; every rank is then a fork of it.
        ctx.set_forkserver_preload(["torch", "torch.distributed", __name__])
    reports = ctx.Queue()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    exited_at: dict[int, float] = {}  # rank -> when its process was first seen exited
    with tempfile.TemporaryDirectory(prefix="mok_dist_") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_child,
                args=(fn, rank, world_size, init_file, backend, timeout_s, args, reports),
                name=f"mok-rank{rank}",
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        try:
            while len(results) + len(failures) < world_size:
                now = time.monotonic()
                if failures:
                    deadline = min(deadline, now + _FAILURE_GRACE_S)
                if now > deadline:
                    if not failures:
                        late = [r for r in range(world_size) if r not in results]
                        failures.update({r: f"no report within timeout_s={timeout_s}" for r in late})
                    break
                try:
                    rank, ok, payload = reports.get(timeout=0.1)
                except queue_lib.Empty:
                    # A rank that died without reporting (segfault, os._exit, killed) is a failure;
                    # wait a moment after its exit, as its report may still be in the pipe.
                    for rank, p in enumerate(procs):
                        if p.exitcode is not None and rank not in results and rank not in failures:
                            exited_at.setdefault(rank, now)
                            if now - exited_at[rank] > 1.0:
                                failures[rank] = f"process exited with code {p.exitcode} without a report"
                    continue
                if ok:
                    results[rank] = pickle.loads(payload)
                else:
                    failures[rank] = payload
        finally:
            for p in procs:
                p.join(timeout=5.0 if not failures else 0.5)
            for p in procs:
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=5.0)
                if p.is_alive():
                    p.kill()
                    p.join()
            reports.close()
    if failures:
        # In the order the failures arrived: the first is usually the cause, later ones its echoes
        # (e.g. "Connection closed by peer" in ranks that were waiting on the failed one).
        details = "\n".join(f"--- rank {r} ---\n{msg.rstrip()}" for r, msg in failures.items())
        raise RuntimeError(
            f"run_distributed({getattr(fn, '__qualname__', fn)}, world_size={world_size}): "
            f"{len(failures)} rank(s) failed: {sorted(failures)}, first rank {next(iter(failures))}\n{details}"
        )
    return [results[r] for r in range(world_size)]
