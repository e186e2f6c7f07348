"""lm-evaluation-harness adapter: score and sample a k3 checkpoint on lm-eval's tasks.

    k3 eval --model_args checkpoint=runs/k3 --tasks lambada_openai hellaswag

K3LM answers lm-eval's three requests with a CausalLM and the checkpoint's tokenizer:

- loglikelihood(context, continuation): log p(continuation | context), summed over the continuation's
  tokens, and whether greedy decoding would produce exactly those tokens;
- loglikelihood_rolling(text): log p(text | <|endoftext|>), every token scored once (perplexity tasks);
- generate_until(context, gen_kwargs): greedy decoding through the hybrid cache (sampling when the task
  asks for it) until one of the `until` strings, <|endoftext|> or `max_gen_toks` tokens.

Context length. GPT-2 has learned positions for `max_position_embeddings` tokens: longer inputs lose
their left end (loglikelihood, generation) or are scored in lm-eval's rolling windows (perplexity).
The rest of the lineage has no position limit (linear mixers carry a state; MLA is NoPE or RoPE), so
inputs are scored whole; one longer than `max_length` goes through the cache in pieces of that many
tokens, which is exact and holds only one piece's logits in memory.

Batches are right-padded: the model is causal, so what follows a sequence cannot change its logits.

How lm-eval finds "k3": lm-eval resolves `--model NAME` in a registry that only its own model list and
imported `@register_model` classes fill; it reads no entry points (0.4.11 to 0.5.0.dev1). The k3 wheel
installs a start-up hook (lm-eval-hook/_k3_lm_eval.py) that adds "k3" to that registry, as the lazy
placeholder "k3.eval.lm_eval:K3LM", when lm-eval loads its model list: a plain `lm_eval --model k3`
works. Importing this module registers K3LM too, which `k3 eval` / `python -m k3.eval` (see `main`)
do before handing the command line to lm-eval. k3's pyproject.toml also declares the `lm_eval.models`
entry point that lm-eval's plugin discovery will read (EleutherAI/lm-evaluation-harness#4013).
"""

from __future__ import annotations

import importlib
import logging
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
from tqdm import tqdm

from ..io import reading
from ..models import CausalLM
from ..tokenizer import Tokenizer

