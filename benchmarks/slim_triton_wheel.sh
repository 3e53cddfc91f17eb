#!/usr/bin/env bash
# A Triton release small enough to travel to a GPU machine that has no internet (about 51 MB for
# 3.9.0, whose wheel is 286 MB): the wheel's `triton` package and dist-info as a tar.xz, without
# what mok never loads (the AMD backend, CUPTI and the profiler, the instrumentation library, the
# plugins) and with the debug information stripped from libtriton.so. Of the two bundled ptxas it
# keeps the one Triton 3.9 runs for sm_90 and newer (`ptxas-blackwell`, CUDA 13.4), linked as
# `ptxas` too. benchmarks/triton_versions.sh takes the result as TRITON_TARBALL.
#   usage: bash benchmarks/slim_triton_wheel.sh 3.9.0 OUT.tar.xz
set -euo pipefail
version=${1:?Triton version}
out=$(realpath -m "${2:?output .tar.xz}")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$work" "triton==$version"
cd "$work"
python3 -m zipfile -e triton-*.whl pkg
cd pkg
rm -rf triton/backends/amd triton/backends/nvidia/lib/cupti* triton/instrumentation triton/_C/libproton.so \
  triton/plugins triton/FileCheck triton/include
bin=triton/backends/nvidia/bin
if [ -f $bin/ptxas-blackwell ]; then rm -f $bin/ptxas && ln -s ptxas-blackwell $bin/ptxas; fi
strip --strip-unneeded triton/_C/libtriton.so
chmod +x $bin/*
tar cf - triton triton-*.dist-info | xz -9e -T2 > "$out"
ls -la "$out"
