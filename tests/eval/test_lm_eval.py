"""The lm-evaluation-harness adapter: its three requests against direct computations with the model,
then lm-eval end to end on local tasks (tests/eval/tasks), in process and through the command line."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model, model_registry  # noqa: E402

import k3  # noqa: E402
from k3.eval.lm_eval import K3LM, main  # noqa: E402
from k3.models import CausalLM, get_config  # noqa: E402

from ..corpus import WORDS  # noqa: E402
from .conftest import TASKS  # noqa: E402

ROOT = Path(k3.__file__).resolve().parents[1]  # the k3 this test imports; the CLI test runs the same one


def requests(kind: str, *arguments) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=0) for a in arguments]


@torch.no_grad()
def direct(model, tokens: list[int], start: int) -> tuple[float, bool]:
    """sum over i >= start of log p(tokens[i] | tokens[:i]) from one plain forward, and whether each
    tokens[i] is the argmax."""
    logp = model(torch.tensor([tokens[:-1]]))[0].float().log_softmax(-1)
    target = torch.tensor(tokens[start:])
    rows = logp[start - 1 :]
    return float(rows.gather(-1, target[:, None]).sum()), bool((rows.argmax(-1) == target).all())


@torch.no_grad()
def greedy(model, tokenizer, context: str, steps: int) -> list[int]:
    """k3's own greedy generation (CausalLM.generate), up to <|endoftext|>."""
    ids = tokenizer.encode(context)
    new = model.generate(torch.tensor([ids]), steps, temperature=0)[0, len(ids) :].tolist()
    return new[: new.index(tokenizer.eot_id)] if tokenizer.eot_id in new else new


def cut(text: str, until: list[str]) -> str:
    return text[: min([text.find(s) for s in until if s in text], default=len(text))]


def count_forwards(model) -> list:
    calls: list = []
    model.register_forward_hook(lambda *args: calls.append(1))
    return calls


# -- the three requests --------------------------------------------------------------------------
def test_loglikelihood_is_the_continuations_log_probability(k3_checkpoint):
    lm = K3LM(checkpoint=str(k3_checkpoint))
    tok, model = lm.k3_tokenizer, lm.model
    pairs = [
        ("to be or not", " to be"),
        ("the question", " whether tis nobler in mind"),
        ("", "slings arrows"),
        ("mind", " suffer"),
        ("that is", " the"),
    ]
    one_by_one = lm.loglikelihood(requests("loglikelihood", *pairs))
    lm.batch_size = 3  # right-padded batches of different lengths give the same numbers
    batched = lm.loglikelihood(requests("loglikelihood", *pairs))
    for (context, continuation), got, got_batched in zip(pairs, one_by_one, batched):
        head = tok.encode(context) if context else [tok.eot_id]  # an empty context is <|endoftext|>
        whole = tok.encode(context + continuation) if context else [tok.eot_id] + tok.encode(continuation)
        assert whole[: len(head)] == head and len(whole) > len(head)
        want = direct(model, whole, len(head))
        assert got[0] == pytest.approx(want[0], abs=1e-4) and got[1] == want[1]
        assert got_batched[0] == pytest.approx(want[0], abs=1e-4) and got_batched[1] == want[1]
        assert got[0] < 0


def test_is_greedy_when_the_continuation_is_the_argmax(k3_checkpoint):
    lm = K3LM(checkpoint=str(k3_checkpoint))
    context = lm.k3_tokenizer.encode("whether tis nobler")
    with torch.no_grad():
        best = lm.model.generate(torch.tensor([context]), 4, temperature=0)[0, len(context) :].tolist()
    other = best[:-1] + [(best[-1] + 1) % lm.model.config.vocab_size]
    (_, top), (_, not_top) = lm._loglikelihood_tokens([(("", ""), context, best), (("", ""), context, other)])
    assert top and not not_top


