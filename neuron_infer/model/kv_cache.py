"""The block KV cache a step graph takes: [L, N, Hkv, bs, D] per K and per V (block 0 is the scratch block)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheShape:
    layers: int
    blocks: int  # N, block 0 included
    kv_heads: int  # local to this rank
    block_size: int
    head_dim: int
    dtype: torch.dtype

    @property
    def dims(self) -> tuple[int, ...]:
        return (self.layers, self.blocks, self.kv_heads, self.block_size, self.head_dim)  # [L, N, Hkv, bs, D]

    def allocate(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(self.dims, dtype=self.dtype), torch.zeros(self.dims, dtype=self.dtype)

    def block_bytes(self) -> int:
        """Bytes of one block, K and V."""
        elems = 2 * self.layers * self.kv_heads * self.block_size * self.head_dim
        return elems * torch.empty((), dtype=self.dtype).element_size()

    def nbytes(self) -> int:
        return self.blocks * self.block_bytes()

    def with_blocks(self, blocks: int) -> CacheShape:
        return dataclasses.replace(self, blocks=blocks)
