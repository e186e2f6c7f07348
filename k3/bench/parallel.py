"""`k3 bench parallel`: what the processes of `k3 train --parallel fsdp --ep N` send and hold, measured on
real processes (gloo, on this machine's CPUs) beside the planner's model of it (`k3.plan.traffic`).

For each process count and ep, one spawned job per recompute setting takes a warm-up step and then a
measured one. The bytes each process sends are counted at the dispatcher (a TorchDispatchMode that sees
every c10d collective, FSDP2's, DTensor's and k3's own all-to-alls), converted as the planner counts them:
an all-gather of a P-byte input over M ranks sends (M - 1) P, a reduce-scatter of an input I sends
(M - 1) I / M, an all-to-all what goes to the other ranks, an all-reduce 2 (M - 1) I / M. Memory: each
process's peak resident set (ru_maxrss) after the steps, and its rise over the process once its model is
sharded and its optimizer built (activations, gradients, optimizer states, gather buffers).
"""

from __future__ import annotations

import collections
import os
import resource
import socket
import tempfile

import torch

from ..training.dist_muon import EXCHANGING

__all__ = ["run", "measure"]

CATEGORY = {
    "_allgather_base_": "fsdp all-gather",
    "_reduce_scatter_base_": "fsdp reduce-scatter",
    "all_gather_into_tensor": "muon all-gather (whole)",
    "alltoall_base_": "all-to-all",
    "allreduce_": "all-reduce",
    "all_reduce": "all-reduce",
}


class SentBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes this process sends, by collective (see the module), for the ops run under it."""

    def __init__(self):
        super().__init__()
        self.sent: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional") and func._opname in CATEGORY:
            category = CATEGORY[func._opname]
            if category == "all-to-all" and EXCHANGING.get():  # distributed Muon's, not the experts'
                category = "muon exchange"
            self.sent[category] += self._bytes(func.namespace, func._opname, args)
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _bytes(namespace: str, op: str, args) -> float:
        import torch.distributed as dist

        def size(t) -> int:
            return t.numel() * t.element_size()

        if namespace == "_c10d_functional":  # (input, ..., group size, group name)
            n = args[1] if op == "all_gather_into_tensor" else dist.get_world_size()
            return (n - 1) * size(args[0]) if op == "all_gather_into_tensor" else 2 * (n - 1) / n * size(args[0])
        if op == "allreduce_":  # (tensors, group, ...)
            n = dist.ProcessGroup.unbox(args[1]).size()
            return sum(2 * (n - 1) / n * size(t) for t in args[0])
        group = dist.ProcessGroup.unbox(args[2])
        n, tensor = group.size(), args[1]
        if op == "_allgather_base_":
            return (n - 1) * size(tensor)
        if op == "_reduce_scatter_base_":
            return (n - 1) / n * size(tensor)
        splits = list(args[4]) or [tensor.shape[0] // n] * n  # alltoall_base_: input rows to each rank
        row = size(tensor) // max(tensor.shape[0], 1)
        return (sum(splits) - splits[group.rank()]) * row


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (Linux reports KiB)


def _torchrun_environment(rank: int, world: int, port: int) -> None:
    """This spawned process as rank `rank` of `world` on this machine (torchrun's variables), on one thread."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)


def _worker(rank: int, world: int, port: int, settings: dict, out: str) -> None:
    from ..models import get_config
    from ..training import TrainConfig
    from ..training.build import build, build_model
    from ..training.parallel import init_parallel
    from ..training.step import train_step

    _torchrun_environment(rank, world, port)
    torch.manual_seed(0)  # the same initial weights in every job (fp32 and bf16 runs compare one model)
    cfg = TrainConfig(
        batch_size=settings["batch_size"],
        seq_len=settings["seq_len"],
        recompute=settings["recompute"],
        ep=settings["ep"],
        optimizer=settings["optimizer"],
        precision=settings["precision"],
    )
    dims = init_parallel("fsdp", "cpu", settings["ep"])
    model = build_model(get_config(settings["preset"], vocab_size=257), dims)
    optimizer, _ = build(model, cfg, dims)
    generator = torch.Generator().manual_seed(0)

    def batch():
        return torch.randint(0, 257, (cfg.batch_size, cfg.seq_len + 1), generator=generator)

    base = _peak_rss()
    train_step(model, optimizer, batch(), cfg, dims)  # optimizer states made
    counter = SentBytes()
    with counter:
        loss = train_step(model, optimizer, batch(), cfg, dims).loss
    result = {
        "sent": dict(counter.sent),
        "peak rss": _peak_rss(),
        "rss rise": _peak_rss() - base,
        "loss": loss,
        "ns_flops": getattr(optimizer, "ns_flops", 0),
    }
    _gather_to_file(result, world, out)


def _gather_to_file(result: dict, world: int, out: str) -> None:
    """Every process's `result`, in rank order, saved by rank 0 at `out`; then the process group ends."""
    import torch.distributed as dist

    results = [None] * world
    dist.all_gather_object(results, result)
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def measure(
    world: int,
    ep: int,
    preset: str = "kimi-k3-tiny",
    seq_len: int = 256,
    batch_size: int = 8,
    recompute: str = "none",
    optimizer: str = "muon",
    precision: str = "fp32",
) -> list[dict]:
    """One job of `world` gloo processes under fsdp x ep `ep`: per process, the bytes sent in one step by
    collective, and memory (see the module). `precision` "bf16": `k3 train --precision bf16` (bf16
    autocast; FSDP gathers bfloat16 weights and reduces float32 gradients)."""
    settings = dict(
        ep=ep,
        preset=preset,
        seq_len=seq_len,
        batch_size=batch_size,
        recompute=recompute,
        optimizer=optimizer,
        precision=precision,
    )
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "results.pt")
        torch.multiprocessing.spawn(_worker, args=(world, _free_port(), settings, out), nprocs=world)
        return torch.load(out, weights_only=False)


