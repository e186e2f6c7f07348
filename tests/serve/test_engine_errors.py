"""The serving engine's trust boundary: a failure of one sequence (its callback, its sampling, a token its
forward cannot take) ends that sequence alone, in a prefill turn as in a decode turn, and its neighbours
get what they get alone; what could never run is refused at once, in one line naming the argument, by
`Engine.submit` or the constructor, never later inside a forward."""

from __future__ import annotations

import logging
import math
import threading

import pytest
import torch

import k3.serve.prefill as prefill_module
from k3.serve import Engine, Sequence

from .test_engine import alone, make_engine, tiny, wait_until

VOCAB = 97  # tiny()'s vocabulary


def same_length_prompts(count: int, length: int = 6) -> list[list[int]]:
    """Prompts of one length, so that their prefill pieces run as one batch."""
    return torch.randint(0, VOCAB, (count, length), generator=torch.Generator().manual_seed(4)).tolist()


class Run:
    """A sequence's callbacks: its tokens, its finish reason, an event set when it finishes; `boom_at`: the
    on_token call (1 = its first token) that raises."""

    def __init__(self, boom_at: int | None = None):
        self.tokens, self.reason, self.done, self.boom_at = [], None, threading.Event(), boom_at

    def sequence(self, prompt, max_tokens, **kw) -> Sequence:
        kw.setdefault("temperature", 0.0)
        return Sequence(prompt, max_tokens, on_token=self._token, on_finish=self._finish, **kw)

    def _token(self, token):
        self.tokens.append(token)
        if len(self.tokens) == self.boom_at:
            raise RuntimeError("callback boom")

    def _finish(self, reason):
        self.reason = reason
        self.done.set()


def submit_in_one_turn(engine: Engine, sequences: list[Sequence]) -> None:
    """Submit while holding the engine's lock: its loop admits them all in the same turn."""
    with engine.lock:
        for s in sequences:
            engine.submit(s)


def record_prefill_batches(engine: Engine, monkeypatch) -> list[int]:
    """The sizes of the groups of prompt pieces the engine's forwards run (tried, whether or not they succeed)."""
    sizes, real = [], prefill_module.packed_forward

    def packed(model, ids, groups):
        sizes.extend(group.count for group in groups if group.picks is None)
        return real(model, ids, groups)

    monkeypatch.setattr(prefill_module, "packed_forward", packed)
    return sizes


@pytest.mark.parametrize("kind", ["callback", "sample"])
@pytest.mark.parametrize("at", [1, 3], ids=["prefill-turn", "decode-turn"])
def test_one_sequences_failure_ends_it_alone(kind, at, monkeypatch, caplog):
    """A sequence whose on_token raises (or whose sampling raises) at its first token (the prefill turn, in
    a prefill batch with its neighbours) or its third (a decode turn, beside them) ends alone with the
    error recorded; the three admitted in the same turn get exactly their tokens alone (greedy)."""
    import k3.serve.sampler as sampler_module

    caplog.set_level(logging.WARNING, "k3.serve")
    draws, real = [], sampler_module.sample_turn

    def poisoned(logits, rows, noise):  # the poisoned row's draws counted: its `at`-th raises
        bad = [s for s in rows if s.temperature == 0.5]
        if bad and len(rows) > 1:
            draws.append(len(bad[0].tokens) + 1)
        if bad and draws and draws[-1] == at:
            raise RuntimeError("poisoned row")
        return real(logits, rows, noise)

    monkeypatch.setattr(sampler_module, "sample_turn", poisoned)
    model = tiny("kimi-k3-tiny")
    engine = make_engine(model).start()
    sizes = record_prefill_batches(engine, monkeypatch)
    try:
        bad_prompt, *good_prompts = same_length_prompts(4)
        bad = Run(boom_at=at if kind == "callback" else None)
        settings = {"temperature": 0.5, "seed": 1} if kind == "sample" else {}
        good = [Run() for _ in good_prompts]
        # the failing one first: a failure that escaped would hit the ones after it in the batch
        submit_in_one_turn(
            engine, [bad.sequence(bad_prompt, 8, **settings)] + [r.sequence(p, 8) for r, p in zip(good, good_prompts)]
        )
        assert bad.done.wait(120)
        expected = "error: RuntimeError: " + ("callback boom" if kind == "callback" else "poisoned row")
        assert bad.reason == expected
        if kind == "callback":  # its tokens up to the one its callback failed on: those it gets alone
            assert bad.tokens == alone(model, bad_prompt, at)
        else:
            assert len(bad.tokens) == at - 1
        for run, prompt in zip(good, good_prompts):
            assert run.done.wait(120) and run.reason == "length" and run.tokens == alone(model, prompt, 8)
        assert max(sizes) == 4  # all four prefilled as one batch
        assert "callback raised" in caplog.text if kind == "callback" else "poisoned row" in caplog.text
        wait_until(lambda: engine.reserved == 0 and len(engine.free_rows) == engine.slots)
    finally:
        engine.stop()


