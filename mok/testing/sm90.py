"""Gluon and Triton kernels compiled for Hopper (sm_90a) on any machine, GPU or not: ptxas's
register and spill counts, for tests that guard a kernel's resource use where no Hopper GPU runs
them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

__all__ = ["gluon_ptxas_report", "triton_ptxas_report"]

# Compiles one kernel for sm_90a and writes its PTX. It runs in a fresh process: kernels run
# under the interpreter earlier in a test session leave Triton's language module patched in ways
# that break a later compile in the same process.
_COMPILE_FOR_SM90A = """
import importlib, json, sys
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource
module, name, signature, constants, aligned, options, gluon, ptx_path = json.loads(sys.argv[1])
attrs = {(list(signature).index(arg),): [["tt.divisibility", 16]] for arg in aligned}
source = (GluonASTSource if gluon else ASTSource)(getattr(importlib.import_module(module), name), signature,
                                                  constants, attrs)
with open(ptx_path, "w") as f:
    f.write(compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"])
"""


def gluon_ptxas_report(
    module: str, kernel_name: str, signature: dict, constants: dict, aligned: tuple[str, ...] = (), num_warps: int = 4
) -> tuple[int, int]:
    """(registers per thread, spilled bytes) of the Gluon kernel `module.kernel_name` compiled
    for sm_90a, without a GPU, whose wgmma (if any) ptxas did not serialize; `signature` maps
    each argument to its Triton type ("constexpr" for those in `constants`), `aligned` names
    the arguments compiled as multiples of 16 (as a launch specializes them when they are)."""
    return _ptxas_report(module, kernel_name, signature, constants, aligned, {"num_warps": num_warps}, True)


def triton_ptxas_report(
    module: str, kernel_name: str, signature: dict, constants: dict, aligned: tuple[str, ...] = (),
    num_warps: int = 4, num_stages: int = 3,
) -> tuple[int, int]:
    """`gluon_ptxas_report` for a Triton (`@triton.jit`) kernel, compiled with `num_stages`."""
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return _ptxas_report(module, kernel_name, signature, constants, aligned, options, False)


def _ptxas_report(module: str, kernel_name: str, signature: dict, constants: dict, aligned: tuple[str, ...],
                  options: dict, gluon: bool) -> tuple[int, int]:
    from triton.backends.nvidia.compiler import get_ptxas

    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        argument = json.dumps([module, kernel_name, signature, constants, list(aligned), options, gluon, ptx])
        compiled = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90A, argument], capture_output=True, text=True,
                                  env=env)
        assert compiled.returncode == 0, f"compiling {kernel_name} failed:\n{compiled.stderr[-3000:]}"
        # The ptxas Triton itself uses (TRITON_PTXAS_PATH may name a newer one): the PTX's ISA version follows it.
        ptxas = get_ptxas(90).path
        result = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", os.devnull], capture_output=True, text=True)
    assert result.returncode == 0, f"{ptxas} failed:\n{result.stderr}"
    report = result.stderr
    # C7514: ptxas serializes the kernel's wgmma (a register of one read while it runs)
    assert "C7514" not in report, f"{kernel_name}: {report}"
    return int(re.search(r"Used (\d+) registers", report)[1]), int(re.search(r"(\d+) bytes spill stores", report)[1])
