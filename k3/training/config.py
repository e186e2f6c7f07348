"""`TrainConfig`: every setting of a training run, checked when it is made.

It is saved in each checkpoint (config.json, "train") and rebuilt from there on resume, so its fields
are plain values; `model_config` turns the preset and overrides into the model's ModelConfig.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..models import ModelConfig, get_config


@dataclass
class TrainConfig:
    preset: str = "kimi-k3-tiny"
    model_overrides: dict = field(default_factory=dict)  # ModelConfig fields, e.g. {"hidden_size": 192}
    data: str | None = None  # None: the default Shakespeare corpus
    tokenizer: str = "bpe"  # "bpe" | "byte"
    vocab_size: int = 4096
    val_fraction: float = 0.1
    seq_len: int = 256
    batch_size: int = 8  # measured: 2.12 vs 2.19 bits/byte at 16, in the same 10-minute budget
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    schedule: str = "wsd"  # "wsd" | "cosine"; measured: 2.070 vs 2.083 bits/byte in the same 10-minute budget
    wsd_decay_fraction: float = 0.2
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    moe_bias_rate: float = 1e-3
    max_steps: int | None = 1000
    time_budget: float | None = None  # minutes; fixes max_steps after calibration_steps
    calibration_steps: int = 5
    eval_every: int = 100
    eval_tokens: int = 32768  # validation tokens per periodic evaluation
    final_eval_tokens: int | None = 262144  # ... and for the final one (None: all of them)
    checkpoint_every: int | None = None
    out: str = "runs/k3"
    seed: int = 0
    threads: int | None = None
    compile: bool = False  # torch.compile the decoder (k3.training.strategy.compile_decoder)

    def __post_init__(self):
        self.betas = tuple(self.betas)
        if self.schedule not in ("cosine", "wsd"):
            raise ValueError(f"TrainConfig: `schedule` must be 'cosine' or 'wsd', got {self.schedule!r}")
        if self.tokenizer not in ("bpe", "byte"):
            raise ValueError(f"TrainConfig: `tokenizer` must be 'bpe' or 'byte', got {self.tokenizer!r}")
        if self.max_steps is None and self.time_budget is None:
            raise ValueError("TrainConfig: give `max_steps` or `time_budget`")
        for name in ("seq_len", "batch_size", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig: `{name}` must be >= 1, got {getattr(self, name)}")


def model_config(cfg: TrainConfig, vocab_size: int) -> ModelConfig:
    """The model the run trains: `cfg.preset` with `cfg.model_overrides` and the tokenizer's vocabulary."""
    return get_config(cfg.preset, **{**cfg.model_overrides, "vocab_size": vocab_size})
