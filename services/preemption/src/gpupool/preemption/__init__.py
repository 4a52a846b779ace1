"""gpupool.preemption."""
