"""Loaded weights in one block of memory backed by transparent huge pages (Linux), for faster decode on CPU.

A batch-1 decode step streams every weight once. With 4 KiB pages the 269 MB of SmolLM2 span ~66,000 pages, one TLB
miss each; in 2 MiB pages they span ~135. Where the kernel has transparent huge pages off, or `madvise` is
unavailable, the block is ordinary memory and nothing else changes. Tensors are copied in one at a time as they are
read, so loading needs the block plus one tensor, not twice the weights.
"""
from __future__ import annotations

import mmap
from collections.abc import Callable, Iterable

import torch

ALIGN = 4096  # every tensor starts on its own page-aligned offset (any dtype's alignment is satisfied)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def pack_weights(tensors: Iterable[tuple[str, torch.Tensor]], capacity: int,
                 follow: frozenset[str] = frozenset(),
                 check: Callable[[str, torch.Tensor], None] | None = None) -> dict[str, torch.Tensor]:
    """Copy (name, CPU tensor) pairs, consumed one by one, into one huge-page-advised anonymous mapping of
    `capacity` bytes -> {name: tensor} with the same shapes, dtypes and values. `check(name, copy)` runs on each
    copy as soon as it is made (its bytes still in cache) and may raise.

    Each tensor starts on an ALIGN boundary, except those named in `follow`, which start right where the previous
    tensor ends: a run of equal-shaped tensors then forms one contiguous block (the stacked decoder-layer weights,
    artifact/weights.py). Each run is a torch storage of its own over its part of the mapping (tensors of different
    runs never alias, as tracing higher-order ops such as while_loop requires of its inputs). `capacity` must cover
    the sum of the sizes rounded up to ALIGN (pages never written cost no memory). The returned tensors are views of
    the mapping and keep it alive.
    """
    block = mmap.mmap(-1, max(capacity, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        block.madvise(mmap.MADV_HUGEPAGE)  # before the first touch, so the copies fault in huge pages
    raw = torch.frombuffer(block, dtype=torch.uint8)  # [capacity] bytes, for the copies
    out: dict[str, torch.Tensor] = {}
    run: list[tuple[str, torch.Tensor, int]] = []  # (name, source, offset) of the run being packed
    end = 0
    for name, t in tensors:
        if name not in follow:
            _own_storage(block, run, out)
            run = []
        size = t.numel() * t.element_size()
        offset = end if name in follow else _aligned(end)
        if offset + size > len(block):
            raise ValueError(f"pack_weights: {name!r} ({size} bytes at offset {offset}) overflows the {len(block)}-"
                             "byte block; pass a capacity that covers every tensor rounded up to ALIGN")
        copy = raw[offset: offset + size].view(t.dtype).view(t.shape)
        copy.copy_(t)
        if check is not None:
            check(name, copy)
        run.append((name, t, offset))
        end = offset + size
    _own_storage(block, run, out)
    return out


def _own_storage(block: mmap.mmap, run: list[tuple[str, torch.Tensor, int]], out: dict[str, torch.Tensor]) -> None:
    """The run's tensors as views of one storage over its bytes of `block` (which the storage keeps alive)."""
    if not run:
        return
    start = run[0][2]
    _, last, last_offset = run[-1]
    size = last_offset + last.numel() * last.element_size() - start
    raw = torch.frombuffer(block, dtype=torch.uint8, count=size, offset=start) if size else torch.empty(0, dtype=torch.uint8)
    for name, t, offset in run:
        n = t.numel() * t.element_size()
        out[name] = raw[offset - start: offset - start + n].view(t.dtype).view(t.shape)
