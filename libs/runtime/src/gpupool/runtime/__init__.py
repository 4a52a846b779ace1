"""gpupool.runtime."""
