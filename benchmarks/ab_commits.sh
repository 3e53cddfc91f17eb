#!/usr/bin/env bash
# mok at an earlier commit beside the working tree, in alternating processes on one GPU, and one
# record of both with the ratios (benchmarks/compare_runs.py).
#   here:             bash benchmarks/ab_commits.sh prepare COMMIT   (its mok/ into .ab/base; keep .ab
#                     out of git, e.g. in .git/info/exclude)
#   on a GPU machine: bash benchmarks/ab_commits.sh run              (carry .ab)
# Each of ROUNDS (default 2) rounds runs, per tree, one bench process per argument set in BENCH_SETS
# (separated by ';'), after a warm-up process on each tree (WARMUP_ARGS, default the first set: compiles
# kernels, brings the GPU to its working clocks; not recorded; WARMUP=0 skips it). Writes the record and
# runs.tar.gz (every log and per-run record) under $OUT (or ./bench_out).
set -uo pipefail
case ${1:-} in
  prepare)
    rm -rf .ab && mkdir -p .ab/base
    git archive "${2:?name the base commit}" mok | tar -x -C .ab/base
    git rev-parse --short "$2" > .ab/base_commit
    echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- mok || echo +changes)" > .ab/other_commit
    echo "base $(cat .ab/base_commit), other $(cat .ab/other_commit)" ;;
  run)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
    unset TRITON_INTERPRET
    OUT=${OUT:-bench_out}
    mkdir -p "$OUT"
    SETS=${BENCH_SETS:-"--preset qwen3-30b,deepseek-v3-slice,mixtral-8x7b --precision bf16,fp8_block;--preset qwen3-30b --precision mxfp8"}
    base() { PYTHONPATH=$PWD/.ab/base TRITON_CACHE_DIR=/tmp/triton-cache-base "$@"; }
    other() { PYTHONPATH=$PWD TRITON_CACHE_DIR=/tmp/triton-cache-other "$@"; }
    if [ "${WARMUP:-1}" != 0 ]; then
      for run in base other; do
        echo "== warm-up $run ($(date +%T))"
        $run timeout ${STEP_TIMEOUT:-400} python3 -m mok.bench ${WARMUP_ARGS:-${SETS%%;*}} --pass fwd+bwd --impl mok --rounds 1 \
          --no-plot --no-write > "$OUT/warmup-$run.log" 2>&1 || tail -5 "$OUT/warmup-$run.log"
      done
    fi
    for round in $(seq ${ROUNDS:-2}); do
      for run in base other; do
        IFS=';' read -ra sets <<< "$SETS"
        for i in "${!sets[@]}"; do
          echo "== round $round $run set $i ($(date +%T))"
          $run timeout ${STEP_TIMEOUT:-400} python3 -m mok.bench ${sets[$i]} --pass fwd+bwd --impl mok --rounds 2 \
            --no-plot --out "$OUT/$run-$round" > "$OUT/bench-$run-$round-$i.log" 2>&1
          tail -${TAIL:-4} "$OUT/bench-$run-$round-$i.log"
        done
      done
    done
    python3 benchmarks/compare_runs.py "$OUT" --what ab-commits \
      --labels "$(cat .ab/base_commit)" "$(cat .ab/other_commit)" \
      --command "bash benchmarks/ab_commits.sh prepare $(cat .ab/base_commit) && ROUNDS=${ROUNDS:-2} \
${WARMUP_ARGS:+WARMUP_ARGS=\"$WARMUP_ARGS\" }${BENCH_SETS:+BENCH_SETS=\"$BENCH_SETS\" }bash benchmarks/ab_commits.sh run"
    (cd "$OUT" && tar czf runs.tar.gz base-* other-* ./*.log && rm -rf base-* other-* ./*.log) ;;
  *) echo "usage: $0 prepare COMMIT | run" >&2; exit 2 ;;
esac
