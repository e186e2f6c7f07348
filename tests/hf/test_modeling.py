"""K3ForCausalLM is k3's CausalLM under transformers: the same logits (to float32 rounding) and the same
greedy tokens as k3's own generation (compared in float64, where no rounding difference between two
code paths can flip an argmax), through save_pretrained / AutoModelForCausalLM.from_pretrained; its
cache continues across generate calls and follows beam search; what it cannot do is refused clearly."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from k3.hf import CACHE_ARG, K3Cache, K3Config, K3ForCausalLM  # noqa: E402
from k3.models import CausalLM, get_config  # noqa: E402

VOCAB = 96
# small widths: the structure of each preset (K3: KDA/MLA, latent MoE, SiTU, AttnRes; GPT-2: tied head,
# learned positions; Kimi Linear: MoE with a dense first layer) at a fraction of the cost
MODELS = {
    "kimi-k3-tiny": dict(hidden_size=64, num_layers=4),
    "gpt2-tiny": dict(hidden_size=32, num_layers=2),
    "kimi-linear-tiny": dict(hidden_size=64, num_layers=4),
}


def k3_model(name: str, seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    model = CausalLM(get_config(name, vocab_size=VOCAB, **MODELS[name])).eval()
    with torch.no_grad():  # a non-zero routing bias, so that losing it on the way would show
        for moe in model.moe_layers():
            moe.gate.e_score_correction_bias.uniform_(-0.1, 0.1)
    return model


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request, tmp_path_factory):
    """(k3 model, the same model saved by transformers and loaded with AutoModelForCausalLM)."""
    model = k3_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    K3ForCausalLM.from_k3(model).save_pretrained(path)
    return model, transformers.AutoModelForCausalLM.from_pretrained(path).eval(), path


def float64(*modules):
    """Copies of `modules` in float64 (the fixtures' float32 models stay as they are)."""
    return tuple(copy.deepcopy(m).double() for m in modules)


def test_round_trip_gives_k3_logits(pair):
    model, hf, path = pair
    assert type(hf) is K3ForCausalLM and hf.config.model_type == "k3"
    assert hf.k3.config == model.config
    if model.config.tie_word_embeddings:
        assert hf.k3.lm_head.weight is hf.k3.model.embed_tokens.weight
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # equal to float32 rounding, not bitwise: a model loaded from disk holds the same weights in other
        # buffers, whose alignment can change the CPU kernels' summation order
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=1e-5, atol=1e-6)
        # and k3 itself reads the directory transformers wrote
        torch.testing.assert_close(CausalLM.from_pretrained(path)(ids), model(ids), rtol=1e-5, atol=1e-6)


def test_greedy_generate_equals_k3_generate(pair):
    model, hf = float64(*pair[:2])
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))  # an unpadded batch
    out = hf.generate(ids, do_sample=False, max_new_tokens=24)
    assert out.shape == (2, 7 + 24)
    assert torch.equal(out, model.generate(ids, 24, temperature=0))
    one = hf.generate(ids[:1], attention_mask=torch.ones_like(ids[:1]), do_sample=False, max_new_tokens=24)
    assert torch.equal(one, out[:1])


def test_sampling_runs_and_top_k_1_is_greedy(pair):
    _, hf, _ = pair
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    sampled = hf.generate(ids, do_sample=True, top_k=8, temperature=1.5, max_new_tokens=6)
    assert sampled.shape == (1, 11) and torch.equal(sampled[:, :5], ids)
    assert int(sampled.min()) >= 0 and int(sampled.max()) < VOCAB
    torch.manual_seed(0)
    assert torch.equal(hf.generate(ids, do_sample=True, top_k=8, temperature=1.5, max_new_tokens=6), sampled)
    assert torch.equal(
        hf.generate(ids, do_sample=True, top_k=1, max_new_tokens=6), hf.generate(ids, do_sample=False, max_new_tokens=6)
    )
    nucleus = hf.generate(ids, do_sample=True, top_p=0.9, max_new_tokens=6)
    assert nucleus.shape == (1, 11) and int(nucleus.max()) < VOCAB


