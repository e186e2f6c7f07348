"""A serving turn's forward (`Prefiller`, a part the engine holds): the running rows' next tokens and the
prefilling prompts' pieces, packed into one forward over the slot pool's rows (`k3.inference.packed`).

A turn's token budget (`max_num_batched_tokens`) goes first to the running rows, one token each; what is
left, at most `prefill_chunk` tokens, to a piece of each prefilling prompt, oldest first (a round). The
prompt work is bounded too: the pieces' multiply-adds (`k3.serve.sequence.prefill_macs`, matmuls per
token plus attention per slot each token reads) at most those of `prefill_chunk` tokens at a prompt's
start, a prompt that needs more than one piece at most half of them, so a piece deep in a long prompt
holds fewer tokens (vLLM caps a long prompt's piece by a token count, `long_prefill_token_threshold`; here
its cost sets it), a short prompt beside it still finishes in one turn, and the running rows' next token
waits no longer for it than for a short prompt's piece. A piece is at most the sequence's planned piece
and what is left of its prompt, and never crosses a prefix-cache block's end. In the forward a piece goes
through its row of the pool itself (`Cache.view`), pieces of one length through their rows by index
(`k3.inference.row_cache.RowsCache`: the slots the forward reads are gathered, the states written back once
it succeeded): after prefix-cache hits every prompt's remainder is a short piece, and one forward of k rows
costs far less than k forwards, each bound by dispatch. A round is as large as its transient bytes (its
pieces' `prefill_bytes` and the slots gathered) fit in the budget's free room. A turn without pieces runs
the pool's decode step.

A prompt's ids are checked against the vocabulary before its piece joins a forward, so that a sequence
whose prompt is wrong ends alone; a forward that fails anyway ends every sequence in it.
"""

from __future__ import annotations

import logging

import torch

from ..inference.packed import Group, packed_forward
from ..inference.row_cache import RowsCache
from .sampler import logprobs_of
from .sequence import Sequence, prefill_bytes, prefill_macs, prefill_macs_terms, sequence_bytes, tokens_within

log = logging.getLogger("k3.serve")

