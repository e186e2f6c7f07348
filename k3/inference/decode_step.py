"""DecodeStep: one token for every row of a cache of fixed slots, as one function of tensors that compiles whole.

    tokens [B] -> embed -> layers (over the cache, in place) -> norm -> lm_head -> sample -> next [B]

Eager decoding is bound by PyTorch's dispatch of each small op (hundreds a token in a hybrid model); a
fast decoder captures the step once and replays it. What makes the step capturable (no graph break, no
recompile from one token to the next):
- static state: the cache's buffers (`model.new_cache(B, max_length=N)`, k3.inference.cache), written in
  place at a position tensor, attention over all N slots masked past each row's position;
- the MoE gathers its chosen experts' matrices by index from stacks made with the step, and each layer's
  projections of one input run as one matmul by a joined copy (`k3.layers.joined`): no `.tolist()`, no
  bincount. The step makes these copies when it is made (`prepare_for_decoding`), keeps them, and passes
  each layer its own (`fused`); nothing else reads them;
- Block AttnRes's sources in one fixed buffer (`DepthSources`);
- sampling inside the step from noise drawn outside (`k3.inference.generation.sample_with_noise`: greedy,
  temperature, top-k, top-p): no generator in the graph, no host sync.

`compile=True` runs it through torch.compile (`fullgraph=True`): inductor's C++ kernels on the CPU, CUDA
graphs (`mode="reduce-overhead"`) on CUDA. On the CPU the products of a few rows by a weight matrix are
reductions that stream the weights (`k3.inference.row_products`) rather than GEMM calls. Inductor keeps
what it compiled on disk (its FX graph and AOTAutograd caches, in `compile_cache_dir()`), so the same
model's next run starts without compiling again. Greedy tokens equal eager decoding's (same maths; float
rounding may differ in the last place).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from ..layers.moe import STACKED_BYTES_LIMIT, DecodeWeights
from ..runtime import check_compiler
from .generation import check_sampling, is_greedy, sample_with_noise
from .row_products import RowProducts

COMPILE_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
RECOMPILE_LIMIT = 64  # graphs one process may keep for the step (models x batch sizes x samplers)


def compile_cache_dir() -> Path:
    """Where compiled decode steps are kept between runs: $TORCHINDUCTOR_CACHE_DIR when set, else
    ~/.cache/k3/inductor (set as that variable, which inductor reads), so a second run of the same model
    loads its kernels instead of compiling them. A folder that cannot be made or written is a ValueError
    naming the variable (inductor's own error names neither)."""
    path = os.environ.get(COMPILE_CACHE_ENV) or None  # set but empty: the default, as unset
    chosen = path is not None
    if path is None:
        path = str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "k3" / "inductor")
    where = (
        f"the environment variable {COMPILE_CACHE_ENV}={path}"
        if chosen
        else f"the compile cache {path} (the default; set {COMPILE_CACHE_ENV} for another folder)"
    )
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{where}: is a file, not a folder; give a folder")
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{where}: cannot make the folder ({e.strerror}); give a folder that can be written") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{where}: the folder cannot be written; give a folder that can be")
    os.environ[COMPILE_CACHE_ENV] = path
    return Path(path)


def compile_step(fn, device: torch.device | str, backend: str = "inductor"):
    """torch.compile(fn, fullgraph=True): inductor on the CPU, with CUDA graphs (reduce-overhead) on CUDA."""
    device = torch.device(device)
    if backend == "inductor":
        check_compiler(device)
        compile_cache_dir()
    # every model, batch size and sampler compiles the same function: room for more than dynamo's default 8
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    if backend != "inductor":
        return torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)
    if device.type == "cuda":
        return torch.compile(fn, fullgraph=True, dynamic=False, mode="reduce-overhead")
    # on the CPU, a C++ wrapper calls the kernels (the default Python one costs ~0.2 ms a step here)
    return torch.compile(fn, fullgraph=True, dynamic=False, options={"cpp_wrapper": True})


def prepare_for_decoding(model) -> list[tuple]:
    """The weight copies a decode step reads (`CausalLM.decoding_weights`), from the weights as they are now;
    `model.model(..., fused=...)` hands them to the layers."""
    return model.decoding_weights()


