"""gpupool.observability."""
