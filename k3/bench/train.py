"""`k3 bench train`: kimi-k3-tiny against a GPT-2 of the same width and (total) parameter count, on the
same data: training tokens/s measured side by side, then validation bits per byte after the same
wall-clock budget each."""

from __future__ import annotations

import dataclasses

import torch

from ..models import CausalLM, count_params, get_config
from ..training import TrainConfig, build_optimizer, prepare, train, training_step
from .timing import interleaved_best, matmul_gflops, write_report


def matched_gpt2(reference: str = "kimi-k3-tiny", vocab_size: int = 4096) -> tuple[dict, int]:
    """gpt2-tiny overrides (same width) whose depth brings its total parameters closest to `reference`."""
    target = count_params(get_config(reference, vocab_size=vocab_size)).total
    width = get_config(reference).hidden_size
    best = min(
        range(1, 64),
        key=lambda n: abs(
            count_params(get_config("gpt2-tiny", vocab_size=vocab_size, hidden_size=width, num_layers=n)).total - target
        ),
    )
    return {"hidden_size": width, "num_layers": best}, target


def step_cases(models: dict[str, CausalLM], cfg: TrainConfig, data) -> dict:
    """One training step of each model (its own optimizer, a fresh batch each call) as a timing case."""
    generator = torch.Generator().manual_seed(0)
    cases = {}
    for name, model in models.items():
        optimizer = build_optimizer(model, cfg)
        cases[name] = lambda m=model, o=optimizer: training_step(
            m, o, data.batch(cfg.batch_size, cfg.seq_len, generator), cfg
        )
    return cases


def run(
    minutes: float = 5.0,
    speed_steps: int = 5,
    out: str = "runs/bench-train",
    json_path: str | None = None,
    data: str | None = None,
) -> dict:
    base = TrainConfig(
        data=data, time_budget=minutes, max_steps=None, eval_every=10**9, eval_tokens=65536, final_eval_tokens=65536
    )
    tokenizer, token_data = prepare(base)
    gpt_overrides, target = matched_gpt2(vocab_size=tokenizer.vocab_size)
    runs = {"kimi-k3-tiny": {}, "gpt2-tiny": gpt_overrides}
    results: dict = {}
    print(
        f"k3 bench train: kimi-k3-tiny vs gpt2-tiny (width {gpt_overrides['hidden_size']}, "
        f"{gpt_overrides['num_layers']} layers to match {target:,} parameters), {base.batch_size} x "
        f"{base.seq_len} tokens per step, {base.optimizer}, {torch.get_num_threads()} threads; machine matmul "
        f"{matmul_gflops():.0f} GFLOP/s (1024^3 float32)"
    )
    # speed: one step of each model in turn, `speed_steps` rounds after a warm-up, the fastest kept (the
    # least disturbed by the machine's other work), so both see the same machine state
    models = {name: CausalLM(get_config(name, **{**o, "vocab_size": tokenizer.vocab_size})) for name, o in runs.items()}
    best = interleaved_best(step_cases(models, base, token_data), speed_steps, grad=True)
    for name, model in models.items():
        results[name] = {
            "parameters": model.num_parameters(),
            "active": count_params(model.config).active,
            "tokens_per_s": base.batch_size * base.seq_len / best[name],
        }
    ratio = results["kimi-k3-tiny"]["tokens_per_s"] / results["gpt2-tiny"]["tokens_per_s"]
    for name, r in results.items():
        print(
            f"  {name:14s} {r['parameters']:>10,} parameters ({r['active']:,} active)  "
            f"{r['tokens_per_s']:8.0f} training tokens/s"
        )
    print(f"  kimi-k3-tiny trains at {ratio:.2f}x gpt2-tiny's tokens/s")
    # quality after the same wall-clock budget
    for name, overrides in runs.items():
        cfg = dataclasses.replace(
            base, preset=name, model_overrides=overrides, out=f"{out}/{name}", overwrite=True
        )  # the benchmark's own folder, run after run
        history = train(cfg, progress=False)
        results[name]["val_bpb"] = history["final_val_bpb"]
        results[name]["steps"] = history["step"][-1] if history["step"] else 0
    print(f"\nvalidation bits per byte after {minutes:g} minutes of training each:")
    for name, r in results.items():
        print(f"  {name:14s} {r['val_bpb']:.3f}  ({r['steps']} steps)")
    if json_path:
        write_report(json_path, {"minutes": minutes, "speed_ratio": ratio, "results": results}, "train", indent=2)
    return results
