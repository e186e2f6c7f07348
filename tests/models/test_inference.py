"""Prefill + decode through the hybrid cache == one full forward, for every tiny preset; cache memory;
Block AttnRes bookkeeping against the article's formula; generation."""

from __future__ import annotations

import pytest
import torch

from k3.layers import BlockAttnRes
from k3.models import Cache, CausalLM, get_config
from k3.models.decoder import attn_res_source_counts

from .conftest import TINY, tiny_model


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("name", TINY)
def test_prefill_then_decode_equals_full_forward(name):
    model = tiny_model(name)
    ids = torch.randint(0, 512, (2, 106), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        for t in (1, 5, 64, 100):
            cache = model.new_cache(2)
            steps = [model(ids[:, :t], cache=cache)]
            steps += [model(ids[:, s : s + 1], cache=cache) for s in range(t, t + 6)]
            got = torch.cat(steps, dim=1)
            assert got.shape == (2, t + 6, 512)
            assert cache.length == t + 6
            assert rel(got, full[:, : t + 6]) <= 1e-4, (name, t)


def test_prefill_in_pieces_equals_one_prefill():
    model = tiny_model("kimi-k3-tiny")
    ids = torch.randint(0, 512, (2, 90))
    with torch.no_grad():
        cache = model.new_cache(2)
        pieces = torch.cat([model(ids[:, :33], cache=cache), model(ids[:, 33:], cache=cache)], dim=1)
        assert rel(pieces, model(ids)) <= 1e-4


def test_cache_memory_constant_for_kda_and_linear_in_length_for_mla():
    model = tiny_model("kimi-k3-tiny")
    c = model.config
    n_mla = c.layer_types.count("mla")
    cache = model.new_cache(2)
    sizes = []
    with torch.no_grad():
        model(torch.randint(0, 512, (2, 10)), cache=cache)
        sizes.append(cache.nbytes_by_type(held=True))
        for _ in range(3):
            model(torch.randint(0, 512, (2, 1)), cache=cache)
            sizes.append(cache.nbytes_by_type(held=True))
    assert len({s["kda"] for s in sizes}) == 1 and sizes[0]["kda"] > 0
    per_token = 2 * n_mla * (c.kv_lora_rank + c.qk_rope_head_dim) * 4  # batch 2, fp32
    for before, after in zip(sizes, sizes[1:]):
        assert after["mla"] - before["mla"] == per_token
    assert sizes[0]["mla"] == 10 * per_token
    assert cache.nbytes(held=True) == sum(sizes[-1].values())
    assert cache.nbytes() == sizes[-1]["kda"] + sizes[-1]["mla"] // 13 * cache.capacity  # every slot allocated


def direct_attn_res_forward(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    """The article's block_attn_res, written out: V = stack(blocks + [partial]); K = RMS(V);
    h = sum softmax(w . K) V with w = norm.weight * proj.weight; a block closes every B layers."""

    def block_attn_res(blocks, partial, res):
        V = torch.stack(blocks + [partial])
        K = V / torch.sqrt(V.pow(2).mean(-1, keepdim=True) + res.eps)
        logits = torch.einsum("d,nbtd->nbt", res.norm.weight * res.proj.weight.squeeze(0), K)
        return torch.einsum("nbt,nbtd->btd", logits.softmax(0), V)

    dec, B = model.model, model.config.attn_res_block_size
    blocks, partial = [], dec.embed_tokens(ids)
    for i, layer in enumerate(dec.layers):
        h = block_attn_res(blocks, partial, layer.attn_res)
        if i % B == 0:
            blocks, partial = blocks + [partial], torch.zeros_like(partial)
        partial = partial + layer.self_attn(layer.input_layernorm(h))
        h = block_attn_res(blocks, partial, layer.mlp_res)
        partial = partial + layer.ffn(layer.post_attention_layernorm(h))
    return model.lm_head(dec.norm(block_attn_res(blocks, partial, dec.final_res)))


@pytest.mark.parametrize("name", ["kimi-k3-tiny", "kimi-k3-article-tiny"])
def test_attn_res_bookkeeping_matches_direct_formula(name):
    model = tiny_model(name).double()
    with torch.no_grad():  # non-trivial depth queries (they start at zero)
        for p in model.parameters():
            if p.dim() == 2 and p.shape[0] == 1:
                p.normal_()
        ids = torch.randint(0, 512, (2, 20))
        assert model.config.num_layers > model.config.attn_res_block_size  # more than one block
        torch.testing.assert_close(model(ids), direct_attn_res_forward(model, ids), rtol=1e-10, atol=1e-10)


def test_generate_greedy_equals_argmax_loop_and_stream():
    """float64: the cached decode and the full forwards round differently, which must not flip an argmax."""
    model = tiny_model("kimi-linear-tiny").double()
    prompt = torch.randint(0, 512, (2, 7))
    out = model.generate(prompt, max_new_tokens=5, temperature=0)
    ids = prompt
    with torch.no_grad():
        for _ in range(5):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ids)
    streamed = torch.stack(list(model.stream(prompt, max_new_tokens=5, temperature=0)), dim=1)
    assert torch.equal(streamed, out[:, 7:])


def test_sampling_is_seeded_and_respects_top_k():
    model = tiny_model("gpt2-tiny")
    prompt = torch.randint(0, 512, (1, 4))
    a = model.generate(prompt, 6, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(5))
    b = model.generate(prompt, 6, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
    with torch.no_grad():  # every sampled token was among the 3 most likely
        logits = model(a[:, :-1])[0, 3:]
    top3 = logits.topk(3, dim=-1).indices
    assert all(int(a[0, 4 + i]) in top3[i].tolist() for i in range(6))


def test_top_p_keeps_only_the_nucleus():
    from k3.inference.generation import sample

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    draws = {int(sample(logits, top_p=0.7, generator=torch.Generator().manual_seed(s))) for s in range(200)}
    assert draws == {0, 1}


def test_eos_stops_generation():
    model = tiny_model("gpt2-tiny")
    prompt = torch.randint(0, 512, (1, 4))
    first = int(model.generate(prompt, 1, temperature=0)[0, -1])
    out = model.generate(prompt, 10, temperature=0, eos_token_id=first)
    assert out.shape == (1, 5) and int(out[0, -1]) == first


def test_bad_inputs_say_what_to_do():
    model = tiny_model("kimi-k3-tiny")
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 512\)"):  # at the boundary: generate
        model.generate(torch.tensor([[1, 600]]), 1)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 512\)"):
        model.check_tokens(torch.tensor([[1, 600]]))
    with pytest.raises(ValueError, match=r"`input_ids` must be token ids in \[0, 512\)"):  # the embedding's
        model(torch.tensor([[1, 600]]))  # IndexError, said (a forward reads nothing back before it)
    with pytest.raises(ValueError, match="`input_ids` must be a \\[B, T\\]"):
        model(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="int64"):
        model(torch.tensor([[1.0, 2.0]]))
    cache = model.new_cache(2)
    with pytest.raises(ValueError, match="batch size 2.*new_cache\\(3\\)"):
        model(torch.randint(0, 512, (3, 4)), cache=cache)
    other = tiny_model("kimi-linear-tiny")
    with pytest.raises(ValueError, match="another model"):
        model(torch.randint(0, 512, (2, 4)), cache=other.new_cache(2))
    with pytest.raises(ValueError, match="`batch_size`"):
        model.new_cache(0)
    gpt = tiny_model("gpt2-tiny", max_position_embeddings=8)
    with pytest.raises(ValueError, match="learned positions for 8 tokens"):
        gpt(torch.randint(0, 512, (1, 9)))
    with pytest.raises(ValueError, match="prompt"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), 3)
    assert isinstance(cache, Cache) and "kimi-k3-tiny" in repr(cache)


def test_attn_res_source_counts_match_the_model():
    """`attn_res_source_counts` (the lab's AttnRes cost) is the number of sources each mix reads."""
    config = get_config("kimi-k3-tiny", hidden_size=32, num_layers=7, attn_res_block_size=3)
    model = CausalLM(config).eval()
    seen = []
    hooks = [
        m.register_forward_hook(lambda mod, inputs, out: seen.append(len(inputs[0])))
        for m in model.modules()
        if isinstance(m, BlockAttnRes)
    ]
    with torch.no_grad():
        model(torch.zeros(1, 3, dtype=torch.long))
    for h in hooks:
        h.remove()
    assert seen == attn_res_source_counts(config)
    k3_counts = attn_res_source_counts(get_config("kimi-k3"))
    assert len(k3_counts) == 2 * 93 + 1 and k3_counts[-1] == 1 + 8  # the embedding and 7 block sums + partial
    assert attn_res_source_counts(get_config("kimi-linear")) == []
