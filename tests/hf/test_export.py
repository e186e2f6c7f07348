"""`k3 export`: a k3 training checkpoint becomes a directory that transformers loads — in k3's format
(AutoModelForCausalLM after `import k3.hf`, AutoTokenizer) with k3's logits (to float32 rounding) and
greedy tokens (compared in float64, where two code paths' rounding cannot flip an argmax), or in Kimi
Linear's own format, which transformers' KimiLinearForCausalLM loads and runs to k3's logits (fp32,
relative error <= 1e-5; measured 1.2e-6) and greedy tokens (k3's argmax up to near-ties). Models Kimi
Linear cannot express are refused."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from k3.checkpoints.hf_config import kimi_linear_config  # noqa: E402
from k3.cli import main  # noqa: E402
from k3.hf.export import export  # noqa: E402
from k3.models import CausalLM, get_config  # noqa: E402
from k3.tokenizer import Tokenizer, train_bpe  # noqa: E402
from k3.training import TrainConfig  # noqa: E402

TEXT = "to be or not to be, that is the question: whether 'tis nobler in the mind to suffer"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def training_checkpoint(path, preset: str, **overrides) -> tuple[CausalLM, Tokenizer]:
    """What `k3 train --out path` leaves for export: weights, config.json {"k3", "train", "step"} and
    tokenizer.json (trainer_state.pt and loss.png are not read)."""
    tokenizer = train_bpe([TEXT] * 4, vocab_size=300)
    torch.manual_seed(0)
    model = CausalLM(get_config(preset, vocab_size=tokenizer.vocab_size, **overrides)).eval()
    with torch.no_grad():
        for moe in model.moe_layers():
            moe.gate.e_score_correction_bias.uniform_(-0.1, 0.1)
    model.save_pretrained(path)
    config = {"k3": model.config.to_dict(), "train": dataclasses.asdict(TrainConfig(preset=preset)), "step": 5}
    (path / "config.json").write_text(json.dumps(config))
    tokenizer.save(path / "tokenizer.json")
    return model, tokenizer


def assert_greedy_under(model: CausalLM, tokens: torch.Tensor, prompt_length: int, margin: float = 1e-4) -> None:
    """Every token after the prompt is the argmax of k3's float64 logits at its position, or within
    `margin` of it: transformers' own Kimi Linear runs float32 only, and a near-tie between two tokens
    may go either way in another code path's rounding."""
    with torch.no_grad():
        logits = copy.deepcopy(model).double()(tokens)[:, prompt_length - 1 : -1]
    chosen = logits.gather(-1, tokens[:, prompt_length:, None]).squeeze(-1)
    assert tokens.shape[1] > prompt_length and (logits.amax(-1) - chosen <= margin).all(), (
        tokens,
        logits.amax(-1) - chosen,
    )


