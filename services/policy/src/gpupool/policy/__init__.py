"""gpupool.policy."""
