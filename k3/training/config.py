"""`TrainConfig`: every setting of a training run, checked when it is made (a value out of range, of
the wrong type, a model override that names no field or that the preset refuses: a ValueError that
names the field, the value and what is expected).

It is saved in each checkpoint (config.json, "train") and rebuilt from there on resume, so its fields
are plain values; `model_config` turns the preset and overrides into the model's ModelConfig, and
refuses one whose training state cannot fit in this machine's memory before anything is allocated.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from ..inference.generation import check_seed
from ..models import PRESETS, ModelConfig, count_params, get_config
from ..models.config import check_field_names
from ..runtime import refuse_if_over_memory

DEFAULT_MAX_STEPS = 1000  # without a time budget
WARMUP_FRACTION, MAX_WARMUP_STEPS = 0.05, 50  # the default warm-up: 50 steps of a 1,000-step run, 2 of 30
QK_CLIP_TAU = 100.0  # QK-Clip's logit bound with Muon (Kimi K2's tau; k3.training.qk_clip)
TRAINING_BYTES_PER_PARAMETER = 16  # float32 weights, gradients and AdamW's two moments (activations aside)
# float32 values a decoder layer keeps for its backward, per token and unit of width (about: the norms' and
# projections' inputs, attention's and the feed-forward's intermediates; Megatron's 34 bytes in 16-bit halved)
ACTIVATION_VALUES_PER_WIDTH = 17
LOGIT_COPIES = 2  # the logits and the softmax's gradient, float32, for every token of the micro-batch
WINDOW_BYTES = 256  # a drawn window's offset, its view of the stream and its place in the list torch.stack reads
# torch threads a run may ask for: 8 a core, at least 64, at most 1024. Far past the cores threads only wait for
# each other, and past some thousands torch's and the tokenizers' thread pools crash (--threads 3000 segfaults
# on a 2-core machine, 100000 panics in Rust); 1024 ran (slowly) there
THREADS_PER_CORE, MIN_MAX_THREADS, MAX_MAX_THREADS = 8, 64, 1024
MAX_TIME_BUDGET = 60 * 24 * 366  # minutes: a year; a longer budget is a typo (1e308 overflowed the plan)


def max_threads() -> int:
    """The most torch threads `--threads` (any command's) and TrainConfig.threads take on this machine."""
    return min(MAX_MAX_THREADS, max(MIN_MAX_THREADS, THREADS_PER_CORE * (os.cpu_count() or 1)))


def threads_bound_words() -> str:
    """Why `max_threads()` is what it is, for the messages that refuse more."""
    return (
        f"{THREADS_PER_CORE} a core of this machine's {os.cpu_count() or 1}, at least {MIN_MAX_THREADS}, at most "
        f"{MAX_MAX_THREADS}: more threads only wait for each other, and thousands crash torch's thread pools"
    )


@dataclass
class TrainConfig:
    """Every setting of a training run (`k3 train`'s flags, by field): the model (`preset`,
    `model_overrides`), the data and tokenizer, the optimizer and its schedule, the run's length
    (`max_steps` or `time_budget`), evaluation, checkpoints and the machine. Checked when made."""

    preset: str = "kimi-k3-tiny"
    model_overrides: dict = field(default_factory=dict)  # ModelConfig fields, e.g. {"hidden_size": 192}
    data: str | None = None  # None: the default Shakespeare corpus
    tokenizer: str = "bpe"  # "bpe" | "byte"
    vocab_size: int = 4096
    val_fraction: float = 0.1
    seq_len: int = 256
    batch_size: int = 8  # the defaults' choice: docs/training.md
    optimizer: str = "muon"  # "muon" (hidden matrices; AdamW on the rest) | "adamw"
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int | None = None  # None: WARMUP_FRACTION of the run's steps, at most MAX_WARMUP_STEPS
    schedule: str = "wsd"  # "wsd" | "cosine"
    wsd_decay_fraction: float = 0.2
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    qk_clip: float | None = None  # QK-Clip's tau (k3.training.qk_clip); 0: off; None: 100 with Muon, off with AdamW
    moe_bias_rate: float = 1e-3
    max_steps: int | None = None  # training steps; DEFAULT_MAX_STEPS unless time_budget gives the run's length
    time_budget: float | None = None  # minutes; fixes max_steps after calibration_steps
    calibration_steps: int = 5
    eval_every: int = 100
    eval_tokens: int = 32768  # validation tokens per periodic evaluation
    final_eval_tokens: int | None = 262144  # ... and for the final one (None: all of them)
    checkpoint_every: int | None = None
    async_checkpoint: bool = False  # --parallel fsdp | ep: write the DCP files in the background (k3.training.sharded)
    out: str = "runs/k3"
    overwrite: bool = False  # a new run may replace the k3 checkpoint in `out` (never files k3 did not write)
    seed: int = 0
    threads: int | None = None
    compile: bool = False  # torch.compile the decoder (k3.training.parallel.compile_decoder)
    device: str = "auto"  # "auto" (CUDA, then MPS, then the CPU) | "cpu" | "cuda" | "mps"
    precision: str = "fp32"  # "fp32" | "bf16": autocast over float32 weights and optimizer states
    grad_accum: int = 1  # micro-batches of `batch_size` per optimizer step (the batch is their sum)
    ep: int = 1  # --parallel fsdp: the ranks of an expert-parallel group (k3.training.parallel)
    recompute: str = "none"  # "none" | "full" | "selective": activation recompute (k3.training.parallel)
    log: str | None = None  # besides metrics.jsonl: "tensorboard" | "wandb" | None

    def __post_init__(self):
        if isinstance(self.betas, (list, tuple)):
            self.betas = tuple(self.betas)
        for name in ("data", "out"):  # a pathlib.Path is a path too
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))
        if self.schedule not in ("cosine", "wsd"):
            raise ValueError(f"TrainConfig: `schedule` must be 'cosine' or 'wsd', got {self.schedule!r}")
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(
                    f"TrainConfig: `{name}` must be one of {', '.join(map(repr, choices))}, got {getattr(self, name)!r}"
                )
        if self.tokenizer not in ("bpe", "byte"):
            raise ValueError(f"TrainConfig: `tokenizer` must be 'bpe' or 'byte', got {self.tokenizer!r}")
        if self.max_steps is not None and self.time_budget is not None:
            raise ValueError(
                f"TrainConfig: `max_steps` {self.max_steps!r} and `time_budget` {self.time_budget!r} "
                f"both set the run's length; give one (steps or minutes)"
            )
        if self.max_steps is None and self.time_budget is None:
            self.max_steps = DEFAULT_MAX_STEPS
        for name, (ok, expected) in _RULES.items():
            value = getattr(self, name)
            if not ok(value):
                raise ValueError(f"TrainConfig: `{name}` must be {expected}, got {value!r}")
        if self.warmup_steps is not None and self.max_steps is not None and self.warmup_steps > self.max_steps:
            raise ValueError(
                f"TrainConfig: `warmup_steps` {self.warmup_steps} is more than `max_steps` {self.max_steps}: the "
                f"learning rate would never reach `lr`; give at most {self.max_steps} warm-up steps (None: 5% of the "
                f"steps, at most 50)"
            )
        if not (
            isinstance(self.betas, tuple)
            and len(self.betas) == 2
            and all(_number(b) and 0 <= b < 1 for b in self.betas)
        ):
            raise ValueError(f"TrainConfig: `betas` must be two numbers in [0, 1), got {self.betas!r}")
        if self.tokenizer == "bpe" and self.vocab_size < 257:
            raise ValueError(
                f"TrainConfig: `vocab_size` must be at least 257 (256 bytes + <|endoftext|>) for "
                f"a BPE tokenizer, got {self.vocab_size}"
            )
        check_seed(self.seed, "TrainConfig.seed")
        if not isinstance(self.preset, str) or self.preset not in PRESETS:
            raise ValueError(f"TrainConfig: unknown preset {self.preset!r}; choose from: {', '.join(PRESETS)}")
        _check_model_overrides(self)


