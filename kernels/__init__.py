"""localserve.kernels."""
