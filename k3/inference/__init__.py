"""k3.inference: running a model to produce tokens — sampling and generation through the decode cache
(`generation`), and the decode step over a static cache that compiles whole (`decode_step`).

Below `k3.models` (tests/test_structure.py): both are duck-typed over the model and its cache, which
`CausalLM.generate`, `stream` and `decode_step` pass in."""
