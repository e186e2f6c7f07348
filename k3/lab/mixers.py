"""The lab's own sequence mixers, which `k3.lab.synthetic.build_model` puts in place of k3's so that the
mixers compared differ in their memory only: softmax attention and MLA reading through the short causal
convolution the linear family has (`ConvAttention`, `ConvLatentAttention`), and linear attention as DeltaNet's
layer with the additive update (`AdditiveLinearAttention`). Training and scoring only: none has a cache."""

from __future__ import annotations

import torch

from ..layers.attention import MultiHeadAttention
from ..layers.conv import ShortConvolution
from ..layers.linear_attention import DeltaNet
from ..layers.mla import MultiHeadLatentAttention
from ..ops import attention, chunk_linear_attn


class ConvAttention(MultiHeadAttention):
    """Softmax attention whose q, k and v pass through a depthwise causal convolution (kernel `conv_size`, no
    activation) first, as the linear family's do: each position's key can carry the tokens just before it,
    which is what MQAR's key-to-value binding needs. Training and scoring only (no cache)."""

    def __init__(self, hidden_size: int, num_heads: int, conv_size: int = 4):
        super().__init__(hidden_size, num_heads)
        self.qkv_conv1d = ShortConvolution(3 * hidden_size, conv_size, activation=None)

    @property
    def window(self) -> int:
        """Positions a token's key and value reach back over (the convolution's kernel)."""
        return self.qkv_conv1d.kernel_size

    def _qkv(self, x: torch.Tensor):
        B, T, _ = x.shape
        return self.qkv_conv1d(self.c_attn(x))[0].view(B, T, 3, self.num_heads, -1).unbind(2)

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        if cache is not None:
            raise ValueError("ConvAttention: a lab model for training and scoring; it has no decoding cache")
        B, T, _ = x.shape
        o, _ = attention(*self._qkv(x))
        return self.c_proj(o.reshape(B, T, self.hidden_size))

    @torch.no_grad()
    def attention_probs(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden_size] -> the causal attention probabilities [B, H, T, T] of each head."""
        q, k, _ = self._qkv(x)
        T = x.shape[1]
        logits = torch.einsum("bthd,bshd->bhts", q, k) * q.shape[-1] ** -0.5
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        return logits.masked_fill(future, float("-inf")).softmax(-1)


class ConvLatentAttention(MultiHeadLatentAttention):
    """MLA whose latent c_t passes through a depthwise causal convolution (kernel `conv_size`, no activation)
    before keys and values are expanded from it (MLA's public hook `mix_latents`): the short convolution
    `ConvAttention` gives softmax attention, so that both attentions of the lab read through the same token
    shift (a two-layer model has no earlier layer to build one). Keys and values at t then carry tokens t-3..t,
    so a query can find a key's binding at any of the W latents that hold it (`window`). Training and scoring
    only (no cache)."""

    def __init__(self, *args, conv_size: int = 4, **kwargs):
        super().__init__(*args, **kwargs)
        self.latent_conv1d = ShortConvolution(self.kv_lora_rank, conv_size, activation=None)

    @property
    def window(self) -> int:
        return self.latent_conv1d.kernel_size

    @classmethod
    def like(cls, mla: MultiHeadLatentAttention, conv_size: int) -> "ConvLatentAttention":
        return cls(
            mla.hidden_size,
            mla.num_heads,
            q_lora_rank=mla.q_lora_rank,
            kv_lora_rank=mla.kv_lora_rank,
            qk_nope_head_dim=mla.dn,
            qk_rope_head_dim=mla.dr,
            v_head_dim=mla.dv,
            output_gate=None if mla.g_proj is None else "full",
            rope_theta=mla.rope_theta,
            norm_eps=mla.kv_a_layernorm.eps,
            conv_size=conv_size,
        )

    def mix_latents(self, c: torch.Tensor) -> torch.Tensor:
        """MLA's latent hook: c [B, T, r] -> the causal convolution of c over t (`latent_conv1d`)."""
        return self.latent_conv1d(c)[0]

    def forward(self, x: torch.Tensor, cache=None, absorb: bool | None = None) -> torch.Tensor:
        if cache is not None:
            raise ValueError("ConvLatentAttention: a lab model for training and scoring; it has no decoding cache")
        return super().forward(x, None, absorb)


def additive_rule(
    q, k, v, beta, *, initial_state=None, output_final_state=False, use_qk_l2norm=True, chunk_size=64, check_values=True
):
    """Linear attention's update in the delta family's calling convention: S_t = S_{t-1} + k_t^T v_t,
    o_t = q_t S_t (no normaliser; the write strength beta is not used: linear attention only adds)."""
    return chunk_linear_attn(
        q,
        k,
        v,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm=use_qk_l2norm,
        normalize=False,
        chunk_size=chunk_size,
        check_values=check_values,
    )


class AdditiveLinearAttention(DeltaNet):
    """The lab's linear attention: DeltaNet's layer (q, k, v = SiLU(ShortConv(W x)), q and k L2-normalised,
    per-head RMSNorm on the output) with DeltaNet's delta rule replaced by linear attention's additive update
    S_t = S_{t-1} + k_t^T v_t, o_t = q_t S_t. The two differ only in how the memory is written, which is what
    the recall and overwrite claims are about; DeltaNet's write strength beta (b_proj) is computed and left
    unused; its hook is the delta family's `chunk_op`. (k3.layers.LinearAttention, the article's normalised ELU+1
    form without a short convolution, is the probe "elu_linear_attn" beside it.) Training and scoring only (no
    cache)."""

    chunk_op = staticmethod(additive_rule)

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        if cache is not None:
            raise ValueError("AdditiveLinearAttention: a lab model for training and scoring; it has no decoding cache")
        return super().forward(x)
