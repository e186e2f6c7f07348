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
"""

from __future__ import annotations

from torch import nn

STD = 0.02  # a model's std (GPT-2's)


def init_linear(linear: nn.Linear, std: float | None) -> None:
    """Weight ~ N(0, std), bias 0; std None: nn.Linear's own initialisation."""
    if std is None:
        linear.reset_parameters()
        return
    nn.init.normal_(linear.weight, std=std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)
