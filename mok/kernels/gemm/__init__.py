"""The grouped GEMMs of the expert MLPs, over the expert-sorted layout of `routing/schedule.py`, one file
per GEMM: gate_up.py (the forward's gate/up, SwiGLU in its epilogue), down.py (the forward's down, scattered
to the route slots), dgrad.py (the down dgrad with the SwiGLU backward and the router-weight gradient, and the
gate/up dgrad), wgrad.py (both weight gradients); common.py holds what they share (the forward's tile
chooser, the checks, the Triton main loops and stores over sorted or gathered rows).

Beside them the warp-specialized Gluon kernels that stand in for them on Hopper, one file per kernel, as
each serves several GEMMs: hopper_scatter.py (the down GEMM and the gate/up dgrad), hopper_gathered.py
(fp8_block: the gate/up GEMM and the down dgrad's product, token rows gathered by the producer),
hopper_wgrad.py (the weight gradients); hopper_common.py holds their pipeline (the ring, the MMA loops,
the stores), tile configs and where they run.
"""
