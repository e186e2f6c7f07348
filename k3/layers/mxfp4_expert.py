"""A routed expert kept in MXFP4 (Kimi K3's published experts): 4.25 bits a weight in memory, each matrix
decoded to the model's dtype when the expert runs.

`MXFP4Expert` stands in for `Expert` inside `RoutedExperts`: it has the same `w1`, `w3`, `w2` (read-only
properties that decode on access, so every dispatch path of `RoutedExperts` runs it unchanged), `act`
and `forward`. What it stores are the checkpoint's tensors under the checkpoint's names,
`w1.weight_packed` uint8 [hidden, dim / 2] and `w1.weight_scale` uint8 [hidden, dim / 32] (and so for w3,
w2), the compressed-tensors layout of `k3.ops.mxfp4`. It is for inference: the codes have no gradient.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops import mxfp4
from .moe import Expert

MATRICES = ("w1", "w3", "w2")
PARTS = ("weight_packed", "weight_scale")


class MXFP4Expert(nn.Module):
    """One routed expert, w2(act(w1 x) * w3 x), whose matrices stay MXFP4-encoded (module docstring)."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        activation: str = "swiglu",
        situ_beta: float = 4.0,
        situ_linear_beta: float | None = 25.0,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        for size in (dim, hidden):
            if size % mxfp4.GROUP_SIZE:
                raise ValueError(
                    f"MXFP4Expert: the expert's sizes must be multiples of {mxfp4.GROUP_SIZE} "
                    f"(one scale per {mxfp4.GROUP_SIZE} inputs), got dim {dim}, hidden {hidden}"
                )
        self.activation, self.situ_beta, self.situ_linear_beta = activation, situ_beta, situ_linear_beta
        self.dtype = dtype  # what the matrices decode to; follows model.to(dtype)
        shapes = {"w1": (hidden, dim), "w3": (hidden, dim), "w2": (dim, hidden)}
        for name, (rows, cols) in shapes.items():
            self.register_buffer(f"{name}_packed", torch.zeros(rows, cols // 2, dtype=torch.uint8))
            self.register_buffer(f"{name}_scale", torch.zeros(rows, cols // mxfp4.GROUP_SIZE, dtype=torch.uint8))

    @classmethod
    def from_expert(cls, expert: Expert) -> "MXFP4Expert":
        """The MXFP4 encoding of a full-precision expert (same activation)."""
        hidden, dim = expert.w1.shape
        out = cls(dim, hidden, expert.activation, expert.situ_beta, expert.situ_linear_beta, expert.w1.dtype)
        for name in MATRICES:
            out.set_matrix(name, *mxfp4.encode(getattr(expert, name)))
        return out

    def set_matrix(self, name: str, packed: torch.Tensor, scale: torch.Tensor) -> None:
        """Store matrix `name` (w1, w3 or w2) from its packed codes and scales."""
        getattr(self, f"{name}_packed").copy_(packed)
        getattr(self, f"{name}_scale").copy_(scale)

    def matrix(self, name: str) -> torch.Tensor:
        """Matrix `name` decoded to `self.dtype`."""
        return mxfp4.decode(getattr(self, f"{name}_packed"), getattr(self, f"{name}_scale"), self.dtype)

    w1 = property(lambda self: self.matrix("w1"))
    w3 = property(lambda self: self.matrix("w3"))
    w2 = property(lambda self: self.matrix("w2"))
    forward = Expert.forward
    act = Expert.act

    def reset_parameters(self, std: float | None = None, residual_std: float | None = None) -> None:
        """Nothing to initialise: the codes come from a checkpoint."""

    def nbytes(self) -> int:
        """Bytes held: 4.25 bits per weight."""
        return sum(b.nbytes for b in self.buffers())

    # -- the checkpoint's names: `w1.weight_packed` for the buffer `w1_packed` ----------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name in MATRICES:
            for part, suffix in zip(PARTS, ("packed", "scale")):
                buffer = getattr(self, f"{name}_{suffix}")
                destination[f"{prefix}{name}.{part}"] = buffer if keep_vars else buffer.detach()

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        for name in MATRICES:
            for part, suffix in zip(PARTS, ("packed", "scale")):
                key, buffer = f"{prefix}{name}.{part}", getattr(self, f"{name}_{suffix}")
                if key not in state_dict:
                    missing_keys.append(key)
                elif state_dict[key].shape != buffer.shape:
                    error_msgs.append(
                        f"size mismatch for {key}: checkpoint {list(state_dict[key].shape)}, model {list(buffer.shape)}"
                    )
                else:
                    with torch.no_grad():
                        buffer.copy_(state_dict[key])

    def _apply(self, fn, recurse=True):
        """Follow `.to(dtype)` / `.half()` for the decoded matrices; the uint8 codes stay as they are."""
        self.dtype = fn(torch.empty(0, dtype=self.dtype, device=self.w1_packed.device)).dtype
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        hidden, half = self.w1_packed.shape
        return f"dim={2 * half}, hidden={hidden}, MXFP4 -> {self.dtype}"
