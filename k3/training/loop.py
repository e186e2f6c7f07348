"""`k3 train`: next-token training of any preset on a text corpus, on a CPU or a GPU.

AdamW (no weight decay on norms, biases, A_log, dt_bias or the AttnRes queries), linear warmup then
cosine or WSD (warmup-stable-decay) learning rate, gradient clipping, the MoE bias update after every
step, validation in bits per byte, a progress bar, and checkpoints that resume exactly: the loss
sequence of a resumed run equals the uninterrupted one (same seed, same machine and thread count).

With `time_budget` (minutes) the number of steps is fixed after the first few steps from their speed,
and stored in the checkpoint, so a resumed run follows the same schedule.

Each step appends a line to `metrics.jsonl` in the output folder (k3.training.metrics), and to
TensorBoard or wandb with `log`. `device` picks where the run trains, `precision` "bf16" runs the
forward passes under bfloat16 autocast, `grad_accum` takes each step in micro-batches
(k3.training.step), `qk_clip` bounds the attention logits after each step (k3.training.qk_clip).

`train` reads the same on one process and under torchrun (`parallel` "ddp", "fsdp" or "ep"): a
`ParallelDims` (k3.training.parallel) says which slice of the batch this process takes, how losses are
summed over processes and how the processes agree; the data, the model and the optimizer are built
for them (k3.training.build), the step is one function (k3.training.step.train_step, whose `StepResult`
the loop logs), and one `Checkpointer` (k3.training.checkpointer) saves and resumes every mode. The
single-process path does not touch torch.distributed.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import signal
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

from ..checkpoints.checkpoint import load_into
from ..ops.kernels import kernels_words
from ..runtime import machine_speed_words
from .budget import _replan, _steps_in_budget, _warmup_words
from .build import build, build_model, memory_share, prepare_data
from .checkpoint import check_new_run_folder, claim_output, load_training_checkpoint
from .checkpointer import Checkpointer
from .config import TrainConfig, model_config, qk_clip_threshold
from .metrics import MetricsLog, check_logger
from .optim import learning_rate
from .parallel import ParallelDims, launch, parallel_dims
from .resume import _check_saved_data, _resume_overrides, _same_folder, _share, check_same_corpus
from .step import NonFiniteLossError, evaluate, train_step
from .stop import Interrupted, signal_words, stop_on_signals

__all__ = ["train", "TrainConfig"]


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def train(
    cfg: TrainConfig,
    resume: str | None = None,
    progress: bool = True,
    parallel: str = "none",
    asked: tuple[str, ...] = (),
) -> dict:
    """Train (or resume from the checkpoint directory `resume`); returns the run's history.
    `parallel`: "none", or under torchrun "ddp", "fsdp" or "ep" (k3.training.parallel). `asked`:
    fields of `cfg` given by name, which a resumed run takes even where they equal the default
    (`k3 train --resume DIR --precision fp32` on a bf16 run).
    The output folder is checked, created and locked before any work (OutputFolderError: unusable,
    another run holds it, or it holds a checkpoint (a new run replaces one only with `cfg.overwrite`) or
    files k3 did not write under the names a run writes; every process of a torchrun job checks); a NaN
    or infinite loss or gradient norm stops the run (NonFiniteLossError)."""
    with stop_on_signals() as stop:  # start-up: a signal stops the run at once; then after a step (k3.training.stop)
        return _train(cfg, resume, progress, parallel, asked, stop)


def _train(cfg: TrainConfig, resume: str | None, progress: bool, parallel: str, asked: tuple, stop) -> dict:
    """`train`, its signal handlers installed."""
    state, changes = None, {}
    if resume is not None:
        state = load_training_checkpoint(resume, share=_share(parallel))
        corpus_known = state.get("corpus") is not None
        changes = _resume_overrides(cfg, state["train_config"], asked, corpus_known)
        if "data" not in changes:
            _check_saved_data(state["train_config"], resume, corpus_known)
        changes.setdefault("out", str(resume))
        changes["overwrite"] = cfg.overwrite  # this command's choice, never the saved run's
        changes["async_checkpoint"] = cfg.async_checkpoint  # (as is how this launch saves)
        if "ep" not in changes:  # not asked: the saved layout adapts to this launch
            changes["ep"] = _launch_ep(state["train_config"].ep, parallel)
        cfg = dataclasses.replace(state["train_config"], **changes)
        if _nothing_to_do(state, cfg, changes, resume):
            return state["history"]
    if resume is None or not _same_folder(cfg.out, resume):  # a resumed run writes on in its own folder
        check_new_run_folder(cfg.out, cfg.overwrite)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    check_logger(cfg.log)  # a missing package before any work
    dims = parallel_dims(parallel, cfg.batch_size, cfg.device, cfg.ep)  # (under torchrun: its process group)
    try:
        whole = state is not None and state["model"] is not None
        # the sizes (parameters and activations) before the tokenizer or any work: with the smallest
        # vocabulary (the 257 bytes) until the tokenizer gives its own, which `_run` checks again
        model_config(cfg, state["tokenizer"].vocab_size if state else 257, share=memory_share(cfg, dims, whole))
        out = Path(cfg.out)
        # before any work: a bad --out costs nothing; a run refused before its first save leaves nothing behind
        lock = dims.on_main(lambda: claim_output(out))
        try:
            return _run(cfg, dims, state, changes, resume, out, progress, stop)
        finally:
            if lock is not None:
                lock.release()
    finally:
        dims.close()


def _launch_ep(saved: int, parallel: str) -> int:
    """The `ep` of a resumed run that did not ask for one: the checkpoint's where this launch can take it
    (--parallel fsdp over a process count it divides), else 1, said: a checkpoint resumes at any process
    count and in any mode with the plain command (an explicit --ep is checked against the launch as given)."""
    world = launch().world
    if saved == 1 or (parallel == "fsdp" and world % saved == 0):
        return saved
    if parallel == "ep":  # (--parallel ep splits the experts over all its processes itself)
        return 1
    if launch().rank == 0:
        _say(
            f"k3 train: the checkpoint was trained with --ep {saved} (--parallel fsdp); this launch (--parallel "
            f"{parallel}, {world} process{'es' if world > 1 else ''}) trains on with ep 1"
        )
    return 1


def _nothing_to_do(state: dict, cfg: TrainConfig, changes: dict, resume: str) -> bool:
    """True (said) when the checkpoint has trained every step the resumed run asks for: nothing is
    trained, evaluated or written. Fewer steps than it has trained is an error: a run cannot go back."""
    done = state["step"]
    target = cfg.max_steps if "max_steps" in changes else state["max_steps"]
    if target is None or done < target:
        return False
    if "max_steps" in changes and target < done:
        raise ValueError(
            f"--max-steps {target}: the checkpoint in {resume} has trained {done} steps already; "
            f"give --max-steps above {done} to train on (a run cannot go back)"
        )
    _say(
        f"k3 train: nothing to do: the checkpoint in {resume} has trained all its {done} steps; give --max-steps "
        f"above {done} to train on (nothing was written)"
    )
    return True


def _run(
    cfg: TrainConfig,
    dims: ParallelDims,
    state: dict | None,
    changes: dict,
    resume: str | None,
    out: Path,
    progress: bool,
    stop: stop_on_signals,
) -> dict:
    """`train` once the run's configuration is known and its output folder claimed."""
    tokenizer, data = prepare_data(cfg, dims, state["tokenizer"] if state else None)
    corpus = data.fingerprint()
    if state is not None:
        check_same_corpus(state.get("corpus"), corpus, data, cfg.data)
    if dims.is_main and state is None and cfg.tokenizer == "bpe" and tokenizer.vocab_size < cfg.vocab_size:
        _say(
            f"k3 train: warning: --vocab-size {cfg.vocab_size}: the corpus gave the BPE tokenizer only "
            f"{tokenizer.vocab_size:,} tokens (no more merges to learn); the model's vocabulary is "
            f"{tokenizer.vocab_size:,}"
        )
    # a corpus too short for one window is refused before anything is said or written
    data.batch(1, cfg.seq_len, torch.Generator())
    data.val_windows(cfg.seq_len, cfg.seq_len)
    torch.manual_seed(cfg.seed)
    whole = state is not None and state["model"] is not None  # a sharded checkpoint is read into the shards
    mconfig = model_config(cfg, tokenizer.vocab_size, share=memory_share(cfg, dims, whole))
    model = build_model(mconfig, dims, whole)
    num_parameters = model.num_parameters()  # (a process of --parallel ep holds fewer)
    if whole:
        load_into(model, state["model"], f"checkpoint {resume}")
    optimizer, groups = build(model, cfg, dims)
    checkpointer = Checkpointer(model, optimizer, dims, groups, corpus, cfg.async_checkpoint)
    generator = torch.Generator().manual_seed(cfg.seed)
    history = {"step": [], "loss": [], "lr": [], "val_step": [], "val_bpb": [], "tokens": 0, "seconds": 0.0}
    step, max_steps = 0, cfg.max_steps
    if state is not None:
        checkpointer.load(state)
        generator.set_state(state["data_rng"])
        torch.set_rng_state(state["torch_rng"])
        history, step = state["history"], state["step"]
        max_steps = cfg.max_steps if "max_steps" in changes else state["max_steps"]
        if dims.is_main:
            _say(
                f"k3 train: resumed {resume} at step {step} of {max_steps or 'a time budget'} "
                f"({history['tokens']:,} tokens, {history['seconds'] / 60:.1f} min trained so far)"
            )
    if dims.is_main:  # the machine's speed beside the run's, so tokens/s compare across machines
        precision = "bf16 autocast (float32 weights and optimizer states)" if cfg.precision == "bf16" else "float32"
        optimizer_words = "Muon (matrices) + AdamW" if cfg.optimizer == "muon" else "AdamW"
        if cfg.recompute != "none":
            precision += f", {cfg.recompute} activation recompute"
        _say(
            f"k3 train: {mconfig.name}, {num_parameters:,} parameters, "
            f"{data.train.numel():,} training tokens ({data.val.numel():,} validation), {_batch_words(cfg)}, "
            f"{optimizer_words}, "
            f"on {_device_words(cfg, dims.device)}, {precision}, {_threads_words()}{dims.describe()}; "
            f"{machine_speed_words(dims.device)}"
            + (f"; {kernels_words(dims.device)}" if dims.device.type == "cuda" else "")
        )
    metrics = (
        MetricsLog(out, step, Path(resume) if resume else None, cfg.log, dataclasses.asdict(cfg))
        if dims.is_main
        else None
    )
    run = _Run(cfg, dims, model, optimizer, checkpointer, data, tokenizer)
    try:
        return _loop(run, generator, history, step, max_steps, out, progress, metrics, stop)
    except BaseException:
        with contextlib.suppress(Exception):  # the last asynchronous save is whole: commit it before the error
            checkpointer.finish()
        raise
    finally:
        if metrics is not None:
            metrics.close()