def test_a_cache_continues_across_generate_calls():
    hf = K3ForCausalLM.from_k3(k3_model("kimi-k3-tiny"))
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    whole = hf.generate(ids, do_sample=False, max_new_tokens=9)
    cache = hf.new_cache(2)
    first = hf.generate(ids, do_sample=False, max_new_tokens=4, **{CACHE_ARG: cache})
    assert isinstance(cache, K3Cache) and cache.get_seq_length() == 6 + 4 - 1  # the last token is not fed yet
    assert torch.equal(hf.generate(first, do_sample=False, max_new_tokens=5, **{CACHE_ARG: cache}), whole)


def test_forward_returns_the_cache_and_decodes_from_it():
    model = k3_model("kimi-linear-tiny")
    hf = K3ForCausalLM.from_k3(model)
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = hf(ids[:, :8], use_cache=True)
        cache = out[CACHE_ARG]
        steps = [out.logits] + [hf(ids[:, t : t + 1], **{CACHE_ARG: cache}).logits for t in (8, 9)]
        k3_cache = model.new_cache(1)
        ref = [model(ids[:, :8], cache=k3_cache)] + [model(ids[:, t : t + 1], cache=k3_cache) for t in (8, 9)]
    assert cache.length == 10
    # bitwise: the wrapper runs the very same module on the same weights (from_k3 shares, not copies)
    torch.testing.assert_close(torch.cat(steps, 1), torch.cat(ref, 1), rtol=0, atol=0)


def test_beam_search_reorders_the_cache():
    """Beam search through the cache (rows reordered every step) picks what it picks without one (float64:
    the two paths round differently, which must not flip a choice between near-equal beams)."""
    hf = K3ForCausalLM.from_k3(k3_model("kimi-k3-tiny").double())
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(6))
    cached = hf.generate(ids, num_beams=3, do_sample=False, max_new_tokens=8)
    assert torch.equal(cached, hf.generate(ids, num_beams=3, do_sample=False, max_new_tokens=8, use_cache=False))


def test_labels_give_the_shifted_cross_entropy():
    model = k3_model("gpt2-tiny")
    hf = K3ForCausalLM.from_k3(model)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(7))
    labels = ids.clone()
    labels[0, :3] = -100
    out = hf(ids, labels=labels)
    logits = model(ids)[:, :-1].reshape(-1, VOCAB)
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1)))
    assert isinstance(out[CACHE_ARG], K3Cache)  # eval mode: a cache unless use_cache=False
    assert hf(ids, use_cache=False).get(CACHE_ARG) is None
    hf.train()
    assert hf(ids).get(CACHE_ARG) is None  # training: no cache unless asked for


def test_refusals_name_the_problem():
    hf = K3ForCausalLM.from_k3(k3_model("kimi-linear-tiny"))
    ids = torch.randint(0, VOCAB, (2, 5))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # a left-padded row
    with pytest.raises(ValueError, match="padded batches are not supported"):
        hf.generate(ids, attention_mask=mask, max_new_tokens=2)
    with pytest.raises(ValueError, match="inputs_embeds"):
        hf(inputs_embeds=torch.zeros(1, 2, 64))
    with pytest.raises(ValueError, match="must be a K3Cache"):
        hf(ids, **{CACHE_ARG: transformers.DynamicCache()})
    with pytest.raises(ValueError, match="batch size 1"):  # k3's own check, through the wrapper
        hf(ids, **{CACHE_ARG: hf.new_cache(1)})
    with pytest.raises(ValueError, match="`vocab_size` is 7 but the k3 config says 96"):
        K3Config(k3=hf.k3.config, vocab_size=7)
    with pytest.raises(ValueError, match="no k3 model config"):
        K3ForCausalLM(K3Config())


def test_from_pretrained_is_strict(pair, tmp_path):
    from safetensors.torch import load_file, save_file

    _, _, path = pair
    for name in ("config.json", "generation_config.json"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    state = load_file(path / "model.safetensors")
    state.pop("k3.model.norm.weight")
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="does not match its config: missing keys .*k3.model.norm.weight"):
        K3ForCausalLM.from_pretrained(tmp_path)
