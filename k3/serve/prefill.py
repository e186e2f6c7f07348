"""The serving engine's prefill turn (`Engine` takes it from `Prefill`): prompt tokens into the prefilling
sequences' own caches, up to `prefill_chunk` a turn, oldest sequence first. A sequence that fails (its
cache, its forward, its first token) ends alone; the others run on as they would without it.

Each sequence's next piece is at most its planned piece, the tokens left of the turn's budget and of its
prompt, and never crosses a prefix-cache block's end. Pieces of the same length from several sequences
run as one forward over their caches joined (`Cache.concat`: each row at its own position, as a decode
batch): after prefix-cache hits every prompt's remainder is a short turn, and one forward of k rows costs
far less than k forwards, each bound by dispatch (a 32-token piece of kimi-k3-tiny: ~17 ms alone, 16 of
them ~60 ms together). A batch is as large as its transient bytes (its pieces' `prefill_bytes` and the
joined cache) fit in the budget's free room; each row then goes back into its own cache, and on its way
on exactly as a piece run alone.
"""

from __future__ import annotations

import logging

import torch

from ..inference.cache import Cache
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


class Prefill:
    """`Engine`'s prefill turn (see the module); the engine gives the model, budget, prefix cache and rows."""

    def _prefill_turn(self) -> None:
        """Prefill up to `prefill_chunk` prompt tokens (all of every admitted prompt when 0), oldest
        sequence first, pieces of one length from several sequences together; a sequence whose prompt is
        all in gets its first token and joins the running rows. A sequence that fails ends alone
        (`_fail_prefill`): a batch whose forward fails runs its pieces again one by one."""
        budget = self.prefill_chunk or float("inf")
        while budget > 0 and self.prefilling:
            head = self.prefilling[0]
            if head.cancelled:
                self._leave_prefill(head, "cancelled")
                continue
            group, n = self._batch(budget)
            if len(group) == 1:
                self._prefill_alone(head, n)
            elif group:
                self._prefill_together(group, n)
            budget -= n * len(group)

    def _fail_prefill(self, sequence: Sequence, error: Exception) -> None:
        """End `sequence` alone with `error` (and a line in the log): it leaves the prefilling sequences,
        or, had it joined the running rows already, the loop drops it at the turn's end."""
        log.error("k3 serve: sequence %d failed in its prefill: %s: %s", sequence.id, type(error).__name__, error)
        reason = f"error: {type(error).__name__}: {error}"
        if sequence in self.prefilling:
            self._leave_prefill(sequence, reason)
        else:
            self._finish(sequence, reason)

    def _prefill_alone(self, sequence: Sequence, n: int) -> None:
        try:
            self._prefill_piece(sequence, n)
        except Exception as e:
            self._fail_prefill(sequence, e)

    def _start_prefill(self, sequence: Sequence) -> None:
        """Its generator (when seeded), its prefill cache (sized to its prompt), and what the prefix cache has of it."""
        if sequence.seed is not None:  # its own draws (unseeded rows draw from the engine's generator)
            sequence.generator = torch.Generator(self.device)
            sequence.generator.manual_seed(sequence.seed)
        sequence.cache = self.model.new_cache(1, max_length=len(sequence.prompt))
        if self.prefix is not None and sequence.prompt_logprobs is None:  # a cached prefix has no logits
            run = self.prefix.lookup(sequence.prompt)
            if run:
                self.prefix.restore(run, sequence.cache)
                sequence.prefilled = sequence.cached_tokens = len(run) * self.prefix.block

    def _piece(self, sequence: Sequence, budget: float) -> int:
        """The tokens of the sequence's next piece (its cache started): at most its planned piece, `budget`
        and what is left of its prompt, never across a prefix-cache block's end."""
        if sequence.cache is None:
            self._start_prefill(sequence)
        start = sequence.prefilled
        n = min(sequence.piece, budget, len(sequence.prompt) - start)
        if sequence.prompt_logprobs is not None:  # each position's logits: [n, vocab] at once
            n = min(n, PROMPT_LOGPROBS_PIECE)
        if self.prefix is not None:
            n = min(n, self.prefix.block - start % self.prefix.block)
        return int(n)

    def _batch(self, budget: float) -> tuple[list[Sequence], int]:
        """The oldest prefilling sequence and the next ones (in order, not cancelled) whose piece has its
        length, while their pieces fit `budget` and the batch's transient bytes the free room; and that
        length. One whose cache fails to start ends alone (`_fail_prefill`): none when it is the oldest."""
        head, config, dtype_bytes = self.prefilling[0], self.model.config, self.dtype_bytes
        try:
            n = self._piece(head, budget)
        except Exception as e:
            self._fail_prefill(head, e)
            return [], 0
        group, longest = [head], len(head.prompt)
        if head.prompt_logprobs is not None:
            return group, n
        need = prefill_bytes(config, n, len(head.prompt), dtype_bytes)
        for sequence in self.prefilling[1:]:
            if sequence.cancelled or sequence.prompt_logprobs is not None or n * (len(group) + 1) > budget:
                continue
            try:
                if self._piece(sequence, budget) != n:
                    continue
            except Exception as e:
                self._fail_prefill(sequence, e)
                continue
            wider = max(longest, len(sequence.prompt))
            more = need + prefill_bytes(config, n, len(sequence.prompt), dtype_bytes)
            if more + (len(group) + 1) * sequence_bytes(config, wider, dtype_bytes) > self.room:
                break
            group.append(sequence)
            longest, need = wider, more
        return group, n

    def _prefill_piece(self, sequence: Sequence, n: int) -> None:
        """Run the sequence's next `n` prompt tokens into its own cache, then `_after_piece`."""
        start = sequence.prefilled
        ids = torch.tensor([sequence.prompt[start : start + n]], device=self.device)
        every = sequence.prompt_logprobs is not None
        logits = self.model(ids, cache=sequence.cache, logits_to_keep=n if every else 1, prefill_piece=n)
        if every:
            prompt_logprobs(sequence, start, logits[0])
        self._after_piece(sequence, n, logits[:, -1])

    def _prefill_together(self, group: list[Sequence], n: int) -> None:
        """The next `n` prompt tokens of every sequence of `group` as one forward over their caches joined
        (each row at its own position); each row then back into its sequence's cache. Should that forward
        fail (nothing of the sequences' own caches has changed yet), each piece runs again alone, so that
        only the sequence at fault fails."""
        try:
            joined = Cache.concat([s.cache for s in group], max_length=max(len(s.prompt) for s in group))
            ids = torch.tensor([s.prompt[s.prefilled : s.prefilled + n] for s in group], device=self.device)
            logits = self.model(ids, cache=joined, logits_to_keep=1, prefill_piece=n)[:, -1]
        except Exception as e:
            log.warning(
                "k3 serve: a prefill of %d sequences failed (%s: %s); each runs alone", len(group), type(e).__name__, e
            )
            for sequence in group:
                self._prefill_alone(sequence, n)
            return
        for row, sequence in enumerate(group):
            try:
                sequence.cache.copy_row(0, joined, row)
                self._after_piece(sequence, n, logits[row : row + 1])
            except Exception as e:
                self._fail_prefill(sequence, e)

    def _after_piece(self, sequence: Sequence, n: int, logits: torch.Tensor) -> None:
        """A piece of `n` tokens ran: keep the prefix-cache block it completed; at the prompt's end the
        sequence is ready, its `logits` [1, vocab] kept for the turn's one sample (`Engine._turn`)."""
        sequence.prefilled += n
        if self.prefix is not None and sequence.prefilled % self.prefix.block == 0:
            self._keep_block(sequence)
        if sequence.prefilled == len(sequence.prompt):
            with self._lock:
                self.prefilling.remove(sequence)
                self.ready.append(sequence)
                sequence.first_logits = logits

    def _keep_block(self, sequence: Sequence) -> None:
        """Keep the block its prefill has just completed, making room by evicting older blocks; skipped
        when even an empty prefix cache would not have the room."""
        with self._lock:
            need = self.prefix.block_bytes(sequence.cache) - self.room
            if need > 0 and self.prefix.evict(need) < need:
                return
            self.prefix.insert(sequence.prompt, sequence.prefilled, sequence.cache)
