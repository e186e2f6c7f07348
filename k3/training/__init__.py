"""k3.training: next-token training of any preset (`train(TrainConfig(...))`, the `k3 train` command),
with exact resume, checkpoints, validation in bits per byte, and torchrun's data, fully sharded and expert
parallelism.

The modules, each below the next: config (TrainConfig), muon (Muon on the matrices + AdamW), optim (the
optimizer and the learning-rate schedule), data (corpus, tokenizer, token streams), objective (the loss
and bits per byte), checkpoint, qk_clip (MuonClip's bound on the attention logits, after each step),
parallel (ParallelDims, and ddp / fsdp / ep applied to a model from outside), step (the training step
`train_step` and `evaluate`, one function for one process and many), build (the run's data, model and
optimizer for its processes), checkpointer (one Checkpointer for every mode), metrics (metrics.jsonl,
TensorBoard, wandb), resume (what a resumed run keeps), budget (a time budget's step count), loop
(`train`). No class stands for a mode: what differs between one process and many is asked of the
`ParallelDims`.
"""

from .build import build, build_model, prepare_data
from .checkpointer import Checkpointer
from .config import TrainConfig
from .data import TokenData, prepare
from .loop import train
from .muon import Muon
from .objective import bits_per_byte, next_token_loss
from .optim import build_optimizer, learning_rate, no_decay
from .parallel import ParallelDims, parallel_dims
from .step import NonFiniteLossError, StepResult, evaluate, train_step, training_step

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
    "Muon",
    "ParallelDims",
    "parallel_dims",
    "prepare_data",
    "build_model",
    "build",
    "Checkpointer",
    "evaluate",
    "StepResult",
    "NonFiniteLossError",
]
