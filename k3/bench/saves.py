"""`k3 bench parallel --saves`: what a checkpoint costs the training steps, synchronous against
`--async-checkpoint`, measured on gloo processes of `--parallel fsdp`.

Each job runs `steps` training steps of the model and saves (`Checkpointer.save`, as `k3 train` does)
after every `every`-th; per process, the seconds each step took, the seconds the save call held the
loop (synchronous: the DCP write, the hashing and the commit; asynchronous: the copy to CPU memory,
the files written by a thread while the next steps run, the commit once every process is done), and
whether the saves were all committed. The figure that matters is the loop's time from a save's start
to the end of the next step, beside two plain steps.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch

from .parallel import _free_port, _gather_to_file, _torchrun_environment


def _worker(rank: int, world: int, port: int, settings: dict, out: str) -> None:
    from ..models import get_config
    from ..tokenizer import byte_tokenizer
    from ..training import TrainConfig
    from ..training.build import build, build_model
    from ..training.checkpoint import load_training_checkpoint
    from ..training.checkpointer import Checkpointer
    from ..training.parallel import init_parallel
    from ..training.step import train_step

    _torchrun_environment(rank, world, port)
    torch.manual_seed(0)
    cfg = TrainConfig(
        batch_size=settings["batch_size"], seq_len=settings["seq_len"], async_checkpoint=settings["async"]
    )
    dims = init_parallel("fsdp", "cpu")
    model = build_model(get_config(settings["preset"], vocab_size=257, **settings["overrides"]), dims)
    optimizer, groups = build(model, cfg, dims)
    checkpointer = Checkpointer(model, optimizer, dims, groups, asynchronous=cfg.async_checkpoint)
    generator = torch.Generator().manual_seed(0)
    history = {"step": [], "loss": [], "lr": [], "val_step": [], "val_bpb": [], "tokens": 0, "seconds": 0.0}
    steps, saves = [], []
    for step in range(1, settings["steps"] + 1):
        began = time.perf_counter()
        batch = torch.randint(0, 257, (cfg.batch_size, cfg.seq_len + 1), generator=generator)
        train_step(model, optimizer, batch, cfg, dims)
        checkpointer.poll()
        steps.append(time.perf_counter() - began)
        if step % settings["every"] == 0:
            began = time.perf_counter()
            checkpointer.save(settings["folder"], byte_tokenizer(), cfg, step, settings["steps"], generator, history)
            saves.append(time.perf_counter() - began)
    checkpointer.finish()
    saved = load_training_checkpoint(settings["folder"])["step"] if rank == 0 else None
    _gather_to_file({"steps": steps, "saves": saves, "saved step": saved}, world, out)


def measure(
    asynchronous: bool,
    world: int = 2,
    preset: str = "kimi-k3-tiny",
    overrides: dict | None = None,
    seq_len: int = 64,
    batch_size: int = 4,
    steps: int = 12,
    every: int = 4,
) -> list[dict]:
    """One job (see the module): per process, its step times, save-call times and the step it saved last."""
    with tempfile.TemporaryDirectory() as folder:
        settings = dict(
            preset=preset,
            overrides=overrides or {},
            seq_len=seq_len,
            batch_size=batch_size,
            steps=steps,
            every=every,
            folder=os.path.join(folder, "run"),
            **{"async": asynchronous},
        )
        out = os.path.join(folder, "results.pt")
        torch.multiprocessing.spawn(_worker, args=(world, _free_port(), settings, out), nprocs=world)
        return torch.load(out, weights_only=False)


def summary(ranks: list[dict], every: int) -> dict:
    """The slowest process's figures: median plain step, median save call, and the median time from a
    save's start to the end of the step after it (what the loop lost to it, with the step)."""
    worst = max(ranks, key=lambda r: sum(r["saves"]))
    after = [worst["steps"][i] for i in range(every, len(worst["steps"]), every)]  # the step after each save
    plain = [t for i, t in enumerate(worst["steps"]) if i % every != 0 and i > 1]
    return {
        "plain step s": statistics.median(plain),
        "save call s": statistics.median(worst["saves"]),
        "save + next step s": statistics.median(s + a for s, a in zip(worst["saves"], after)),
        "saved step": ranks[0]["saved step"],
    }


def run(
    world: int = 2, preset: str = "kimi-k3-tiny", overrides: dict | None = None, json_path: str | None = None, **kw
) -> dict:
    """Both ways, one after the other, printed side by side (and written to `json_path` as JSON)."""
    from .timing import write_report

    every = kw.get("every", 4)
    report = {
        mode: summary(measure(mode == "async", world, preset, overrides, **kw), every) for mode in ("sync", "async")
    }
    for mode, figures in report.items():
        print(
            f"k3 bench parallel --saves, {world} processes, {mode}: plain step {figures['plain step s']:.3f} s, "
            f"save call {figures['save call s']:.3f} s, save + next step {figures['save + next step s']:.3f} s "
            f"(last committed: step {figures['saved step']})"
        )
    if json_path:
        write_report(json_path, report, "parallel --saves")
    return report
