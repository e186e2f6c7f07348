"""k3 models as Hugging Face transformers models: K3Config, K3ForCausalLM and the cache they share.

A thin adapter, not a second implementation. K3ForCausalLM holds one k3 `CausalLM` as `.k3` (so its
parameters are k3's names under the prefix `k3.`), its forward is CausalLM's forward, and its cache is
k3's cache plus the few things GenerationMixin asks of a cache. What `generate` relies on:

- `prepare_inputs_for_generation` feeds the whole prompt once (k3's chunked prefill) and afterwards
  only the tokens the cache has not seen yet (one recurrent decode step each);
- the cache goes in and comes back under the name this transformers uses: `cache` from 5.x on,
  `past_key_values` before (`CACHE_ARG`);
- the model is stateful (`_is_stateful`): generate makes no DynamicCache for it, and refuses assisted
  generation (a recurrent state cannot be rolled back to a shorter prefix);
- no padding: the recurrent layers would fold pad tokens into their state, so an `attention_mask`
  with zeros (a left- or right-padded batch) is refused. Batch size 1 and unpadded batches work.

Tested with transformers 4.57 and 5.x.
"""

from __future__ import annotations

import torch
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..models.config import LINEAR_MIXERS, ModelConfig
from ..models.model import Cache, CausalLM
from .remote_code import AUTO_MAP, REMOTE_CODE_FILES

# transformers 5 renamed the cache argument and output field `past_key_values` to `cache`
CACHE_ARG = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
# transformers 5 ties weights from a {tied: source} dict, 4.x from a list of tied names
_TIED = {"k3.lm_head.weight": "k3.model.embed_tokens.weight"}
_TIED_WEIGHTS_KEYS = _TIED if hasattr(PreTrainedModel, "get_expanded_tied_weights_keys") else list(_TIED)


class K3Config(PretrainedConfig):
    """The transformers config of a k3 model: the k3 `ModelConfig` as a dict under `k3`
    (`ModelConfig.to_dict`), plus the standard fields transformers reads, which follow from it:
    vocab_size, hidden_size, num_hidden_layers, tie_word_embeddings.

    `K3Config()` without a k3 config describes no model (transformers builds one to find the defaults
    it leaves out of config.json); `K3ForCausalLM` refuses it."""

    model_type = "k3"

    def __init__(self, k3: dict | ModelConfig | None = None, **kwargs):
        model_config = ModelConfig.from_dict(k3) if isinstance(k3, dict) else k3
        if model_config is not None and not isinstance(model_config, ModelConfig):
            raise ValueError(f"K3Config: `k3` must be a ModelConfig or its to_dict(), got {type(k3).__name__}")
        if model_config is not None:
            derived = dict(
                vocab_size=model_config.vocab_size,
                hidden_size=model_config.hidden_size,
                num_hidden_layers=model_config.num_layers,
                tie_word_embeddings=model_config.tie_word_embeddings,
            )
            for name, value in derived.items():
                if kwargs.get(name, value) != value:
                    raise ValueError(
                        f"K3Config: `{name}` is {kwargs[name]!r} but the k3 config says {value!r}; "
                        f"change the k3 config (`k3`), the other fields follow from it"
                    )
            kwargs.update(derived)
        super().__init__(**kwargs)
        self.k3 = None if model_config is None else model_config.to_dict()

    @property
    def model_config(self) -> ModelConfig:
        """The k3 ModelConfig this config carries."""
        if self.k3 is None:
            raise ValueError("K3Config: no k3 model config; make one with K3Config(k3=get_config(...))")
        return ModelConfig.from_dict(self.k3)


class K3Cache(Cache):
    """k3's cache with what transformers' generate reads of a cache, and the row reordering
    beam search needs. Like the model it belongs to, it cannot be cropped or compiled."""

    is_compileable = False
    is_croppable = False

    @property
    def is_linear(self) -> list[bool]:
        """Per layer: is it a fixed-size recurrent state (rather than a growing KV / latent cache)?"""
        return [kind in LINEAR_MIXERS for kind in self.config.layer_types]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen so far (the same for every layer)."""
        return self.length

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search: row i continues from the state of row beam_idx[i] (every cached tensor is
        batch-first), in place."""
        self.reorder(beam_idx)


