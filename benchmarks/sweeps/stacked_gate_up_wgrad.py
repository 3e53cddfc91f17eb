"""The bf16 gate/up wgrad: two accumulators (the default) against one over the stacked
[d_g | d_u] (tile-config flag STACKED), timed in the order current, new…, new… reversed,
current, since a config timed later in a sweep measures slower (the GPU's clock falls under
sustained load).

    python benchmarks/sweeps/stacked_gate_up_wgrad.py [tune_gemm.py's options]
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
import tune_gemm  # noqa: E402

CURRENT = tune_gemm._configs((128, 128, 64, 3), group_m=False)
STACKED = [dict(cfg, STACKED=True) for cfg in tune_gemm._configs((128, 256, 64, 3), group_m=False)
           + tune_gemm._persistent(tune_gemm._configs((128, 256, 64, 3), group_m=False))
           + tune_gemm._configs((128, 128, 64, 4), group_m=False)]

if __name__ == "__main__":
    tune_gemm.CONFIGS = {"gate_up_wgrad": CURRENT + STACKED + STACKED[::-1] + CURRENT}
    tune_gemm.main()
