"""The KV-cache block pool: which blocks are free, who holds each, and which hold a cached prompt prefix.

The cache has N blocks of `block_size` token slots. Block 0 is the scratch block: padding rows and padding tokens
write there and no sequence ever owns it. A sequence holds an ordered list of blocks (its block table); position p
lives in block table[p // bs] at offset p % bs.

Prefix caching (as vLLM's automatic prefix caching): every full block of a prompt has a hash chained over the
previous block's hash and the block's tokens, so equal hashes mean equal prefixes up to and including the block.
A cached block is shared by reference count; when the last holder lets it go it stays cached but free. Fresh blocks
come from the never-cached free blocks first; only when those run out is a free cached block evicted, the least
recently used one first (its hash is forgotten).

Reservations: a sequence is admitted only with blocks promised for its whole length bound, so a running sequence
never waits for a block mid-generation; the promise is drawn down as it grows.

Everything here is deterministic (no Python hash randomization, FIFO order), so tensor-parallel ranks fed the same
decisions hold the same blocks.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from neuron_infer.errors import NeuronInferError

SCRATCH = 0


def block_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The chained hash of each full block of `tokens` (a partial last block has none)."""
    out, parent = [], b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = hashlib.sha256(parent)
        h.update(",".join(map(str, tokens[start: start + block_size])).encode())
        parent = h.digest()
        out.append(parent)
    return out


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks holding `tokens` positions."""
    return -(-tokens // block_size)


class BlockPool:
    """N blocks (block 0 reserved as scratch) with reference counts, reservations and the prefix-cache map."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        if num_blocks < 2:
            raise NeuronInferError(f"a KV cache of {num_blocks} block(s) holds nothing (block 0 is scratch)")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.refs = [0] * num_blocks
        self._plain: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))  # free, no prefix
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free blocks holding a cached prefix, LRU first
        self._hash_of: dict[int, bytes] = {}
        self._cached: dict[bytes, int] = {}
        self.reserved = 0  # blocks promised to running sequences, not yet taken
        self.queries = 0  # prompt blocks looked up in the prefix cache
        self.hits = 0  # of which found

    @property
    def usable(self) -> int:
        return self.num_blocks - 1

    @property
    def free(self) -> int:
        """Blocks nobody holds (cached-but-free ones included)."""
        return len(self._plain) + len(self._evictable)

    @property
    def in_use(self) -> int:
        return self.usable - self.free

    @property
    def available(self) -> int:
        """Free blocks not promised to a running sequence."""
        return self.free - self.reserved

    # ---- prefix cache --------------------------------------------------------------------------------------------
    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def lookup(self, hashes: Sequence[bytes], count: bool = True) -> list[int]:
        """The cached blocks of the longest cached prefix of `hashes` (nothing when prefix caching is off)."""
        if not self.prefix_caching:
            return []
        out = []
        for h in hashes:
            b = self._cached.get(h)
            if b is None:
                break
            out.append(b)
        if count:
            self.queries += len(hashes)
            self.hits += len(out)
        return out

    def register(self, block: int, h: bytes) -> None:
        """Record that `block` holds the prefix with hash `h` (a prefix already cached elsewhere keeps its block)."""
        if self.prefix_caching and h not in self._cached and block not in self._hash_of:
            self._cached[h] = block
            self._hash_of[block] = h

    def release_all(self) -> None:
        """No block is held any more (a new runner takes over the cache): cached prefixes stay cached."""
        for b in range(1, self.num_blocks):
            if self.refs[b]:
                self.refs[b] = 0
                (self._evictable if b in self._hash_of else self._plain)[b] = None
        self.reserved = 0

    def forget_prefixes(self) -> None:
        """Drop every cached prefix (free cached blocks become plain free blocks)."""
        self._plain.update(self._evictable)
        self._evictable.clear()
        self._cached.clear()
        self._hash_of.clear()

    # ---- holding blocks ------------------------------------------------------------------------------------------
    def take(self, block: int) -> None:
        """Hold a cached block (shared: its reference count goes up; a free one leaves the free list)."""
        if self.refs[block] == 0:
            (self._evictable if block in self._hash_of else self._plain).pop(block)
        self.refs[block] += 1

    def allocate(self) -> int:
        """A fresh block: a never-cached free one, else the least recently used cached one (which forgets its
        prefix)."""
        if not self.free:
            raise NeuronInferError("the KV cache has no free block left")  # reservations make this unreachable
        block, _ = (self._plain if self._plain else self._evictable).popitem(last=False)
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._cached[h]
        self.refs[block] = 1
        return block

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; the last one frees it (the tail of a sequence first, so a shared
        prefix's early blocks are the last to be evicted)."""
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                (self._evictable if b in self._hash_of else self._plain)[b] = None
