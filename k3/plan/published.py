"""The planner against published figures, each with its source:

- DeepSeek-V3 (DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437): 671B total and 37B
  activated parameters (section 1 and Table 1 of the config), pre-trained on 14.8T tokens at sequence
  length 4,096 in 2,664K H800 GPU-hours, 2,788K with context extension (119K) and post-training (5K)
  (Table 1), in FP8 mixed precision. The planner counts the same model built from its published config
  (`deepseek_v3`), computes its FLOPs per token, and states the MFU the published GPU-hours imply.
- Kimi K3's published repository (huggingface.co/moonshotai/Kimi-K3): about 1.56 TB, the routed experts
  in MXFP4 and the rest bf16. The planner's serving weight bytes must agree within 2%.
- torchtitan's DeepSeek-V3 16B on 8 H100s (torchtitan issue 1789; its train_configs/deepseek_v3_16b.toml):
  about 11.5k tokens/s per GPU, about 20% MFU, FSDP over the 8 GPUs, full recomputation, AdamW. The
  planner's step (compute + exposed communication) beside it.
- nanoGPT's GPT-2 (124M) reproduction (github.com/karpathy/nanoGPT, README and config/train_gpt2.py):
  "about 4 days" on one 8 x A100 40GB node, 600,000 iterations of 491,520 tokens (12 x 1,024 x 40
  accumulation steps x 8 GPUs) at sequence length 1,024: 295B tokens.
"""

from __future__ import annotations

import dataclasses

from ..models import ModelConfig, count_params, get_config
from .figures import Figures
from .hardware import GPUS
from .serving import weight_bytes
from .shapes import model_shapes
from .training import TrainSettings, plan_training

DEEPSEEK_V3 = dict(
    total=671e9,
    active=37e9,
    tokens=14.8e12,
    pretrain_gpu_hours=2.664e6,
    total_gpu_hours=2.788e6,
    seq_len=4096,
    gpus=2048,
)
KIMI_K3_REPOSITORY_BYTES = 1.56e12
# torchtitan's DeepSeek-V3 16B (its "16B" flavor, train_configs/deepseek_v3_16b.toml: FSDP over 8 GPUs, no ep,
# full activation checkpointing, AdamW, bf16 mixed precision, 8 x 4,096 tokens per GPU) on 8 H100s: about
# 11.5k tokens/s per GPU, about 20% MFU (torchtitan issue 1789)
TORCHTITAN_DSV3_16B = dict(tokens_per_s=11.5e3, mfu=0.20, gpus=8, gpu="h100", seq_len=4096, local_batch=8)
NANOGPT_GPT2 = dict(seconds=4 * 86400, gpus=8, gpu="a100-40gb", iterations=600_000, batch_tokens=491_520, seq_len=1024)


def deepseek_v3() -> ModelConfig:
    """DeepSeek-V3 from its published config.json (the multi-token-prediction module left out, as the 671B
    is): 61 MLA layers, the first 3 with a dense FFN, then 256 routed experts (top 8) and one shared."""
    return ModelConfig(
        name="deepseek-v3",
        vocab_size=129280,
        hidden_size=7168,
        num_layers=61,
        layer_types=["mla"] * 61,
        mlp_types=["dense"] * 3 + ["moe"] * 58,
        num_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        ffn_activation="swiglu",
        intermediate_size=18432,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
        num_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_eps=1e-6,
    )


def deepseek_v3_16b() -> ModelConfig:
    """torchtitan's DeepSeek-V3 16B flavor (DeepSeek-V2-Lite's shape): DeepSeek-V3's design at 27 MLA layers
    without query LoRA, the first with a dense FFN, then 64 routed experts (top 6) and 2 shared."""
    return dataclasses.replace(
        deepseek_v3(),
        name="deepseek-v3-16b",
        vocab_size=102400,
        hidden_size=2048,
        num_layers=27,
        layer_types=["mla"] * 27,
        mlp_types=["dense"] + ["moe"] * 26,
        num_heads=16,
        q_lora_rank=None,
        intermediate_size=10944,
        num_experts=64,
        num_experts_per_tok=6,
        moe_intermediate_size=1408,
        num_shared_experts=2,
        routed_scaling_factor=1.0,
    )


