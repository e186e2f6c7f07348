"""k3.checkpoints: weights in and out — k3's own format and Kimi's (`checkpoint`), Kimi K3's published
layout (`kimi_k3_format`), Kimi config.json fields (`hf_config`), sharded training checkpoints
(torch.distributed.checkpoint files, `dcp`), `from_pretrained` over all of them (`loading`), and GGUF,
llama.cpp's format, out (`gguf_format`).

Below `k3.models` (tests/test_structure.py): the model's class comes in as an argument
(`CausalLM.from_pretrained` passes itself; its `config_class`, ModelConfig, reads config.json), the
model and its config are used by what they offer, and `k3.models.config` reads Kimi configs through
`hf_config`."""
