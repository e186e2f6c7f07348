"""Real peer: transformers' KimiLinearForCausalLM. A checkpoint it saves loads into k3 and gives the
same logits, prefill and decode; transformers' in-memory layout loads too; k3's own checkpoints
round-trip and refuse a mismatched configuration."""

from __future__ import annotations

import pytest
import torch

from k3.checkpoints.checkpoint import convert_kimi_state_dict, load_into
from k3.models import CausalLM, get_config

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "KimiLinearForCausalLM"):
    pytest.skip("this transformers has no KimiLinearForCausalLM", allow_module_level=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def hf_model():
    cfg = transformers.KimiLinearConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        num_local_experts=8,
        num_experts_per_tok=2,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        linear_head_dim=16,
        linear_num_heads=4,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
    )
    torch.manual_seed(0)
    return transformers.KimiLinearForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def saved(hf_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi_linear")
    hf_model.save_pretrained(path)
    return path


def test_saved_checkpoint_loads_and_matches_prefill_and_decode(hf_model, saved):
    model = CausalLM.from_pretrained(saved).eval()
    assert model.config.layer_types == ["kda", "kda", "kda", "mla"]
    ids = torch.randint(3, 128, (2, 41), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf_model(ids).logits
        assert rel(model(ids), ref) <= 1e-4
        # prefill 33 tokens, then decode one at a time, through both caches
        out = hf_model(ids[:, :33], use_cache=True)
        hf_cache, hf_steps = out.cache if hasattr(out, "cache") else out.past_key_values, [out.logits]
        cache = model.new_cache(2)
        steps = [model(ids[:, :33], cache=cache)]
        for s in range(33, 41):
            out = hf_model(ids[:, s : s + 1], cache=hf_cache, use_cache=True)
            hf_steps.append(out.logits)
            steps.append(model(ids[:, s : s + 1], cache=cache))
    hf_decoded, decoded = torch.cat(hf_steps, 1), torch.cat(steps, 1)
    assert rel(hf_decoded, ref) <= 1e-4  # transformers' own decode is consistent
    assert rel(decoded, hf_decoded) <= 1e-4


def test_transformers_in_memory_layout_loads(hf_model, saved):
    model = CausalLM.from_pretrained(saved)
    other = CausalLM(model.config)
    state = hf_model.state_dict()
    assert any(k.endswith("experts.gate_up_proj") for k in state)  # really the fused layout
    load_into(other, convert_kimi_state_dict(state, model.config), "transformers state_dict")
    ids = torch.randint(3, 128, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(other(ids), model(ids))


def test_k3_checkpoint_round_trip_and_mismatch(tmp_path):
    torch.manual_seed(0)
    model = CausalLM(get_config("kimi-k3-tiny", vocab_size=256)).eval()
    model.save_pretrained(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors"]
    loaded = CausalLM.from_pretrained(tmp_path / "ckpt").eval()
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), rtol=1e-5, atol=1e-6)
    other = CausalLM(get_config("kimi-k3-tiny", vocab_size=256, hidden_size=64))
    with pytest.raises(ValueError, match="does not match the model's configuration: .*shape mismatch"):
        load_into(other, model.state_dict(), "ckpt")
    with pytest.raises(FileNotFoundError, match="config.json"):
        CausalLM.from_pretrained(tmp_path)


def test_tied_gpt2_checkpoint_round_trip(tmp_path):
    torch.manual_seed(0)
    model = CausalLM(get_config("gpt2-tiny", vocab_size=256)).eval()
    model.save_pretrained(tmp_path)
    loaded = CausalLM.from_pretrained(tmp_path).eval()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), rtol=1e-5, atol=1e-6)
