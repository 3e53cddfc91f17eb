#!/usr/bin/env bash
# mok under a second Triton release beside the installed one, on one GPU machine.
#   usage: TRITON_TARBALL=path.tar.xz bash benchmarks/triton_versions.sh STEP...
#   STEPS: tests  the GPU suite under the second release (six pytest processes side by side);
#          base-tests  the same under the installed release (alone: no tarball needed);
#          rerun  RERUN_TESTS (pytest arguments) under the second release;
#          ws-tests  its Gluon kernels' GPU tests alone;
#          bench  the layer under both releases in alternating processes (BENCH_ARGS, ROUNDS),
#                 then one record of both with the ratios (benchmarks/compare_runs.py).
# TRITON_TARBALL holds a release's `triton` package folder (and its dist-info), e.g. a wheel's
# contents less what mok does not use (the AMD backend, CUPTI), so that it fits a device call.
# Writes logs and records under $OUT (or ./bench_out).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
SITE=/tmp/triton-other
base() { PYTHONPATH=$PWD TRITON_CACHE_DIR=/tmp/triton-cache-base "$@"; }
other() { PYTHONPATH=$SITE:$PWD TRITON_CACHE_DIR=/tmp/triton-cache-other "$@"; }
runs=base
if [ "$*" != base-tests ]; then  # every other step runs the second release
  if [ ! -d $SITE/triton ]; then
    mkdir -p $SITE && tar xJf "${TRITON_TARBALL:?name a tarball of the second Triton}" -C $SITE || exit 1
  fi
  for backend in amd nvidia; do  # backends the tarball left out are not to be discovered
    [ -d $SITE/triton/backends/$backend ] || sed -i "/triton.backends.$backend/d" $SITE/triton-*.dist-info/entry_points.txt
  done
  runs="base other"
fi
for run in $runs; do
  $run python3 -c "import torch, triton; print('$run: torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$OUT/versions.txt"
done
T=${STEP_TIMEOUT:-540}
# The GPU suite in six pytest processes side by side (compiling dominates; one process per
# group keeps each group inside a call's limit).
suite() {
  local run=$1 name=$2 args="-q -p no:cacheprovider -rfE"
  $run timeout $T python3 -m pytest $args tests/kernels/test_warp_specialized.py tests/kernels/test_gluon_api.py \
    -k "not compile" > "$OUT/$name-g1.log" 2>&1 &
  $run timeout $T python3 -m pytest $args tests/test_triton_backward.py tests/test_gpu_forward.py > "$OUT/$name-g2.log" 2>&1 &
  $run timeout $T python3 -m pytest $args tests/kernels/test_dgrad.py tests/kernels/test_wgrad.py > "$OUT/$name-g3.log" 2>&1 &
  $run timeout $T python3 -m pytest $args tests/kernels --ignore=tests/kernels/test_warp_specialized.py \
    --ignore=tests/kernels/test_gluon_api.py --ignore=tests/kernels/test_dgrad.py --ignore=tests/kernels/test_wgrad.py \
    > "$OUT/$name-g4.log" 2>&1 &
  $run timeout $T python3 -m pytest $args tests --ignore=tests/kernels --ignore=tests/dist \
    --ignore=tests/test_triton_backward.py --ignore=tests/test_gpu_forward.py > "$OUT/$name-g5.log" 2>&1 &
  $run timeout $T python3 -m pytest $args -rs tests/dist/test_ep_gpu.py > "$OUT/$name-g6.log" 2>&1 &
  wait
  for g in 1 2 3 4 5 6; do echo "-- $name g$g"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/$name-g$g.log" | tail -12; done
}
for step in "$@"; do
  echo "== $step ($(date +%T))"
  case $step in
    tests|base-tests)  # tests: under the second release; base-tests: under the installed one
      run=other; [ $step = base-tests ] && run=base
      suite $run $step ;;
    rerun)  # RERUN_TESTS under the second release
      other timeout $T python3 -m pytest -q -p no:cacheprovider -rfE $RERUN_TESTS > "$OUT/rerun.log" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/rerun.log" | tail -12 ;;
    ws-tests)
      other timeout $T python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_warp_specialized.py \
        tests/kernels/test_gluon_api.py -k "not compile" 2>&1 | tail -15 | tee "$OUT/ws-tests.log" ;;
    bench)
      for round in $(seq ${ROUNDS:-2}); do
        for run in base other; do
          $run timeout $T python3 -m mok.bench ${BENCH_ARGS:---preset qwen3-30b,deepseek-v3-slice --pass fwd+bwd \
            --precision bf16,fp8_block --impl mok --rounds 2} --no-plot --out "$OUT/$run-$round" \
            > "$OUT/bench-$run-$round.log" 2>&1
          tail -8 "$OUT/bench-$run-$round.log"
        done
      done
      version() { $1 python3 -c "import triton; print('triton', triton.__version__)"; }
      python3 benchmarks/compare_runs.py "$OUT" --what triton-versions --labels "$(version base)" "$(version other)" \
        --command "TRITON_TARBALL=... bash benchmarks/triton_versions.sh $*" ;;
    *) echo "unknown step $step" ;;
  esac
done
