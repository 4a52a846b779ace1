"""gpupool.admission_queue."""