log = logging.getLogger(__name__)
# lm-eval lists its own models in the registry on first lookup only if the registry is still empty:
# list them now, before "k3" goes in, or `--model hf` would stop resolving in this process
importlib.import_module("lm_eval.models")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PIECE = 2048  # tokens per forward when scoring long inputs of a model without a position limit
MAX_GEN_TOKS = 256  # lm-eval's usual default when a task gives no max_gen_toks
MODEL_ARGS = ("checkpoint", "tokenizer", "device", "dtype", "batch_size", "max_length")
GEN_KWARGS = ("until", "max_gen_toks", "max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "num_beams")


@register_model("k3")
class K3LM(TemplateLM):
    """A k3 model for lm-eval. model_args:

    checkpoint  a `k3 train --out` directory, or a `save_pretrained` one (then also give `tokenizer`)
    tokenizer   a tokenizer.json (default: the one in `checkpoint`)
    device      "cpu" (default), "cuda", "cuda:1", ...
    dtype       "float32" (default), "bfloat16" or "float16"
    batch_size  loglikelihood requests per forward (default 1)
    max_length  GPT-2: the context window (default and maximum: its positions); other models: tokens
                per forward piece when scoring long inputs (default 2048), their context is never cut
    """

    def __init__(
        self,
        checkpoint: str,
        tokenizer: str | None = None,
        device: str = "cpu",
        dtype: str | torch.dtype = "float32",
        batch_size: int | str = 1,
        max_length: int | None = None,
    ):
        super().__init__()
        path = Path(checkpoint)
        if not path.is_dir():
            raise FileNotFoundError(
                f"k3 lm-eval: `checkpoint` must be a k3 checkpoint directory; {str(path)!r} is not a directory"
            )
        self.checkpoint = str(path)
        self._device = _device(device)
        self.dtype = _dtype(dtype)
        self.batch_size = _positive_int("batch_size", batch_size)
        with reading(path):  # under the folder's lock, a save that died after its commit point finished
            self.k3_tokenizer = _tokenizer(path, tokenizer)
            self.model = CausalLM.from_pretrained(path, dtype=self.dtype).to(self._device).eval()
        config = self.model.config
        if self.k3_tokenizer.vocab_size > config.vocab_size:
            raise ValueError(
                f"k3 lm-eval: the tokenizer has {self.k3_tokenizer.vocab_size} tokens but the model "
                f"only {config.vocab_size}; give the tokenizer the model was trained with"
            )
        # learned positions (GPT-2) bound the context; other models only use max_length as a piece size
        self.positions = config.max_position_embeddings
        if max_length is None:
            self._max_length = self.positions or PIECE
        else:
            self._max_length = _positive_int("max_length", max_length)
            if self.positions and self._max_length > self.positions:
                raise ValueError(
                    f"k3 lm-eval: `max_length` must be at most {self.positions} for {config.name!r} "
                    f"(its learned positions), got {self._max_length}"
                )

    # -- construction from lm-eval's arguments ------------------------------------------------------
    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "K3LM":
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "K3LM":
        """model_args win over lm-eval's --device and --batch_size (its other run settings do not
        apply). lm-eval's command line passes --device cuda:0 unless told otherwise: on a machine
        without CUDA that default becomes the CPU, with a warning."""
        unknown = sorted(set(arg_dict) - set(MODEL_ARGS))
        if unknown or "checkpoint" not in arg_dict:
            given = ", ".join(map(str, arg_dict)) or "none"
            raise ValueError(
                f"k3 lm-eval: model_args are {', '.join(MODEL_ARGS)} (checkpoint=DIR required); got "
                f"{given}" + (f" ({', '.join(unknown)} unknown)" if unknown else "")
            )
        harness = {
            k: v for k, v in (additional_config or {}).items() if k in ("device", "batch_size") and v is not None
        }
        if (
            "device" in harness
            and "device" not in arg_dict
            and str(harness["device"]).startswith("cuda")
            and not torch.cuda.is_available()
        ):
            log.warning("k3 lm-eval: --device %s, but CUDA is not available; running on the CPU", harness["device"])
            harness["device"] = "cpu"
        return cls(**{**harness, **arg_dict})

    # -- what TemplateLM and the evaluator ask about --------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.k3_tokenizer.eot_id

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.checkpoint

    def get_model_info(self) -> dict:
        return {
            "k3_model": self.model.config.name,
            "k3_parameters": self.model.num_parameters(),
            "k3_dtype": str(self.dtype).removeprefix("torch."),
        }

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """k3's tokenizers add no special tokens; <|endoftext|> written in the text is that token."""
        return self.k3_tokenizer.encode(string)

    def tok_decode(self, tokens) -> str:
        return self.k3_tokenizer.decode(tokens)

    # -- scoring ----------------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: ((context, continuation), context tokens, continuation tokens), as TemplateLM
        tokenized them (an empty context is <|endoftext|>)."""
        rows = []
        for _, context, continuation in requests:
            tokens = context + continuation
            if self.positions:  # keep the last max_length inputs and the final target
                tokens = tokens[-(self._max_length + 1) :]
            rows.append((tokens, min(len(continuation), len(tokens) - 1)))
        results = self._score(rows, disable_tqdm)
        for (pair, _, _), result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", pair, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        rows, owner = [], []
        for i, (text,) in enumerate(r.args for r in requests):
            tokens = self.tok_encode(text)
            if not tokens:
                continue
            if self.positions:
                windows = get_rolling_token_windows(tokens, self.prefix_token_id, self._max_length, context_len=1)
                pieces = [(context + target, len(target)) for context, target in map(make_disjoint_window, windows)]
            else:
                pieces = [([self.prefix_token_id] + tokens, len(tokens))]
            rows += pieces
            owner += [i] * len(pieces)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._score(rows, disable_tqdm)):
            totals[i] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def _score(self, rows: list[tuple[list[int], int]], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """Each row (tokens, n) -> (sum of log p of its last n tokens given the tokens before them,
        whether each of those is the most likely next token). Rows that fit in max_length inputs go
        in right-padded batches, longest first; longer ones (no position limit) through the cache."""
        results: list[tuple[float, bool] | None] = [None] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        long = [i for i in order if len(rows[i][0]) - 1 > self._max_length]
        short = [i for i in order if len(rows[i][0]) - 1 <= self._max_length]
        batches = [short[s : s + self.batch_size] for s in range(0, len(short), self.batch_size)]
        with tqdm(total=len(rows), desc="k3 scoring", disable=disable_tqdm) as bar:
            for i in long:
                results[i] = self._score_in_pieces(*rows[i])
                bar.update(1)
            for batch in batches:
                for i, result in zip(batch, self._score_batch([rows[i] for i in batch])):
                    results[i] = result
                bar.update(len(batch))
        return results

    @torch.no_grad()
    def _score_batch(self, rows: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        width = max(len(tokens) for tokens, _ in rows) - 1
        ids = torch.full((len(rows), max(width, 1)), self.eot_token_id, dtype=torch.long)
        for b, (tokens, _) in enumerate(rows):
            ids[b, : len(tokens) - 1] = torch.tensor(tokens[:-1])
        logits = self.model(ids.to(self._device))  # [B, width, V]
        return [
            _logprob(logits[b, len(tokens) - 1 - n : len(tokens) - 1], tokens[len(tokens) - n :])
            for b, (tokens, n) in enumerate(rows)
        ]

    @torch.no_grad()
    def _score_in_pieces(self, tokens: list[int], n: int) -> tuple[float, bool]:
        """One long sequence, max_length inputs per forward, the cache carrying everything before."""
        cache = self.model.new_cache(1)
        inputs, first = tokens[:-1], len(tokens) - 1 - n  # inputs[t] predicts tokens[t + 1]; score t >= first
        total, greedy = 0.0, True
        for start in range(0, len(inputs), self._max_length):
            piece = inputs[start : start + self._max_length]
            logits = self.model(torch.tensor([piece], device=self._device), cache=cache)[0]
            lo, hi = max(first, start), start + len(piece)
            if lo < hi:
                logprob, top = _logprob(logits[lo - start :], tokens[lo + 1 : hi + 1])
                total, greedy = total + logprob, greedy and top
        return total, greedy

    # -- generation -------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for context, gen_kwargs in tqdm([r.args for r in requests], desc="k3 generating", disable=disable_tqdm):
            text = self._generate(context, dict(gen_kwargs))
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out

    def _generate(self, context: str, kwargs: dict) -> str:
        unknown = sorted(set(kwargs) - set(GEN_KWARGS))
        if unknown or kwargs.get("num_beams", 1) != 1:
            raise ValueError(
                f"k3 lm-eval: generation supports {', '.join(GEN_KWARGS)} (num_beams 1 only); the "
                f"task asks for {unknown or {'num_beams': kwargs['num_beams']}}"
            )
        until = kwargs.get("until") or []
        until = [s for s in ([until] if isinstance(until, str) else until) if s]
        steps = _positive_int("max_gen_toks", kwargs.get("max_gen_toks", kwargs.get("max_new_tokens", MAX_GEN_TOKS)))
        sample = bool(kwargs.get("do_sample", False))
        temperature = float(kwargs.get("temperature", 1.0)) if sample else 0.0
        ids = self.tok_encode(context) or [self.prefix_token_id]
        if self.positions:  # prompt and new tokens must fit in the learned positions
            steps = min(steps, self._max_length - 1)
            ids = ids[-(self._max_length - steps) :]
        prompt = torch.tensor([ids], device=self._device)
        new: list[int] = []
        text = ""
        for token in self.model.stream(
            prompt,
            steps,
            temperature=temperature,
            top_k=kwargs.get("top_k"),
            top_p=kwargs.get("top_p"),
            eos_token_id=self.eot_token_id,
        ):
            if int(token[0]) == self.eot_token_id:
                break
            new.append(int(token[0]))
            text = self.tok_decode(new)
            if any(stop in text for stop in until):
                break
        cut = min([text.find(stop) for stop in until if stop in text], default=len(text))
        return text[:cut]


def _logprob(logits: torch.Tensor, targets: list[int]) -> tuple[float, bool]:
    """logits [n, V] at the positions predicting `targets` (n ids) -> (sum of log p(target), all argmax)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    target = torch.tensor(targets, device=logp.device, dtype=torch.long)
    return float(logp.gather(-1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())


def _positive_int(name: str, value) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1 or (isinstance(value, float) and value != number):
        raise ValueError(f"k3 lm-eval: `{name}` must be a positive integer, got {value!r}")
    return number


def _dtype(value) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    if value in DTYPES:
        return DTYPES[value]
    raise ValueError(f"k3 lm-eval: `dtype` must be one of {', '.join(DTYPES)}, got {value!r}")


def _device(value) -> torch.device:
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"k3 lm-eval: `device` must be a torch device such as 'cpu' or 'cuda:0', got {value!r}") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"k3 lm-eval: `device` is {value!r} but CUDA is not available here; use device=cpu")
    return device