def test_a_token_the_forward_cannot_take_fails_only_its_sequence(monkeypatch, caplog):
    """A prompt changed after submit to hold a token past the vocabulary (what submit refuses) is caught before
    its piece joins the turn's forward: only that sequence ends (a ValueError naming the prompt), and the others,
    prefilled together without it, get what they get alone."""
    caplog.set_level(logging.WARNING, "k3.serve")
    model = tiny("kimi-k3-tiny")
    engine = make_engine(model).start()
    sizes = record_prefill_batches(engine, monkeypatch)
    try:
        prompts = same_length_prompts(3)
        runs = [Run() for _ in prompts]
        sequences = [r.sequence(p, 5) for r, p in zip(runs, prompts)]
        with engine.lock:  # the loop admits them after the change
            for s in sequences:
                engine.submit(s)
            sequences[0].prompt[2] = 99999  # past submit's check
        assert runs[0].done.wait(120)
        assert runs[0].reason == "error: ValueError: `prompt` must be token ids in [0, 97) (the vocabulary), got 99999"
        for run, prompt in zip(runs[1:], prompts[1:]):
            assert run.done.wait(120) and run.reason == "length" and run.tokens == alone(model, prompt, 5)
        assert sizes == [2] and "failed in its prefill" in caplog.text
        wait_until(lambda: engine.reserved == 0 and len(engine.free_rows) == engine.slots)
    finally:
        engine.stop()


def test_sequence_refuses_what_is_not_token_ids():
    """Made with a prompt of anything but token ids, a bad eos id or a callback that is not callable: a
    ValueError naming the field. A prompt of any integers becomes a list of ints of the sequence's own."""
    for prompt, field in (
        ([1, 2.0], r"prompt\[1\].*2\.0"),
        ([True], r"prompt\[0\].*True"),
        ([3, -1], r"prompt\[1\].*-1"),
        (["5"], r"prompt\[0\]"),
        ("abc", r"`prompt` must be a list of token ids.*'abc'"),
        (5, r"`prompt` must be a list"),
        ([], r"`prompt` is empty"),
    ):
        with pytest.raises(ValueError, match=field):
            Sequence(prompt, 2)
    with pytest.raises(ValueError, match="eos_token_id.*-1"):
        Sequence([1], 2, eos_token_id=-1)
    with pytest.raises(ValueError, match="on_token.*None"):
        Sequence([1], 2, on_token=None)
    mine = [4, 5]
    s = Sequence(mine, 2)
    mine.append(99999)
    assert s.prompt == [4, 5]
    from_tensor = Sequence(torch.tensor([7, 8]), 2).prompt
    assert from_tensor == [7, 8] and all(type(t) is int for t in from_tensor)


def test_submit_refuses_what_could_never_run():
    """A token id or eos id past the vocabulary, a setting changed to one out of range after the sequence
    was made, too many tokens: refused at submit in one line naming the field, and nothing is queued."""
    model = tiny("kimi-k3-tiny")
    engine = make_engine(model).start()
    try:
        changed_prompt, changed_temperature, changed_top_k = Sequence([1, 2], 2), Sequence([1], 2), Sequence([1], 2)
        changed_prompt.prompt.append(1.5)
        changed_temperature.temperature = math.nan
        changed_top_k.top_k = 0
        for sequence, field in (
            (Sequence([99999], 2), r"prompt\[0\].*\[0, 97\).*99999"),
            (Sequence([1, 2, 97], 2), r"prompt\[2\].*97"),
            (Sequence([1], 2, eos_token_id=97), r"eos_token_id.*< 97.*97"),
            (changed_prompt, r"prompt\[2\].*1\.5"),
            (changed_temperature, "temperature.*nan"),
            (changed_top_k, "top_k.*0"),
            (Sequence([1], 10**30), f"are {10**30 + 1} tokens, more than the 128 a sequence may have"),
        ):
            with pytest.raises(ValueError, match=field) as refused:
                engine.submit(sequence)
            assert "\n" not in str(refused.value) and sequence.finish_reason is None
        with pytest.raises(ValueError, match="expected a Sequence, got list"):
            engine.submit([1, 2])
        stats = engine.stats()
        assert stats["waiting"] == 0 and stats["running"] == 0 and engine.reserved == 0
    finally:
        engine.stop()