PROMPT_LOGPROBS_PIECE = 64  # prompt tokens a piece holds when every position's logits are kept
MIN_PIECE = 16  # prompt tokens a turn's first piece holds at least, whatever its work


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
    """The forwards of `engine`'s turn (see the module): it reads the engine's model, pool, budget, prefix
    cache and prefilling sequences, and hands a sequence whose prompt is all in to its ready ones."""

    def __init__(self, engine):
        self.engine = engine
        self.terms = prefill_macs_terms(engine.model.config)
        chunk = engine.prefill_chunk  # a turn's prompt work: `prefill_chunk` tokens at a prompt's start
        self.turn_macs = prefill_macs(self.terms, chunk, 0) if chunk else float("inf")

    def turn(self, rows: list[Sequence]) -> torch.Tensor | None:
        """The turn's forward: the running `rows`' next tokens and a round of prompt pieces packed into one
        (`_round`, under the turn's budget: at most `prefill_chunk` prompt tokens and the work of as many at
        a prompt's start, `max_num_batched_tokens` tokens in all), or the decode step alone when no prompt
        waits. The rows' logits [len(rows), vocab] (None without rows, or when their forward failed)."""
        engine = self.engine
        tokens = engine.prefill_chunk or float("inf")
        if engine.max_num_batched_tokens is not None:
            tokens = min(tokens, engine.max_num_batched_tokens - len(rows))
        pieces = self._round(tokens, self.turn_macs)
        return self._forward(pieces, rows) if pieces or rows else None

    def fail(self, sequence: Sequence, error: Exception) -> None:
        """End `sequence` alone with `error` (and a line in the log): it leaves the prefilling sequences,
        or, had it been ready, the loop drops it at the turn's end."""
        log.error("k3 serve: sequence %d failed in its prefill: %s: %s", sequence.id, type(error).__name__, error)
        reason = f"error: {type(error).__name__}: {error}"
        if sequence in self.engine.prefilling:
            self.engine.leave_prefill(sequence, reason)
        else:
            self.engine.finish(sequence, reason)

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

    def _piece(self, sequence: Sequence, tokens: float, work: float, first: bool) -> int:
        """The tokens of the sequence's next piece (its row started): at most its planned piece, `tokens`,
        the tokens whose work (`k3.serve.sequence.prefill_macs`: a token late in a long prompt attends to
        every slot before it) fits `work`, or half the turn's when the rest of its prompt takes more than one piece
        (it takes several turns anyway; a short prompt beside it finishes in this one, and the running rows'
        next token waits less), the turn's `first` piece at least MIN_PIECE tokens (so that every prompt
        moves), and what is left of its prompt, never across a prefix-cache block's end; its ids checked
        against the vocabulary (a ValueError naming them: the forward they would break is shared)."""
        if not sequence.started:
            self._start(sequence)
        start, prefix = sequence.prefilled, self.engine.prefix
        n = min(sequence.piece, tokens, len(sequence.prompt) - start)
        if len(sequence.prompt) - start > sequence.piece:  # it takes more turns anyway: room for others
            work = min(work, self.turn_macs / 2)
        if work != float("inf"):
            affordable = tokens_within(self.terms, work, start)
            n = min(n, max(affordable, MIN_PIECE) if first else affordable)
        if sequence.prompt_logprobs is not None:  # each position's logits: [n, vocab] at once
            n = min(n, PROMPT_LOGPROBS_PIECE)
        if prefix is not None:
            n = min(n, prefix.block - start % prefix.block)
        vocab = self.engine.model.config.vocab_size
        outside = [t for t in sequence.prompt[start : start + int(n)] if not 0 <= t < vocab]
        if outside:
            raise ValueError(f"`prompt` must be token ids in [0, {vocab}) (the vocabulary), got {outside[0]}")
        return int(n)

    def _round(self, tokens: float, work: float) -> list[tuple[list[Sequence], int, bool]]:
        """A piece for each prefilling sequence, oldest first, while `tokens` and `work` (multiply-adds)
        last (`_piece`: a long prompt's piece takes at most half the turn's work), each whose transient
        bytes fit the free room beside the pieces before it (the first's always: its admission made room
        for it; a long prompt's piece does not keep shorter ones out): grouped as (the sequences whose
        pieces have one length, that length, whether every position's logits are kept: such a piece runs
        alone). A sequence whose row fails to start ends alone (`fail`)."""
        engine, config = self.engine, self.engine.model.config
        groups: dict[tuple, list[Sequence]] = {}
        used = need = 0
        for sequence in list(engine.prefilling):
            if tokens < 1 or work <= 0:
                break
            if sequence.cancelled:
                engine.leave_prefill(sequence, "cancelled")
                continue
            try:
                n = self._piece(sequence, tokens, work, first=not used)
            except Exception as e:
                self.fail(sequence, e)
                continue
            if n == 0:
                continue  # its context makes even one token too much work; a shorter prompt's may fit
            prompt, dtype_bytes = len(sequence.prompt), engine.dtype_bytes
            more = prefill_bytes(config, n, prompt, dtype_bytes) + sequence_bytes(config, prompt, dtype_bytes)
            if used and need + more > engine.room:
                continue  # a later, shorter prompt's piece may fit beside
            used, need, tokens = used + n, need + more, tokens - n
            work -= prefill_macs(self.terms, n, sequence.prefilled)
            every = sequence.prompt_logprobs is not None
            groups.setdefault((n, every, sequence.id if every else None), []).append(sequence)
        return [(group, n, every) for (n, every, _), group in groups.items()]

    def _forward(self, pieces: list[tuple[list[Sequence], int, bool]], rows: list[Sequence]) -> torch.Tensor | None:
        """One forward of the running `rows`' next tokens and `pieces` (the decode step alone when there are
        no pieces): the rows' logits, each piece's kept for its sequence (`_after_piece`). A forward that
        fails ends every sequence in it (the failure is not one sequence's: their ids were checked)."""
        engine, pool = self.engine, self.engine.pool
        try:
            if not pieces:
                return pool.decode([s.row for s in rows], [s.held for s in rows])
            groups, ids = [], []
            if rows:
                groups.append(pool.decoding([s.row for s in rows], [s.held for s in rows]))
                ids.append(pool.feed.index_select(0, groups[0].picks))
            for group, n, _ in pieces:
                if len(group) == 1:
                    cache = pool.cache.view(1, pool.max_length, first=group[0].row)
                    cache.lengths = [group[0].prefilled]
                else:
                    cache = RowsCache(pool.cache, [s.row for s in group], [s.prefilled for s in group])
                groups.append(Group(cache, len(group), n))
                tokens = [t for s in group for t in s.prompt[s.prefilled : s.prefilled + n]]
                ids.append(torch.tensor(tokens, device=engine.device))
            hidden = packed_forward(engine.model, torch.cat(ids), groups)
        except Exception as e:
            log.exception("k3 serve: a turn's forward failed; its %d running sequences end with an error", len(rows))
            if rows:
                engine.fail_running(e)
            for group, _, _ in pieces:
                for sequence in group:
                    self.fail(sequence, e)
            return None
        index, spans, start = list(range(len(rows))), [], len(rows)  # the positions whose logits are needed
        for group, n, every in pieces:
            for sequence in group:
                spans.append((sequence, n, every, len(index)))
                index += list(range(start, start + n)) if every else [start + n - 1]
                start += n
        logits = engine.model.lm_head(hidden[torch.tensor(index, device=hidden.device)])
        for sequence, n, every, at in spans:
            try:
                if every:
                    prompt_logprobs(sequence, sequence.prefilled, logits[at : at + n])
                    at += n - 1
                self._after_piece(sequence, n, logits[at : at + 1])
            except Exception as e:
                self.fail(sequence, e)
        return logits[: len(rows)] if rows else None

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