def _tokenizer(checkpoint: Path, tokenizer: str | None) -> Tokenizer:
    path = Path(tokenizer) if tokenizer is not None else checkpoint / "tokenizer.json"
    if not path.exists():
        if tokenizer is not None:
            raise FileNotFoundError(f"k3 lm-eval: `tokenizer` {tokenizer!r} does not exist")
        raise FileNotFoundError(
            f"k3 lm-eval: {checkpoint} has no tokenizer.json (a `k3 train` checkpoint has one); "
            f"pass tokenizer=PATH to the tokenizer.json the model was trained with"
        )
    return Tokenizer.load(path)


def main(argv: list[str] | None = None) -> int:
    """lm-eval's command line with "k3" registered (by importing this module): `k3 eval ARGS` is
    `lm_eval ARGS`, with `--model k3` added when a run names no model."""
    from lm_eval.__main__ import cli_evaluate

    args = list(sys.argv[1:] if argv is None else argv)
    is_run = not args or args[0] == "run" or args[0].startswith("-")
    if (
        is_run
        and not any(a == "--model" or a.startswith("--model=") for a in args)
        and "-h" not in args
        and "--help" not in args
    ):
        args += ["--model", "k3"]
    saved = sys.argv
    sys.argv = ["lm_eval", *args]  # lm-eval's parser reads sys.argv itself
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    return 0
