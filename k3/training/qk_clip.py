"""QK-Clip, the "Clip" of Kimi K2's MuonClip (K2 report, Sec 2.1, Algorithm 1): after each optimizer step,
every softmax-attention head whose largest pre-softmax logit of the step went above tau has its query
and key weights scaled down, so that the same inputs would give tau:

    S_max^h = max over the step's tokens (every micro-batch, every process) of scale * q_i^h . k_j^h, j <= i
    gamma_h = min(1, tau / S_max^h)
    MLA:  head h's q^C (nope) rows of q_b_proj (q_proj without a query LoRA) x sqrt(gamma_h),
          its q^R (rotary) rows x gamma_h, its k^C (key nope) rows of kv_b_proj x sqrt(gamma_h)
    MHA:  head h's q rows and k rows of c_attn (weights and biases) x sqrt(gamma_h)

A logit is q . k, so both parts of an MLA logit, q^C . k^C and q^R . k^R, and an MHA logit shrink by
gamma_h: the head's largest logit on the step's batch becomes tau. MLA's value rows, its rotary key k^R
(one for all heads, in kv_a_proj_with_mqa), the norms and the down-projections are left as they are,
as are heads at or under tau, bit for bit. This is Megatron-LM's `clip_qk` with alpha 0.5 (q^C x
eta^alpha, q^R x eta, k^C x eta^(1 - alpha)).

The layers record S_max in their training forwards while `begin_step` asks them (k3.layers.max_logit);
the model knows nothing of processes: `clip` takes a `max_over_processes` (the ParallelDims' MAX
all-reduce), so that every process of a torchrun job clips with the global batch's maxima, identically.
Under FSDP a weight is a DTensor whose rows are split over the ranks: each rank scales its own rows.
The clip is a function of the step's batch and weights, so a resumed run clips as the uninterrupted one.
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers.attention import MultiHeadAttention
from ..layers.mla import MultiHeadLatentAttention

__all__ = ["attention_layers", "begin_step", "head_max_logits", "clip"]


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """The softmax-attention layers of `model` (MLA and GPT-2 attention), in module order."""
    return [m for m in model.modules() if isinstance(m, (MultiHeadLatentAttention, MultiHeadAttention))]


def begin_step(model: nn.Module, tau: float) -> list[nn.Module]:
    """Clear what `model`'s attention layers recorded, and have them record their heads' largest logits
    in the step's training forwards when `tau` > 0 (else not at all). Returns the layers."""
    layers = attention_layers(model)
    for layer in layers:
        layer.record_max_logits, layer.max_logits = tau > 0, None
    return layers


def head_max_logits(layers: list[nn.Module], device: torch.device) -> torch.Tensor:
    """Every head's recorded S_max, the layers' [H] one after the other (float64, on `device`); -inf for
    a layer that recorded nothing."""
    parts = [
        torch.full((layer.num_heads,), float("-inf"), dtype=torch.float64, device=device)
        if layer.max_logits is None
        else layer.max_logits.to(device, torch.float64)
        for layer in layers
    ]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=device)


def clip(layers: list[nn.Module], tau: float, max_over_processes=None) -> tuple[float | None, int]:
    """QK-Clip of `layers` (`begin_step`'s, after the step's forwards and its optimizer step) at `tau` > 0,
    with each head's S_max taken over the processes by `max_over_processes` (a function of the [n]
    maxima, in place or returned; None: this process alone). Returns the largest logit of the step
    (None without attention layers) and how many heads were clipped."""
    if not tau > 0:
        raise ValueError(f"qk_clip.clip: `tau` must be a finite number > 0, got {tau!r}")
    if not layers:
        return None, 0
    device = next(layers[0].parameters()).device
    maxima = head_max_logits(layers, device)
    if max_over_processes is not None:
        maxima = max_over_processes(maxima)
    over = maxima > tau
    gamma = torch.where(over, tau / maxima, torch.ones_like(maxima))  # min(1, tau / S_max): 1 where not over
    with torch.no_grad():
        for layer, g, hit in zip(
            layers, gamma.split([m.num_heads for m in layers]), over.split([m.num_heads for m in layers])
        ):
            if hit.any():  # a layer with no head over tau is not touched at all
                (_clip_mla if isinstance(layer, MultiHeadLatentAttention) else _clip_mha)(layer, g)
    return maxima.max().item(), int(over.sum())


def _clip_mla(mla: MultiHeadLatentAttention, gamma: torch.Tensor) -> None:
    """q rows [H, dn + dr] per head: nope x sqrt(gamma), rope x gamma; kv_b rows [H, dn + dv] per head:
    key x sqrt(gamma), value x 1 (k3.layers.mla's layouts)."""
    H, dn = mla.num_heads, mla.dn
    root = gamma.sqrt()[:, None]
    q = torch.ones(H, dn + mla.dr, dtype=gamma.dtype, device=gamma.device)
    q[:, :dn], q[:, dn:] = root, gamma[:, None]
    kv = torch.ones(H, dn + mla.dv, dtype=gamma.dtype, device=gamma.device)
    kv[:, :dn] = root
    _scale_rows((mla.q_proj if mla.q_lora_rank is None else mla.q_b_proj).weight, q.flatten())
    _scale_rows(mla.kv_b_proj.weight, kv.flatten())


def _clip_mha(mha: MultiHeadAttention, gamma: torch.Tensor) -> None:
    """c_attn's rows [3 (q, k, v), H, D]: head h's q and k rows x sqrt(gamma_h), biases alike; values x 1."""
    D = mha.hidden_size // mha.num_heads
    rows = torch.ones(3, mha.num_heads, D, dtype=gamma.dtype, device=gamma.device)
    rows[:2] = gamma.sqrt()[None, :, None]
    _scale_rows(mha.c_attn.weight, rows.flatten())
    if mha.c_attn.bias is not None:
        _scale_rows(mha.c_attn.bias, rows.flatten())


def _scale_rows(param: torch.Tensor, factor: torch.Tensor) -> None:
    """param [rows, ...] *= factor [rows], row by row, in place (the factor rounded to param's dtype). A
    sharded parameter (FSDP's DTensor) scales the rows this rank holds by their slice of the factor."""
    factor = factor.to(param.dtype).view(-1, *([1] * (param.dim() - 1)))
    if not hasattr(param, "device_mesh"):
        param.mul_(factor)
        return
    from torch.distributed.tensor import distribute_tensor

    mine = distribute_tensor(factor, param.device_mesh, param.placements, src_data_rank=None).to_local()
    param.to_local().mul_(mine)
