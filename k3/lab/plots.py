"""Figures for `k3 lab`: matplotlib without a display, written atomically."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from ..io import atomic_write


@contextmanager
def figure(path: Path, ncols: int = 1, nrows: int = 1, size: tuple[float, float] | None = None):
    """`with figure(path, ncols=2) as (fig, axes): ...` then the PNG is at `path` (its folder is created)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    size = size or (5.0 * ncols, 3.8 * nrows)
    fig, axes = plt.subplots(nrows, ncols, figsize=size, dpi=100, squeeze=False)
    try:
        yield fig, (axes[0, 0] if ncols * nrows == 1 else axes.ravel())
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    finally:
        plt.close(fig)
