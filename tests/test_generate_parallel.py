"""`torchrun ... -m k3 generate --parallel ep`: 2 processes (gloo), each holding half of every MoE layer's
routed experts and reading only those, generate the tokens one process generates."""

from __future__ import annotations

import os

import pytest
import torch

from k3.cli import main
from k3.models import CausalLM, get_config
from k3.tokenizer import byte_tokenizer

from .processes import free_port, join, leave

pytestmark = pytest.mark.slow  # 2 spawned processes

WORLD = 2
PROMPTS = [[116, 111, 32, 98, 101], [97, 98], [104, 101, 108, 108, 111, 32, 119]]  # "to be", "ab", "hello w"
NEW = 12


def checkpoint(folder) -> None:
    torch.manual_seed(0)  # KDA + MoE, MLA + MoE; 8 experts, top-2: 4 a process
    config = get_config(
        "kimi-k3-tiny", vocab_size=257, hidden_size=48, num_layers=3, num_experts=8, num_experts_per_tok=2
    )
    CausalLM(config).save_pretrained(folder)
    byte_tokenizer().save(folder / "tokenizer.json")


def _worker(rank: int, port: int, folder: str, out: str) -> None:
    from k3.training.parallel import load_expert_parallel

    join(rank, WORLD, port)
    model = load_expert_parallel(folder, torch.device("cpu")).eval()
    held = [[e for e, expert in enumerate(moe.experts) if expert is not None] for moe in model.moe_layers()]
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[0]]))
    rows = model.double().generate(PROMPTS, NEW, temperature=0)  # float64: no rounding can flip an argmax
    model.float()
    with open(f"{out}/stdout{rank}.txt", "w") as stdout:
        import contextlib

        with contextlib.redirect_stdout(stdout):  # the command line, on the same process group
            code = main(
                [
                    "generate",
                    "--checkpoint",
                    folder,
                    "--prompt",
                    "to be",
                    "--temperature",
                    "0",
                    "--max-new-tokens",
                    str(NEW),
                    "--ignore-eot",
                    "--parallel",
                    "ep",
                ]
            )
    torch.save(
        {
            "held": held,
            "logits": logits,
            "rows": rows,
            "code": code,
            "parameters": sum(p.numel() for p in model.parameters()),
        },
        f"{out}/rank{rank}.pt",
    )
    leave()


def test_two_processes_generate_what_one_does(tmp_path):
    folder = tmp_path / "ckpt"
    checkpoint(folder)
    torch.multiprocessing.spawn(_worker, args=(free_port(), str(folder), str(tmp_path)), nprocs=WORLD)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    one = CausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        logits = one(torch.tensor([PROMPTS[0]]))
    rows = one.double().generate(PROMPTS, NEW, temperature=0)
    assert [r["held"] for r in results] == [[[0, 1, 2, 3]] * 2, [[4, 5, 6, 7]] * 2]  # half the experts each
    assert all(r["parameters"] < one.num_parameters() for r in results)
    for r in results:
        assert torch.allclose(r["logits"], logits, rtol=1e-5, atol=1e-6)
        assert [row.tolist() for row in r["rows"]] == [row.tolist() for row in rows]
        assert r["code"] == 0
    printed = (tmp_path / "stdout0.txt").read_text()  # the command line's float32 continuation, streamed
    assert printed.startswith("to be") and len(printed.rstrip("\n")) > len("to be"), printed
    assert (tmp_path / "stdout1.txt").read_text() == ""  # rank 0 alone prints


def test_the_interactive_mode_and_one_process_are_refused(tmp_path, capsys):
    folder = tmp_path / "ckpt"
    checkpoint(folder)
    assert main(["generate", "--checkpoint", str(folder), "--parallel", "ep"]) == 2
    assert "--parallel ep takes --prompt or --prompt-file" in capsys.readouterr().err
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    assert main(["generate", "--checkpoint", str(folder), "--prompt", "to", "--parallel", "ep"]) == 2
    assert "--parallel ep runs under torchrun (missing RANK" in capsys.readouterr().err
