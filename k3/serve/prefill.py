"""The serving engine's prefill (`Prefiller`, a part the engine holds): prompt tokens into the prefilling
sequences' own rows of the slot pool, up to `prefill_chunk` a turn, oldest sequence first. A sequence that
fails (its forward, its first token) ends alone; the others run on as they would without it.

Each sequence's next piece is at most its planned piece, the tokens left of the turn's budget and of its
prompt, and never crosses a prefix-cache block's end. A piece run alone goes through the pool's row itself
(`Cache.view` of that row). Pieces of the same length from several sequences run as one forward over their
rows addressed by index (`k3.inference.row_cache.RowsCache`: each row at its own position, as a decode
batch; the slots the forward reads are gathered, the states written back once it succeeded): after
prefix-cache hits every prompt's remainder is a short turn, and one forward of k rows costs far less than k
forwards, each bound by dispatch (a 32-token piece of kimi-k3-tiny: ~17 ms alone, 16 of them ~60 ms
together). A batch is as large as its transient bytes (its pieces' `prefill_bytes` and the slots gathered)
fit in the budget's free room.
"""

from __future__ import annotations

import logging

import torch

from ..inference.row_cache import RowsCache
from .sampler import logprobs_of
from .sequence import Sequence, prefill_bytes, sequence_bytes

log = logging.getLogger("k3.serve")

PROMPT_LOGPROBS_PIECE = 64  # prompt tokens a piece holds when every position's logits are kept


def prompt_logprobs(sequence: Sequence, start: int, logits: torch.Tensor) -> None:
    """Record, from a piece's logits [n, V] (its prompt's positions start ... start+n-1), the log-probability
    of each next prompt token and the `prompt_logprobs` likeliest alternatives (the model's distribution, as
    `k3.serve.sampler` gives a generated token's)."""
    following = sequence.prompt[start + 1 : start + 1 + logits.shape[0]]
    if following:
        tokens = torch.tensor(following, device=logits.device)
        chosen, top = logprobs_of(logits[: len(following)], tokens, [sequence.prompt_logprobs] * len(following))
        sequence.prompt_token_logprobs += zip(chosen, top)