def _batch_words(cfg: TrainConfig) -> str:
    if cfg.grad_accum == 1:
        return f"{cfg.batch_size} x {cfg.seq_len} tokens per step"
    return (
        f"{cfg.batch_size * cfg.grad_accum} x {cfg.seq_len} tokens per step in {cfg.grad_accum} micro-batches "
        f"of {cfg.batch_size}"
    )


def _threads_words() -> str:
    n = torch.get_num_threads()
    return f"{n} CPU thread{'' if n == 1 else 's'}"


def _device_words(cfg: TrainConfig, device: torch.device) -> str:
    """Where the run trains, and why when --device auto chose it."""
    if cfg.device != "auto":
        return str(device)
    return f"{device} (--device auto: CUDA, else MPS, else the CPU)"


class _Run(NamedTuple):
    """What the steps, evaluations and saves of a run work on."""

    cfg: TrainConfig
    dims: ParallelDims
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    checkpointer: Checkpointer
    data: object  # k3.training.data.TokenData
    tokenizer: object


def _loop(
    run: _Run,
    generator: torch.Generator,
    history: dict,
    step: int,
    max_steps: int | None,
    out: Path,
    progress: bool,
    metrics: MetricsLog | None,
    stop: stop_on_signals,
) -> dict:
    """The steps, the evaluations and the saves of `_run`, from `step`; returns the history. A first signal
    (`stop`) ends the steps after the one under way and saves; a second one ends them at once, unsaved."""
    from tqdm import tqdm

    cfg, dims, model, optimizer, checkpointer, data = run[:6]
    val_windows = data.val_windows(cfg.seq_len, cfg.eval_tokens)
    model.train()
    started = time.time() - history["seconds"]
    start = {"step": step, "tokens": history["tokens"], "seconds": history["seconds"]}  # this run's own figures
    bar = tqdm(
        total=max_steps,
        initial=step,
        disable=not (progress and dims.is_main),
        unit="step",
        dynamic_ncols=True,
        desc="train",
        file=sys.stderr,
    )

    def save() -> None:
        history["seconds"] = time.time() - started
        checkpointer.save(out, run.tokenizer, cfg, step, max_steps, generator, history)

    # a time-budget run sets its own step count from the speed of its steps (a resumed one keeps its plan)
    plans = cfg.time_budget is not None and max_steps is None
    step_times: collections.deque = collections.deque(maxlen=50)  # the last steps' seconds (evaluations apart)
    stop.steps_begin()
    doing = None  # what a second signal stops (None: the step under way)
    try:
        while max_steps is None or step < max_steps:
            lr = learning_rate(cfg, step, max_steps)  # None before a time budget's plan: warmup only
            for group in optimizer.param_groups:
                group["lr"] = lr
            step_started = time.time()
            windows = data.batch(cfg.batch_size * cfg.grad_accum, cfg.seq_len, generator)
            try:
                result = train_step(model, optimizer, windows, cfg, dims)
            except NonFiniteLossError as e:
                bar.close()
                raise NonFiniteLossError(
                    f"step {step + 1}: {e}; stopped there without saving it (the checkpoint in "
                    f"{out}, if any, is from before). Lower --lr or raise --warmup, then resume or start "
                    f"again"
                ) from None
            loss, step_seconds = result.loss, time.time() - step_started
            if step >= 2:  # the first two steps warm up allocators and caches: not timed
                step_times.append(step_seconds)
            step += 1
            history["step"].append(step)
            history["loss"].append(loss)
            history["lr"].append(lr)
            history["tokens"] += windows[:, 1:].numel()
            elapsed = time.time() - started
            per_step = sum(step_times) / max(1, len(step_times))
            if plans and max_steps is not None and step % 10 == 0 and step < max_steps:
                if dims.is_main:
                    max_steps = _replan(cfg, step, elapsed, per_step, max_steps, bar)
                max_steps = dims.share(max_steps)  # one clock decides
            if plans and max_steps is None and len(step_times) >= cfg.calibration_steps:
                max_steps = dims.share(_steps_in_budget(cfg, step, elapsed, per_step))
                bar.total = max_steps
                if dims.is_main:
                    bar.write(
                        f"k3 train: {per_step:.2f} s/step; {max_steps} steps fit in "
                        f"{cfg.time_budget:g} min with the evaluations" + _warmup_words(cfg, max_steps),
                        file=sys.stderr,
                    )
            record = {
                "step": step,
                "loss": loss,
                "lr": lr,
                "tokens_per_s": windows[:, 1:].numel() / max(step_seconds, 1e-9),
                "grad_norm": result.grad_norm,
            }
            if qk_clip_threshold(cfg) > 0:  # QK-Clip's figures: the step's largest logit, the heads it scaled
                record.update(max_logit=result.max_logit, qk_clipped_heads=result.qk_clipped_heads)
            if step % cfg.eval_every == 0 or step == max_steps:
                bpb = evaluate(model, data, val_windows, dims, cfg.precision)
                history["val_step"].append(step)
                history["val_bpb"].append(bpb)
                record["val_bpb"] = bpb
                if dims.is_main:
                    bar.write(f"step {step}: train loss {loss:.3f}, validation {bpb:.3f} bits/byte", file=sys.stderr)
            if metrics is not None:
                metrics.write(record)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{history['tokens'] / max(elapsed, 1e-9):.0f}", lr=f"{lr:.1e}")
            bar.update(1)
            checkpointer.poll()  # an asynchronous save written everywhere: commit it
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step != max_steps:
                doing = f"the save of step {step}"
                save()
                doing = None
            # a signal: finish the step, so the checkpoint resumes exactly (all processes at the same step)
            if dims.any(stop.requested):
                bar.close()
                doing = f"the save of step {step}"
                save()
                checkpointer.finish()  # (an asynchronous one: written and committed before the message)
                if dims.is_main:
                    _say(
                        f"\ninterrupted ({signal_words(stop.signum or signal.SIGTERM)}) at step {step}; checkpoint "
                        f"saved. Resume with:\n  k3 train --resume {out}"
                    )
                raise Interrupted(stop.signum or signal.SIGTERM, said=True)  # (a process torchrun signalled alone)
        bar.close()
        stop.during, doing = "the final evaluation and save", "the final evaluation"
        said = _final_evaluation(run, history, step, metrics)
        doing = f"the final save (step {step})"
        save()
    except KeyboardInterrupt as e:
        if getattr(e, "said", False):
            raise
        bar.close()  # a second signal: stopped at once, nothing saved
        if dims.is_main:
            _say(
                f"\nstopped at once in {doing or f'step {step + 1}'}, without saving; {out} holds what its last "
                f"save wrote, whole (k3 train --resume {out} continues it), or no checkpoint if the run had saved none"
            )
        raise Interrupted(getattr(e, "signum", signal.SIGINT), said=True) from None
    checkpointer.finish()
    if dims.is_main:
        _say(f"k3 train: done, {_run_words(step, history, start)}; {said}; checkpoint in {out}")
    return history