def test_submit_before_start_and_a_second_start_are_errors_at_once():
    """Nothing serves an engine not started: submit says so at once instead of queueing for ever. An engine
    starts once: a second start, or a start after stop, is refused."""
    model = tiny("kimi-k3-tiny")
    engine = make_engine(model)
    with pytest.raises(RuntimeError, match="not started.*engine.start"):
        engine.submit(Sequence([1, 2], 2))
    assert engine.stats()["waiting"] == 0
    engine.start()
    try:
        with pytest.raises(RuntimeError, match="starts once"):
            engine.start()
    finally:
        engine.stop()
    with pytest.raises(RuntimeError, match="starts once"):
        engine.start()
    stopped = make_engine(model)
    stopped.stop()
    with pytest.raises(RuntimeError, match="starts once"):
        stopped.start()


def test_a_sequence_runs_once():
    """Submitting a sequence again, queued, running or finished, to the same engine or another, is refused
    at once; the first run goes on untouched."""
    model = tiny("kimi-k3-tiny")
    engine, other = make_engine(model).start(), make_engine(model).start()
    try:
        run = Run()
        sequence = run.sequence([1, 2, 3], 6)
        engine.submit(sequence)
        for target in (engine, other):
            with pytest.raises(ValueError, match=rf"sequence {sequence.id} was submitted before"):
                target.submit(sequence)
        assert run.done.wait(120) and run.reason == "length" and run.tokens == alone(model, [1, 2, 3], 6)
        with pytest.raises(ValueError, match=r"submitted before \(length\)"):
            engine.submit(sequence)
        assert run.tokens == alone(model, [1, 2, 3], 6) and sequence.finish_reason == "length"
        wait_until(lambda: engine.stats()["running"] == 0 and engine.reserved == 0)
        assert other.stats()["waiting"] == 0 and other.stats()["running"] == 0
    finally:
        engine.stop()
        other.stop()


@pytest.mark.parametrize(
    "argument, value, says",
    [
        ("cache_memory", "1GiB", r"number of bytes >= 1, got '1GiB' \(for a size: k3.serve.parse_bytes\('1GiB'\)\)"),
        ("cache_memory", math.nan, "number of bytes >= 1, got nan"),
        ("cache_memory", math.inf, "number of bytes >= 1, got inf"),
        ("cache_memory", 1.5, "number of bytes >= 1, got 1.5"),
        ("cache_memory", 0, "number of bytes >= 1, got 0"),
        ("cache_memory", True, "number of bytes >= 1, got True"),
        ("cache_memory", None, "number of bytes >= 1, got None"),
        ("cache_memory", 10**20, "100,000,000,000,000,000,000 bytes, more than the .* bytes free on"),
        ("max_queue", 0, "an int >= 1, got 0"),
        ("max_queue", math.nan, "an int >= 1, got nan"),
        ("max_queue", None, "an int >= 1, got None"),
        ("max_running", "8", "an int >= 1, got '8'"),
        ("max_running", True, "an int >= 1, got True"),
        ("prefill_chunk", -1, "an int >= 0, got -1"),
        ("prefill_chunk", 2.5, "an int >= 0, got 2.5"),
        ("max_length", 1, "an int >= 2, got 1"),
        ("max_length", 128.0, "an int >= 2, got 128.0"),
        ("prefix_block", "8", "an int >= 1, got '8'"),
        ("compile", 3, "True, False or a torch.compile backend name, got 3"),
        ("compile", "no-such-backend", "backend name, got 'no-such-backend'"),
        ("prefix_cache", "yes", "True or False, got 'yes'"),
    ],
)
def test_the_constructor_refuses_each_bad_argument_in_one_line(argument, value, says):
    model = tiny("kimi-k3-tiny")
    with pytest.raises(ValueError, match=rf"^Engine: `{argument}`.*{says}") as refused:
        make_engine(model, **{argument: value})
    assert "\n" not in str(refused.value)


def test_the_constructor_takes_a_whole_float_budget_and_refuses_more_than_learned_positions():
    model = tiny("kimi-k3-tiny")
    engine = make_engine(model, cache_memory=1e9)
    assert engine.cache_memory == 10**9 and type(engine.cache_memory) is int
    gpt2 = tiny("gpt2-tiny")  # 128 learned positions
    with pytest.raises(ValueError, match=r"^Engine: `max_length` must be <= 128 .*got 129$"):
        make_engine(gpt2, max_length=129)
