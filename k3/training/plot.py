"""The loss curve: training loss per step and validation bits per byte, as a PNG beside the checkpoint."""

from __future__ import annotations

import math


def plot_history(history: dict, path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    if history["step"]:
        # training loss in bits per token, smoothed over ~1% of the run
        losses = [x / math.log(2) for x in history["loss"]]
        w = max(1, len(losses) // 100)
        smooth = [
            sum(losses[max(0, i - w + 1) : i + 1]) / len(losses[max(0, i - w + 1) : i + 1]) for i in range(len(losses))
        ]
        ax.plot(history["step"], smooth, label="train loss (bits/token)", color="tab:blue")
        ax.set_xlabel("step")
        ax.set_ylabel("bits per token", color="tab:blue")
    if history["val_step"]:
        ax2 = ax.twinx()
        ax2.plot(history["val_step"], history["val_bpb"], "o-", color="tab:red", label="validation (bits/byte)")
        ax2.set_ylabel("validation bits per byte", color="tab:red")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
