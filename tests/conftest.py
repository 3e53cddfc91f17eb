import contextlib
import zlib

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seeded(request):
    """Draws from torch's default generators (CPU and every CUDA device) start from a seed of the
    test's own id: a failure reproduces in a fresh process and whatever ran before it."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def set_plan():
    """set_plan(**fields): these kernel-plan fields for the rest of the test (`plan.override`);
    a later call wins, and all are undone after the test."""
    from mok.kernels import plan

    with contextlib.ExitStack() as stack:
        yield lambda **fields: stack.enter_context(plan.override(**fields))


@pytest.fixture(autouse=True)
def _fresh_workspaces():
    import mok

    yield
    mok.clear_workspace_cache()


def _kernel_devices():
    """Where Triton kernels can run here: the CPU under TRITON_INTERPRET=1, else CUDA."""
    from mok.kernels.common import interpreting

    if interpreting():
        return ["cpu"]
    return ["cuda"] if torch.cuda.is_available() else []


def pytest_generate_tests(metafunc):
    if "kernel_device" in metafunc.fixturenames:
        devices = _kernel_devices()
        params = devices or [pytest.param("none", marks=pytest.mark.skip(reason="no CUDA and TRITON_INTERPRET unset"))]
        metafunc.parametrize("kernel_device", params)