def saved_train_config(fields: dict) -> TrainConfig:
    """The TrainConfig a checkpoint's config.json recorded; one saved before the `optimizer` field
    existed trained with AdamW, and one saved before `qk_clip` existed without QK-Clip. A `vocab_size`
    among the model overrides of an older checkpoint never took effect (the tokenizer's vocabulary
    replaced it) and is dropped, and so is a `time_budget` saved beside a `max_steps` (older code ran
    the steps) and a `threads` above this machine's `max_threads()` (all cores here instead)."""
    overrides = {k: v for k, v in fields.get("model_overrides", {}).items() if k != "vocab_size"}
    fields = {"optimizer": "adamw", "qk_clip": 0.0, **fields, "model_overrides": overrides}
    if fields.get("max_steps") is not None and fields.get("time_budget") is not None:
        fields["time_budget"] = None  # both saved by older code, which then ran `max_steps`
    threads = fields.get("threads")
    if isinstance(threads, int) and not isinstance(threads, bool) and threads > max_threads():
        fields["threads"] = None  # a bigger machine's thread count: this one's cores (a machine setting)
    return TrainConfig(**fields)


def qk_clip_threshold(cfg: TrainConfig) -> float:
    """The run's QK-Clip threshold tau (0.0: off): `cfg.qk_clip`, or by default QK_CLIP_TAU with Muon
    (MuonClip, as Kimi K2 trains) and off with AdamW."""
    if cfg.qk_clip is not None:
        return float(cfg.qk_clip)
    return QK_CLIP_TAU if cfg.optimizer == "muon" else 0.0


