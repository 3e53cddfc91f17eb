"""Sweep: the warp-specialized (Gluon) kernels against the Triton kernels they replace, on the
down GEMM, the gate/up dgrad and both wgrads (bf16, and fp8_block: cooperative only, also at 4
stages and at 128×128), each with the Triton tiles the defaults pick on some preset, then the
warp-specialized configs of the kind (ping-pong and cooperative, the cooperative also at
GROUP_M 8), timed in the order Triton…, warp-specialized…, the same
reversed, since a config timed later in a sweep measures slower (the GPU's clock falls under
sustained load); with `--rounds R` the whole list takes turns R times as well. `diff vs first` is 0 where the
output is bitwise the Triton kernel's.

    python benchmarks/sweeps/warp_specialized.py [tune_gemm.py's options, e.g. --kernel down_wgrad --rounds 6]
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
import tune_gemm  # noqa: E402

from mok.kernels.gemm import hopper_common  # noqa: E402

PING_PONG, COOPERATIVE = hopper_common.tile_config(cooperative=False), hopper_common.tile_config(cooperative=True)
TRITON = {
    "down": tune_gemm._persistent(tune_gemm._configs((128, 256, 64, 3))) + tune_gemm._configs((128, 256, 64, 4)),
    "gate_up_dgrad": tune_gemm._configs((128, 256, 64, 3))
    + tune_gemm._persistent(tune_gemm._configs((128, 256, 64, 4))),
    "down_wgrad": tune_gemm._configs((128, 256, 64, 3), group_m=False),
    "gate_up_wgrad": tune_gemm._configs((128, 128, 64, 3), group_m=False),
    **{kind: tune_gemm.CONFIGS[kind] for kind in tune_gemm.CONFIGS if kind.endswith("_fp8")},
}
FP8_DOWN, FP8_GATE_UP = (hopper_common.fp8_block_tile_config(stacked) for stacked in (False, True))


def _fp8_configs(base: dict) -> list[dict]:
    """The fp8_block tile (128×256, two 128-column accumulators per consumer), at 4 stages, and 128×128 at 6."""
    return [base, dict(base, num_stages=4), dict(base, BLOCK_N=128, num_stages=6)]


WARP_SPECIALIZED = {
    "down": [PING_PONG, COOPERATIVE, dict(PING_PONG, GROUP_M=8), dict(COOPERATIVE, GROUP_M=8)],
    "gate_up_dgrad": [PING_PONG, COOPERATIVE, dict(COOPERATIVE, GROUP_M=8)],
    "down_wgrad": [PING_PONG, COOPERATIVE, dict(COOPERATIVE, GROUP_M=8)],
    "gate_up_wgrad": [COOPERATIVE, dict(COOPERATIVE, GROUP_M=8)],  # two outputs: cooperative only
    **{kind: _fp8_configs(FP8_GATE_UP if kind == "gate_up_wgrad_fp8" else FP8_DOWN)
       for kind in ("down_fp8", "gate_up_dgrad_fp8", "down_wgrad_fp8", "gate_up_wgrad_fp8")},
    "gate_up_fp8": [FP8_DOWN, dict(FP8_DOWN, num_stages=4)],  # 128×256: a gate and an up tile per B slot
}

def configs() -> dict:
    """tune_gemm.py's CONFIGS for this sweep."""
    return {kind: triton_configs + WARP_SPECIALIZED[kind] + WARP_SPECIALIZED[kind][::-1] + triton_configs[::-1]
            for kind, triton_configs in TRITON.items()}


if __name__ == "__main__":
    tune_gemm.CONFIGS = configs()
    tune_gemm.main()
