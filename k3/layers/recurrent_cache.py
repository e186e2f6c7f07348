"""The linear family's decode caches: the fixed-size recurrent state and the short convolutions' windows,
growing-batch (`RecurrentCache`) and preallocated (`StaticRecurrentCache`) variants (k3.layers.cache)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import LayerCache


@dataclass
class RecurrentCache(LayerCache):
    """Decode state of one linear-family layer: conv states (q, k, v) [N, D, W-1] (None for plain
    linear attention) and the recurrent state, [N, H, K, V] (or (S, z) for linear attention)."""

    conv_states: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    recurrent_state: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None

    tensor_fields = ("conv_states", "recurrent_state")  # nothing grows with the sequence

    def conv_window(self) -> torch.Tensor:
        """The three conv states joined along the channels, [N, 3D, W-1] (what a decode step reads)."""
        return torch.cat(self.conv_states, dim=1)

    def store(self, recurrent_state, conv_states=None, conv_window: torch.Tensor | None = None) -> None:
        """Keep a forward's new state: the recurrent state, and the conv states as three tensors or as one
        joined window [N, 3D, W-1] (split here). A growing cache adopts the tensors given."""
        if conv_window is not None:
            conv_states = tuple(conv_window.split(conv_window.shape[1] // 3, dim=1))
        if conv_states is not None:
            self.conv_states = tuple(conv_states)
        self.recurrent_state = recurrent_state


class StaticRecurrentCache(RecurrentCache):
    """A linear-family layer's decode state in buffers allocated once, updated in place (transformers'
    static linear-attention layers; vLLM's state pool): the three conv states as one window
    [N, 3D, W-1] (`conv_window`, read whole by a decode step; `conv_states` gives its three views) and the
    recurrent state [N, H, K, V] (linear attention: (S, z)). They start at zero, which is a fresh
    sequence's state; `store` copies a forward's new state into them, so their addresses never change."""

    static = True

    def __init__(self, window: torch.Tensor | None, recurrent_state):
        self._window, self.recurrent_state = window, recurrent_state

    @property
    def conv_states(self):
        return None if self._window is None else tuple(self._window.split(self._window.shape[1] // 3, dim=1))

    def conv_window(self) -> torch.Tensor:
        return self._window

    def buffers(self) -> list[torch.Tensor]:
        """The tensors allocated for this cache: the conv window (when the layer has convolutions) and the state(s)."""
        return [t for t in (self._window, *_as_tuple(self.recurrent_state)) if t is not None]

    def store(self, recurrent_state, conv_states=None, conv_window: torch.Tensor | None = None) -> None:
        if conv_window is not None:
            self._window.copy_(conv_window)
        elif conv_states is not None:
            D = self._window.shape[1] // 3
            for i, state in enumerate(conv_states):  # narrow: one view at a time (split's may not be written)
                self._window.narrow(1, i * D, D).copy_(state)
        for buffer, state in zip(_as_tuple(self.recurrent_state), _as_tuple(recurrent_state)):
            buffer.copy_(state)

    def reorder(self, index: torch.Tensor) -> None:
        raise NotImplementedError(
            "StaticRecurrentCache: a static cache keeps its rows in place; reorder a "
            "growing cache (model.new_cache(batch_size) without max_length)"
        )


def _as_tuple(state) -> tuple:
    return tuple(state) if isinstance(state, (tuple, list)) else (state,)