class Prefiller:
    """The prefill side of `engine`'s turn (see the module): it reads the engine's model, pool, budget, prefix
    cache and prefilling sequences, and hands a sequence whose prompt is all in to its ready ones."""

    def __init__(self, engine):
        self.engine = engine

    def turn(self) -> None:
        """Prefill up to `prefill_chunk` prompt tokens (all of every admitted prompt when 0), oldest
        sequence first, pieces of one length from several sequences together; a sequence whose prompt is
        all in is ready for its first token. A sequence that fails ends alone (`fail`): a batch whose
        forward fails runs its pieces again one by one."""
        engine = self.engine
        budget = engine.prefill_chunk or float("inf")
        while budget > 0 and engine.prefilling:
            head = engine.prefilling[0]
            if head.cancelled:
                engine.leave_prefill(head, "cancelled")
                continue
            group, n = self._batch(budget)
            if len(group) == 1:
                self._alone(head, n)
            elif group:
                self._together(group, n)
            budget -= n * len(group)

    def fail(self, sequence: Sequence, error: Exception) -> None:
        """End `sequence` alone with `error` (and a line in the log): it leaves the prefilling sequences,
        or, had it been ready, the loop drops it at the turn's end."""
        log.error("k3 serve: sequence %d failed in its prefill: %s: %s", sequence.id, type(error).__name__, error)
        reason = f"error: {type(error).__name__}: {error}"
        if sequence in self.engine.prefilling:
            self.engine.leave_prefill(sequence, reason)
        else:
            self.engine.finish(sequence, reason)

    def _alone(self, sequence: Sequence, n: int) -> None:
        try:
            self._piece_alone(sequence, n)
        except Exception as e:
            self.fail(sequence, e)

    def _start(self, sequence: Sequence) -> None:
        """Its generator (when seeded), its row emptied, and what the prefix cache has of its prompt restored
        into the row."""
        engine = self.engine
        if sequence.seed is not None:  # its own draws (unseeded rows draw from the engine's generator)
            sequence.generator = torch.Generator(engine.device)
            sequence.generator.manual_seed(sequence.seed)
        engine.pool.cache.clear_row(sequence.row)
        sequence.started = True
        if engine.prefix is not None and sequence.prompt_logprobs is None:  # a cached prefix has no logits
            run = engine.prefix.lookup(sequence.prompt)
            if run:
                engine.prefix.restore(run, engine.pool.cache, sequence.row)
                sequence.prefilled = sequence.cached_tokens = len(run) * engine.prefix.block

    def _piece(self, sequence: Sequence, budget: float) -> int:
        """The tokens of the sequence's next piece (its row started): at most its planned piece, `budget`
        and what is left of its prompt, never across a prefix-cache block's end."""
        if not sequence.started:
            self._start(sequence)
        start, prefix = sequence.prefilled, self.engine.prefix
        n = min(sequence.piece, budget, len(sequence.prompt) - start)
        if sequence.prompt_logprobs is not None:  # each position's logits: [n, vocab] at once
            n = min(n, PROMPT_LOGPROBS_PIECE)
        if prefix is not None:
            n = min(n, prefix.block - start % prefix.block)
        return int(n)

    def _batch(self, budget: float) -> tuple[list[Sequence], int]:
        """The oldest prefilling sequence and the next ones (in order, not cancelled) whose piece has its
        length, while their pieces fit `budget` and the batch's transient bytes the free room; and that
        length. One whose row fails to start ends alone (`fail`): none when it is the oldest."""
        engine = self.engine
        head, config, dtype_bytes = engine.prefilling[0], engine.model.config, engine.dtype_bytes
        try:
            n = self._piece(head, budget)
        except Exception as e:
            self.fail(head, e)
            return [], 0
        group, longest = [head], len(head.prompt)
        if head.prompt_logprobs is not None:
            return group, n
        need = prefill_bytes(config, n, len(head.prompt), dtype_bytes)
        for sequence in engine.prefilling[1:]:
            if sequence.cancelled or sequence.prompt_logprobs is not None or n * (len(group) + 1) > budget:
                continue
            try:
                if self._piece(sequence, budget) != n:
                    continue
            except Exception as e:
                self.fail(sequence, e)
                continue
            wider = max(longest, len(sequence.prompt))
            more = need + prefill_bytes(config, n, len(sequence.prompt), dtype_bytes)
            if more + (len(group) + 1) * sequence_bytes(config, wider, dtype_bytes) > engine.room:
                break
            group.append(sequence)
            longest, need = wider, more
        return group, n

    def _piece_alone(self, sequence: Sequence, n: int) -> None:
        """Run the sequence's next `n` prompt tokens through its row of the pool, then `_after_piece`."""
        engine, start = self.engine, sequence.prefilled
        row = engine.pool.cache.view(1, engine.pool.max_length, first=sequence.row)
        row.lengths = [start]
        ids = torch.tensor([sequence.prompt[start : start + n]], device=engine.device)
        every = sequence.prompt_logprobs is not None
        logits = engine.model(ids, cache=row, logits_to_keep=n if every else 1, prefill_piece=n)
        if every:
            prompt_logprobs(sequence, start, logits[0])
        self._after_piece(sequence, n, logits[:, -1])

    def _together(self, group: list[Sequence], n: int) -> None:
        """The next `n` prompt tokens of every sequence of `group` as one forward over their rows (each at
        its own position). Should that forward fail (the rows' states and positions are written back only
        after it succeeded), each piece runs again alone, so that only the sequence at fault fails."""
        engine = self.engine
        try:
            rows = RowsCache(engine.pool.cache, [s.row for s in group], [s.prefilled for s in group])
            ids = torch.tensor([s.prompt[s.prefilled : s.prefilled + n] for s in group], device=engine.device)
            logits = engine.model(ids, cache=rows, logits_to_keep=1, prefill_piece=n)[:, -1]
            rows.commit()
        except Exception as e:
            log.warning(
                "k3 serve: a prefill of %d sequences failed (%s: %s); each runs alone", len(group), type(e).__name__, e
            )
            for sequence in group:
                self._alone(sequence, n)
            return
        for i, sequence in enumerate(group):
            try:
                self._after_piece(sequence, n, logits[i : i + 1])
            except Exception as e:
                self.fail(sequence, e)

    def _after_piece(self, sequence: Sequence, n: int, logits: torch.Tensor) -> None:
        """A piece of `n` tokens ran: keep the prefix-cache block it completed; at the prompt's end the
        sequence is ready, its `logits` [1, vocab] kept for the turn's one draw (`Engine._turn`)."""
        engine = self.engine
        sequence.prefilled += n
        if engine.prefix is not None and sequence.prefilled % engine.prefix.block == 0:
            self._keep_block(sequence)
        if sequence.prefilled == len(sequence.prompt):
            with engine.lock:
                engine.prefilling.remove(sequence)
                engine.ready.append(sequence)
                sequence.first_logits = logits

    def _keep_block(self, sequence: Sequence) -> None:
        """Keep the block its prefill has just completed, making room by evicting older blocks; skipped
        when even an empty prefix cache would not have the room."""
        engine, prefix, pool = self.engine, self.engine.prefix, self.engine.pool.cache
        with engine.lock:
            need = prefix.block_bytes(pool) - engine.room
            if need > 0 and prefix.evict(need) < need:
                return
            prefix.insert(sequence.prompt, sequence.prefilled, pool, sequence.row)
