"""gpupool.node_executor: the only service that touches processes and GPUs.

Parts (see docs/node-executor.md): :mod:`.inventory` (NVML or an explicitly simulated
inventory), :mod:`.workload_socket` (the local endpoint for ``gpupool run``),
:mod:`.processes` (process groups and the SIGTERM/SIGKILL sequence), :mod:`.environment`
(the workload's GPU and CUDA MPS limits), :mod:`.memory_guard` and :mod:`.peer_identity`.
"""
