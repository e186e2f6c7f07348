"""The planner against published figures, each with its source:

- DeepSeek-V3 (DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437): 671B total and 37B
  activated parameters (section 1 and Table 1 of the config), pre-trained on 14.8T tokens at sequence
  length 4,096 in 2,664K H800 GPU-hours, 2,788K with context extension (119K) and post-training (5K)
  (Table 1), in FP8 mixed precision. The planner counts the same model built from its published config
  (`deepseek_v3`), computes its FLOPs per token, and states the MFU the published GPU-hours imply.
- Kimi K3's published repository (huggingface.co/moonshotai/Kimi-K3): about 1.56 TB, the routed experts
  in MXFP4 and the rest bf16. The planner's serving weight bytes must agree within 2%.
- nanoGPT's GPT-2 (124M) reproduction (github.com/karpathy/nanoGPT, README and config/train_gpt2.py):
  "about 4 days" on one 8 x A100 40GB node, 600,000 iterations of 491,520 tokens (12 x 1,024 x 40
  accumulation steps x 8 GPUs) at sequence length 1,024: 295B tokens.
"""

from __future__ import annotations

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
    f.add(
        "GPU-hours for 14.8T tokens: planner at MFU 0.4 (bf16 peak)",
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


CHECKS = {"deepseek-v3": check_deepseek_v3, "kimi-k3-repository": check_kimi_k3_repository, "nanogpt": check_nanogpt}
