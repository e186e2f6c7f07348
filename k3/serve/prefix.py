"""Prefix caching for every kind of layer, the hybrid's recurrent ones included: blocks of a prompt's state
that a later prompt with the same tokens resumes from instead of computing them again.

A prompt is cut into blocks of `block` tokens. After its prefill reaches the end of block j (prefill pieces
never cross a block boundary while the cache is on), the engine keeps
- each attention layer's entries of the block's tokens (GPT-2's keys and values, MLA's latents and rotary
  keys): slots j·block ... (j+1)·block − 1 of every slot buffer;
- each recurrent layer's state at the boundary (the delta family's and linear attention's state, the short
  convolutions' window of the last W−1 inputs), which depends on every token before it, so it is kept per
  block, not derived (vLLM's `--mamba-cache-mode align`; SGLang's `MambaRadixCache`).
A block is keyed by its parent's key and its own tokens, compared exactly, so a hit means the same tokens
from the first one. A new prompt resumes from its longest run of cached blocks that leaves at least one
token to prefill (the next token's logits come from that token's forward): the run's entries are copied
into its cache, the last block's states restored, and its position set; prefill goes on from there with the
same block-aligned pieces a cold prefill runs, so the logits are those of the cold path.

Bytes are counted exactly (the blocks' tensors) and the least recently used block with no cached child is
evicted first when the engine needs room (a child is unreachable without its parent).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

ROOT = -1  # the parent id of a prompt's first block


@dataclass(eq=False)
class Block:
    """One cached block: its id, its parent's id, its tokens; per layer, copies of its tokens' slots
    (`tokens`) and of the states at its end (`states`); `nbytes` their bytes; `children` cached under it."""

    id: int
    parent: int
    key: tuple
    tokens: list[list[torch.Tensor]]
    states: list[list[torch.Tensor]]
    nbytes: int
    children: int = 0


@dataclass
class PrefixStats:
    queries: int = 0  # prompts looked up
    hits: int = 0  # prompts that resumed from a cached block
    hit_tokens: int = 0  # prompt tokens not prefilled thanks to a hit
    prompt_tokens: int = 0  # prompt tokens looked up
    inserted: int = 0
    evicted: int = 0


class PrefixCache:
    """Blocks of `block` tokens of prompts' caches (see the module docstring). `nbytes`: what the blocks hold."""

    def __init__(self, block: int):
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"PrefixCache: `block` must be an int >= 1 (tokens), got {block!r}")
        self.block = block
        self.blocks: OrderedDict[tuple, Block] = OrderedDict()  # least recently used first
        self.by_id: dict[int, Block] = {}
        self.nbytes = 0
        self.stats = PrefixStats()
        self._next_id = 0
        self._block_bytes: int | None = None

    def __len__(self) -> int:
        return len(self.blocks)

    @staticmethod
    def key(parent: int, tokens) -> tuple:
        return (parent, tuple(tokens))

    def _run(self, prompt: list[int], end: int) -> list[Block]:
        """The cached blocks of `prompt` that end before token `end`, from its first, up to the first miss."""
        run, parent = [], ROOT
        for stop in range(self.block, end, self.block):
            found = self.blocks.get(self.key(parent, prompt[stop - self.block : stop]))
            if found is None:
                break
            run.append(found)
            parent = found.id
        return run

    def lookup(self, prompt: list[int]) -> list[Block]:
        """The longest run of cached blocks that `prompt` starts with, leaving at least one of its tokens
        to prefill; marks them used (the deepest least recently, so that a child goes before its parent)."""
        run = self._run(prompt, len(prompt))  # a block ending at len(prompt) is not used
        for found in reversed(run):
            self.blocks.move_to_end(found.key)
        self.stats.queries += 1
        self.stats.prompt_tokens += len(prompt)
        if run:
            self.stats.hits += 1
            self.stats.hit_tokens += len(run) * self.block
        return run

    def restore(self, run: list[Block], cache, row: int = 0) -> None:
        """Write `run`'s blocks into row `row` of `cache` (`k3.inference.cache.Cache`; a serving pool's row):
        their tokens' slots, the last block's states, the position after it."""
        for j, found in enumerate(run):
            for layer, parts in zip(cache.layers, found.tokens):
                layer.write_tokens(row, j * self.block, parts)
        for layer, states in zip(cache.layers, run[-1].states):
            for buffer, saved in zip(layer.states(), states):
                buffer[row].copy_(saved)
        cache.positions[row] = len(run) * self.block
        cache.lengths = [len(run) * self.block if i == row else n for i, n in enumerate(cache.lengths)]

    def parent_of(self, prompt: list[int], end: int) -> int | None:
        """The id of the cached block that ends `block` tokens before `end` in `prompt` (ROOT at the
        start), or None when it is not cached (then no block ending at `end` can be)."""
        run = self._run(prompt, end)
        if len(run) < (end - 1) // self.block:
            return None
        return run[-1].id if run else ROOT

    def block_bytes(self, cache) -> int:
        """The bytes one block of `cache`'s model takes: its tokens' slots and the states at its end (the
        same for every cache of the model this prefix cache serves: counted once)."""
        if self._block_bytes is None:
            total = 0
            for layer in cache.layers:
                for t, axis in layer.storage.values():
                    total += t[0].narrow(axis - 1, 0, 1).numel() * t.element_size() * self.block
                total += sum(s[0].numel() * s.element_size() for s in layer.states())
            self._block_bytes = total
        return self._block_bytes

    def insert(self, prompt: list[int], end: int, cache, row: int = 0) -> Block | None:
        """Keep the block of `prompt` that ends at token `end` (a multiple of `block`) from row `row` of
        `cache`, which has just reached `end`; None when it is cached already or its parent is not (the
        parent was evicted while the prompt ran)."""
        if end % self.block or end < self.block:
            raise ValueError(f"PrefixCache.insert: `end` {end} is not a positive multiple of the block {self.block}")
        parent = self.parent_of(prompt, end)
        key = self.key(parent, prompt[end - self.block : end])
        if parent is None or key in self.blocks:
            return None
        tokens = [layer.read_tokens(row, end - self.block, end) for layer in cache.layers]
        states = [[s[row].clone() for s in layer.states()] for layer in cache.layers]
        nbytes = sum(t.numel() * t.element_size() for parts in tokens + states for t in parts)
        found = Block(self._next_id, parent, key, tokens, states, nbytes)
        self._next_id += 1
        self.blocks[key] = self.by_id[found.id] = found
        self.nbytes += nbytes
        if parent != ROOT:
            self.by_id[parent].children += 1
        self.stats.inserted += 1
        return found

    def evict(self, nbytes: int) -> int:
        """Free at least `nbytes` (or everything) by dropping least recently used blocks without cached
        children; the bytes freed."""
        freed = 0
        while freed < nbytes and self.blocks:
            victim = next(b for b in self.blocks.values() if b.children == 0)
            del self.blocks[victim.key], self.by_id[victim.id]
            self.nbytes -= victim.nbytes
            freed += victim.nbytes
            if victim.parent != ROOT:
                self.by_id[victim.parent].children -= 1
            self.stats.evicted += 1
        return freed

    def summary(self) -> dict:
        s = self.stats
        return {
            "block": self.block,
            "blocks": len(self.blocks),
            "bytes": self.nbytes,
            "queries": s.queries,
            "hits": s.hits,
            "hit_rate": s.hits / s.queries if s.queries else 0.0,
            "hit_tokens": s.hit_tokens,
            "token_hit_rate": s.hit_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
            "inserted": s.inserted,
            "evicted": s.evicted,
        }
