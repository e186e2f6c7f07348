"""`k3 generate` streaming text: the continuation of one prompt as it is sampled (`stream_text`), and the
interactive mode, `k3 generate` without `--prompt` or `--prompt-file` (`interactive`).

Interactive mode reads prompts from stdin, one a line, and streams each one's continuation. Each
prompt starts afresh (a new cache), or with `--chat` continues the conversation: every prompt (on a
new line, "\\n" + prompt) and every continuation so far is the context, held in one cache that is
kept between turns, so a turn feeds only its own tokens (and the last token sampled, not yet fed).
Ctrl-D (end of input) ends the session, exit 0; Ctrl-C during a generation stops that one and returns
to the prompt (the text so far is kept, and with --chat stays in the conversation; the cache, which a
Ctrl-C may leave half-updated, is rebuilt from the conversation's tokens); Ctrl-C at the prompt exits
with 130. With a terminal, a `> ` prompt is shown and the continuation follows the typed line; with
piped input, each prompt is printed before its continuation, as `k3 generate --prompt` does. A prompt
that cannot be used (nothing after tokenization, too long for learned positions) is reported on stderr
and skipped.
"""

from __future__ import annotations

import contextlib
import sys
import time


def stream_text(
    model, tokenizer, ids: list[int], args, generator, new: list[int], cache=None
) -> tuple[float, float] | None:
    """Print the continuation of the tokens `ids` as it is sampled (`args`: max_new_tokens and the
    sampling flags), a character split over several tokens once it is whole; each token is appended to
    `new`, which holds what was generated if a Ctrl-C ends it early. With `cache`, `ids` continue the
    tokens it has seen (`CausalLM.stream`). The continuation ends at <|endoftext|> (kept in `new`, not
    printed) unless args.ignore_eot. With --compile, returns (the seconds between the first token, sampled
    from the prefill, and the second: the compiled step's first call, compiling or loading it; the seconds
    from the second token to the end)."""
    import time

    import torch

    prompt = torch.tensor([ids], device=model.lm_head.weight.device)
    eot = None if args.ignore_eot else tokenizer.eot_id
    shown = ""
    compiled = getattr(args, "compile", False)
    if cache is None and len(ids) > LONG_PROMPT:
        prompt, cache = prefill_with_progress(model, prompt, args.max_new_tokens, compiled)
    arrivals: list[float] = []
    for token in model.stream(
        prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_token_id=eot,
        generator=generator,
        cache=cache,
        compile=compiled,
    ):
        if compiled and len(arrivals) < 2:
            arrivals.append(time.perf_counter())
        new.append(int(token[0]))
        if new[-1] == eot:
            break
        text = tokenizer.decode(new)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            print(text[len(shown) :], end="", flush=True)
            shown = text
    text = tokenizer.decode([t for t in new if t != eot])
    if text != shown:  # the stream ended inside a character: show what there is
        print(text[len(shown) :], end="", flush=True)
    return (arrivals[1] - arrivals[0], time.perf_counter() - arrivals[1]) if len(arrivals) == 2 else None


LONG_PROMPT = 4096  # prompt tokens past which k3 generate shows the prefill's progress (seconds on a CPU)


def prefill_with_progress(model, prompt, max_new_tokens: int, static: bool):
    """Run all but the last token of `prompt` [1, T] into a new cache a piece at a time (`PREFILL_PIECE`
    tokens), with a progress bar on stderr that gives the rate and the time left; returns (the last token
    [1, 1], the cache) for `stream` to continue from. `static`: the cache has fixed slots (--compile)."""
    import torch
    from tqdm import tqdm

    from ..inference.generation import check_cache_fits, check_positions, static_slots
    from ..models.model import PREFILL_PIECE

    T = prompt.shape[1]
    check_positions(model, [T], max_new_tokens)
    check_cache_fits(model, prompt, max_new_tokens)
    cache = model.new_cache(1, max_length=static_slots(model, T, max_new_tokens)) if static else model.new_cache(1)
    with torch.no_grad(), tqdm(total=T - 1, unit="tok", desc="prefill", file=sys.stderr, leave=False) as bar:
        for start in range(0, T - 1, PREFILL_PIECE):
            piece = prompt[:, start : min(start + PREFILL_PIECE, T - 1)]
            model(piece, cache=cache, logits_to_keep=1)
            bar.update(piece.shape[1])
    return prompt[:, -1:], cache


@contextlib.contextmanager
def prefill_progress(model, total: int):
    """A progress bar on stderr over the prefill of `total` prompt tokens (a batch of prompts, run by
    `generate` in pieces): a hook on the decoder counts the tokens of each forward of more than one token,
    and goes when they are all in (before any compiled decode step is traced)."""
    from tqdm import tqdm

    bar = tqdm(total=total, unit="tok", desc="prefill", file=sys.stderr, leave=False)

    def count(module, args):
        ids = args[0]
        if ids.dim() == 2 and ids.shape[1] > 1:
            bar.update(ids.numel())
            if bar.n >= total:
                handle.remove()

    handle = model.model.register_forward_pre_hook(count)
    try:
        yield
    finally:
        handle.remove()
        bar.close()