def model_config(cfg: TrainConfig, vocab_size: int, share: float = 1.0) -> ModelConfig:
    """The model the run trains: `cfg.preset` with `cfg.model_overrides` and the tokenizer's vocabulary;
    a ValueError with the estimate (`training_bytes`) when its training cannot fit in this machine's
    memory (`share` of the parameters' state on this machine: a sharded run's processes here)."""
    config = get_config(cfg.preset, **{**cfg.model_overrides, "vocab_size": vocab_size})
    positions = config.max_position_embeddings
    if positions and cfg.seq_len > positions:
        raise ValueError(
            f"--seq-len {cfg.seq_len}: {config.name!r} has learned positions for {positions} tokens; give --seq-len "
            f"at most {positions}, or more positions (--set max_position_embeddings={cfg.seq_len})"
        )
    total = count_params(config).total
    held = f", {share:.3g} of them on this machine" if share != 1 else ""
    refuse_if_over_memory(
        f"training {config.name!r} ({total:,} parameters x {TRAINING_BYTES_PER_PARAMETER} bytes"
        f"{held}, the activations of {cfg.batch_size} x {cfg.seq_len} tokens and the step's "
        f"{cfg.batch_size * cfg.grad_accum:,} token windows: --batch-size {cfg.batch_size} x "
        f"--grad-accum {cfg.grad_accum})",
        training_bytes(cfg, config, share),
        "choose a smaller preset, --hidden-size or --num-layers, or a smaller --batch-size, "
        "--grad-accum or --seq-len (--grad-accum N takes a batch in N micro-batches; --recompute full keeps "
        "fewer activations)",
    )
    return config


def training_bytes(cfg: TrainConfig, config: ModelConfig, share: float = 1.0) -> int:
    """About the memory a training step needs on this machine: the parameters' state (`share` of it,
    TRAINING_BYTES_PER_PARAMETER each) and the activations its backward keeps for one micro-batch (each
    layer's, ACTIVATION_VALUES_PER_WIDTH float32 values per token and unit of width; with --recompute full
    a layer's input alone, and one layer's whole while it is recomputed) and its logits (LOGIT_COPIES); a
    torchrun job's processes here take their part of the micro-batch; and the step's batch_size x
    grad_accum token windows, drawn at once (int64 tokens, and about WINDOW_BYTES for each window's
    offset and view while they are stacked)."""
    from .parallel.dims import launch

    here = launch()
    tokens = cfg.batch_size * cfg.seq_len * here.local_world / here.world
    layer = tokens * config.hidden_size * ACTIVATION_VALUES_PER_WIDTH * 4
    kept = (
        layer + config.num_layers * tokens * config.hidden_size * 4
        if cfg.recompute == "full"
        else (config.num_layers * layer)
    )
    logits = tokens * config.vocab_size * 4 * LOGIT_COPIES
    windows = cfg.batch_size * cfg.grad_accum * ((cfg.seq_len + 1) * 8 + WINDOW_BYTES)
    return int(count_params(config).total * TRAINING_BYTES_PER_PARAMETER * share + kept + logits + windows)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(low: int, none: bool = False):
    return lambda v: (none and v is None) or (isinstance(v, int) and not isinstance(v, bool) and v >= low)


