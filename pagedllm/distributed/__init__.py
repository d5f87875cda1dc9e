"""Tensor and pipeline parallelism on ``torch.distributed`` (gloo on CPU, NCCL on CUDA)."""
