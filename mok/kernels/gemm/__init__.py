"""The grouped GEMMs of the expert MLPs, over the expert-sorted layout of `routing/schedule.py`, one file
per GEMM: gate_up.py (the forward's gate/up, SwiGLU in its epilogue), down.py (the forward's down, scattered
to the route slots), dgrad.py (the down dgrad with the SwiGLU backward and the router-weight gradient, and the
gate/up dgrad), wgrad.py (both weight gradients); common.py holds what they share (the forward's tile
chooser, the checks, the Triton main loops and stores over sorted or gathered rows).
"""
