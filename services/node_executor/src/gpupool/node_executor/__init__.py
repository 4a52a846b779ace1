"""gpupool.node_executor."""
