"""Forward hooks that read what each part of a model computes, on the unmodified model: every AttnRes
mix's weights over its sources, every MoE router's expert load (with and without the correction
bias), every KDA layer's forget gate, and, on request, every MLA layer's attention probabilities. Each
hook calls the layer's own analysis method (`BlockAttnRes.weights`, `Router.scores` /
`Router.choose`, `KimiDeltaAttention.forget_gate`, `MultiHeadLatentAttention.attention_probs`) on
the inputs the layer was given: the same code its forward pass runs."""

from __future__ import annotations

import math

import torch

from ...layers import BlockAttnRes, KimiDeltaAttention, MoE, MultiHeadLatentAttention
from ...models import CausalLM


def router_loads(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Assignments per expert (with the correction bias, as the model routes; without it) for x [..., d]."""
    router = moe.router
    scores = router.scores(x.reshape(-1, x.shape[-1]))
    E = scores.shape[-1]
    return (
        torch.bincount(router.choose(scores).flatten(), minlength=E),
        torch.bincount(router.choose(scores, balanced=False).flatten(), minlength=E),
    )


class Recorder:
    """Forward hooks on every AttnRes mix, MoE, KDA and MLA layer of a model, accumulating statistics."""

    def __init__(self, model: CausalLM, keep_attention: bool = False):
        self.model, self.keep_attention = model, keep_attention
        self.names = {m: n for n, m in model.named_modules()}
        self.attn_res: dict[str, dict] = {}  # mix -> {"weights": sum over tokens [N], "entropy": sum, "tokens"}
        self.moe: dict[str, dict] = {}  # layer -> {"with": load [E], "without": load [E]}
        self.kda: dict[str, dict] = {}  # layer -> {"g_sum": [H, K], "tokens": n, "g": [list of samples]}
        self.mla: dict[str, torch.Tensor] = {}  # layer -> probs [B, H, T, T] of the last batch
        self._handles = []

    def __enter__(self):
        for module in self.model.modules():
            if isinstance(module, BlockAttnRes):
                self._handles.append(module.register_forward_hook(self._on_attn_res))
            elif isinstance(module, MoE):
                self._handles.append(module.register_forward_hook(self._on_moe))
            elif isinstance(module, KimiDeltaAttention):
                self._handles.append(module.register_forward_pre_hook(self._on_kda))
            elif isinstance(module, MultiHeadLatentAttention) and self.keep_attention:
                self._handles.append(module.register_forward_hook(self._on_mla))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return False

    def _on_attn_res(self, module, inputs, output):
        sources = inputs[0]
        alpha = module.weights(sources)  # [N, B, T]
        n = len(sources)
        entropy = -(alpha * alpha.clamp_min(1e-30).log()).sum(0) / math.log(n) if n > 1 else torch.zeros_like(alpha[0])
        rec = self.attn_res.setdefault(self._mix_name(module), {"weights": 0.0, "entropy": 0.0, "tokens": 0})
        rec["weights"] = rec["weights"] + alpha.flatten(1).sum(1)
        rec["entropy"] += entropy.sum().item()
        rec["tokens"] += alpha[0].numel()

    def _mix_name(self, module) -> str:
        name = self.names[module]  # model.layers.3.attn_res, model.layers.3.mlp_res, model.final_res
        if name.endswith("final_res"):
            return "final"
        layer = name.split(".")[2]
        return f"L{layer} {'attn' if name.endswith('attn_res') else 'ffn'}"

    def _on_moe(self, module, inputs, output):
        with_bias, without = router_loads(module, inputs[0])
        rec = self.moe.setdefault(self._layer_name(module), {"with": 0, "without": 0})
        rec["with"] = rec["with"] + with_bias
        rec["without"] = rec["without"] + without

    def _layer_name(self, module) -> str:
        return "L" + self.names[module].split(".")[2]

    def _on_kda(self, module, inputs):
        g = module.forget_gate(inputs[0])  # [B, T, H, K], log decay per token and key channel
        rec = self.kda.setdefault(self._layer_name(module), {"g_sum": 0.0, "tokens": 0, "samples": []})
        rec["g_sum"] = rec["g_sum"] + g.double().sum((0, 1))
        rec["tokens"] += g.shape[0] * g.shape[1]
        rec["samples"].append(g.flatten()[:: max(1, g.numel() // 20000)])

    def _on_mla(self, module, inputs, output):
        self.mla[self._layer_name(module)] = module.attention_probs(inputs[0]).float()


@torch.no_grad()
def record(model: CausalLM, windows: torch.Tensor, batch_size: int = 8) -> Recorder:
    """Statistics of AttnRes, MoE and KDA over validation windows [n, T + 1] (inputs: the first T)."""
    with Recorder(model) as rec:
        for i in range(0, windows.shape[0], batch_size):
            model(windows[i : i + batch_size, :-1])
    return rec


@torch.no_grad()
def record_attention(model: CausalLM, ids: list[int]) -> Recorder:
    """Statistics as `record`'s, and the attention probabilities [H, T, T] of every MLA layer, on one prompt
    `ids`."""
    with Recorder(model, keep_attention=True) as rec:
        model(torch.tensor([ids]))
    rec.mla = {name: probs[0] for name, probs in rec.mla.items()}
    return rec
