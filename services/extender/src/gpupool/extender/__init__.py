"""gpupool.extender: the kube-scheduler extender that keeps whole-GPU pods off GPU-sharing nodes
and GPU-sharing pods on nodes with the right policy and room (docs/kubernetes.md)."""
