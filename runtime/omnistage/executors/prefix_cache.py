"""Prompt-prefix KV reuse for the autoregressive engines (ar, thinker).

Requests that begin with the same tokens (a system prompt, a conversation's earlier turns)
compute the same keys and values for them: a causal model's KV at position i depends on tokens
0..i only. The cache keeps those KV in blocks of `BLOCK_TOKENS` tokens, each named by a digest
chained from the block before it, so a block is found only after the same whole prefix. A
prompt pass looks up the longest run of its leading blocks, builds its KV cache from them and
computes only the rest of the prompt; then it stores the blocks it computed.

A block may also hold the hidden-state rows the executor hands downstream for its tokens (a
thinker feeding a talker needs every prompt row): a request that wants them reuses only blocks
that have them, and fills them in where they were missing.

Memory is bounded by a byte budget (keys, values and rows of every block); past it the least
recently used blocks go. A lookup touches its chain from the last block to the first, so the
first blocks, shared by the most prompts, are evicted last. Everything here runs on the engine
thread; `stats` is read by the metrics collector (plain ints, read whole).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: Tokens per block: the granularity of a match (a prefix is reused in whole blocks).
BLOCK_TOKENS = 16


@dataclass
class PrefixStats:
    """Counters since the cache was made (lookups: prompt passes that asked)."""

    lookups: int = 0
    hits: int = 0  # lookups that reused at least one block
    prompt_tokens: int = 0  # tokens of the prompt passes that asked
    saved_tokens: int = 0  # of them, taken from the cache instead of computed
    evicted_blocks: int = 0
    blocks: int = 0
    bytes: int = 0
    capacity_bytes: int = 0


@dataclass
class Hit:
    """What a lookup found: `tokens` leading tokens' KV per layer ([1, heads, tokens, dim]),
    and their hidden rows when they were asked for (None otherwise)."""

    tokens: int
    kv: list[tuple[Any, Any]]
    rows: Any = None


@dataclass
class _Block:
    kv: list[tuple[Any, Any]]
    rows: Any
    nbytes: int


class PrefixCache:
    def __init__(self, capacity_bytes: int, block_tokens: int = BLOCK_TOKENS) -> None:
        if capacity_bytes < 0 or block_tokens < 1:
            raise ValueError("PrefixCache needs capacity_bytes >= 0 and block_tokens >= 1")
        self.block_tokens = block_tokens
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # least recently used first
        self.stats = PrefixStats(capacity_bytes=capacity_bytes)

    def _chain(self, ids: Sequence[int], limit: int) -> list[bytes]:
        """The digests of the whole blocks among the first `limit` tokens."""
        keys, parent, b = [], b"", self.block_tokens
        for start in range(0, limit - limit % b, b):
            digest = hashlib.blake2b(parent + array("q", ids[start:start + b]).tobytes(),
                                     digest_size=16).digest()
            keys.append(digest)
            parent = digest
        return keys

    def lookup(self, ids: Sequence[int], limit: int, *, want_rows: bool) -> Hit | None:
        """The longest run of cached leading blocks within ids[:limit] (None: not one).

        `limit` is what may be reused: at most the prompt (never tokens after it) and at least
        one token short of the pass, which must compute something to sample from."""
        import torch

        st = self.stats
        st.lookups += 1
        st.prompt_tokens += len(ids)
        found: list[_Block] = []
        chain = self._chain(ids, limit)
        for key in chain:
            block = self._blocks.get(key)
            if block is None or (want_rows and block.rows is None):
                break
            found.append(block)
        if not found:
            return None
        self._touch(chain[:len(found)])
        tokens = len(found) * self.block_tokens
        st.hits += 1
        st.saved_tokens += tokens
        layers = len(found[0].kv)
        kv = [(torch.cat([blk.kv[i][0] for blk in found], dim=-2),
               torch.cat([blk.kv[i][1] for blk in found], dim=-2)) for i in range(layers)]
        rows = cat_rows([blk.rows for blk in found]) if want_rows else None
        return Hit(tokens, kv, rows)

    def insert(self, ids: Sequence[int], limit: int, kv: list[tuple[Any, Any]],
               rows: Any = None) -> None:
        """Keep the whole blocks of ids[:limit] from a pass's KV (per layer [1, heads, >=
        limit, dim]) and, when given, its hidden rows ([>= limit, width], or a tuple of such),
        then evict down to the budget. Blocks already kept are only touched (and given rows
        they lacked)."""
        chain = self._chain(ids, limit)
        if not chain:
            return
        st, b = self.stats, self.block_tokens
        for n, key in enumerate(chain):
            lo, hi = n * b, (n + 1) * b
            block = self._blocks.get(key)
            if block is None:
                block_kv = [(k[..., lo:hi, :].clone(), v[..., lo:hi, :].clone()) for k, v in kv]
                block_rows = _slice_rows(rows, lo, hi)
                nbytes = sum(k.nbytes + v.nbytes for k, v in block_kv) + _nbytes(block_rows)
                self._blocks[key] = _Block(block_kv, block_rows, nbytes)
                st.blocks += 1
                st.bytes += nbytes
            elif block.rows is None and rows is not None:
                block.rows = _slice_rows(rows, lo, hi)
                extra = _nbytes(block.rows)
                block.nbytes += extra
                st.bytes += extra
        self._touch(chain)
        self._evict()

    def clear(self) -> None:
        """Drop every block (a replica going to sleep gives its accelerator memory back)."""
        self._blocks.clear()
        self.stats.blocks = self.stats.bytes = 0

    def _touch(self, chain: list[bytes]) -> None:
        for key in reversed(chain):  # the first block ends most recent
            self._blocks.move_to_end(key)

    def _evict(self) -> None:
        st = self.stats
        while st.bytes > st.capacity_bytes and self._blocks:
            _, block = self._blocks.popitem(last=False)
            st.bytes -= block.nbytes
            st.blocks -= 1
            st.evicted_blocks += 1


def _slice_rows(rows: Any, lo: int, hi: int) -> Any:
    if rows is None:
        return None
    if isinstance(rows, tuple):
        return tuple(r[lo:hi].clone() for r in rows)
    return rows[lo:hi].clone()


def cat_rows(parts: list[Any]) -> Any:
    """Hidden rows one after the other (tensors, or tuples of tensors alike)."""
    import torch

    if isinstance(parts[0], tuple):
        return tuple(torch.cat([p[i] for p in parts], dim=0) for i in range(len(parts[0])))
    return torch.cat(parts, dim=0)


def _nbytes(rows: Any) -> int:
    if rows is None:
        return 0
    if isinstance(rows, tuple):
        return sum(r.nbytes for r in rows)
    return int(rows.nbytes)