def check_torchtitan_deepseek_v3_16b() -> Figures:
    """The planner's step (compute + exposed communication) against torchtitan's DeepSeek-V3 16B on 8 H100s."""
    p = TORCHTITAN_DSV3_16B
    batch = p["gpus"] * p["local_batch"] * p["seq_len"]
    settings = TrainSettings(
        gpus=p["gpus"],
        gpu=p["gpu"],
        fsdp=p["gpus"],
        ep=1,
        seq_len=p["seq_len"],
        micro_batch=p["local_batch"],
        global_batch_tokens=batch,
        optimizer="adamw",
        recompute="full",
    )
    plan = plan_training(deepseek_v3_16b(), settings)
    f = Figures("torchtitan's DeepSeek-V3 16B on 8 x H100 (torchtitan issue 1789) against the planner")
    f.add("training FLOPs per token at 4,096 (planner)", plan["FLOPs per token"], "FLOP")
    f.add("step: compute at MFU 0.4 (planner)", plan["step time: compute"], "s")
    f.add("step: exposed communication (planner)", plan["communication exposed communication"], "s")
    f.add("tokens/s per GPU: planner", batch / plan["step time"] / p["gpus"], "tokens/s")
    f.add("tokens/s per GPU: published (about)", p["tokens_per_s"], "tokens/s")
    implied = p["tokens_per_s"] * plan["FLOPs per token"] / GPUS[p["gpu"]].bf16_flops
    f.add("MFU the published tokens/s imply (planner's FLOPs)", implied, "fraction")
    f.add("MFU: published (about)", p["mfu"], "fraction")
    f.notes = [
        "Over 8 GPUs of one node FSDP's traffic crosses NVLink and hides under the compute: the planner's step is "
        "compute bound, so the gap to the published figure is the compute's own efficiency (an MFU of 0.4 "
        f"assumed, about {implied:.2f} reached: flex attention, no torch.compile, full recomputation's extra "
        "forward, which MFU does not count).",
    ]
    return f


def check_deepseek_v3() -> Figures:
    """Parameter counts and the training cost of 14.8T tokens against DeepSeek-V3's report."""
    config, p = deepseek_v3(), DEEPSEEK_V3
    pc = count_params(config)
    plan = plan_training(config, TrainSettings(gpus=p["gpus"], gpu="h800", seq_len=p["seq_len"]))
    per_token = plan["FLOPs per token"]
    flops = per_token * p["tokens"]
    f = Figures("DeepSeek-V3 (arXiv:2412.19437) against the planner")
    f.add("parameters: planner", pc.total, "count")
    f.add("parameters: published", p["total"], "count")
    f.add("active parameters: planner (embedding lookup excluded)", pc.active, "count")
    f.add("active parameters: published", p["active"], "count")
    f.add("training FLOPs per token at 4,096 (planner)", per_token, "FLOP")
    compute_share = plan["step time: compute"] / plan["step time"]
    f.add(
        "GPU-hours for 14.8T tokens: planner at MFU 0.4 (bf16 peak), compute alone",
        plan["GPU-hours per trillion tokens"] * compute_share * p["tokens"] / 1e12,
        "GPU-hours",
    )
    f.add(
        "GPU-hours for 14.8T tokens: planner, compute + exposed communication",
        plan["GPU-hours per trillion tokens"] * p["tokens"] / 1e12,
        "GPU-hours",
    )
    f.add("GPU-hours for 14.8T tokens: published (pre-training)", p["pretrain_gpu_hours"], "GPU-hours")
    f.add("GPU-hours: published total (with context extension and post-training)", p["total_gpu_hours"], "GPU-hours")
    achieved = flops / (p["pretrain_gpu_hours"] * 3600)
    f.add("implied FLOP/s per GPU (pre-training)", achieved, "FLOP/s")
    f.add("implied MFU on the H800's dense bf16 peak", achieved / GPUS["h800"].bf16_flops, "fraction")
    f.add("implied MFU on the H800's dense fp8 peak", achieved / GPUS["h800"].fp8_flops, "fraction")
    f.notes = [
        f"The report's 37B is rounded: the planner's count without the embedding table "
        f"({pc.active / 1e9:.2f}B) and with it ({(pc.active + config.vocab_size * config.hidden_size) / 1e9:.2f}B) "
        "both round to it.",
        "The planner's FLOPs leave out the multi-token-prediction module DeepSeek-V3 also trains "
        "(one more MLA + MoE layer and its projection).",
        "DeepSeek-V3 trained in FP8: against the fp8 peak the implied MFU halves; the 2,788K total "
        "includes 124K GPU-hours that are not the 14.8T-token pre-training.",
        f"With communication the planner prices k3's own layout ({plan.inputs['fsdp']} FSDP ranks, ep "
        f"{plan.inputs['ep']}, no pipeline, float32 gradients reduce-scattered every micro-batch): "
        f"{plan['communication exposed communication'] / plan['step time']:.0%} of its step is exposed "
        "communication, most of it FSDP's traffic over the network. DeepSeek-V3 ran 16 pipeline stages x ep "
        "64 x ZeRO-1, its all-to-alls hidden by DualPipe and its weights in FP8: the published cost is what "
        "that layout reaches, and compute alone at MFU 0.4 is within 3% of it.",
    ]
    return f


