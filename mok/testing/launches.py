"""Which Triton and Gluon kernels a block of code launches, and how: for tests that must show a
kernel-plan choice changed something (a test whose two sides run the same kernels would pass
without testing the choice).

`recorded_launches()` is a context manager that collects every `kernel[grid](...)` launched in
its block, compiled or under the interpreter, as a Counter of `Launch`es: the kernel's name, its
grid, its constexpr arguments and launch options, and the dtype of each tensor argument (so a
product kept in fp32 rather than bf16 shows). Sizes and pointers passed as plain integers are left
out: they follow the inputs, not the plan."""

from __future__ import annotations

import collections
import contextlib
import inspect
from collections.abc import Iterator
from typing import NamedTuple
from unittest import mock

import torch
from triton.runtime.jit import KernelInterface

__all__ = ["Launch", "recorded_launches"]


class Launch(NamedTuple):
    kernel: str
    grid: tuple | str  # "callable" for a grid computed from the arguments
    arguments: tuple[tuple[str, str], ...]  # (name, what it was) of the arguments that choose how it runs


def _is_constexpr(annotation: object) -> bool:
    return "constexpr" in (getattr(annotation, "__name__", None) or str(annotation))


def _described(value: object) -> str:
    """A tensor by its dtype, a TMA descriptor by its block and its tensor's dtype, else repr."""
    if isinstance(value, torch.Tensor):
        return str(value.dtype)
    if hasattr(value, "block_shape"):  # triton's and Gluon's TensorDescriptor
        base = getattr(value, "base", None)
        return f"descriptor{list(value.block_shape)} {getattr(base, 'dtype', '')}"
    return repr(value)


def _launch(kernel: KernelInterface, grid: object, args: tuple, kwargs: dict) -> Launch:
    fn = kernel.fn
    signature = inspect.signature(fn)
    bound = signature.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in signature.parameters})
    described = []
    for name, value in bound.arguments.items():
        choosing = _is_constexpr(signature.parameters[name].annotation)
        if choosing or isinstance(value, torch.Tensor) or hasattr(value, "block_shape"):
            described.append((name, _described(value)))
    described += [(name, repr(value)) for name, value in kwargs.items() if name not in signature.parameters]
    return Launch(fn.__name__, "callable" if callable(grid) else tuple(grid), tuple(sorted(described)))


@contextlib.contextmanager
def recorded_launches() -> Iterator[collections.Counter]:
    """The launches of the block, counted, in the Counter it yields (filled as they happen)."""
    launches: collections.Counter = collections.Counter()
    launch_with = KernelInterface.__getitem__

    def recording(kernel, grid):
        run = launch_with(kernel, grid)

        def launch(*args, **kwargs):
            launches[_launch(kernel, grid, args, kwargs)] += 1
            return run(*args, **kwargs)

        return launch

    with mock.patch.object(KernelInterface, "__getitem__", recording):
        yield launches
