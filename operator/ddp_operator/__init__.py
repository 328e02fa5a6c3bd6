"""ddp-operator: a Kubernetes operator for PyTorch DistributedDataParallel training."""

__version__ = "0.1.0"
