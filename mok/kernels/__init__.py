"""Triton (and, on Hopper, Gluon) kernels, one family per file, grouped by what they compute:

    routing/   schedule.py (the expert-sorted, tile-padded layout), gather.py (token rows into it),
               combine.py (each token's route outputs summed back)
    gemm/      the experts' grouped GEMMs: gate_up.py, down.py, dgrad.py, wgrad.py (Triton), common.py
               (what they share); hopper_scatter.py, hopper_gathered.py, hopper_wgrad.py (the Gluon kernels
               that run them on Hopper), hopper_common.py (their pipeline)
    quant/     mxfp8.py, fp8_block.py: the quantizers
    comm/      push.py (peer stores and the arrival wait), dispatch.py (send-buffer copies): expert parallelism

and for all of them common.py (constants and small helpers), plan.py (which kernels and tiles run on each
GPU) and gluon_api.py (the Gluon names across Triton releases). No torch.distributed here; launchers
validate their arguments and allocate their outputs."""
