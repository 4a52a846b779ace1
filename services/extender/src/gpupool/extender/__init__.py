"""gpupool.extender."""
