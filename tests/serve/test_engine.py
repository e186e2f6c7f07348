"""The serving engine: continuous batching over a slot pool gives every sequence what it would get alone,
the pool and the prefills keep within the cache budget, and cancelled or finished rows free their slots at
once."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from k3.models import Cache, CausalLM, get_config
from k3.serve import Engine, QueueFull, Sequence, prefill_bytes, sequence_bytes

from .conftest import poison_sampling

PRESETS = ["kimi-k3-tiny", "kimi-linear-tiny", "gpt2-tiny"]


def tiny(preset: str, dtype=torch.float64) -> CausalLM:
    torch.manual_seed(0)
    overrides = {"max_position_embeddings": 128} if preset == "gpt2-tiny" else {}
    return CausalLM(get_config(preset, vocab_size=97, hidden_size=32, **overrides)).to(dtype).eval()


def make_engine(model, **kw) -> Engine:
    """An engine with a small pool (16 slots of 128 tokens) unless told otherwise."""
    kw.setdefault("cache_memory", 10**9)
    kw.setdefault("max_running", 16)
    kw.setdefault("max_length", 128)
    return Engine(model, **kw)


def alone(model, prompt: list[int], n: int) -> list[int]:
    return model.generate([prompt], n, temperature=0)[0][len(prompt) :].tolist()


class Collector:
    """A sequence's callbacks: its tokens and its finish reason, and an event set when it finishes."""

    def __init__(self):
        self.tokens, self.reason, self.done = [], None, threading.Event()

    def sequence(self, prompt, max_tokens, **kw) -> Sequence:
        return Sequence(
            prompt,
            max_tokens,
            temperature=kw.pop("temperature", 0.0),
            on_token=self.tokens.append,
            on_finish=self._finish,
            **kw,
        )

    def _finish(self, reason):
        self.reason = reason
        self.done.set()


def wait_until(condition, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)


def prompts(count: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 97, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        for _ in range(count)
    ]


@pytest.mark.parametrize("preset", PRESETS)
def test_concurrent_sequences_get_what_they_would_alone(preset):
    """16 sequences of different prompt and output lengths, arriving while others decode: each gets the
    greedy tokens it gets alone (float64: batching changes nothing but rounding)."""
    model = tiny(preset)
    engine = make_engine(model).start()
    try:
        work = [(p, 3 + i % 7) for i, p in enumerate(prompts(16))]
        collectors = []
        for i, (prompt, n) in enumerate(work):
            c = Collector()
            engine.submit(c.sequence(prompt, n))
            collectors.append(c)
            if i % 4 == 3:
                time.sleep(0.02)  # later ones join a batch already decoding
        for c in collectors:
            assert c.done.wait(120)
        assert engine.peak_running > 1  # they did run together
        for (prompt, n), c in zip(work, collectors):
            assert c.reason == "length"
            assert c.tokens == alone(model, prompt, n)
        assert engine.stats()["running"] == 0 and engine.reserved == 0
    finally:
        engine.stop()


