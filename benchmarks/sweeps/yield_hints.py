"""The scheduler's yield hint on the scaling FFMA/FMUL of the fp8 warp-specialized GEMMs (not kept:
BENCHMARKS.md, "Tried: the scheduler's yield hint"). A Triton stages hook rewrites the control bits of the
compiled cubins of the three kernels before the driver loads them, and clears the operand-reuse flags that a
yield invalidates; hint bits only, so the results are bitwise the same.

    python benchmarks/sweeps/yield_hints.py MODE [PRESET] [ITERS]     MODE: off, alt, all, ffma-alt, ffma-all

profiles the preset's fp8_block forward+backward (benchmarks/profile_layer.py) with the kernels so patched,
in a Triton cache of its own (the cache key does not see the patch): one mode per process.

Control bits of an sm_90 instruction: the high 64-bit word, bits 41-44 the stall count, bit 45 the yield
flag (0 = yield), bits 58-61 operand reuse.
"""
import os
import re
import struct
import subprocess
import tempfile

from triton import knobs

YIELD_BIT = 1 << 45
REUSE_BITS = 0xF << 58
# a cuobjdump -sass line: /*offset*/ [@predicate] OPCODE ...
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(\S+)")


def _text_section(cubin: bytes, kernel: str) -> int:
    """File offset of .text.<kernel> in an ELF64 cubin."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    def header(i):  # (name's offset in the section-name table, the section's file offset)
        name, _, _, _, offset = struct.unpack_from("<IIQQQ", cubin, shoff + i * shentsize)
        return name, offset
    _, strtab = header(shstrndx)
    for i in range(shnum):
        name, offset = header(i)
        end = cubin.index(b"\0", strtab + name)
        if cubin[strtab + name:end].decode() == f".text.{kernel}":
            return offset
    raise KeyError(kernel)


def _instructions(cubin: bytes) -> list[tuple[int, str]]:
    """(offset in its function, opcode) of every instruction of the cubin (one kernel per cubin)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    out = []
    for line in sass.splitlines():
        match = _LINE.search(line)
        if match:
            op = match.group(2)
            if op.startswith("@"):  # predicated: the opcode follows
                op = line.split(op)[1].split()[0]
            out.append((int(match.group(1), 16), op))
    return out


def patch(cubin: bytes, kernel: str, mode: str) -> tuple[bytes, int]:
    """mode 'alt': every other FFMA/FMUL yields; 'all': every one; 'ffma-alt': FFMA only, every other."""
    base = _text_section(cubin, kernel)
    ops = ("FFMA",) if mode.startswith("ffma") else ("FFMA", "FMUL")
    every = 2 if mode.endswith("alt") else 1
    data = bytearray(cubin)
    seen = changed = 0
    for offset, op in _instructions(cubin):
        if op.split(".")[0] not in ops:
            continue
        seen += 1
        if seen % every:
            continue
        at = base + offset + 8
        high, = struct.unpack_from("<Q", data, at)
        new = (high & ~YIELD_BIT) & ~REUSE_BITS
        if new != high:
            struct.pack_into("<Q", data, at, new)
            changed += 1
    return bytes(data), changed


KERNELS = ("_scatter_ws_kernel", "_gathered_ws_kernel", "_wgrad_ws_kernel")


def install(mode: str, kernels=KERNELS) -> None:
    """Patch every compile of `kernels` from now on (use a fresh TRITON_CACHE_DIR)."""
    def hook(backend, stages, options, language, capability):
        make = stages["cubin"]

        def make_patched(src, metadata):
            cubin = make(src, metadata)
            if metadata.get("name") in kernels:
                cubin, changed = patch(cubin, metadata["name"], mode)
                print(f"yield_hints {mode}: {metadata['name']}: {changed} instructions", flush=True)
            return cubin
        stages["cubin"] = make_patched
    knobs.runtime.add_stages_inspection_hook = hook


def main() -> None:
    import argparse
    import shutil
    import sys

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["off", "alt", "all", "ffma-alt", "ffma-all"])
    parser.add_argument("preset", nargs="?", default="qwen3-30b")
    parser.add_argument("iters", nargs="?", type=int, default=20)
    args = parser.parse_args()
    if args.mode != "off":
        # the unpatched cache, less the kernels the patch changes
        base, cache = os.path.expanduser("~/.triton/cache"), tempfile.mkdtemp(prefix=f"triton-{args.mode}-")
        if os.path.isdir(base):
            shutil.copytree(base, cache, dirs_exist_ok=True)
            for entry in os.listdir(cache):
                if any(name.startswith(KERNELS) for name in os.listdir(os.path.join(cache, entry))):
                    shutil.rmtree(os.path.join(cache, entry))
        os.environ["TRITON_CACHE_DIR"] = cache
        install(args.mode)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import profile_layer

    profile_layer.profile_layer(argparse.Namespace(preset=args.preset, precision="fp8_block", backward=True,
                                                   iters=args.iters, registers=False))


if __name__ == "__main__":
    main()
