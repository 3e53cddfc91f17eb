#!/usr/bin/env bash
# mok.integrations on a GPU machine without internet, in two steps:
#   bash benchmarks/integrations_device.sh wheels   # here: transformers + torchtitan wheels (Python 3.12,
#                                                   # about 34 MB) into .whl/integrations, to carry along
#   bash benchmarks/integrations_device.sh run      # there: install them offline, the gpu-marked
#                                                   # integration tests, then benchmarks/hf_layer_stack.py
# torchtitan is installed without its dependencies (datasets, wandb, tensorboard, ...): its MoE
# modules import with spmd_types, tyro, docstring_parser, typeguard and torch_checkpointing.
# Writes logs and the JSON record under $OUT (or ./bench_out).
set -uo pipefail
WHEELS=.whl/integrations
TITAN=(torchtitan==0.3.0 spmd_types==0.2.3 tyro docstring_parser typeguard torch_checkpointing)
case ${1:?wheels or run} in
  wheels)
    platform=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
              --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
    python3 -m pip download -q "${platform[@]}" -d $WHEELS "transformers==5.25.0" &&
      python3 -m pip download -q --no-deps "${platform[@]}" -d $WHEELS "${TITAN[@]}" &&
      rm -f $WHEELS/numpy-*  # the GPU machine's numpy stays
    du -sh $WHEELS ;;
  run)
    unset TRITON_INTERPRET
    deps=$(mktemp -d)  # installed beside, not into, the machine's Python environment
    export PYTHONPATH=$PWD:$deps${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
    OUT=${OUT:-bench_out}
    mkdir -p "$OUT"
    # Every wheel carried, as it is (no resolver: it would want numpy, which the machine has).
    python3 -m pip install -q --no-index --no-deps --target "$deps" $WHEELS/*.whl || exit 1
    timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/integrations tests/test_expert_counts.py \
      2>&1 | tail -20 | tee "$OUT/integrations-tests.log"
    timeout 240 python3 benchmarks/hf_layer_stack.py --out "$OUT" 2>&1 | tee "$OUT/hf-layer-stack.log" ;;
  *) echo "usage: $0 wheels|run" >&2; exit 2 ;;
esac
