"""gpupool.webhook: the mutating admission webhook that puts the CUDA hook into GPU-sharing pods
and refuses a pod whose share spec the core rejects (docs/cuda-hook.md)."""
