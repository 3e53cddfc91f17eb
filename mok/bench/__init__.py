"""mok's benchmark: `python -m mok.bench`.

`presets` holds the benchmark shapes and FLOP count, `baselines` the implementations mok is
measured against (the torchtitan-style PyTorch layer, eager and compiled; SonicMoE),
`runner` the check-then-time loop, `report` the table, JSON record and plot, and
`__main__` the command line.
"""

from mok.bench.presets import GPU_PRESETS, PRESETS, Preset

__all__ = ["GPU_PRESETS", "PRESETS", "Preset"]
