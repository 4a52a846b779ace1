"""gpupool's read-only web console: cluster, node, pod and GPU-timeline pages from the log."""
