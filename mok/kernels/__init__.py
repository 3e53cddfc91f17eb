"""Triton kernels, one family per file. No torch.distributed here; launchers validate
their arguments and allocate their outputs."""