@pytest.fixture(scope="module")
def kimi_linear(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi_linear_run")
    return (*training_checkpoint(path, "kimi-linear-tiny", hidden_size=64, num_layers=4), path)


def test_cli_export_k3_format(kimi_linear, tmp_path, capsys):
    model, tokenizer, checkpoint = kimi_linear
    out = tmp_path / "hf"
    assert main(["export", str(checkpoint), str(out)]) == 0
    assert "k3 format" in capsys.readouterr().out
    names = [
        "config.json",
        "configuration_k3.py",
        "generation_config.json",
        "model.safetensors",
        "modeling_k3.py",
        "tokenizer.json",
        "tokenizer_config.json",
    ]  # the .py files: remote code (test_remote_code.py)
    assert sorted(os.listdir(out)) == names
    umask = os.umask(0)
    os.umask(umask)
    assert all((out / n).stat().st_mode & 0o777 == 0o666 & ~umask for n in names)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = tokenizer.encode(TEXT + "<|endoftext|> to be")
    assert hf_tokenizer(TEXT + "<|endoftext|> to be").input_ids == ids
    assert hf_tokenizer.decode(ids) == tokenizer.decode(ids)
    assert hf_tokenizer.eos_token_id == tokenizer.eot_id

    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.config.eos_token_id == tokenizer.eot_id
    prompt = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(hf(prompt).logits, model(prompt), rtol=1e-5, atol=1e-6)
    hf64, model64 = hf.double(), copy.deepcopy(model).double()
    assert torch.equal(
        hf64.generate(prompt, do_sample=False, max_new_tokens=20),
        model64.generate(prompt, 20, temperature=0, eos_token_id=tokenizer.eot_id),
    )
    # k3 reads the exported directory as one of its own checkpoints: the same config and tensors
    # (bitwise: a round trip of the tensors), and `k3 generate` runs from it
    exported, original = CausalLM.from_pretrained(out), CausalLM.from_pretrained(checkpoint)
    assert exported.config == original.config
    assert all(torch.equal(a, b) for a, b in zip(exported.state_dict().values(), original.state_dict().values()))
    assert exported.state_dict().keys() == original.state_dict().keys()
    assert (
        main(["generate", "--checkpoint", str(out), "--prompt", "to be", "--temperature", "0", "--max-new-tokens", "8"])
        == 0
    )
    assert capsys.readouterr().out.startswith("to be")


@pytest.mark.skipif(not hasattr(transformers, "KimiLinearForCausalLM"), reason="transformers has no Kimi Linear")
def test_export_kimi_linear_format_loads_in_transformers(kimi_linear, tmp_path):
    model, tokenizer, checkpoint = kimi_linear
    out = tmp_path / "kimi"
    export(checkpoint, out, format="kimi-linear")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "kimi_linear" and config["eos_token_id"] == tokenizer.eot_id
    assert "auto_map" not in config and not list(out.glob("*.py"))  # transformers' own class loads it
    hf, info = transformers.KimiLinearForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    hf.eval()
    ids = torch.randint(0, tokenizer.vocab_size, (2, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel(hf(ids).logits, model(ids)) <= 1e-5
    prompt = ids[:1, :9]
    assert_greedy_under(model, hf.generate(prompt, do_sample=False, max_new_tokens=20, eos_token_id=None), 9)
    # and back: k3 reads the Kimi Linear directory (convert_kimi_state_dict undoes kimi_state_dict)
    again = CausalLM.from_pretrained(out).eval()
    assert again.config.replace(name=model.config.name) == model.config
    with torch.no_grad():
        torch.testing.assert_close(again(ids), model(ids), rtol=1e-5, atol=1e-6)


def test_kimi_linear_format_refuses_kimi_k3(tmp_path, capsys):
    checkpoint = tmp_path / "k3run"
    training_checkpoint(checkpoint, "kimi-k3-tiny", hidden_size=64, num_layers=2)
    out = tmp_path / "out"
    assert main(["export", str(checkpoint), str(out), "--format", "kimi-linear"]) == 2
    err = capsys.readouterr().err
    for what in (
        "safe KDA gate",
        "output gate 'full'",
        "gated MLA",
        "'situ'",
        "latent MoE",
        "Block Attention Residuals",
    ):
        assert what in err, what
    assert "k3 export: error:" in err and "k3's own format" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k3run"]  # nothing written


def test_kimi_linear_config_refusals():
    with pytest.raises(ValueError, match=r"layer types \['mha'\]"):
        kimi_linear_config(get_config("gpt2-tiny"))
    pattern = ["dense", "moe", "dense", "moe"]
    with pytest.raises(ValueError, match="dense FFN layers after the first MoE layer"):
        kimi_linear_config(get_config("kimi-linear-tiny", num_layers=4).replace(mlp_types=pattern))
    with pytest.raises(ValueError, match="MoE layers without a shared expert"):
        kimi_linear_config(get_config("kimi-linear-tiny", num_shared_experts=0))
    assert kimi_linear_config(get_config("kimi-linear-tiny"))["model_type"] == "kimi_linear"


def test_export_without_transformers_says_what_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails as if not installed
    for name in ("k3.hf", "k3.hf.export", "k3.hf.modeling"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert main(["export", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "k3.hf needs Hugging Face transformers >= 4.57: pip install 'k3[hf]'" in capsys.readouterr().err
