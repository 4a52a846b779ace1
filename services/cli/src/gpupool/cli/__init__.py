"""gpupool.cli."""
