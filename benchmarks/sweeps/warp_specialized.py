"""The warp-specialized (Gluon) kernels against the Triton kernels they replace: the down GEMM,
the gate/up dgrad and both wgrads, each with the Triton tiles the defaults pick on some preset,
the ping-pong schedule and the cooperative one (`mok/kernels/warp_specialized.py`), timed in
the order Triton…, warp-specialized…, the same reversed, since a config timed later in a sweep
measures slower (the GPU's clock falls under sustained load); with `--rounds R` the whole list
takes turns R times as well. `diff vs first` is 0 where the output is bitwise the Triton kernel's.

    python benchmarks/sweeps/warp_specialized.py [tune_gemm.py's options, e.g. --rounds 6]
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
import tune_gemm  # noqa: E402

from mok.kernels import warp_specialized  # noqa: E402

WARP_SPECIALIZED = [warp_specialized.tile_config(cooperative=False), warp_specialized.tile_config(cooperative=True)]
TRITON = {
    "down": tune_gemm._persistent(tune_gemm._configs((128, 256, 64, 3))) + tune_gemm._configs((128, 256, 64, 4)),
    "gate_up_dgrad": tune_gemm._configs((128, 256, 64, 3))
    + tune_gemm._persistent(tune_gemm._configs((128, 256, 64, 4))),
    "down_wgrad": tune_gemm._configs((128, 256, 64, 3), group_m=False),
    "gate_up_wgrad": tune_gemm._configs((128, 128, 64, 3), group_m=False),
}

if __name__ == "__main__":
    tune_gemm.CONFIGS = {kind: configs + WARP_SPECIALIZED + WARP_SPECIALIZED[::-1] + configs[::-1]
                         for kind, configs in TRITON.items()}
    tune_gemm.main()
