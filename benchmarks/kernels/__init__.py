"""The Triton kernels compiled for NVIDIA targets without a GPU: registers, spills, launch configurations."""
