"""The CPU path: torch ops and a few C functions with the same signatures as the Triton kernels."""