def test_rolling_loglikelihood_sums_every_token_and_pieces_through_the_cache(k3_checkpoint):
    text = " ".join(WORDS)
    whole = K3LM(checkpoint=str(k3_checkpoint))
    tok = whole.k3_tokenizer
    tokens = tok.encode(text)
    want, _ = direct(whole.model, [tok.eot_id] + tokens, 1)
    assert whole.loglikelihood_rolling(requests("loglikelihood_rolling", (text,)))[0] == pytest.approx(want, rel=1e-5)
    pieces = K3LM(checkpoint=str(k3_checkpoint), max_length=8)  # no position limit: 8 tokens per forward
    calls = count_forwards(pieces.model)
    got, empty = pieces.loglikelihood_rolling(requests("loglikelihood_rolling", (text,), ("",)))
    assert len(calls) == -(-len(tokens) // 8) > 2
    assert got == pytest.approx(want, rel=1e-5) and empty == 0.0
    # the same pieces serve loglikelihood when context + continuation exceed max_length
    (long,) = pieces.loglikelihood(requests("loglikelihood", ("", text)))
    assert long[0] == pytest.approx(want, rel=1e-5)


def test_gpt2_is_scored_in_windows_of_its_positions(gpt2_checkpoint):
    model_dir, tokenizer = gpt2_checkpoint
    lm = K3LM(checkpoint=str(model_dir), tokenizer=str(tokenizer), batch_size=2)
    tok, model = lm.k3_tokenizer, lm.model
    assert lm.max_length == 16
    text = " ".join(WORDS[:14])
    t = tok.encode(text)
    n = len(t)
    assert 32 < n < 48, n  # two full windows of 16 predictions and a partial one
    # lm-eval's rolling windows: predict t[0:16] from <eot> t[0:15], t[16:32] from t[15:31], and the
    # rest t[32:n] with a full window of 16 inputs t[n-17:n-1]
    want = (
        direct(model, [tok.eot_id] + t[:16], 1)[0]
        + direct(model, t[15:32], 1)[0]
        + direct(model, t[n - 17 :], 17 - (n - 32))[0]
    )
    assert lm.loglikelihood_rolling(requests("loglikelihood_rolling", (text,)))[0] == pytest.approx(want, rel=1e-5)
    # a context longer than the positions loses its left end
    context, continuation = text, " to be"
    whole = tok.encode(context + continuation)
    scored = len(whole) - len(tok.encode(context))
    got = lm.loglikelihood(requests("loglikelihood", (context, continuation)))[0]
    assert got[0] == pytest.approx(direct(model, whole[-17:], 17 - scored)[0], abs=1e-4)
    # generation keeps prompt + new tokens within the 16 positions (counted where the model is asked for
    # them: re-encoding the text can give more tokens than were generated, e.g. for bytes that are not UTF-8)
    calls, stream = [], model.stream
    model.stream = lambda prompt, steps, **kw: calls.append((prompt.shape[1], steps)) or stream(prompt, steps, **kw)
    (text_out,) = lm.generate_until(requests("generate_until", (text, {"max_gen_toks": 40})))
    del model.stream
    assert len(calls) == 1 and sum(calls[0]) <= 16 and isinstance(text_out, str)


def test_generate_until_is_greedy_generation_cut_at_the_stop_string(k3_checkpoint):
    lm = K3LM(checkpoint=str(k3_checkpoint))
    tok, model = lm.k3_tokenizer, lm.model
    context = "to be or not to be"
    new = greedy(model, tok, context, 12)
    full = tok.decode(new)
    starts = [i for i in range(2, len(full) - 1) if full.find(full[i : i + 2]) == i]
    assert starts, f"greedy output {full!r} has no fresh 2-character string to stop at"
    stop = full[starts[0] : starts[0] + 2]
    needed = next(k for k in range(1, len(new) + 1) if stop in tok.decode(new[:k]))
    calls = count_forwards(model)
    got = lm.generate_until(
        requests(
            "generate_until",
            (context, {"until": [stop, "never said"], "max_gen_toks": 12}),
            (context, {"until": "never said", "max_gen_toks": 12}),
            (context, {"max_gen_toks": 3}),
        )
    )
    assert got == [cut(full, [stop]), full, tok.decode(new[:3])]
    assert got[0] == full[: starts[0]]
    assert len(calls) == needed + len(new) + 3  # it stopped as soon as the stop string was out


def test_sampling_follows_the_task_and_the_seed(k3_checkpoint):
    lm = K3LM(checkpoint=str(k3_checkpoint))
    tok = lm.k3_tokenizer
    context = "the question"
    torch.manual_seed(7)
    (got,) = lm.generate_until(
        requests("generate_until", (context, {"do_sample": True, "temperature": 0.7, "top_k": 5, "max_gen_toks": 8}))
    )
    ids = tok.encode(context)
    torch.manual_seed(7)
    with torch.no_grad():
        new = lm.model.generate(torch.tensor([ids]), 8, temperature=0.7, top_k=5)[0, len(ids) :].tolist()
    new = new[: new.index(tok.eot_id)] if tok.eot_id in new else new
    assert got == tok.decode(new)
    with pytest.raises(ValueError, match=r"task asks for \['repetition_penalty'\]"):
        lm.generate_until(requests("generate_until", (context, {"repetition_penalty": 1.2})))
    with pytest.raises(ValueError, match="num_beams"):
        lm.generate_until(requests("generate_until", (context, {"num_beams": 4})))


# -- construction -----------------------------------------------------------------------------------
def test_bad_model_args_say_what_is_wrong(k3_checkpoint, gpt2_checkpoint, tmp_path):
    model_dir, tokenizer = gpt2_checkpoint
    with pytest.raises(FileNotFoundError, match="`checkpoint` must be a k3 checkpoint directory"):
        K3LM(checkpoint=str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="no tokenizer.json .* pass tokenizer=PATH"):
        K3LM(checkpoint=str(model_dir))
    with pytest.raises(ValueError, match=r"`dtype` must be one of float32, bfloat16, float16, got 'int8'"):
        K3LM(checkpoint=str(k3_checkpoint), dtype="int8")
    with pytest.raises(ValueError, match=r"`batch_size` must be a positive integer, got 'auto'"):
        K3LM(checkpoint=str(k3_checkpoint), batch_size="auto")
    with pytest.raises(ValueError, match="`max_length` must be at most 16"):
        K3LM(checkpoint=str(model_dir), tokenizer=str(tokenizer), max_length=32)
    with pytest.raises(ValueError, match="`device` must be a torch device"):
        K3LM(checkpoint=str(k3_checkpoint), device="gpu please")
    with pytest.raises(ValueError, match=r"model_args are checkpoint, .* got pretrained, dtype \(pretrained unknown\)"):
        K3LM.create_from_arg_string("pretrained=gpt2,dtype=float32")
    with pytest.raises(ValueError, match=r"\(checkpoint=DIR required\); got none"):
        K3LM.create_from_arg_obj({}, {"device": "cpu"})
    with pytest.raises(ValueError, match="the tokenizer has .* tokens but the model only"):
        K3LM(checkpoint=str(model_dir), tokenizer=str(k3_checkpoint / "tokenizer.json"))


def test_model_args_win_over_the_harness_settings(k3_checkpoint):
    lm = K3LM.create_from_arg_string(
        f"checkpoint={k3_checkpoint},batch_size=3,dtype=bfloat16",
        {"batch_size": 8, "max_batch_size": 64, "device": "cpu"},
    )
    assert (lm.batch_size, lm.dtype, lm.device.type) == (3, torch.bfloat16, "cpu")
    assert lm.model.lm_head.weight.dtype == torch.bfloat16
    assert K3LM.create_from_arg_obj({"checkpoint": str(k3_checkpoint)}, {"batch_size": 2}).batch_size == 2
    if not torch.cuda.is_available():  # lm_eval's command line passes --device cuda:0 unless told otherwise
        assert K3LM.create_from_arg_obj({"checkpoint": str(k3_checkpoint)}, {"device": "cuda:0"}).device.type == "cpu"
        with pytest.raises(ValueError, match="CUDA is not available"):
            K3LM.create_from_arg_obj({"checkpoint": str(k3_checkpoint), "device": "cuda"}, {})


# -- how lm-eval finds the adapter -----------------------------------------------------------------
def test_registered_as_k3_and_declared_as_an_lm_eval_plugin():
    tomllib = pytest.importorskip("tomllib")
    assert get_model("k3") is K3LM
    assert "hf" in model_registry and "vllm" in model_registry  # lm-eval's own models are still there
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    entry = importlib.metadata.EntryPoint(
        name="k3", value=project["entry-points"]["lm_eval.models"]["k3"], group="lm_eval.models"
    )
    assert entry.load() is K3LM
    assert any(dep.startswith("lm-eval") for dep in project["optional-dependencies"]["eval"])


def test_k3_eval_is_lm_evals_command_line_with_model_k3(monkeypatch):
    import lm_eval.__main__

    seen = []
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: seen.append(list(sys.argv)))
    main(["--tasks", "x", "--model_args", "checkpoint=d"])
    main(["run", "--model", "hf", "--tasks", "x"])
    main(["ls", "tasks"])
    assert seen == [
        ["lm_eval", "--tasks", "x", "--model_args", "checkpoint=d", "--model", "k3"],
        ["lm_eval", "run", "--model", "hf", "--tasks", "x"],
        ["lm_eval", "ls", "tasks"],
    ]


