"""gpupool.core."""
