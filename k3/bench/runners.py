"""The models `k3 bench models` (and `k3 bench serve`, `k3 bench models --compile`) time: their names, k3's
builds at the bench vocabulary, transformers' peers (GPT2LMHeadModel of the matched GPT-2's shape,
KimiLinearForCausalLM loading kimi-linear-tiny's weights), and `Runner`, one way to drive any of them."""

from __future__ import annotations

import inspect
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoints.checkpoint import kimi_state_dict
from ..checkpoints.hf_config import kimi_linear_config
from ..models import CausalLM, get_config
from ..training import TrainConfig, build_optimizer, training_step
from .train import matched_gpt2

K3_TINY, KIMI_LINEAR, GPT2 = "kimi-k3-tiny", "kimi-linear-tiny", "gpt2-tiny"
HF_GPT2, HF_KIMI = "transformers-gpt2", "transformers-kimi-linear"
MODELS = (K3_TINY, KIMI_LINEAR, GPT2, HF_GPT2, HF_KIMI)
LABELS = {
    K3_TINY: "kimi-k3-tiny",
    KIMI_LINEAR: "kimi-linear-tiny",
    GPT2: "gpt2-tiny (matched)",
    HF_GPT2: "transformers GPT2LMHeadModel",
    HF_KIMI: "transformers KimiLinearForCausalLM",
}
VOCAB = 4096


@dataclass
class Runner:
    """One model and how to drive it: `prefill(ids)` -> cache, `decode(token, cache)`, `train_case`."""

    name: str
    model: torch.nn.Module
    hf: bool
    parameters: int = field(init=False)

    def __post_init__(self):
        self.parameters = sum(p.numel() for p in self.model.parameters())
        if self.hf:
            takes_cache = "cache" in inspect.signature(self.model.forward).parameters  # transformers 5's name
            self._cache_kw = "cache" if takes_cache else "past_key_values"

    def prefill(self, ids: torch.Tensor):
        with torch.inference_mode():
            if not self.hf:
                cache = self.model.new_cache(ids.shape[0])
                self.model(ids, cache=cache)
                return cache
            return _cache_of(self.model(ids, use_cache=True))

    def decode(self, token: torch.Tensor, cache) -> torch.Tensor:
        with torch.inference_mode():
            if not self.hf:
                return self.model(token, cache=cache)
            return self.model(token, use_cache=True, **{self._cache_kw: cache}).logits

    def train_case(self, windows: torch.Tensor, cfg: TrainConfig):
        """One training step on `windows` [B, T + 1] as a callable (k3 reads T + 1, transformers T)."""
        self.model.train()
        if not self.hf:
            optimizer = build_optimizer(self.model, cfg)
            return lambda: training_step(self.model, optimizer, windows, cfg)
        optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
        )
        inputs = windows[:, :-1]  # the same T tokens through the model (the loss shifts the labels)
        if getattr(self.model, "loss_type", None) is None:  # KimiLinear's: the causal LM loss, without a warning
            self.model.loss_type = "ForCausalLM"

        def step():
            loss = self.model(input_ids=inputs, labels=inputs, use_cache=False).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
            optimizer.step()

        return step


def _cache_of(out):
    """The cache a transformers forward returned (`cache` in transformers 5, `past_key_values` before)."""
    return out.cache if hasattr(out, "cache") else out.past_key_values


def _transformers():
    try:
        import transformers
    except ImportError:
        return None
    return transformers


def build_k3(names, positions: int, seed: int = 0) -> tuple[dict[str, CausalLM], dict]:
    """k3's models among `names`, seeded, in eval mode; the matched GPT-2's overrides (with positions)."""
    gpt, _ = matched_gpt2(K3_TINY, vocab_size=VOCAB)
    gpt["max_position_embeddings"] = positions
    out = {}
    for name in names:
        torch.manual_seed(seed)
        overrides = gpt if name == GPT2 else {}
        out[name] = CausalLM(get_config(name, vocab_size=VOCAB, **overrides)).eval()
    return out, gpt


def build_hf_gpt2(transformers, gpt: dict, seed: int = 0):
    """transformers' GPT2LMHeadModel of the matched GPT-2's shape, its own init, no dropout."""
    c = get_config(GPT2, vocab_size=VOCAB, **gpt)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=c.hidden_size,
        n_layer=c.num_layers,
        n_head=c.num_heads,
        n_positions=c.max_position_embeddings,
        n_inner=c.intermediate_size,
        layer_norm_epsilon=c.norm_eps,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config).eval()


def build_hf_kimi(transformers, model: CausalLM):
    """transformers' KimiLinearForCausalLM with `model`'s weights, read from a folder in Kimi Linear's own
    format (what `k3 export --format kimi-linear` writes: `kimi_linear_config`, `kimi_state_dict`)."""
    from safetensors.torch import save_file

    config = kimi_linear_config(model.config)  # refuses what Kimi Linear cannot express
    # pad_token_id explicitly: KimiLinearConfig's default (163839) would be outside a small vocabulary
    config.update(bos_token_id=None, eos_token_id=None, pad_token_id=None, torch_dtype="float32")
    with tempfile.TemporaryDirectory() as tmp:
        save_file(kimi_state_dict(model), Path(tmp) / "model.safetensors", metadata={"format": "pt"})
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        hf = transformers.KimiLinearForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    return hf.eval()


def logits_error(k3: Runner, hf: Runner, length: int = 32, seed: int = 0) -> float:
    """Largest relative error of `hf`'s logits against `k3`'s: a prefill of `length` tokens, then one
    decode step from the cache (the two paths that are timed)."""
    ids = torch.randint(0, VOCAB, (1, length + 1), generator=torch.Generator().manual_seed(seed))
    rel = lambda a, b: ((b - a).norm() / a.norm()).item()  # noqa: E731
    with torch.inference_mode():
        k3_cache = k3.model.new_cache(1)
        out = hf.model(ids[:, :-1], use_cache=True)
        prefill = rel(k3.model(ids[:, :-1], cache=k3_cache), out.logits)
        step = rel(k3.decode(ids[:, -1:], k3_cache), hf.decode(ids[:, -1:], _cache_of(out)))
    return max(prefill, step)