def _final_evaluation(run: _Run, history: dict, step: int, metrics: MetricsLog | None) -> str:
    """The run's final evaluation (into `history` and the metrics), and what to say of it."""
    cfg, data = run.cfg, run.data
    if cfg.final_eval_tokens == 0:  # asked for no final evaluation
        history.pop("final_val_bpb", None)
        return "no final evaluation (final_eval_tokens 0)"
    final_windows = data.val_windows(cfg.seq_len, cfg.final_eval_tokens)
    final = evaluate(run.model, data, final_windows, run.dims, cfg.precision)
    history["final_val_bpb"] = final
    if metrics is not None:
        metrics.write({"step": step, "final_val_bpb": final, "final_eval_tokens": final_windows[:, 1:].numel()})
    return (
        f"validation {final:.3f} bits per byte ({final_windows[:, 1:].numel():,} of {data.val.numel():,} "
        f"validation tokens)"
    )


def _run_words(step: int, history: dict, start: dict) -> str:
    """This run's steps, tokens, minutes and speed; for a resumed run, the checkpoint's totals beside them."""
    steps, tokens = step - start["step"], history["tokens"] - start["tokens"]
    seconds = max(history["seconds"] - start["seconds"], 1e-9)
    words = f"{steps} steps, {tokens:,} tokens in {seconds / 60:.1f} min ({tokens / seconds:.0f} tokens/s)"
    if start["step"] == 0:
        return words
    return (
        f"this run {words} from step {start['step']}; in all {step} steps, {history['tokens']:,} tokens, "
        f"{history['seconds'] / 60:.1f} min"
    )