def test_the_pool_and_a_prefill_keep_within_the_budget():
    """The budget holds two rows of max_length tokens beside one prefill piece (which writes into its row
    of the pool): two slots, so two run at once at most; a sequence of max_length tokens, prompt and
    max_tokens, runs, one more is refused at submit, naming the bound."""
    model = tiny("gpt2-tiny")
    row = sequence_bytes(model.config, 29, 8)
    one_prefill = prefill_bytes(model.config, 29, 29, 8)
    engine = Engine(model, cache_memory=2 * row + one_prefill + row // 2, max_length=29).start()
    try:
        assert engine.slots == 2 and engine.pool_bytes == model.cache_bytes(2, 29) == 2 * row
        collectors = [Collector() for _ in range(6)]
        for c, prompt in zip(collectors, prompts(6, seed=3)):
            engine.submit(c.sequence((prompt * 10)[:9], 20))  # 29 tokens, prompt and max_tokens
        for c in collectors:
            assert c.done.wait(120) and c.reason == "length" and len(c.tokens) == 20
        assert engine.peak_running == 2
        with pytest.raises(ValueError, match="prompt tokens and max_tokens 20 are 30 tokens, more than the 29 a"):
            engine.submit(Collector().sequence([1] * 10, 20))
        wait_until(lambda: engine.stats()["slots_free"] == 2 and engine.stats()["cache_bytes_reserved"] == 0)
    finally:
        engine.stop()
    with pytest.raises(ValueError, match="does not hold one row of 29 tokens"):
        Engine(model, cache_memory=one_prefill + row // 2, max_length=29)


def test_queue_bound_and_cancel():
    model = tiny("kimi-k3-tiny")
    engine = make_engine(model, max_running=1, max_queue=1, max_length=4096).start()
    try:
        running, waiting = Collector(), Collector()
        first = running.sequence([1, 2, 3, 4, 5], 4000)
        engine.submit(first)
        wait_until(lambda: engine.stats()["running"] == 1)
        second = waiting.sequence([1, 2, 3, 4, 5], 4000)
        engine.submit(second)  # waits: one slot
        with pytest.raises(QueueFull):
            engine.submit(Collector().sequence([1], 5))
        engine.cancel(second)  # a waiting one leaves at once
        assert waiting.reason == "cancelled" and engine.stats()["waiting"] == 0
        wait_until(lambda: len(running.tokens) >= 3)
        engine.cancel(first)
        assert running.done.wait(10) and running.reason == "cancelled"
        assert engine.stats()["running"] == 0 and engine.reserved == 0
    finally:
        engine.stop()


def test_end_of_text_finishes_with_stop():
    model = tiny("kimi-k3-tiny")
    prompt = prompts(1)[0]
    expected = alone(model, prompt, 6)
    engine = make_engine(model).start()
    try:
        c = Collector()
        engine.submit(c.sequence(prompt, 6, eos_token_id=expected[2]))
        assert c.done.wait(120)
        cut = expected.index(expected[2])
        assert c.reason == "stop" and c.tokens == expected[:cut]
    finally:
        engine.stop()


def test_seeded_sampling_does_not_depend_on_the_batch():
    """A seed fixes a sequence's draws whatever else runs beside it (each row has its own generator)."""
    model = tiny("kimi-k3-tiny")
    engine = make_engine(model).start()
    try:
        lone = Collector()
        engine.submit(lone.sequence([5, 6, 7], 12, temperature=1.0, seed=42))
        assert lone.done.wait(120)
        crowd = [Collector() for _ in range(4)]
        for i, c in enumerate(crowd):
            engine.submit(
                c.sequence([5, 6, 7] if i == 2 else [i + 1] * (i + 2), 12, temperature=1.0, seed=42 if i == 2 else i)
            )
        for c in crowd:
            assert c.done.wait(120)
        assert crowd[2].tokens == lone.tokens
    finally:
        engine.stop()


def test_sequence_checks():
    with pytest.raises(ValueError, match="prompt"):
        Sequence([], 4)
    with pytest.raises(ValueError, match="max_tokens"):
        Sequence([1], 0)
    with pytest.raises(ValueError, match="temperature"):
        Sequence([1], 2, temperature=-1)


def test_the_cache_shrinks_after_the_longest_row_leaves():
    """concat a long and a short row, drop the long one: the slots only it needed are freed, and the
    short row decodes on exactly as it would alone."""
    model = tiny("kimi-k3-tiny")
    long_prompt, short_prompt = list(range(1, 30)), [3, 1, 4]
    caches, logits = [], []
    for p in (long_prompt, short_prompt):
        cache = model.new_cache(1)
        logits.append(model(torch.tensor([p]), cache=cache, logits_to_keep=1)[:, -1])
        caches.append(cache)
    model(torch.tensor([list(range(40, 80))]), cache=caches[0])  # the long row passes the first slots
    both = Cache.concat(caches)
    assert both.length == 69 and both.lengths == [69, 3] and both.capacity >= 69
    both.reorder(torch.tensor([1]))
    assert both.length == 3 and both.capacity < 69 and both.trim() == 0
    token = torch.tensor([[7]])
    ref = model.new_cache(1)
    model(torch.tensor([short_prompt]), cache=ref)
    torch.testing.assert_close(model(token, cache=both), model(token, cache=ref), rtol=0, atol=1e-12)


def test_a_row_that_fails_to_sample_ends_alone(monkeypatch, caplog):
    """One sequence whose sampling raises (here a patched `sample_turn`, for any draw that holds it) ends with
    an error of its own and a line in the log: the turn's rows then draw alone, and the sequences decoding
    beside it go on to what they get alone."""
    poison_sampling(monkeypatch, lambda s: s.temperature == 0.5, "poisoned row")
    model = tiny("kimi-k3-tiny")
    engine = make_engine(model).start()
    try:
        work = [(p, 8) for p in prompts(3, seed=5)]
        good = [Collector() for _ in work]
        for (prompt, n), c in zip(work, good):
            engine.submit(c.sequence(prompt, n))
        wait_until(lambda: all(len(c.tokens) >= 1 for c in good))
        bad = Collector()
        engine.submit(bad.sequence([1, 2, 3], 8, temperature=0.5, seed=1))
        assert bad.done.wait(120) and bad.reason.startswith("error: RuntimeError: poisoned row")
        for (prompt, n), c in zip(work, good):
            assert c.done.wait(120) and c.reason == "length" and c.tokens == alone(model, prompt, n)
        assert "poisoned row" in caplog.text
        wait_until(lambda: engine.stats()["running"] == 0 and engine.reserved == 0)
    finally:
        engine.stop()


def test_sequence_refuses_a_seed_the_generator_cannot_take():
    for seed in (2**64, -1, 1.5, True):
        with pytest.raises(ValueError, match="seed"):
            Sequence([1], 2, temperature=1.0, seed=seed)


def test_max_running_bounds_the_batch():
    model = tiny("kimi-k3-tiny")
    engine = make_engine(model, max_running=1).start()
    try:
        collectors = [Collector() for _ in range(6)]
        for c, prompt in zip(collectors, prompts(6, seed=7)):
            engine.submit(c.sequence(prompt, 3))
        for c in collectors:
            assert c.done.wait(120) and c.reason == "length"
        assert engine.peak_running == 1
    finally:
        engine.stop()


def test_a_long_prompt_is_prefilled_in_pieces_between_decode_turns():
    """A prompt of many pieces (prefill_chunk 8) does not stall the running batch: the running sequence
    decodes between its pieces, and both get what they get alone."""
    model = tiny("kimi-k3-tiny")
    engine = make_engine(model, prefill_chunk=8).start()
    try:
        runner, long = Collector(), Collector()
        engine.submit(runner.sequence([1, 2, 3], 60))
        wait_until(lambda: len(runner.tokens) >= 1)
        long_prompt = (prompts(4, seed=9)[0] * 40)[:96]
        sequence = long.sequence(long_prompt, 4)
        engine.submit(sequence)
        wait_until(lambda: sequence.prefilled > 0)
        at_start = len(runner.tokens)
        wait_until(lambda: len(long.tokens) >= 1 or long.done.is_set())
        assert len(runner.tokens) - at_start >= 96 // 8 - 2  # a decode turn after (nearly) every piece
        assert long.done.wait(120) and long.tokens == alone(model, long_prompt, 4)
        assert runner.done.wait(120) and runner.tokens == alone(model, [1, 2, 3], 60)
    finally:
        engine.stop()


def test_admission_counts_a_prefill_piece_and_shrinks_it_to_fit():
    model = tiny("kimi-k3-tiny")
    prompt = list(range(1, 97)) * 20  # 1,920 tokens
    cache = sequence_bytes(model.config, len(prompt), 8)
    roomy = make_engine(model, max_length=2048, max_running=1, prefill_chunk=0)
    piece, transient = roomy.plan(Sequence(prompt, 1))
    assert piece == len(prompt) and transient == prefill_bytes(model.config, piece, len(prompt), 8) > cache
    room = cache + transient // 4
    piece, transient = roomy.plan(Sequence(prompt, 1), room=room)
    assert piece < len(prompt) and transient <= room


def test_a_long_prompt_takes_smaller_pieces_to_start_beside_a_running_one():
    """A prefill piece is sized to the room the pool and the prefix cache leave: the long prompt starts
    now in smaller pieces and gets what it gets alone."""
    model = tiny("kimi-k3-tiny")
    prompt = (prompts(1, seed=11)[0] * 100)[:512]
    full = prefill_bytes(model.config, len(prompt), len(prompt), 8)
    pool = model.cache_bytes(2, 1024)
    row = sequence_bytes(model.config, 1024, 8)
    budget = pool + row + prefill_bytes(model.config, 1024, 1024, 8) // 8 + full // 2
    engine = make_engine(model, cache_memory=budget, max_length=1024, max_running=2, prefill_chunk=0)
    engine.start()
    try:
        runner, long = Collector(), Collector()
        first = runner.sequence([1, 2, 3], 1000)
        engine.submit(first)
        wait_until(lambda: len(runner.tokens) >= 1)
        sequence = long.sequence(prompt, 4)
        engine.submit(sequence)
        assert long.done.wait(60)
        assert sequence.piece < len(prompt) and long.tokens == alone(model, prompt, 4)
        engine.cancel(first)
    finally:
        engine.stop()


def test_a_failed_batch_forward_fails_the_batch_logs_it_and_serving_goes_on(monkeypatch, caplog):
    model = tiny("kimi-k3-tiny")
    engine = make_engine(model).start()
    try:
        broken = threading.Event()
        real = engine.pool.decode

        def decode(*args, **kw):
            if broken.is_set():
                raise RuntimeError("the batch's forward broke")
            return real(*args, **kw)

        monkeypatch.setattr(engine.pool, "decode", decode)
        victims = [Collector() for _ in range(2)]
        for c in victims:
            engine.submit(c.sequence([1, 2, 3], 120))
        wait_until(lambda: all(len(c.tokens) >= 1 for c in victims))
        broken.set()
        for c in victims:
            assert c.done.wait(120) and c.reason == "error: RuntimeError: the batch's forward broke"
        assert "a turn's forward failed" in caplog.text
        broken.clear()
        after = Collector()
        engine.submit(after.sequence([4, 5], 3))
        assert after.done.wait(120) and after.reason == "length" and after.tokens == alone(model, [4, 5], 3)
        assert engine.stats()["running"] == 0 and engine.reserved == 0
    finally:
        engine.stop()


@pytest.mark.parametrize("preset", ["kimi-k3-tiny", "gpt2-tiny"])
def test_the_compiled_engine_serves_at_once_and_gets_what_each_would_alone(preset, monkeypatch):
    """The engine with compiled steps (aot_eager: no C++ compiler needed) answers while its steps compile in
    the background (here held back until the first sequences are done, so they run on eager steps), then on
    the compiled ones; rows joining and leaving across batch buckets: each sequence's greedy tokens are those
    it gets alone, before and after. A compile runs over the pool's last rows, lent and given back. The loop
    and the compiler run with the engine's `threads`; the compiler's thread ends when no bucket waits, and
    another starts for the next."""
    import k3.serve.slots as slots_module

    model = tiny(preset)
    hold, threads = threading.Event(), set()
    real = slots_module.SlotPool._compile

    def held(pool, key):
        hold.wait(120)
        threads.add(("compiler", torch.get_num_threads()))
        real(pool, key)

    monkeypatch.setattr(slots_module.SlotPool, "_compile", held)
    engine = make_engine(model, compile="aot_eager", max_length=128, max_running=4, threads=1).start()
    work = [(p, 2 + 3 * (i % 3)) for i, p in enumerate(prompts(7, seed=13))]
    try:
        for phase in ("eager", "compiled"):
            if phase == "compiled":
                hold.set()
                wait_until(lambda: engine.stats()["buckets_to_compile"] == 0, timeout=300)
                assert engine.stats()["compiled_buckets"] == 3 and engine.lent == 0
            collectors = []
            for prompt, n in work:
                c = Collector()
                sequence = c.sequence(prompt, n)
                sequence.on_token = lambda t, real=sequence.on_token: (
                    threads.add(("loop", torch.get_num_threads())) or real(t)
                )
                engine.submit(sequence)
                collectors.append(c)
            for (prompt, n), c in zip(work, collectors):
                assert c.done.wait(300) and c.reason == "length" and c.tokens == alone(model, prompt, n), phase
            if phase == "eager":
                assert engine.pool.compiled == {} and (4, 128) in engine.pool.steps
                assert set(engine.pool.steps) <= {(1, 128), (2, 128), (4, 128)}  # the batch buckets
        assert sorted(engine.pool.compiled) == [(1, 128), (2, 128), (4, 128)]  # the batch buckets, no others
        assert engine.stats()["compiled"] and engine.stats()["compile_seconds"] > 0
        assert threads == {("compiler", 1), ("loop", 1)}
        wait_until(lambda: engine.pool._compiler is None)  # nothing waits: its thread has ended
        engine.pool._queue((1, 64))  # a bucket a turn asks for starts another
        wait_until(lambda: (1, 64) in engine.pool.compiled and engine.pool._compiler is None, timeout=120)
    finally:
        hold.set()
        engine.stop()


def test_rows_lent_to_the_compiler_are_held_by_no_sequence():
    """The pool's last rows lent to a compile (`_reserve`) are admitted to no sequence until given back, and
    rows are lent only while no sequence holds them."""
    model = tiny("kimi-k3-tiny")
    engine = make_engine(model, max_length=128, max_running=4).start()
    try:
        assert engine._reserve(2) and not engine._reserve(3) and engine.lent == 2
        work = [(p, 6) for p in prompts(4, seed=21)]
        collectors = [Collector() for _ in work]
        for (prompt, n), c in zip(work, collectors):
            engine.submit(c.sequence(prompt, n))
        wait_until(lambda: engine.stats()["running"] == 2)
        assert not engine._reserve(1)  # two held, two lent: none free
        for (prompt, n), c in zip(work, collectors):
            assert c.done.wait(120) and c.tokens == alone(model, prompt, n)
        assert engine.peak_running == 2
        engine._reserve(-2)
        assert engine.lent == 0 and engine._reserve(4)
        engine._reserve(-4)
    finally:
        engine.stop()


def test_buckets():
    model = tiny("kimi-k3-tiny")
    eager = make_engine(model, max_length=4096, max_running=64).pool
    assert eager.buckets(1, 0) == (1, 64) and eager.buckets(3, 64) == (3, 128) and eager.buckets(64, 4095) == (64, 4096)
    compiled = make_engine(model, max_length=4096, max_running=48).pool
    compiled.compile = True  # the buckets only (nothing compiles here)
    assert (
        compiled.buckets(1, 10) == (1, 256)
        and compiled.buckets(5, 255) == (8, 256)
        and compiled.buckets(5, 256) == (8, 1024)
    )
    assert (
        compiled.buckets(33, 1023) == (40, 1024)
        and compiled.buckets(41, 1024) == (48, 4096)
        and compiled.buckets(2, 300) == (2, 1024)
        and compiled.buckets(3, 300, compiled=False) == (3, 320)
    )
    assert compiled.batch_buckets() == [1, 2, 4, 8, 16, 24, 32, 40, 48]  # vLLM's capture sizes, then the slots
    compiled.slots = 50
    assert compiled.batch_buckets()[-3:] == [40, 48, 50]


def test_a_cache_view_and_row_copies_share_and_move_state():
    model = tiny("kimi-k3-tiny")
    pool = model.new_cache(3, max_length=16)
    one = model.new_cache(1, max_length=5)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4, 5]]), cache=one)
    pool.copy_row(2, one)
    assert pool.lengths == [0, 0, 5] and pool.positions.tolist() == [0, 0, 5]
    pool.copy_row(0, pool, 2)
    view = pool.view(2, 8)
    assert view.batch_size == 2 and view.capacity == 8 and view.positions.data_ptr() == pool.positions.data_ptr()
    for mine, theirs, layer in zip(view.layers, one.layers, pool.layers):
        for a, b, base in zip(mine.states(), theirs.states(), layer.states()):
            assert torch.equal(a[0], b[0]) and a.data_ptr() == base.data_ptr()
        for name in mine.sequences:
            assert torch.equal(mine.sequences[name][0, :5], theirs.sequences[name][0])
    with pytest.raises(ValueError, match="fixed cache"):
        pool.view(4, 8)