def _in(low: float, high: float = math.inf, low_open: bool = False, high_open: bool = False, none: bool = False):
    return lambda v: (
        (none and v is None)
        or (_number(v) and (low < v if low_open else low <= v) and (v < high if high_open else v <= high))
    )


_CHOICES = {  # field: the values it takes
    "optimizer": ("muon", "adamw"),
    "device": ("auto", "cpu", "cuda", "mps"),
    "precision": ("fp32", "bf16"),
    "log": (None, "tensorboard", "wandb"),
    "recompute": ("none", "full", "selective"),
}


def _path(none: bool = False):
    return lambda v: (none and v is None) or (isinstance(v, str) and v.strip() != "")


_RULES = {  # field: (check, what it expects)
    "data": (_path(none=True), "a path (a UTF-8 text file or a folder of them), or None (the Shakespeare corpus)"),
    "out": (_path(), "a path (the run's folder)"),
    "vocab_size": (_count(1), "an integer >= 1"),
    "val_fraction": (_in(0, 1, low_open=True, high_open=True), "a number in (0, 1)"),
    "seq_len": (_count(1), "an integer >= 1"),
    "batch_size": (_count(1), "an integer >= 1"),
    "lr": (_in(0, low_open=True), "a finite number > 0"),
    "min_lr_ratio": (_in(0, 1), "a number in [0, 1]"),
    "warmup_steps": (_count(0, none=True), "an integer >= 0, or None (5% of the steps, at most 50)"),
    "wsd_decay_fraction": (_in(0, 1), "a number in [0, 1]"),
    "weight_decay": (_in(0), "a finite number >= 0"),
    "grad_clip": (_in(0, low_open=True), "a finite number > 0"),
    "qk_clip": (_in(0, none=True), "a finite number >= 0 (0: off), or None (100 with Muon, off with AdamW)"),
    "moe_bias_rate": (_in(0), "a finite number >= 0"),
    "max_steps": (_count(1, none=True), "an integer >= 1 (or None with a `time_budget`)"),
    "time_budget": (
        _in(0, MAX_TIME_BUDGET, low_open=True, none=True),
        f"a finite number of minutes > 0 and <= {MAX_TIME_BUDGET:,} (a year), or None",
    ),
    "calibration_steps": (_count(1), "an integer >= 1"),
    "eval_every": (_count(1), "an integer >= 1"),
    "eval_tokens": (_count(1), "an integer >= 1"),
    "final_eval_tokens": (
        _count(0, none=True),
        "an integer >= 0 (0: no final evaluation), or None (all validation tokens)",
    ),
    "grad_accum": (_count(1), "an integer >= 1"),
    "ep": (_count(1), "an integer >= 1 (1: no expert parallelism inside fsdp)"),
    "checkpoint_every": (_count(1, none=True), "an integer >= 1, or None (a checkpoint at the end only)"),
    "threads": (
        lambda v: _count(1, none=True)(v) and (v is None or v <= max_threads()),
        f"an integer in [1, {max_threads()}] ({threads_bound_words()}), or None (all cores)",
    ),
    "model_overrides": (lambda v: isinstance(v, dict), "a dict of ModelConfig fields"),
    "overwrite": (lambda v: isinstance(v, bool), "True or False"),
    "async_checkpoint": (lambda v: isinstance(v, bool), "True or False"),
    "compile": (lambda v: isinstance(v, bool), "True or False"),
}


def _check_model_overrides(cfg: TrainConfig) -> None:
    """The overrides name ModelConfig fields that a preset takes, with values it accepts (built here
    without the vocabulary, which comes from the tokenizer; nothing is allocated)."""
    where = f"TrainConfig: `model_overrides` of preset {cfg.preset!r}"
    check_field_names(cfg.model_overrides, where)
    if "vocab_size" in cfg.model_overrides:
        vocabulary = "257 tokens with tokenizer 'byte'" if cfg.tokenizer == "byte" else f"vocab_size {cfg.vocab_size}"
        raise ValueError(
            f"{where}: `vocab_size` {cfg.model_overrides['vocab_size']!r} would be replaced by the "
            f"tokenizer's vocabulary ({vocabulary}); drop it from the overrides (--set) and choose "
            f"the vocabulary with --vocab-size (BPE) or --tokenizer byte"
        )
    get_config(cfg.preset, **cfg.model_overrides)
