"""What every layer's decode cache offers, whatever it holds.

A mixer layer keeps its decode state in a small typed object that the caller owns and the layer updates
in place (`KVCache` for softmax attention, `LatentCache` for MLA, `RecurrentCache` for the linear
family). Each names its tensors once, in `tensor_fields`; those that grow by one row per token, [B, S, ...],
are also listed in `sequence_fields` (a recurrent state has none: its size is fixed). Everything else
(`tensors`, `batch_size`, `nbytes`) follows from that.
"""

from __future__ import annotations

import torch


class LayerCache:
    """Base of the per-layer caches (dataclasses whose fields are tensors, tuples of tensors, or None)."""

    tensor_fields: tuple[str, ...] = ()
    sequence_fields: tuple[str, ...] = ()

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held, in field order (tuples flattened; empty fields skipped)."""
        out: list[torch.Tensor] = []
        for name in self.tensor_fields:
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                out.append(value)
            elif isinstance(value, (tuple, list)):
                out.extend(value)
        return out

    @property
    def batch_size(self) -> int | None:
        """Rows of the cached tensors, or None while the cache is empty."""
        tensors = self.tensors()
        return tensors[0].shape[0] if tensors else None

    def nbytes(self) -> int:
        """Bytes held."""
        return sum(t.numel() * t.element_size() for t in self.tensors())
