from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from neuron_infer.config import BuildConfig
from neuron_infer.errors import NeuronInferError
from neuron_infer.runtime.blocks import BlockPool
from neuron_infer.runtime.buckets import pick_bucket

StepFn = Callable[..., torch.Tensor]


def take_rows(t: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """t[rows] along dim 0; a view where the rows are a run in order. For a step's logits [n, V]: the indexing
    copy runs as a parallel kernel, and the two a batch-1 step made took ~0.15 ms of a 3.5-4 ms SmolLM2 int8 step."""
    rows = list(rows)
    if rows and rows == list(range(rows[0], rows[0] + len(rows))):
        return t[rows[0]: rows[0] + len(rows)]
    return t[rows]


def graph_name(kind: str, tokens: int, attend: int) -> str:
    """Canonical graph name, e.g. 'context_t128_s128', 'tokengen_t1_s512'."""
    return f"{kind}_t{tokens}_s{attend}"


@dataclass(frozen=True)
class GraphSpec:
    kind: str  # "context" | "tokengen" | "verify" (speculation: logits at every token)
    tokens: int  # T
    attend: int  # S (positions visible)
    batch: int
    batch_bucket: bool = False  # a tokengen graph over b < batch_size sequences
    logit_rows: int = 1  # width of the example logit_index (the prefill shape class: 2, its dynamic minimum)

    @property
    def name(self) -> str:
        if self.batch_bucket:
            return batch_graph_name(self.batch, self.attend)
        return graph_name(self.kind, self.tokens, self.attend)


def batch_graph_name(batch: int, attend: int) -> str:
    """A token-generation graph over `batch` sequences, e.g. 'tokengen_b2_t1_s512'."""
    return f"tokengen_b{batch}_t1_s{attend}"


def context_attends(build: BuildConfig, tokens: int) -> tuple[int, ...]:
    """Attend lengths of the context graphs of `tokens`: its own bucket, and the largest context bucket (a prompt
    whose first blocks are cached encodes only its rest, at positions p0.., attending to the cached blocks)."""
    top = build.max_context_length
    return (tokens,) if tokens == top else (tokens, top)


def planned_graphs(build: BuildConfig) -> list[GraphSpec]:
    """Every graph a build compiles."""
    out = [GraphSpec("context", t, s, 1) for t in build.context_bucket_list for s in context_attends(build, t)]
    out += [GraphSpec("tokengen", 1, s, build.batch_size) for s in build.tokengen_bucket_list]
    out += [GraphSpec("tokengen", 1, s, b, True)
            for b in build.tokengen_batch_list if b < build.batch_size for s in build.tokengen_bucket_list]
    return out


TOKENS, BATCH, ROWS = "tokens", "batch", "rows"  # dynamic-dim names
IDS, POSITIONS, LOGIT_INDEX, TABLE = 0, 1, 4, 5  # step arguments (compile/builder.py example_args)
FEW_ROWS = 8  # rows up to which the CPU backend's GEMV kernels serve a linear (compile/cpu_gemv.py MAX_ROWS)


@dataclass(frozen=True)
class ShapeClass:
    """One compiled graph that serves every planned graph of a class (CPU): `example` gives its example inputs and
    `dynamic` the dims left dynamic, {argument index: {dim: (name, min, max)}}. Prefill: one graph for any prompt
    length (tokens 2..max_context_length), any attended length and 2..max_context_length logit rows (logit_index
    [1, R]: the vocabulary head runs over the rows asked for, see Engine.prefill_row); decode and verify: one graph per batch range
    (1; 2..8; 9..batch_size, see _batch_range) for any attended length. Attended lengths are table widths of
    2..max_length/bs blocks (a shorter table is padded with the scratch block: its positions are masked)."""

    name: str
    example: GraphSpec
    dynamic: dict

    @property
    def dims(self) -> set[str]:
        return {name for per_arg in self.dynamic.values() for name, _, _ in per_arg.values()}


def max_table_blocks(build: BuildConfig) -> int:
    """The widest block table a shape-class graph takes (at least 2: size 1 would be specialized at export)."""
    return max(2, build.max_length // build.block_size)


def shape_class(spec: GraphSpec, build: BuildConfig) -> ShapeClass:
    """The shape class that serves `spec` on a backend with dynamic shapes."""
    bs, wmax = build.block_size, max_table_blocks(build)
    dynamic: dict = {TABLE: {1: ("blocks", 2, wmax)}} if wmax > 2 else {}
    w_example = min(3, wmax)
    if spec.kind == "context" and not spec.batch_bucket:
        tmax = build.max_context_length
        if tmax > 2:
            dynamic.update({IDS: {1: (TOKENS, 2, tmax)}, POSITIONS: {1: (TOKENS, 2, tmax)},
                            LOGIT_INDEX: {1: (ROWS, 2, tmax)}})
        return ShapeClass("prefill", GraphSpec("context", min(tmax, 5), w_example * bs, spec.batch, logit_rows=2),
                          dynamic)
    lo, hi = _batch_range(spec.batch, build.batch_size)
    if hi > lo:  # ids, positions, logit_index, table: [B, ...]
        for arg in (IDS, POSITIONS, LOGIT_INDEX, TABLE):
            dynamic.setdefault(arg, {})[0] = (BATCH, lo, hi)
    example = GraphSpec(spec.kind, spec.tokens, w_example * bs, min(lo + 1, hi))
    kind = "decode" if spec.kind == "tokengen" else spec.kind  # "verify": logits at every one of its T tokens
    name = f"{kind}_b{lo}_t{spec.tokens}" if hi == lo else f"{kind}_b{lo}-{hi}_t{spec.tokens}"
    return ShapeClass(name, example, dynamic)


def _batch_range(batch: int, batch_size: int) -> tuple[int, int]:
    """The batch sizes one decode graph serves: 1 alone (size 1 is specialised at export), 2..8 (rows the GEMV and
    attention kernels take) and 9..batch_size (the GEMM)."""
    if batch == 1:
        return 1, 1
    if batch <= FEW_ROWS:
        return 2, min(batch_size, FEW_ROWS)
    return FEW_ROWS + 1, batch_size


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
        self.spec = None  # runtime.spec_engine.SpecEngine over this engine and a draft, set by the loader

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
            s = self.block_size * min(max(2, -(-(start + t) // self.block_size)), max_table_blocks(self.build))
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

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Encode prompts into slots 0..n-1 of the static layout (`bind_stripes`) -> next-token logits [B, V] (idle
        slots: zeros)."""
        self.bind_stripes()
        out = torch.zeros(self.build.batch_size, self.vocab_size, dtype=torch.float32)  # [B, V]
        for slot, p in enumerate(prompts):
            out[slot] = self.prefill_row(slot, p)
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
