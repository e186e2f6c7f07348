"""Helpers for the tests that spawn a few processes talking over gloo on this machine."""

from __future__ import annotations

import datetime
import os
import socket
import sys

import torch


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(rank: int, world: int, port: int) -> None:
    """Make this process rank `rank` of a `world`-process gloo group, as torchrun's environment would
    (one thread a process: a few processes share the 2 cores)."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=180))


def merged_over_ranks(tensors: dict) -> dict:
    """Every rank's {name: tensor} gathered on all, the first rank holding a name giving it (expert
    parallelism: each rank holds its own experts)."""
    parts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, tensors)
    merged = {}
    for part in parts:
        for name, t in part.items():
            merged.setdefault(name, t)
    return merged


def leave() -> None:
    """End this worker: wait for every rank, tear the group down, and exit at once. Exiting skips the
    interpreter's finalization, where gloo's threads (still referenced by meshes and sharded tensors) can
    abort the process after its work is done ("terminate called without an active exception")."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
