"""gpupool.kube."""
