"""gpupool.eventlog."""
