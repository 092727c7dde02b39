from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from neuron_infer.artifact.plan import batch_context_name, batch_graph_name, graph_name, max_table_blocks
from neuron_infer.config import BuildConfig
from neuron_infer.errors import NeuronInferError
from neuron_infer.model.kv_cache import CacheShape
from neuron_infer.runtime.blocks import BlockPool
from neuron_infer.runtime.buckets import pick_bucket

StepFn = Callable[..., torch.Tensor]
Piece = tuple[int, list[int], int, int]  # (slot, prompt, start, end): prompt[start:end] into the blocks of `slot`


def take_rows(t: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """t[rows] along dim 0; a view where the rows are a run in order. For a step's logits [n, V] the indexing
    copy would run as a parallel kernel in the step's serial host time."""
    rows = list(rows)
    if rows and rows == list(range(rows[0], rows[0] + len(rows))):
        return t[rows[0]: rows[0] + len(rows)]
    return t[rows]


def budget_blocks(cache: CacheShape, gib: float) -> int:
    """Blocks (the scratch block included) of a KV cache of `gib` GiB; a budget without one block besides the
    scratch block is refused. (A request longer than the cache holds fails when it is scheduled, naming the fix.)"""
    blocks = round(gib * 2**30) // cache.block_bytes()
    if blocks < 2:
        raise NeuronInferError(
            f"--kv-cache-gib {gib:g} holds {blocks} blocks of {cache.block_size} tokens, but the cache needs at "
            f"least 2 (one block and the scratch block): at least {2 * cache.block_bytes() / 2**30:.6f} GiB")
    return blocks


class Engine:
    """Runs prefill and decode steps over the block cache for one static batch of slots."""

    def __init__(self, graphs: dict[str, StepFn], build: BuildConfig, cache: CacheShape, vocab_size: int,
                 shape_classes: bool = False):
        """shape_classes: the graphs are shape-class graphs (ShapeClass): prefill takes the prompt's own length,
        every graph a table of 2..max_table_blocks blocks."""
        self.graphs, self.build, self.cache_shape, self.vocab_size = graphs, build, cache, vocab_size
        self.shape_classes = shape_classes
        self.k_cache, self.v_cache = cache.allocate()
        self.pool = BlockPool(cache.blocks, cache.block_size)
        self.slots: list[list[int]] = [self._stripe(r) for r in range(build.batch_size)]  # blocks of each slot

    @property
    def min_table_width(self) -> int:
        """Shape-class graphs take tables of 2+ blocks (a dynamic size 1 would be specialised at export)."""
        return 2 if self.shape_classes else 1

    @property
    def block_size(self) -> int:
        return self.cache_shape.block_size

    def bind_stripes(self) -> None:
        """Every slot its own stripe of blocks again (the static layout, for driving the engine without a runner).
        The stripes overwrite blocks the pool may hold cached prefixes in, so the prefix cache is dropped."""
        self.pool.forget_prefixes()
        for slot in range(self.build.batch_size):
            self.bind(slot, self._stripe(slot))

    def _stripe(self, slot: int) -> list[int]:
        per = self.build.max_length // self.block_size
        first = 1 + slot * per
        return list(range(first, first + per)) if first + per <= self.cache_shape.blocks else []

    def slot_kv(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V of `slot` in position order, [L, Hkv, n*bs, D] each (copies; for inspection)."""
        idx = torch.tensor(self.slots[slot], dtype=torch.int64)  # [n]

        def one(cache: torch.Tensor) -> torch.Tensor:
            blocks = cache.index_select(1, idx)  # [L, n, Hkv, bs, D]
            return blocks.transpose(1, 2).flatten(2, 3)  # [L, Hkv, n*bs, D]

        return one(self.k_cache), one(self.v_cache)

    def bind(self, slot: int, blocks: list[int]) -> None:
        """Slot `slot` now holds the sequence whose positions live in `blocks` (in order; [] frees the slot)."""
        self.slots[slot] = blocks

    def table(self, slots: Sequence[int | None], attend: int, min_width: int = 1) -> torch.Tensor:
        """The block table [len(slots), max(attend/bs, min_width)] of the named slots (None, or blocks not yet held:
        the scratch block, whose positions are masked)."""
        width = max(attend // self.block_size, min_width)
        out = torch.zeros(len(slots), width, dtype=torch.int64)  # [b, W]
        for i, slot in enumerate(slots):
            blocks = self.slots[slot][:width] if slot is not None else []
            out[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
        return out

    def _run(self, name: str, ids, pos, logit_index, table: torch.Tensor) -> torch.Tensor:
        try:
            fn = self.graphs[name]
        except KeyError as e:
            raise NeuronInferError(f"compiled graph {name!r} is missing from the artifact; recompile") from e
        with torch.inference_mode():
            return fn(ids, pos, self.k_cache, self.v_cache, logit_index, table)

    def context_graph(self, tokens: int, start: int) -> tuple[int, int]:
        """(T, S) of the context graph encoding `tokens` tokens that start at position `start`."""
        t = pick_bucket(tokens, self.build.context_bucket_list, "prompt", "--max-context-length/--context-buckets")
        return (t, t) if start == 0 else (t, self.build.max_context_length)

    def reach_attend(self, positions: int) -> int:
        """The attended length of a prefill whose tokens reach `positions` positions: the whole blocks holding them,
        at least two (a dynamic table width of one would be specialised at export), at most the table."""
        return self.block_size * min(max(2, -(-positions // self.block_size)), max_table_blocks(self.build))

    def prefill_row(self, slot: int, prompt: list[int], start: int = 0, end: int | None = None,
                    logit_rows: Sequence[int] | None = None) -> torch.Tensor:
        """Encode prompt[start:end] at positions start.. into the blocks of `slot` (positions < start are already
        cached there; other slots untouched) -> logits [V] after its last token (the next-token logits when `end`
        is the prompt's end), or with `logit_rows` (indices into the piece) logits [len(logit_rows), V] after those
        tokens. end - start must fit the largest context bucket. Shape-class graphs take at least 2 logit rows (a
        dynamic size 1 would be specialised at export): a single row is asked for twice and read once."""
        end = len(prompt) if end is None else end
        n = end - start
        t, s = self.context_graph(n, start)
        name = graph_name("context", t, s)
        if self.shape_classes:  # the prompt's own rows (at least 2), attending to the blocks they reach
            t = max(n, 2)
            s = self.reach_attend(start + t)
        ids = torch.zeros(1, t, dtype=torch.int64)  # [1, T], right-padded; padding writes slots no one reads
        ids[0, :n] = torch.tensor(prompt[start:end], dtype=torch.int64)
        positions = torch.arange(start, start + t, dtype=torch.int64).view(1, t)  # [1, T]
        rows = [n - 1] if logit_rows is None else list(logit_rows)
        want = len(rows)
        if self.shape_classes and want < 2:
            rows = rows * 2
        index = torch.tensor([rows], dtype=torch.int64)  # [1, R]
        logits = self._run(name, ids, positions, index, self.table([slot], s, self.min_table_width))[0]  # [R, V]
        return logits[0] if logit_rows is None else logits[:want]  # [V] or [n_logits, V]

    def prefill_rows(self, pieces: list[Piece]) -> torch.Tensor:
        """Encode several pieces, each `(slot, prompt, start, end)` (distinct slots; end - start fits the largest
        context bucket) -> logits [n, V] after each piece's last token. With the batched prefill graph (CPU builds
        of batch_size >= 2, artifact/plan.py batch_context_graphs; or its eager module) one call encodes them all,
        rows right-padded to the longest piece (padding tokens sit past their row's last token: the causal rule
        hides them, and what they write is rewritten before it is read, or lands in the scratch block); otherwise
        one prefill_row each."""
        name = batch_context_name(self.build.batch_size, self.build.max_context_length,
                                  self.build.max_context_length)
        if len(pieces) < 2 or name not in self.graphs:
            return torch.stack([self.prefill_row(slot, p, start, end) for slot, p, start, end in pieces])  # [n, V]
        n = [end - start for _, _, start, end in pieces]
        t = max(*n, 2)
        ids = torch.zeros(len(pieces), t, dtype=torch.int64)  # [B, T], right-padded
        for i, (_, p, start, end) in enumerate(pieces):
            ids[i, : n[i]] = torch.tensor(p[start:end], dtype=torch.int64)
        starts = torch.tensor([start for _, _, start, _ in pieces], dtype=torch.int64)  # [B]
        positions = starts[:, None] + torch.arange(t, dtype=torch.int64)  # [B, T]
        index = torch.tensor(n, dtype=torch.int64)[:, None] - 1  # [B, 1]: each row's last token
        reach = max(start + m for (_, _, start, _), m in zip(pieces, n))  # positions the real tokens reach
        table = self.table([slot for slot, *_ in pieces], self.reach_attend(reach), self.min_table_width)  # [B, W]
        return self._run(name, ids, positions, index, table)[:, 0]  # [B, V]

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Encode prompts into slots 0..n-1 of the static layout (`bind_stripes`) -> next-token logits [B, V] (idle
        slots: zeros)."""
        self.bind_stripes()
        out = torch.zeros(self.build.batch_size, self.vocab_size, dtype=torch.float32)  # [B, V]
        if prompts:
            out[: len(prompts)] = self.prefill_rows([(slot, p, 0, len(p)) for slot, p in enumerate(prompts)])
        return out

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens [B], positions [B] (slot each token is written to) of every batch slot -> logits [B, V]."""
        s = pick_bucket(int(positions.max()) + 1, self.build.tokengen_bucket_list, "sequence", "--max-length")
        ids = tokens.view(-1, 1).to(torch.int64)  # [B, 1]
        pos = positions.view(-1, 1).to(torch.int64)  # [B, 1]
        zero = torch.zeros_like(pos)  # [B, 1]: the only token
        table = self.table(range(self.build.batch_size), s, self.min_table_width)  # [B, S/bs]
        return self._run(graph_name("tokengen", 1, s), ids, pos, zero, table)[:, 0]  # [B, V]

    def decode_rows(self, rows: list[int], tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A step over the named slots only: rows (distinct), tokens [n], positions [n] -> logits [n, V].

        Runs the smallest batch-bucket graph >= n; its spare batch rows write token 0 at position 0 into the scratch
        block. At n > the largest bucket below the artifact's batch size, the full-batch graph runs over every slot.
        """
        n, full = len(rows), self.build.batch_size
        b = next((x for x in self.build.tokengen_batch_list if x >= n), full)
        if b >= full:
            all_tokens = torch.zeros(full, dtype=torch.int64)  # [B]
            all_pos = torch.zeros(full, dtype=torch.int64)  # [B]
            all_tokens[rows], all_pos[rows] = tokens, positions
            return take_rows(self.decode(all_tokens, all_pos), rows)  # [n, V]
        ids = torch.zeros(b, 1, dtype=torch.int64)  # [b, 1]
        pos = torch.zeros(b, 1, dtype=torch.int64)  # [b, 1]
        ids[:n, 0], pos[:n, 0] = tokens, positions
        s = pick_bucket(int(positions.max()) + 1, self.build.tokengen_bucket_list, "sequence", "--max-length")
        table = self.table(list(rows) + [None] * (b - n), s, self.min_table_width)  # [b, S/bs]
        return self._run(batch_graph_name(b, s), ids, pos, torch.zeros_like(pos), table)[:n, 0]  # [n, V]