def check_kimi_k3_repository() -> Figures:
    """Kimi K3's weight bytes with MXFP4 routed experts against the published repository's size."""
    config = get_config("kimi-k3")
    planned = sum(weight_bytes(config, model_shapes(config), "mxfp4").values())
    f = Figures("Kimi K3 weights (MXFP4 routed experts, bf16 rest) against huggingface.co/moonshotai/Kimi-K3")
    f.add("weight bytes: planner", planned, "bytes")
    f.add("repository size: published (about)", KIMI_K3_REPOSITORY_BYTES, "bytes")
    f.add("planner / published - 1", planned / KIMI_K3_REPOSITORY_BYTES - 1, "fraction")
    f.notes = [
        "The repository also holds the vision tower, tokenizer and configs; the planner counts the language model only."
    ]
    return f


def check_nanogpt() -> Figures:
    """GPT-2 (124M) on one 8 x A100 40GB node against nanoGPT's published reproduction time."""
    p = NANOGPT_GPT2
    tokens = p["iterations"] * p["batch_tokens"]
    plan = plan_training(
        get_config("gpt2"),
        TrainSettings(
            gpus=p["gpus"], gpu=p["gpu"], seq_len=p["seq_len"], global_batch_tokens=p["batch_tokens"], micro_batch=12
        ),
    )
    planned = plan["step time"] / plan.inputs["global batch tokens"] * tokens
    f = Figures("nanoGPT's GPT-2 (124M) reproduction (github.com/karpathy/nanoGPT) against the planner")
    f.add("tokens (600,000 x 491,520)", tokens, "tokens")
    f.add("training FLOPs per token at 1,024 (planner)", plan["FLOPs per token"], "FLOP")
    f.add("time on 8 x A100 40GB: planner at MFU 0.4", planned, "s")
    f.add("time on 8 x A100 40GB: published (about 4 days)", p["seconds"], "s")
    f.add("GPU-hours: published", p["seconds"] * p["gpus"] / 3600, "GPU-hours")
    implied = plan["FLOPs per token"] * tokens / (p["seconds"] * p["gpus"] * GPUS[p["gpu"]].bf16_flops)
    f.add("implied MFU on the A100's dense bf16 peak", implied, "fraction")
    f.notes = [
        "nanoGPT's own estimate_mfu counts 6N + 12 L H Q T per token (attention at full length, "
        "positions excluded from N); the planner counts causal attention at half that."
    ]
    return f


CHECKS = {
    "deepseek-v3": check_deepseek_v3,
    "torchtitan-deepseek-v3-16b": check_torchtitan_deepseek_v3_16b,
    "kimi-k3-repository": check_kimi_k3_repository,
    "nanogpt": check_nanogpt,
}
