"""`torchrun --nproc_per_node=2 -m k3 train --parallel fsdp --async-checkpoint`: the saves are written by a
thread while the next steps run, committed once every process has written its files (at the latest before
the next save and at the end), and the run and its checkpoints are the synchronous run's; a one-process or
ddp run refuses the flag at its start."""

from __future__ import annotations

import pytest
import torch

from k3.models import CausalLM
from k3.training import TrainConfig, train
from k3.training import checkpoint as ckpt_module

from ..corpus import write_corpus
from ..processes import free_port, join, leave
from .test_sharded_checkpoint import run_cfg as sharded_run_cfg

pytestmark = pytest.mark.slow  # 2 spawned processes (gloo), twice


def run_cfg(corpus, out, **kw) -> TrainConfig:
    """test_sharded_checkpoint's run, 6 steps long, a save every 2."""
    return sharded_run_cfg(corpus, out, **{"max_steps": 6, "eval_every": 3, **kw})


def _worker(rank: int, port: int, corpus: str, root: str) -> None:
    from k3.training.checkpointer import Checkpointer

    join(rank, 2, port)
    commits = []
    finish = Checkpointer.finish

    def counted(self):  # which steps' saves were committed, and when
        if self._pending is not None:
            commits.append(self._pending.step)
        return finish(self)

    Checkpointer.finish = counted
    results = {
        "sync": train(run_cfg(corpus, f"{root}/sync"), progress=False, parallel="fsdp"),
        "async": train(run_cfg(corpus, f"{root}/async", async_checkpoint=True), progress=False, parallel="fsdp"),
        "commits": commits,
    }
    if rank == 0:
        torch.save(results, f"{root}/results.pt")
    leave()


def test_asynchronous_saves_give_the_synchronous_run_and_checkpoints(tmp_path):
    (tmp_path / "corpus").mkdir()
    corpus = write_corpus(tmp_path / "corpus", docs=4, words=300)
    torch.multiprocessing.spawn(_worker, args=(free_port(), str(corpus), str(tmp_path)), nprocs=2)
    results = torch.load(tmp_path / "results.pt", weights_only=False)
    assert results["async"]["loss"] == results["sync"]["loss"]
    assert results["commits"] == [2, 4, 6]  # every save committed, in order, the last before the end
    for name in ("sync", "async"):
        state = ckpt_module.load_training_checkpoint(tmp_path / name)
        assert state["step"] == 6 and state["sharded"] is not None
    a = CausalLM.from_pretrained(tmp_path / "async").state_dict()
    b = CausalLM.from_pretrained(tmp_path / "sync").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)
    # and it resumes as the synchronous checkpoint does
    resumed = train(TrainConfig(max_steps=8), resume=str(tmp_path / "async"), asked=("max_steps",), progress=False)
    assert resumed["step"][-1] == 8


def test_one_process_refuses_async_checkpoint(tmp_path):
    (tmp_path / "corpus").mkdir()
    corpus = write_corpus(tmp_path / "corpus", docs=2, words=100)
    with pytest.raises(ValueError, match="--async-checkpoint .* needs torchrun with --parallel ddp, fsdp or ep"):
        train(run_cfg(corpus, tmp_path / "one", async_checkpoint=True, max_steps=2), progress=False)
