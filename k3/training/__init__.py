"""k3.training: next-token training of any preset (`train(TrainConfig(...))`, the `k3 train` command),
with exact resume, checkpoints, validation in bits per byte, and torchrun's data, fully sharded and expert
parallelism."""

from .loop import TokenData, TrainConfig, train

__all__ = ["TrainConfig", "TokenData", "train"]
