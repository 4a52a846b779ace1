"""gpupool.events."""
