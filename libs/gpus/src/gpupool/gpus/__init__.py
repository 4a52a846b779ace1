"""gpupool.gpus."""
