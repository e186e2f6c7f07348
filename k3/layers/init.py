"""How k3 initialises weights (GPT-2's scheme, as nanoGPT has it).

Every layer sets all of its own parameters in its `reset_parameters(std, residual_std)`. Its constructor
calls it with std = None: PyTorch's defaults for a layer used on its own (nn.Linear's uniform
initialisation). `CausalLM.reset_parameters` calls it again with a model's values:

- projections and embeddings ~ N(0, std), std = 0.02, biases 0;
- the projections that write into the residual stream (attention and FFN outputs) ~ N(0, residual_std),
  residual_std = std / sqrt(2 * num_layers) in a model (each layer adds two outputs to the stream);
- norms 1; special cases stay with their layer: KDA / Gated DeltaNet's A_log and dt_bias, the short
  convolutions, the AttnRes queries at zero (a uniform mix at the start).

residual_std = None means std. Nothing is initialised on the meta device (Kimi K3 at full size is built
there only to be counted).

Every random draw goes through `normal_` and `uniform_` below. Outside a model they are torch's
(`nn.init.normal_` / `uniform_` on the global generator). Inside `seeded_by_name(names, seed)` (what
`CausalLM.reset_parameters` runs in) each parameter's values are a function of (seed, its name) alone:
its rows are drawn in blocks of ROW_BLOCK, block b from a generator seeded by (seed, name, b). So a
process that holds a shard of a parameter (FSDP's DTensor, any placement) draws exactly that shard's
values, without ever making the whole tensor, and any sharding of the model, or none, gets the same
weights: a model built on the meta device, sharded, then materialised shard by shard equals the one a
single process builds with the same seed.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from typing import Callable, Iterator

import torch
from torch import nn

STD = 0.02  # a model's std (GPT-2's)
ROW_BLOCK = 64  # rows drawn from one generator

_names: dict[int, str] | None = None  # id(parameter) -> name, inside seeded_by_name
_seed = 0


@contextlib.contextmanager
def seeded_by_name(names: dict[int, str], seed: int) -> Iterator[None]:
    """Within: `normal_` / `uniform_` on a tensor in `names` (id -> name) draw from (seed, name, row block)."""
    global _names, _seed
    previous = _names, _seed
    _names, _seed = names, seed
    try:
        yield
    finally:
        _names, _seed = previous


def normal_(tensor: torch.Tensor, std: float) -> torch.Tensor:
    """tensor ~ N(0, std), in place (see the module docstring for which generator draws it)."""
    return _draw(
        tensor,
        lambda g, shape: torch.randn(shape, generator=g, dtype=torch.float32) * std,
        lambda t: nn.init.normal_(t, std=std),
    )


def uniform_(tensor: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """tensor ~ U(low, high), in place (see the module docstring for which generator draws it)."""
    return _draw(
        tensor,
        lambda g, shape: torch.rand(shape, generator=g, dtype=torch.float32) * (high - low) + low,
        lambda t: nn.init.uniform_(t, low, high),
    )


def _draw(tensor: torch.Tensor, sample: Callable, unseeded: Callable) -> torch.Tensor:
    name = None if _names is None else _names.get(id(tensor))
    if name is None or tensor.is_meta:
        return unseeded(tensor)
    local, offset = _local_part(tensor)
    if local.numel() == 0:
        return tensor
    full_rows = tensor.shape[0] if tensor.dim() else 1
    rows = range(offset[0], offset[0] + local.shape[0]) if tensor.dim() else range(1)
    pieces = []
    for block in range(rows.start // ROW_BLOCK, -(-rows.stop // ROW_BLOCK)):
        start, stop = block * ROW_BLOCK, min((block + 1) * ROW_BLOCK, full_rows)
        generator = torch.Generator().manual_seed(_block_seed(name, block))
        values = sample(generator, (stop - start, *tensor.shape[1:]))
        pieces.append(values[max(rows.start, start) - start : min(rows.stop, stop) - start])
    values = torch.cat(pieces) if tensor.dim() else pieces[0].reshape(())
    for dim in range(1, tensor.dim()):  # a shard of the other dimensions: its slice of the rows
        values = values.narrow(dim, offset[dim], local.shape[dim])
    with torch.no_grad():
        local.copy_(values)
    return tensor


def _local_part(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The part of `tensor` this process holds and where it starts in the whole (a DTensor's shard)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor, (0,) * tensor.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tensor.to_local(), tuple(offset)


def _block_seed(name: str, block: int) -> int:
    digest = hashlib.sha256(f"{_seed}/{name}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def kaiming_uniform_fan_in_(tensor: torch.Tensor) -> torch.Tensor:
    """nn.Conv1d's / nn.Linear's default, U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (kaiming_uniform_ with a = sqrt(5))."""
    fan_in = math.prod(tensor.shape[1:])
    bound = 1 / math.sqrt(fan_in) if fan_in else 0.0
    return uniform_(tensor, -bound, bound)


def init_linear(linear: nn.Linear, std: float | None) -> None:
    """Weight ~ N(0, std), bias 0; std None: nn.Linear's own initialisation."""
    if std is None:
        linear.reset_parameters()
        return
    normal_(linear.weight, std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)
