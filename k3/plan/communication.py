"""The time a training step's collectives take, and the part of it compute does not hide: `k3 plan --train`'s
step = compute + exposed communication.

Each collective's bytes per GPU (`k3.plan.traffic`) cross the slowest link its group spans, at
COMM_EFFICIENCY of the link's one-direction bandwidth (`k3.plan.hardware`: NVLink within a node of
GPUS_PER_NODE, the GPU's network NIC across nodes). Ranks are laid out as `k3 train` builds its mesh:
a pipeline stage's fsdp ranks consecutive, and within them [fsdp / ep ("efsdp"), ep ("ep")], so an ep
group is ep consecutive ranks and an efsdp group every ep-th one.

- FSDP all-gathers and reduce-scatters (the dense units over the stage's fsdp ranks, the experts over
  their efsdp group): prefetched a unit ahead and reduced behind the backward, so they hide under the
  step's compute; exposed: what exceeds it, and at least the first unit's all-gather, which nothing
  precedes.
- MoE all-to-alls (ep group): a token's rows leave for the ranks of its experts and come back before
  its layer goes on; only the shared experts' compute, which does not wait for them, hides them
  (torchtitan's and DeepSeek's overlap of the routed exchange with the shared expert): exposed, what
  exceeds the shared experts' time. An ep group wider than a node sends (ep - n) / (ep - 1) of its rows
  over the network (n = GPUS_PER_NODE).
- The distributed Muon exchange (after the backward, before the update): exposed whole.

The MFU of the plan's inputs is then the compute's own efficiency; the step's MFU is that diluted by the
exposed communication. Not modelled: latency (a few microseconds a message), congestion, pipeline
stages' point-to-point sends, the loss and norm all-reduces (kilobytes).
"""

from __future__ import annotations

from ..models import ModelConfig
from .hardware import GPUS_PER_NODE, Gpu
from .shapes import Layout

COMM_EFFICIENCY = 0.8  # of a link's bandwidth a large NCCL collective reaches (its bus bandwidth, as measured)


def _link(gpu: Gpu, span: int) -> float:
    """Bytes/s one GPU moves over a group whose ranks span `span` consecutive GPUs."""
    return COMM_EFFICIENCY * (gpu.nvlink_bytes_per_s if span <= GPUS_PER_NODE else gpu.network_bytes_per_s)


def all_to_all_seconds(sent: float, ep: int, gpu: Gpu) -> float:
    """An all-to-all over ep consecutive ranks sending `sent` bytes from each: the rows for ranks in its
    node over NVLink, the others over the network, at the same time."""
    if ep <= 1 or sent == 0:
        return 0.0
    if ep <= GPUS_PER_NODE:
        return sent / _link(gpu, ep)
    off_node = (ep - GPUS_PER_NODE) / (ep - 1)
    return max(sent * (1 - off_node) / _link(gpu, 1), sent * off_node / _link(gpu, ep))


def shared_expert_flops_per_token(config: ModelConfig) -> float:
    """Training FLOPs per token of the shared experts (3 x forward): 6 x their parameters, every MoE layer."""
    if not config.num_shared_experts:
        return 0.0
    width = config.num_shared_experts * config.moe_intermediate_size
    return 6.0 * 3 * config.hidden_size * width * config.mlp_types.count("moe")


def exposed_communication(
    config: ModelConfig, traffic: dict[str, float], layout: Layout, gpu: Gpu, compute_s: float, flops_per_token: float
) -> dict[str, float]:
    """Seconds per step of each collective kind and what of it compute does not hide (see the module)."""
    # the dense units' groups are the stage's fsdp ranks; an efsdp group (every ep-th rank) spans as many
    fsdp_s = (traffic["fsdp all-gather"] + traffic["fsdp reduce-scatter"]) / _link(gpu, layout.fsdp)
    units = max(1, config.num_layers // layout.pp + 1)  # each decoder layer and the root
    first_gather = traffic["fsdp all-gather"] / units / _link(gpu, layout.fsdp)
    a2a_s = all_to_all_seconds(traffic.get("all-to-all (uniform)", 0.0), layout.ep, gpu)
    muon_s = traffic.get("muon exchange", 0.0) / _link(gpu, layout.fsdp)
    shared_s = compute_s * shared_expert_flops_per_token(config) / flops_per_token
    exposed = {
        "FSDP all-gather and reduce-scatter": max(first_gather, fsdp_s - compute_s),
        "MoE all-to-all": max(0.0, a2a_s - shared_s),
        "Muon exchange": muon_s,
    }
    return {
        "time: FSDP all-gather and reduce-scatter": fsdp_s,
        "time: MoE all-to-all": a2a_s,
        "time: Muon exchange": muon_s,
        **{f"exposed: {name}": value for name, value in exposed.items()},
        "exposed communication": sum(exposed.values()),
    }