def _tensors(tree) -> list[torch.Tensor]:
    """The tensors in nested tuples and lists (`prepare_for_decoding`'s copies)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    return [t for item in tree for t in _tensors(item)] if isinstance(tree, (tuple, list)) else []


class DecodeStep:
    """The next token of every row of `cache` (`model.new_cache(B, max_length=N)`), sampled with temperature, top_k
    and top_p (temperature 0: greedy) from noise drawn with `generator`; see the module docstring.

    `step(tokens)` feeds tokens [B] (each row's last token) and returns the next ones [B]; `last_logits`
    [B, vocab] keeps the logits they were sampled from. `compile`: False (eager), True (inductor), or a
    torch.compile backend name (tests use "aot_eager", which needs no C++ compiler). `fused`:
    `prepare_for_decoding(model)`'s copies to read (default: made here). `sample=False`: the step only
    computes `last_logits` and returns None, for a caller that samples them itself (a server's turn)."""

    def __init__(
        self,
        model,
        cache: Cache,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        compile: bool | str = False,
        fused: list[tuple] | None = None,
        sample: bool = True,
    ):
        if not cache.max_length:
            raise ValueError(
                f"DecodeStep: `cache` must be a static cache (model.new_cache(batch_size, "
                f"max_length=N)), got {type(cache).__name__}"
            )
        if cache.config != model.config:
            raise ValueError(
                f"DecodeStep: the cache was made for {cache.config.name!r}, the model is {model.config.name!r}"
            )
        check_sampling(temperature, top_k, top_p)
        self.model, self.cache, self.generator = model, cache, generator
        self.temperature, self.top_k, self.top_p = float(temperature), top_k, top_p
        self.sample = sample
        self.last_logits: torch.Tensor | None = None
        # the step's inputs, each at one address (what CUDA graphs replay from) with one stride (a dynamo guard)
        device = cache.positions.device
        self._tokens = torch.zeros(cache.batch_size, 1, dtype=torch.long, device=device)
        self._noise = (
            torch.empty(cache.batch_size, model.config.vocab_size, device=device)
            if sample and not is_greedy(self.temperature)
            else None
        )
        # the copies the step reads: the weights as they are now, or copies the caller made (steps over one
        # model's caches can share one set)
        self.fused = prepare_for_decoding(model) if fused is None else fused
        if compile and any(isinstance(ffn, DecodeWeights) and ffn.experts is None for _, ffn in self.fused):
            raise RuntimeError(
                "DecodeStep: a captured decode step needs the routed experts stacked, which only "
                f"plain experts held in this process, within {STACKED_BYTES_LIMIT:,} bytes, allow"
            )
        self._compiled, self._warm = bool(compile), False
        # compiled for the CPU: few-row products as reductions inductor streams the weights with (row_products)
        self._row_products = bool(compile) and device.type == "cpu"
        if compile and device.type == "cuda":
            self._mark_static_addresses()
        if compile:
            self._run = compile_step(self._step, cache.positions.device, "inductor" if compile is True else compile)
        else:
            self._run = self._step

    def _mark_static_addresses(self) -> None:
        """Tell dynamo that the tensors the step reads and writes outside its parameters keep their addresses
        (the cache's buffers, the inputs, the stacked experts, the joined projections), so that CUDA graphs
        replay over them rather than copying them in before every replay (transformers' static caches do
        the same)."""
        cache = self.cache
        tensors = [t for layer in cache.layers for t in layer.buffers()] + [cache.positions, self._tokens]
        tensors += [t for t in (cache.sources, self._noise) if t is not None]
        tensors += _tensors(self.fused)
        for t in tensors:
            torch._dynamo.mark_static_address(t)

    def _step(self, tokens: torch.Tensor, noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, 1] -> (next tokens [B], logits [B, vocab]); advances the cache's positions."""
        model, cache = self.model, self.cache
        positions = cache.positions.unsqueeze(1) if model.config.max_position_embeddings else None
        with RowProducts() if self._row_products else contextlib.nullcontext():
            hidden = model.model(tokens, cache.layers, positions, cache.sources, self.fused)
            logits = model.lm_head(hidden[:, -1])
        token = sample_with_noise(logits, noise, self.temperature, self.top_k, self.top_p) if self.sample else None
        cache.advance_positions(1)  # a pool's rows not decoding stay
        return token, logits

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """tokens [B] (int64, the rows' last tokens) -> the next tokens [B] (None without `sample`)."""
        cache = self.cache
        if tokens.shape != (cache.batch_size,):
            raise ValueError(
                f"DecodeStep: `tokens` must be [{cache.batch_size}] (one per row), got {list(tokens.shape)}"
            )
        cache.check_room(1)
        if self._noise is not None:
            self._noise.exponential_(generator=self.generator)
        self._tokens.copy_(tokens.view(-1, 1))
        if self._warm:
            # the same function over the same state as the call before: dynamo need not check everything
            # it checked then (its guards cost ~0.2 ms a call on a 2-core CPU), only what tells graphs apart
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                token, logits = self._run(self._tokens, self._noise)
        else:
            token, logits = self._run(self._tokens, self._noise)
            self._warm = self._compiled
        cache.advance(1, positions=False)  # the step advanced the positions tensor itself
        # a CUDA graph's outputs are overwritten by its next replay: keep copies
        self.last_logits = logits.clone()
        return None if token is None else token.clone()
