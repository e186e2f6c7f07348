"""Parallelism applied to a CausalLM from outside, split as torchtitan splits it: `dims` (how a run is
spread over processes, the one reader of torchrun's environment), `expert_parallel` (the routed experts
split over ranks, the tokens exchanged by all-to-all) and `parallelize` (FSDP2 for every mode,
activation recompute, torch.compile). The models never learn about ranks."""

from .dims import (
    MODES,
    TORCHRUN_ENV,
    ParallelDims,
    check_ep,
    check_expert_split,
    fsdp_mesh,
    init_parallel,
    launch,
    parallel_dims,
)
from .expert_parallel import held_expert_parameters, shard_experts
from .parallelize import (
    RECOMPUTE,
    SELECTIVE_EVERY,
    apply_fsdp,
    apply_recompute,
    compile_decoder,
    load_expert_parallel,
    materialize,
    mixed_precision,
    parallelize,
)

__all__ = [
    "MODES",
    "RECOMPUTE",
    "SELECTIVE_EVERY",
    "TORCHRUN_ENV",
    "ParallelDims",
    "apply_fsdp",
    "apply_recompute",
    "check_ep",
    "check_expert_split",
    "compile_decoder",
    "fsdp_mesh",
    "held_expert_parameters",
    "init_parallel",
    "launch",
    "load_expert_parallel",
    "materialize",
    "mixed_precision",
    "parallel_dims",
    "parallelize",
    "shard_experts",
]