# -- lm-eval end to end, offline -------------------------------------------------------------------
def test_simple_evaluate_on_local_tasks(k3_checkpoint, no_network, monkeypatch, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(tmp_path)  # the tasks find their data next to their YAML, from any working directory
    out = simple_evaluate(
        model="k3",
        model_args={"checkpoint": str(k3_checkpoint), "batch_size": 4},
        tasks=["k3_tiny_mc", "k3_tiny_gen", "k3_tiny_ppl"],
        log_samples=True,
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
    )
    assert no_network == []
    results, samples = out["results"], out["samples"]
    lm = K3LM(checkpoint=str(k3_checkpoint), batch_size=4)
    tok, model = lm.k3_tokenizer, lm.model

    assert len(samples["k3_tiny_mc"]) == 4
    for sample in samples["k3_tiny_mc"]:
        doc = sample["doc"]
        pairs = [tuple(a) for a in sample["arguments"]]
        assert pairs == [(doc["question"], " " + choice) for choice in doc["choices"]]
        want = [lp for lp, _ in lm.loglikelihood(requests("loglikelihood", *pairs))]
        assert [r[0][0] for r in sample["resps"]] == pytest.approx(want, abs=1e-4)
        assert sample["acc"] == float(max(range(4), key=want.__getitem__) == doc["answer"])
    assert results["k3_tiny_mc"]["acc,none"] == pytest.approx(sum(s["acc"] for s in samples["k3_tiny_mc"]) / 4)

    for sample in samples["k3_tiny_gen"]:
        prompt = sample["doc"]["prompt"]
        assert sample["resps"][0][0] == cut(tok.decode(greedy(model, tok, prompt, 12)), ["\n", "."])
    matches = [s["resps"][0][0] == s["doc"]["target"] for s in samples["k3_tiny_gen"]]
    assert results["k3_tiny_gen"]["exact_match,none"] == pytest.approx(sum(matches) / len(matches))

    for sample in samples["k3_tiny_ppl"]:
        want, _ = direct(model, [tok.eot_id] + tok.encode(sample["doc"]["text"]), 1)
        assert sample["resps"][0][0] == pytest.approx(want, rel=1e-5)
    assert results["k3_tiny_ppl"]["bits_per_byte,none"] > 0


SOCKET_GUARD = """import socket, sys
def _refuse(self, address, *args):
    print(f"network access attempted: {address}", file=sys.stderr)
    raise OSError("network access attempted during an offline test")
socket.socket.connect = socket.socket.connect_ex = _refuse
"""


def lm_eval_script() -> Path | None:
    """lm-eval's console script in this interpreter's environment, when k3 is installed there with its
    start-up hook (lm-eval-hook/_k3_lm_eval.py); None when k3 only runs from a source tree (PYTHONPATH)."""
    try:
        importlib.metadata.distribution("k3")
    except importlib.metadata.PackageNotFoundError:
        return None
    script = Path(sys.executable).parent / "lm_eval"
    return script if script.exists() else None


COMMANDS = {"lm_eval": lambda: [str(lm_eval_script())], "k3 eval": lambda: [sys.executable, "-m", "k3", "eval"]}


@pytest.mark.slow  # two fresh interpreters importing lm-eval
@pytest.mark.parametrize("command", COMMANDS)
def test_lm_eval_command_line(command, k3_checkpoint, tmp_path):
    """`lm_eval --model k3 ...` (lm-eval's own command, installed k3) and `k3 eval --model k3 ...`, each in a
    fresh process with sockets refused."""
    if command == "lm_eval" and lm_eval_script() is None:
        pytest.skip("k3 is not pip-installed in this environment, so its lm-eval start-up hook is not either")
    (tmp_path / "sitecustomize.py").write_text(SOCKET_GUARD)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "hf_datasets"),
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [
            *COMMANDS[command](),
            "--model",
            "k3",
            "--model_args",
            f"checkpoint={k3_checkpoint},batch_size=4",
            "--tasks",
            "k3_tiny_mc",
            "k3_tiny_gen",
            "--include_path",
            str(TASKS),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "network access attempted" not in proc.stderr
    if not torch.cuda.is_available():  # no --device given: lm-eval's default cuda:0 falls back to the CPU
        assert "CUDA is not available; running on the CPU" in proc.stderr
    rows = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("|k3_tiny")}
    assert "|acc " in rows["k3_tiny_mc"] and "|exact_match|" in rows["k3_tiny_gen"], proc.stdout


