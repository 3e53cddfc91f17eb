#!/usr/bin/env bash
# One call on a GPU machine: versions, GPU tests, kernel tuning sweep, benchmark.
#   usage: bash benchmarks/device_check.sh [STEPS]
#   STEPS ⊂ {tests,lowp,tune,ws,fp8ws,groupm,profile,bench,sonic,sanitize,fp8,train,ep,epbench} (default: tests bench);
#   lowp: the GPU tests of fp8_block and mxfp8 alone (every preset, ten steps, graphs, compile);
#   ws: the warp-specialized kernels' GPU tests, then their sweep against the Triton kernels (WS_ARGS);
#   groupm: the GROUP_M sweep of the Triton GEMMs (GROUPM_ARGS);
#   fp8ws: the fp8_block warp-specialized kernels' GPU tests, then their sweep (FP8WS_ARGS).
#   ep and epbench need two GPUs (nvidia-h200-x2).
#   env: STEP_TIMEOUT, TUNE_ARGS, WS_ARGS, FP8WS_ARGS, GROUPM_ARGS, PROFILE_PRESETS, PROFILE_ARGS, BENCH_ARGS, EP_BENCH_ARGS, TRAIN_ARGS
# Writes logs, JSON records and plots under $OUT (or ./bench_out).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
steps=${*:-tests bench}
PROFILE_ARGS=${PROFILE_ARGS:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, triton.__version__)" | tee -a "$OUT/gpu.txt"
T=${STEP_TIMEOUT:-300}
for step in $steps; do
  echo "== $step ($(date +%T))"
  case $step in
    tests) timeout $T python3 -m pytest -q -p no:cacheprovider tests/kernels tests/test_triton_forward.py tests/test_triton_backward.py tests/test_gpu_forward.py 2>&1 | tee "$OUT/tests.log" ;;
    tune) timeout $T python3 benchmarks/tune_gemm.py --out "$OUT/tune.json" ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune.log" ;;
    ws) timeout $T python3 -m pytest -q -p no:cacheprovider tests/kernels/test_warp_specialized.py 2>&1 | tail -15 | tee "$OUT/ws-tests.log"
        timeout $T python3 benchmarks/sweeps/warp_specialized.py --out "$OUT/ws-sweep.json" \
          ${WS_ARGS:---preset deepseek-v3-slice --preset mixtral-8x7b --kernel down --kernel down_wgrad --rounds 4} 2>&1 | tee "$OUT/ws-sweep.log" ;;
    groupm) timeout $T python3 benchmarks/sweeps/group_m.py --out "$OUT/group-m.json" \
          ${GROUPM_ARGS:---preset deepseek-v3-slice --preset mixtral-8x7b --rounds 3} 2>&1 | tee "$OUT/group-m.log" ;;
    bench) timeout $T python3 -m mok.bench --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" ;;
    profile) for p in ${PROFILE_PRESETS:-qwen3-30b}; do timeout $T python3 benchmarks/profile_layer.py --preset $p $PROFILE_ARGS; done 2>&1 | grep -v -i warn | tee "$OUT/profile.log" ;;
    sanitize) PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --print-limit 20 \
        python3 -m pytest -q -x -p no:cacheprovider tests/kernels 2>&1 | tail -40 | tee "$OUT/sanitize.log" ;;
    fp8ws) timeout $T python3 -m pytest -q -p no:cacheprovider tests/kernels/test_warp_specialized.py -k "fp8" 2>&1 \
          | tail -15 | tee "$OUT/fp8ws-tests.log"
        timeout $T python3 benchmarks/sweeps/warp_specialized.py --out "$OUT/fp8ws-sweep.json" \
          ${FP8WS_ARGS:---preset qwen3-30b --preset deepseek-v3-slice --kernel gate_up_fp8 --rounds 2} 2>&1 \
          | tee "$OUT/fp8ws-sweep.log" ;;
    lowp) timeout $T python3 -m pytest -q -p no:cacheprovider tests/test_triton_backward.py tests/test_gpu_forward.py \
          -k "low_precision or mxfp8 or fp8_block or ten_steps" 2>&1 | tail -15 | tee "$OUT/lowp.log" ;;
    fp8) timeout $T python3 benchmarks/bench_fp8_gemm.py --out "$OUT/fp8-gemm.json" 2>&1 | tee "$OUT/fp8.log" ;;
    train) timeout $T python3 examples/train_moe_lm.py --out "$OUT" ${TRAIN_ARGS:-} 2>&1 | tee "$OUT/train_moe_lm.log" | grep -v "step .*[1-9]00/" ;;
    ep) timeout $T python3 -m pytest -q -rs -p no:cacheprovider tests/dist/test_ep_gpu.py 2>&1 | tee "$OUT/ep.log" ;;
    epbench) timeout $T torchrun --nproc-per-node 2 -m mok.bench --out "$OUT" --no-plot \
          ${EP_BENCH_ARGS:---preset qwen3-30b --overlap 3,0,0} 2>&1 \
          | grep -v "^W1130\|OMP_NUM\|\*\*\*" | tee "$OUT/epbench.log"
        # the push rate at few programs: the overlap model takes it as proportional below 32
        timeout $T torchrun --nproc-per-node 2 benchmarks/bench_dispatch.py --programs 4,8,13,16,32,64 \
          --out "$OUT/dispatch.json" 2>&1 \
          | grep "programs\|Error" | tee -a "$OUT/epbench.log" ;;
    sonic) tar -xJf .bundle/sonicmoe-site.tar.xz -C /tmp && BENCH_ARGS="${BENCH_ARGS:-} --sonicmoe-site /tmp/site" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
