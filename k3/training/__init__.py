"""k3.training: next-token training of any preset (`train(TrainConfig(...))`, the `k3 train` command),
with exact resume, checkpoints, validation in bits per byte, and torchrun's data, fully sharded and expert
parallelism.

The modules, each below the next: config (TrainConfig), muon (Muon on the matrices + AdamW), optim (the
optimizer and the learning-rate schedule), data (corpus, tokenizer, token streams), objective (the loss
and bits per byte), checkpoint, qk_clip (MuonClip's bound on the attention logits, after each step),
parallel (ddp / fsdp / ep applied to a model, ParallelDims), step (the training step
`train_step`, one function for one process and many), strategy (SingleProcess: data, model, checkpoints
around the step) and distributed (the torchrun strategy), metrics (metrics.jsonl, TensorBoard, wandb), resume
(what a resumed run keeps), budget (a time budget's step count), loop (`train`).
"""

from .config import TrainConfig
from .data import TokenData, prepare
from .loop import train
from .muon import Muon
from .objective import bits_per_byte, next_token_loss
from .optim import build_optimizer, learning_rate, no_decay
from .step import train_step, training_step
from .strategy import SingleProcess

__all__ = [
    "TrainConfig",
    "TokenData",
    "train",
    "prepare",
    "build_optimizer",
    "training_step",
    "train_step",
    "learning_rate",
    "no_decay",
    "next_token_loss",
    "bits_per_byte",
    "SingleProcess",
    "Muon",
]