class K3ForCausalLM(PreTrainedModel, GenerationMixin):
    """A k3 CausalLM (`.k3`) as a transformers causal LM: `from_pretrained`, `save_pretrained`,
    `generate`, the Auto classes (after `import k3.hf`, or with `trust_remote_code=True` on a folder it
    saved). Logits are CausalLM's, bit for bit."""

    config_class = K3Config
    base_model_prefix = "k3"
    main_input_name = "input_ids"
    _is_stateful = True
    _no_split_modules = ["DecoderLayer"]
    _tied_weights_keys = _TIED_WEIGHTS_KEYS

    def __init__(self, config: K3Config):
        super().__init__(config)
        self.k3 = CausalLM(config.model_config)
        self.post_init()

    @classmethod
    def from_k3(cls, model: CausalLM, **config_fields) -> "K3ForCausalLM":
        """Wrap an existing k3 CausalLM (shared, not copied); `config_fields` go to K3Config
        (e.g. eos_token_id)."""
        if not isinstance(model, CausalLM):
            raise ValueError(f"K3ForCausalLM.from_k3: expected a k3 CausalLM, got {type(model).__name__}")
        with torch.device("meta"):  # the placeholder CausalLM is replaced at once: don't allocate it
            wrapper = cls(K3Config(k3=model.config, **config_fields))
        wrapper.k3 = model
        return wrapper.train(model.training)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate must leave the cache to us (transformers 5 does not read _is_stateful here)

    def _init_weights(self, module) -> None:
        """k3's own initialisation (CausalLM.reset_parameters) covers every parameter."""
        if isinstance(module, CausalLM):
            module.reset_parameters()

    def get_input_embeddings(self):
        return self.k3.model.embed_tokens

    def get_output_embeddings(self):
        return self.k3.lm_head

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' from_pretrained, strict: a checkpoint that leaves a parameter missing or has
        extra ones is an error here, not a warning."""
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        problems = [
            f"{what.replace('_', ' ')} {sorted(map(str, info[what]))[:8]}"
            for what in ("missing_keys", "unexpected_keys", "mismatched_keys")
            if info.get(what)
        ]
        if problems:
            raise ValueError(
                "K3ForCausalLM.from_pretrained: the checkpoint does not match its config: " + "; ".join(problems)
            )
        return (model, info) if want_info else model

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' save_pretrained, plus transformers' remote code (`k3.hf.remote_code`): the config
        gets an `auto_map`, and configuration_k3.py and modeling_k3.py are written beside config.json,
        so the folder loads with `trust_remote_code=True` where k3 is installed but not imported."""
        import shutil
        from pathlib import Path

        self.config.auto_map = dict(AUTO_MAP)
        out = super().save_pretrained(save_directory, *args, **kwargs)
        for name in REMOTE_CODE_FILES:
            shutil.copyfile(Path(__file__).parent / "remote_code" / name, Path(save_directory) / name)
        return out

    def new_cache(self, batch_size: int) -> K3Cache:
        """An empty cache for `batch_size` sequences (forward makes one itself when use_cache is set)."""
        self.k3.new_cache(batch_size)  # argument checks
        return K3Cache(self.k3, batch_size)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: K3Cache | None = None,
        cache: K3Cache | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        **kwargs,
    ):
        """input_ids [B, T] -> CausalLMOutputWithPast(logits [B, T, V], loss when `labels` are given, and
        the cache under CACHE_ARG when `use_cache` (default: in eval mode)). A given cache continues
        after the tokens it has seen and is updated in place. `kwargs` (position_ids, cache_position,
        ...) are what generate passes along; positions follow from the cache, so they are not read."""
        if inputs_embeds is not None or input_ids is None:
            raise ValueError("K3ForCausalLM: pass `input_ids` (`inputs_embeds` is not supported)")
        if output_attentions or output_hidden_states:
            raise ValueError("K3ForCausalLM: `output_attentions` / `output_hidden_states` are not supported")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError(
                "K3ForCausalLM: padded batches are not supported (`attention_mask` has zeros): "
                "k3's recurrent layers would read the pad tokens into their state. Generate "
                "each prompt on its own, or batch prompts of equal length without padding"
            )
        if past_key_values is not None and cache is not None and past_key_values is not cache:
            raise ValueError("K3ForCausalLM: pass the cache once, as `cache` or `past_key_values`")
        cache = cache if cache is not None else past_key_values
        if cache is not None and not isinstance(cache, K3Cache):
            raise ValueError(
                f"K3ForCausalLM: the cache must be a K3Cache (model.new_cache(batch_size)), got {type(cache).__name__}"
            )
        use_cache = (not self.training) if use_cache is None else use_cache
        if cache is None and use_cache:
            cache = self.new_cache(input_ids.shape[0])
        logits = self.k3(input_ids, cache=cache)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.k3.config.vocab_size, **kwargs)
        out = CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_ARG: cache if use_cache else None})
        return_dict = getattr(self.config, "return_dict", True) if return_dict is None else return_dict
        return out if return_dict else out.to_tuple()

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.Tensor,
        past_key_values: K3Cache | None = None,
        cache: K3Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool = True,
        **kwargs,
    ) -> dict:
        """The whole sequence while there is no cache yet (prefill), then only what the cache has not seen."""
        if inputs_embeds is not None:
            raise ValueError("K3ForCausalLM.generate: `inputs_embeds` is not supported; pass `input_ids`")
        cache = cache if cache is not None else past_key_values
        if isinstance(cache, K3Cache):
            if cache.length >= input_ids.shape[1]:
                raise ValueError(
                    f"K3ForCausalLM.generate: the cache has seen {cache.length} tokens, the input "
                    f"has {input_ids.shape[1]}; pass the whole sequence (the seen tokens and new ones)"
                )
            input_ids = input_ids[:, cache.length :]
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": use_cache}
        if cache is not None:
            inputs[CACHE_ARG] = cache
        return inputs
