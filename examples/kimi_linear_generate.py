"""Load a Kimi Linear checkpoint into k3 and generate greedily.

    python examples/kimi_linear_generate.py DIR --prompt "The capital of France is"

DIR is a Kimi Linear checkpoint directory: config.json and safetensors weights in the Hub's layout
(moonshotai/Kimi-Linear-48B-A3B-*, about 100 GB in bfloat16) or what transformers' `save_pretrained`
or `k3 export --format kimi-linear` writes. The tokenizer is DIR/tokenizer.json when there is one
(Hugging Face `tokenizers`), else transformers' AutoTokenizer (the Hub's Kimi tokenizer needs
trust_remote_code).
"""

import argparse
from pathlib import Path

import torch

from k3 import CausalLM


def load_tokenizer(directory: Path):
    """(encode, decode) for the checkpoint's tokenizer."""
    if (directory / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        return (lambda text: tokenizer.encode(text).ids), tokenizer.decode
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=True)
    return tokenizer.encode, tokenizer.decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--max-new-tokens", type=int, default=30)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = parser.parse_args()

    model = CausalLM.from_pretrained(args.checkpoint, dtype=getattr(torch, args.dtype)).eval()
    print(f"{model.config.name}: {model.num_parameters():,} parameters, layers {model.config.layer_types}")
    encode, decode = load_tokenizer(args.checkpoint)
    [row] = model.generate([encode(args.prompt)], max_new_tokens=args.max_new_tokens, temperature=0)
    print(decode(row.tolist()))


if __name__ == "__main__":
    main()
