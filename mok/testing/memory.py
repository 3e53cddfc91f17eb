"""GPU memory helpers for tests."""

import torch

# Left to the driver: kernel launches and library workspaces need device memory of their own.
_DRIVER_RESERVE_BYTES = 2 << 30
# Allocations of up to 1 MiB come from the allocator's pool of small blocks, which a large
# block does not serve: this much of it is taken and poisoned as 1 MiB blocks.
_SMALL_POOL_BYTES = 512 << 20


def poison_free_memory(value: float) -> None:
    """Fill the memory the CUDA caching allocator will hand out next with `value` (as fp32):
    every block it holds free, a share of small blocks, and all the device memory it could still
    take but a reserve for the driver. Within one process the allocator hands a step the blocks
    the previous step freed, stale bytes that a kernel reading memory no one wrote would see the
    same each time; after this, such a read shows as a changed (or NaN) result."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # a tensor of a free block's exact size takes that block (the allocator picks the best fit)
    sizes = [block["size"] for segment in torch.cuda.memory_snapshot() for block in segment["blocks"]
             if block["state"] == "inactive"]
    sizes.sort(reverse=True)  # whole blocks first: a smaller request could split a larger block
    junk = [torch.empty(size // 4, device="cuda") for size in sizes]
    junk += [torch.empty((1 << 20) // 4, device="cuda") for _ in range(_SMALL_POOL_BYTES >> 20)]
    numel = max(torch.cuda.mem_get_info()[0] - _DRIVER_RESERVE_BYTES, 0) // 4
    while numel >= 128:
        try:
            junk.append(torch.empty(numel, device="cuda"))
            break
        except torch.OutOfMemoryError:
            numel //= 2
    for tensor in junk:
        tensor.fill_(value)
    del junk
