"""Train a small Kimi K3 from Python, then generate from it.

    python examples/train_tiny.py                       # kimi-k3-tiny on Shakespeare, 200 steps
    python examples/train_tiny.py --data my.txt --steps 50 --preset gpt2-tiny

The same loop as `k3 train` (checkpoints, validation in bits per byte); the checkpoint folder is what
`k3 generate --checkpoint` and `CausalLM.from_pretrained` read.
"""

import argparse

from k3 import CausalLM, TrainConfig, train
from k3.tokenizer import Tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="kimi-k3-tiny")
    parser.add_argument("--data", help="a UTF-8 text file or folder (default: the Shakespeare corpus)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default="runs/example")
    parser.add_argument("--prompt", default="ROMEO:")
    args = parser.parse_args()

    config = TrainConfig(
        preset=args.preset,
        data=args.data,
        max_steps=args.steps,
        out=args.out,
        warmup_steps=min(50, args.steps),
        eval_every=max(1, args.steps // 4),
    )
    history = train(config)
    print(f"validation: {history['final_val_bpb']:.3f} bits per byte after {args.steps} steps")

    model = CausalLM.from_pretrained(args.out).eval()
    tokenizer = Tokenizer.load(f"{args.out}/tokenizer.json")
    [row] = model.generate([tokenizer.encode(args.prompt)], max_new_tokens=60, temperature=0.8, top_k=50)
    print(tokenizer.decode(row))


if __name__ == "__main__":
    main()
