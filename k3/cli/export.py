"""`k3 export`: a k3 checkpoint written in transformers', Kimi's or llama.cpp's (GGUF) format (`k3.hf.export`),
once the checkpoint is known to load."""

from __future__ import annotations

import argparse

NAME = "export"
PARSER = {
    "help": "write a checkpoint in transformers', Kimi's or llama.cpp's (GGUF) format"
}  # the keywords of its subparser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`k3 export`'s arguments, added to its `parser` (made with `PARSER`'s keywords)."""
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="a k3 checkpoint directory (k3 train --out)")
    parser.add_argument("out", metavar="DIR", help="output directory: new or empty (an export never writes over files)")
    parser.add_argument(
        "--format",
        choices=("k3", "kimi-linear", "kimi-k3", "gguf"),
        default="k3",
        help="k3 (default): transformers' Auto classes, with trust_remote_code=True or after `import k3.hf`; "
        "kimi-linear: Kimi Linear's own format; kimi-k3: Kimi K3's published layout; gguf: DIR/model.gguf "
        "for llama.cpp (Kimi K3, Kimi Linear and GPT-2 models; needs k3[gguf])",
    )
    parser.add_argument("--outtype", choices=("f32", "bf16", "q8_0"), help="gguf: the matrices' type (default f32)")
    parser.add_argument(
        "--quantize",
        choices=("mxfp4", "bf16"),
        help="kimi-k3: how the routed experts are stored: mxfp4 (compressed-tensors MXFP4; MXFP4 codes "
        "the checkpoint holds are copied byte for byte) or bf16 (MXFP4 decoded); default: as the "
        "checkpoint stores them",
    )


def run(args) -> int:
    """`k3 export`: a missing transformers or gguf package is said in one line, as bad input is."""
    try:
        from ..hf.export import export
        from .preflight import check_pretrained

        check_pretrained(args.checkpoint, f"checkpoint {args.checkpoint}")
        names = export(args.checkpoint, args.out, format=args.format, quantize=args.quantize, outtype=args.outtype)
    except ModuleNotFoundError as e:  # transformers or gguf missing: say so without a traceback
        if e.name not in ("transformers", "gguf"):
            raise
        raise ValueError(str(e)) from e
    print(f"wrote {', '.join(names)} to {args.out} ({args.format} format)")
    return 0
