"""Sweep: the down dgrad's epilogue (g, u in; d_g, d_u out), on each preset's default tiles.

The down dgrad reads the forward's g, u (2 · rows · I bf16) and writes d_g, d_u (as many) in
its epilogue, a quarter of the tile at a time, and a per-tile launch overlaps none of it with
MMAs: each quarter waits for its g, u loads. Configs: the default, which asks for the tile's
g, u lines in L2 when the main loop ends (the plan's `down_dgrad_prefetch_gate_up`), and the same
without the prefetch.

The configs take turns `--rounds` times (`tune_gemm.py` says why); each output is compared with
the first's.

    python benchmarks/sweeps/down_dgrad_prefetch.py [tune_gemm.py's options, e.g. --preset mixtral-8x7b --rounds 3]
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
import tune_gemm  # noqa: E402

from mok.kernels.gemm.dgrad import dgrad_config  # noqa: E402

VARIANTS = ({"PREFETCH_GATE_UP": True}, {"PREFETCH_GATE_UP": False})


def configs() -> dict:
    """tune_gemm.py's CONFIGS for this sweep: the down dgrad's variants, a function of the preset."""
    return {"down_dgrad": lambda p: [dict(dgrad_config("down", p.intermediate_size, p.hidden_size), **v)
                                     for v in VARIANTS]}


if __name__ == "__main__":
    tune_gemm.CONFIGS = configs()
    tune_gemm.main()
