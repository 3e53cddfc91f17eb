"""Sweep: how many M tiles (GROUP_M) the Triton grouped GEMMs walk per column sweep, on each
preset's default tiles, and the down GEMM's cooperative warp-specialized kernel beside them.

A weight tile is read from HBM once per group of GROUP_M row tiles and then from L2, so a
larger group reads the weights fewer times (mixtral-8x7b's experts hold 2048 rows, 16 M
tiles: at GROUP_M = 8 each expert's weights come from HBM twice), as long as the tiles the
SMs work on at once still fit in L2. The configs take turns `--rounds` times (the GPU's clock
falls under sustained load; `tune_gemm.py` says why), the output of each is compared with the
first (the same K order: bitwise equal).

    python benchmarks/sweeps/group_m.py [tune_gemm.py's options, e.g. --preset mixtral-8x7b --rounds 4]
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
import tune_gemm  # noqa: E402

from mok.kernels.gemm import hopper_common  # noqa: E402
from mok.kernels.gemm.dgrad import dgrad_config  # noqa: E402
from mok.kernels.gemm.common import gemm_config  # noqa: E402

GROUP_M = (8, 16, 32)


def _grouped(default: dict) -> list[dict]:
    return [dict(default, GROUP_M=group_m) for group_m in GROUP_M]


def _defaults(kind: str, p) -> dict:
    """The Triton config the library picks for `kind` on preset p (never warp-specialized)."""
    H, I = p.hidden_size, p.intermediate_size
    return {
        "gate_up": lambda: gemm_config("gate_up", I, H, packed_gate_up=True),
        "down": lambda: gemm_config("down", H, I, allow_warp_specialized=False),
        "down_dgrad": lambda: dgrad_config("down", I, H),
        "gate_up_dgrad": lambda: dgrad_config("gate_up", H, I, allow_warp_specialized=False),
    }[kind]()


def configs() -> dict:
    """tune_gemm.py's CONFIGS for this sweep: per kind, a function of the preset."""
    kinds = ("gate_up", "down_dgrad", "gate_up_dgrad")
    swept = {kind: (lambda p, kind=kind: _grouped(_defaults(kind, p))) for kind in kinds}
    swept["down"] = lambda p: _grouped(_defaults("down", p)) + [hopper_common.tile_config(cooperative=True)]
    return swept


if __name__ == "__main__":
    tune_gemm.CONFIGS = configs()
    tune_gemm.main()
