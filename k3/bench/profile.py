"""`k3 bench profile`: where one training step of kimi-k3-tiny and of its matched GPT-2 spends its time,
layer by layer.

Each part of each layer (mixer, feed-forward or MoE, norms, Block AttnRes) and the decoder's own parts
(embeddings, final norm and residual) is timed on its own, on the inputs it received in a forward pass
of a real batch: its forward with autograd recording, and its forward + backward (a random gradient on
each output, the parameters' gradients cleared before each call as a training step clears them), so
backward = (forward + backward) - forward. The whole training step (forward, loss, backward, optimizer,
QK-Clip, the MoE bias update: `k3.training.training_step`) is timed beside them, and so are the LM head
with the loss (on the decoder's output) and the optimizer step (on a real batch's gradients), all
interleaved round after round in one run (`interleaved_best`); what none of them accounts for (the glue
between parts, QK-Clip, the MoE bias update, clearing and clipping gradients) is reported as the rest.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch
from torch import nn

from ..models import CausalLM, get_config
from ..models.loss import head_cross_entropy
from ..training import TrainConfig, build_optimizer, prepare, training_step
from .timing import interleaved_best, matmul_gflops, write_report
from .train import matched_gpt2


def parts(model: CausalLM) -> dict[str, nn.Module]:
    """The timed parts, by name: each decoder layer's children ("3.self_attn"), then the decoder's own
    modules but the layers ("embed_tokens", "norm", ...)."""
    named = {}
    for i, layer in enumerate(model.model.layers):
        for name, child in layer.named_children():
            named[f"{i}.{name}"] = child
    for name, child in model.model.named_children():
        if name != "layers":
            named[name] = child
    return named


def captured_inputs(model: CausalLM, modules: dict[str, nn.Module], input_ids: torch.Tensor) -> dict:
    """The (args, kwargs) each of `modules` (by name) receives in one forward pass of `input_ids` (the first
    call of each), tensors detached and keeping whether they required a gradient."""
    inputs: dict = {}

    def keep(x):
        if isinstance(x, torch.Tensor):
            return x.detach().requires_grad_(x.requires_grad)
        if isinstance(x, (list, tuple)):
            return type(x)(keep(v) for v in x)
        return x

    def hook(name):
        def record(module, args, kwargs):
            inputs.setdefault(name, (keep(args), {k: keep(v) for k, v in kwargs.items()}))

        return record

    handles = [m.register_forward_pre_hook(hook(name), with_kwargs=True) for name, m in modules.items()]
    try:
        model(input_ids)
    finally:
        for h in handles:
            h.remove()
    return inputs


def _tensors(x) -> list[torch.Tensor]:
    """The tensors of a module's output that carry a gradient, in order."""
    if isinstance(x, torch.Tensor):
        return [x] if x.requires_grad else []
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def part_cases(module: nn.Module, args: tuple, kwargs: dict, seed: int = 0) -> dict:
    """("forward", "both") timing cases of one module on its captured inputs."""
    params = [p for p in module.parameters() if p.requires_grad]
    outputs = _tensors(module(*args, **kwargs))
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in outputs]

    def forward():
        module(*args, **kwargs)

    def both():
        for p in params:
            p.grad = None
        torch.autograd.backward(_tensors(module(*args, **kwargs)), grads)

    return {"forward": forward, "both": both if outputs else forward}


