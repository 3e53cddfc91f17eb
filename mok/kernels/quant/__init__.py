"""Quantizers: the kernels that turn bf16/fp32 operands into the FP8 formats the GEMMs read.

mxfp8.py: MXFP8 (OCP MX, blocks of 32) and rounding to its grid in bf16; fp8_block.py: fp8_block
(1×128 activation and 128×128 weight blocks), along rows, down the sorted layout's columns, or gathered
from the token rows (its Triton kernels and, on NVIDIA GPUs, their Gluon forms). Both are bit-exact with
the formats' definitions in `mok.mxfp8` and `mok.fp8_block`.
"""