def report(new: int, seconds: float, prefill: int, device=None, first_step: tuple[float, float] | None = None) -> None:
    """The speed line on stderr after a continuation; with --compile (`first_step`, from `stream_text`),
    also the time the compiled step's first call took and the speed of the tokens after it."""
    where = f"; on {device}" if device is not None else ""
    after = ""
    if first_step is not None and new > 2:
        compiling, rest = first_step
        after = (
            f"; {compiling:.1f} s of it compiling or loading the decode step, then "
            f"{(new - 2) / max(rest, 1e-9):.1f} tokens/s"
        )
    print(
        f"[{new} tokens in {seconds:.2f} s: {new / max(seconds, 1e-9):.1f} tokens/s, prefill of {prefill} "
        f"prompt tokens included{where}{after}]",
        file=sys.stderr,
    )


class NotText(ValueError):
    """A line of stdin that is not UTF-8 text: said and skipped, the lines after it still read."""


def _read_line(tty: bool) -> str | None:
    """The next line of stdin without its newline; None at the end of input (Ctrl-D). A line that is not
    UTF-8 raises NotText (piped input is read a line of bytes at a time, so the next line still reads)."""
    raw = None if tty else getattr(sys.stdin, "buffer", None)
    try:
        if raw is not None:
            data = raw.readline()
            if not data:
                return None
            data = data[:-1] if data.endswith(b"\n") else data
            line = data.decode("utf-8")
        else:
            line = input("> " if tty else "")
    except EOFError:
        if tty:
            print(file=sys.stderr)  # the terminal's cursor sits after "> "
        return None
    except UnicodeDecodeError as e:
        raise NotText(f"stdin: not UTF-8 text (byte {e.object[e.start]:#04x}); give UTF-8 text") from None
    try:  # under a C locale Python reads bytes that are not UTF-8 as lone surrogates (surrogateescape)
        line.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = ord(line[e.start]) - 0xDC00
        shown = f"byte {byte:#04x}" if 0x80 <= byte <= 0xFF else f"{line[e.start]!r}"
        raise NotText(f"stdin: not UTF-8 text ({shown} at character {e.start} of the line); give UTF-8 text") from None
    return line


CHAT_LENGTH = 4096  # --chat --compile: the tokens a conversation's static cache holds (less: a model's positions)


def _chat_cache(model, args):
    """The conversation's cache: growing, or with --compile static, for CHAT_LENGTH tokens (a turn that
    would pass them is refused with a clear error, as one past a model's learned positions is)."""
    if not getattr(args, "compile", False):
        return model.new_cache(1)
    positions = model.config.max_position_embeddings
    return model.new_cache(1, max_length=min(CHAT_LENGTH, positions) if positions else CHAT_LENGTH)


def interactive(args, model, tokenizer) -> int:
    """The interactive loop (see the module docstring); returns the exit code."""
    import torch

    tty = sys.stdin.isatty()
    if tty:
        mode = "--chat: each prompt continues the conversation" if args.chat else "each prompt on its own"
        print(f"k3 generate: one prompt a line ({mode}); Ctrl-C stops a generation, Ctrl-D ends", file=sys.stderr)
    generator = torch.Generator(model.lm_head.weight.device).manual_seed(args.seed)
    conversation: list[int] = []  # --chat: every token so far, prompts and continuations
    cache = None  # --chat: has seen conversation[:cache.length]
    number = 0
    while True:
        try:
            line = _read_line(tty)
        except NotText as e:
            number += 1
            print(f"k3 generate: error: prompt {number}: {e}; skipped", file=sys.stderr)
            continue
        if line is None:
            break
        if not line.strip():
            continue
        number += 1
        text = "\n" + line if args.chat and conversation else line
        try:
            ids = tokenizer.encode(text)
        except ValueError as e:
            print(f"k3 generate: error: prompt {number}: {e}; skipped", file=sys.stderr)
            continue
        if not ids:
            print(
                f"k3 generate: error: prompt {number} ({line!r}) is empty after tokenization; skipped", file=sys.stderr
            )
            continue
        if args.chat:
            cache = cache if cache is not None else _chat_cache(model, args)
            feed = conversation[cache.length :] + ids
        else:
            feed = ids
        if not tty:
            print(line, end="", flush=True)
        new: list[int] = []
        start = time.perf_counter()
        try:
            first_step = stream_text(model, tokenizer, feed, args, generator, new, cache)
        except KeyboardInterrupt:
            print(flush=True)
            print(f"[interrupted (Ctrl-C) after {len(new)} tokens]", file=sys.stderr)
            if args.chat:
                conversation += ids + new
                cache = None  # a forward stopped midway leaves it unknown: rebuilt from `conversation`
            continue
        except ValueError as e:  # raised before the model runs (e.g. past the learned positions)
            print(flush=True)
            print(f"k3 generate: error: prompt {number}: {e}; skipped", file=sys.stderr)
            continue
        print(flush=True)
        report(len(new), time.perf_counter() - start, len(feed), first_step=first_step)
        if args.chat:
            conversation += ids + new
    return 0