def profile_step(model: CausalLM, cfg: TrainConfig, data, rounds: int = 5, seed: int = 0) -> dict:
    """Forward and backward ms of each part of `model`, of the LM head with the loss, the optimizer step's
    ms and the whole training step's (see the module docstring):
    {"step", "optimizer": ms, "head": {"forward", "backward"}, "parts": {name: {"kind", "forward", "backward"}}}.
    The timed steps train `model` (profile a model built for it); no gradient is left on it."""
    gen = torch.Generator().manual_seed(seed)
    windows = data.batch(cfg.batch_size, cfg.seq_len, gen)
    input_ids, targets = windows[:, :-1], windows[:, 1:]
    modules = parts(model)
    model.train()
    inputs = captured_inputs(model, modules, input_ids)
    hidden = model.model(input_ids, None).detach().requires_grad_()  # what the LM head reads in training

    def head():
        return head_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), model.lm_head.weight, targets)

    # the optimizer on gradients of a real batch, restored before each call (the parts' cases clear them)
    optimizer = build_optimizer(model, cfg)
    model(input_ids, targets=targets).backward()
    grads = [(p, p.grad) for p in model.parameters() if p.grad is not None]

    def optimizer_step():
        for p, g in grads:
            p.grad = g
        optimizer.step()

    step_optimizer = build_optimizer(model, cfg)
    cases = {
        "step": lambda: training_step(model, step_optimizer, data.batch(cfg.batch_size, cfg.seq_len, gen), cfg),
        "optimizer": optimizer_step,
        ("head", "forward"): head,
        ("head", "both"): lambda: head().backward(),
    }
    for name, (args, kwargs) in inputs.items():
        for way, fn in part_cases(modules[name], args, kwargs).items():
            cases[(name, way)] = fn
    best = {k: v * 1e3 for k, v in interleaved_best(cases, rounds, grad=True).items()}
    model.zero_grad(set_to_none=True)  # no gradient of a timed call left behind

    def split(name):
        return {
            "forward": best[(name, "forward")],
            "backward": max(best[(name, "both")] - best[(name, "forward")], 0.0),
        }

    return {
        "step": best["step"],
        "optimizer": best["optimizer"],
        "head": split("head"),
        "parts": {name: {"kind": type(modules[name]).__name__, **split(name)} for name in inputs},
    }


def by_kind(profile: dict) -> dict[str, dict]:
    """The parts' times summed over the layers, per kind of module: {kind: {"count", "forward", "backward"}}."""
    kinds: dict = defaultdict(lambda: {"count": 0, "forward": 0.0, "backward": 0.0})
    for part in profile["parts"].values():
        row = kinds[part["kind"]]
        row["count"] += 1
        row["forward"] += part["forward"]
        row["backward"] += part["backward"]
    return dict(sorted(kinds.items(), key=lambda kv: -(kv[1]["forward"] + kv[1]["backward"])))


def run(rounds: int = 5, json_path: str | None = None, data: str | None = None, out=None) -> dict:
    out = sys.stdout if out is None else out

    def say(line=""):
        print(line, file=out, flush=True)

    cfg = TrainConfig(data=data, max_steps=None, eval_every=10**9)
    tokenizer, token_data = prepare(cfg)
    gpt_overrides, _ = matched_gpt2(vocab_size=tokenizer.vocab_size)
    say(
        f"k3 bench profile: one training step of {cfg.batch_size} x {cfg.seq_len} tokens ({cfg.optimizer}), "
        f"{torch.get_num_threads()} threads, best of {rounds} interleaved rounds; machine matmul "
        f"{matmul_gflops():.0f} GFLOP/s (1024^3 float32)"
    )
    results = {}
    for name, overrides in (("kimi-k3-tiny", {}), ("gpt2-tiny", gpt_overrides)):
        torch.manual_seed(0)
        model = CausalLM(get_config(name, vocab_size=tokenizer.vocab_size, **overrides))
        profile = profile_step(model, cfg, token_data, rounds)
        results[name] = {**profile, "by_kind": by_kind(profile)}
        step = profile["step"]
        say(f"\n{name}: training step {step:.1f} ms")
        say(f"  {'part':28s} {'forward':>9s} {'backward':>9s} {'share':>6s}")
        rows = [
            (f"{kind} x{row['count']}", row["forward"], row["backward"])
            for kind, row in results[name]["by_kind"].items()
        ]
        rows += [("LM head + loss", profile["head"]["forward"], profile["head"]["backward"])]
        for label, fwd, bwd in rows:
            say(f"  {label:28s} {fwd:7.1f} ms {bwd:7.1f} ms {100 * (fwd + bwd) / step:5.1f}%")
        say(f"  {'optimizer step':28s} {profile['optimizer']:18.1f} ms {100 * profile['optimizer'] / step:5.1f}%")
        rest = step - profile["optimizer"] - sum(fwd + bwd for _, fwd, bwd in rows)
        say(f"  {'the rest (glue, QK-Clip, ...)':28s} {rest:18.1f} ms {100 * rest / step:5.1f}%")
    if json_path:
        write_report(json_path, results, "profile")
    return results
