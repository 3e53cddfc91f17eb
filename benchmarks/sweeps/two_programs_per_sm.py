"""Two programs per SM: 128×128 tiles at 3 stages (or 128×64 capped at 128 registers with
`maxnreg`) against the tile configs in use, each kernel's list timed as (current, new,
current, new), since a config timed later in a sweep measures slower (the GPU's clock falls
under sustained load). ptxas (sm_90a) put the new configs at ≤ 128 registers and ≤ 98 KiB of
shared memory, so two programs fit on an SM: one's epilogue can overlap the other's MMAs.

    python benchmarks/sweeps/two_programs_per_sm.py [tune_gemm.py's options]
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
import tune_gemm  # noqa: E402
from tune_gemm import _configs, _persistent  # noqa: E402


def _capped(configs: list[dict], **flags) -> list[dict]:
    """configs at 128 registers per thread (two programs of 8 warps per SM), with flags."""
    return [dict(cfg, maxnreg=128, **flags) for cfg in configs]


def _twice(current: list[dict], new: list[dict]) -> list[dict]:
    return current + new + current + new


SWEEP = {
    "gate_up": _twice([dict(cfg, PACKED=True) for cfg in _configs((128, 128, 64, 4))],
                      _capped(_configs((128, 64, 64, 3)), PACKED=True, X_SORTED=True)
                      + _capped(_configs((128, 64, 64, 3)), PACKED=True)),
    "gate_up_separate": _twice([dict(cfg, X_SORTED=True) for cfg in _configs((128, 128, 64, 4))],
                               _capped(_configs((128, 64, 64, 3)), X_SORTED=True)),
    "down": _twice(_configs((128, 256, 64, 4)) + _persistent(_configs((128, 256, 64, 3))), _configs((128, 128, 64, 3))),
    "gate_up_dgrad": _twice(_configs((128, 256, 64, 3)) + _persistent(_configs((128, 256, 64, 4))),
                            _configs((128, 128, 64, 3))),
    "down_dgrad": _twice(_configs((128, 256, 64, 3)), _capped(_configs((128, 64, 64, 3))) + _configs((128, 64, 64, 4))),
    "down_wgrad": _twice(_configs((128, 256, 64, 3), group_m=False) + _persistent(_configs((128, 256, 64, 3), group_m=False)),
                         _configs((128, 128, 64, 3), group_m=False)),
    "gate_up_wgrad": _twice(_configs((128, 128, 64, 3), group_m=False),
                            _capped(_configs((128, 64, 64, 2), group_m=False)) + _configs((128, 64, 64, 3), group_m=False)),
}

if __name__ == "__main__":
    tune_gemm.CONFIGS = SWEEP
    tune_gemm.main()