def test_start_up_hook_registers_k3_lazily_and_only_when_lm_eval_loads_its_models():
    """The hook imports nothing at start-up, registers the "k3" placeholder next to lm-eval's own models,
    leaves an earlier registration alone, and K3_LM_EVAL_PLUGIN=0 turns it off."""
    hook = ROOT / "lm-eval-hook" / "_k3_lm_eval.py"
    script = f"""
import importlib.util, sys
assert not any(m in sys.modules for m in ("torch", "lm_eval", "k3")), "imported at start-up"
sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "LmEvalModelsFinder"]  # the installed one
spec = importlib.util.spec_from_file_location("_k3_lm_eval", {str(hook)!r})
hook = importlib.util.module_from_spec(spec); spec.loader.exec_module(hook); hook.install(); hook.install()
assert sum(isinstance(f, hook.LmEvalModelsFinder) for f in sys.meta_path) == int(sys.argv[1] != "off")
from lm_eval.api.registry import model_registry
if sys.argv[1] == "taken":
    model_registry.register("k3", target="lm_eval.models.dummy:DummyLM")
import lm_eval.models  # lm-eval's get_model does this to fill its registry
print(model_registry._objs.get("k3"), "k3.eval.lm_eval" in sys.modules, "hf" in model_registry)
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = {}
    for case in ("on", "taken", "off"):
        proc = subprocess.run(
            [sys.executable, "-c", script, case],
            capture_output=True,
            text=True,
            timeout=120,
            env={**env, "K3_LM_EVAL_PLUGIN": "0" if case == "off" else "1"},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[case] = proc.stdout.split()
    assert out["on"] == ["k3.eval.lm_eval:K3LM", "False", "True"]  # registered, not yet imported
    assert out["taken"][0] == "lm_eval.models.dummy:DummyLM"
    assert out["off"][0] == "None" and out["off"][2] == "True"


def test_k3_eval_without_lm_eval_says_how_to_install_it(monkeypatch, capsys):
    from k3.cli import main as k3_main

    for name in [n for n in sys.modules if n == "lm_eval" or n.startswith("lm_eval.")]:
        monkeypatch.setitem(sys.modules, name, None)  # as if lm-eval were not installed
    monkeypatch.delitem(sys.modules, "k3.eval.lm_eval")
    assert k3_main(["eval", "--tasks", "x"]) == 2
    assert "lm-evaluation-harness is not installed; pip install 'k3[eval]'" in capsys.readouterr().err


def test_lm_eval_hf_runs_a_kimi_linear_export(corpus, no_network, tmp_path, monkeypatch):
    """k3[eval] brings what `lm_eval --model hf` needs (accelerate): a Kimi Linear export of a k3 model is
    scored by lm-eval's own transformers adapter, offline, from any working directory."""
    pytest.importorskip("transformers")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from k3.hf.export import export
    from k3.tokenizer import train_bpe

    checkpoint = tmp_path / "checkpoint"
    torch.manual_seed(0)
    tokenizer = train_bpe([p.read_text() for p in corpus.iterdir()], vocab_size=300)
    CausalLM(get_config("kimi-linear-tiny", vocab_size=tokenizer.vocab_size, hidden_size=32)).save_pretrained(
        checkpoint
    )
    tokenizer.save(checkpoint / "tokenizer.json")
    export(checkpoint, tmp_path / "export", format="kimi-linear")
    monkeypatch.chdir(tmp_path)
    out = simple_evaluate(
        model="hf",
        model_args={"pretrained": str(tmp_path / "export"), "dtype": "float32"},
        tasks=["k3_tiny_mc"],
        device="cpu",
        batch_size=4,
        log_samples=True,
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
    )
    assert no_network == []
    assert len(out["samples"]["k3_tiny_mc"]) == 4
    assert 0.0 <= out["results"]["k3_tiny_mc"]["acc,none"] <= 1.0