def planned(
    world: int,
    ep: int,
    preset: str = "kimi-k3-tiny",
    seq_len: int = 256,
    batch_size: int = 8,
    recompute: str = "none",
    optimizer: str = "muon",
    precision: str = "fp32",
) -> dict[str, float]:
    """`k3.plan.traffic.step_traffic` for the same job: float32 gradients and updates; the gathered
    weights and the exchanged rows in float32, or in bfloat16 under `precision` "bf16"."""
    from ..models import get_config
    from ..plan.traffic import step_traffic

    config = get_config(preset, vocab_size=257)
    half = 2 if precision == "bf16" else 4
    return step_traffic(
        config,
        world,
        ep,
        batch_size // world * seq_len,
        optimizer=optimizer,
        recompute=recompute,
        gather_bytes=half,
        row_bytes=half,
    )


def whole_ns_flops(preset: str, ep: int) -> int:
    """The Newton-Schulz FLOPs each rank ran in a step when every rank orthogonalised every matrix it
    holds whole (the dense ones and its ep group's experts): what one owner per matrix divides."""
    from ..models import get_config
    from ..plan.shapes import model_shapes
    from ..training.dist_muon import ns_flops

    shapes = model_shapes(get_config(preset, vocab_size=257))
    dense = [p for ps in shapes.layers + [shapes.first + shapes.last] for p in ps if p.kind == "matrix"]
    experts = [p for n in shapes.experts if n for p in shapes.expert * (n // ep) if p.kind == "matrix"]
    return sum(ns_flops(p.shape) for p in dense + experts)


def run(
    layouts=((2, 1), (2, 2), (4, 2)),
    preset: str = "kimi-k3-tiny",
    seq_len: int = 256,
    batch_size: int = 8,
    json_path: str | None = None,
    precisions=("fp32", "bf16"),
) -> dict:
    """Measure each (processes, ep) of `layouts`: in float32 with recompute none and full, and in each other
    of `precisions` with recompute none; print and return the table."""
    from tqdm import tqdm

    from .timing import write_report

    report = {"preset": preset, "seq_len": seq_len, "batch_size": batch_size, "layouts": []}
    settings = [(p, r) for p in precisions for r in (("none", "full") if p == "fp32" else ("none",))]
    jobs = [(w, e, p, r) for w, e in layouts for p, r in settings]
    for world, ep, precision, recompute in tqdm(jobs, desc="bench parallel", unit="job"):
        ranks = measure(world, ep, preset, seq_len, batch_size, recompute, precision=precision)
        report["layouts"].append(
            {
                "processes": world,
                "ep": ep,
                "recompute": recompute,
                "precision": precision,
                "ranks": ranks,
                "planned": planned(world, ep, preset, seq_len, batch_size, recompute, precision=precision),
                "ns_flops_whole": whole_ns_flops(preset, ep),
            }
        )
    print(format_report(report))
    if json_path:
        write_report(json_path, report, "parallel")
    return report


def format_report(report: dict) -> str:
    lines = [
        f"k3 bench parallel: {report['preset']}, {report['batch_size']} x {report['seq_len']} tokens a step, "
        f"fsdp x ep on gloo; MB sent per process in one step (max over processes) beside k3 plan's model"
    ]
    for row in report["layouts"]:
        ranks, plan = row["ranks"], row["planned"]
        precision = row.get("precision", "fp32")
        head = f"{row['processes']} processes, ep {row['ep']}, recompute {row['recompute']}, {precision}:"
        cells = []
        for name in ("fsdp all-gather", "fsdp reduce-scatter", "muon exchange"):
            cells.append(f"{name} {max(r['sent'].get(name, 0) for r in ranks) / 1e6:.3f} (plan {plan[name] / 1e6:.3f})")
        whole = plan["muon all-gather (whole)"]
        flops = [r.get("ns_flops", 0) for r in ranks]
        cells.append(
            f"muon: {max(r['sent'].get('muon exchange', 0) for r in ranks) / max(whole, 1):.3f}x the bytes of "
            f"gathering every matrix whole ({whole / 1e6:.3f} MB); Newton-Schulz {max(flops) / 1e9:.3f} GFLOP "
            f"on the busiest rank, {row.get('ns_flops_whole', 0) / 1e9:.3f} when each ran them all"
        )
        a2a = [r["sent"].get("all-to-all", 0) / 1e6 for r in ranks]
        cells.append(
            f"all-to-all {min(a2a):.3f}-{max(a2a):.3f} (plan {plan['all-to-all (uniform)'] / 1e6:.3f} "
            f"uniform, {plan['all-to-all (bound)'] / 1e6:.3f} bound)"
        )
        cells.append(f"all-reduce {max(r['sent'].get('all-reduce', 0) for r in ranks) / 1e3:.1f} kB")
        rss = [r["rss rise"] / 2**20 for r in ranks]
        peak = max(r["peak rss"] for r in ranks) / 2**20
        cells.append(f"peak RSS rise {min(rss):.0f}-{max(rss):.0f} MiB (peak {peak:.0f} MiB)")
        lines.append(head)
        lines += ["  " + c for c in cells]
    return "\n".join(lines)
