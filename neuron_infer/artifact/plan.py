"""The graph plan of a build: every graph an artifact holds, its name, its example inputs and its shape class.

Written by compile/ (which graphs to compile, with which example inputs) and read by runtime/ (which graph serves a
step); one definition of the names. Step graphs take (ids [B, T], positions [B, T], k_cache, v_cache,
logit_index [B, n], block_table [B, S/bs]) -> logits [B, n, V]; fused speculation graphs take the signature of
model/spec_step.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from neuron_infer.config import BuildConfig, ModelConfig
from neuron_infer.model.kv_cache import CacheShape
from neuron_infer.model.llama import LlamaModel

CATCH_UP_TOKENS = 8  # positions per draft catch-up pass (draft_tokengen_t8_s{S}: the GEMV kernels' row limit)


def graph_name(kind: str, tokens: int, attend: int) -> str:
    """Canonical graph name, e.g. 'context_t128_s128', 'tokengen_t1_s512'."""
    return f"{kind}_t{tokens}_s{attend}"


@dataclass(frozen=True)
class GraphSpec:
    """One graph of a build's plan: which model runs what step on which static shapes; `name` is its manifest key."""

    kind: str  # "context" | "tokengen" | "verify" (logits at every token) | "fused" (a whole speculative step)
    tokens: int  # T (fused: K, the draft tokens)
    attend: int  # S (positions visible)
    batch: int
    batch_bucket: bool = False  # a tokengen graph over b < batch_size sequences
    model: str = "target"  # "target" | "draft" (speculation: the draft model alone)
    sample: bool = False  # fused: the sampling rule (else greedy)
    logit_rows: int = 1  # width of the example logit_index (the prefill shape class: 2, its dynamic minimum)

    @property
    def name(self) -> str:
        if self.kind == "fused":
            return fused_graph_name(self.tokens, self.attend, self.sample)
        if self.batch_bucket:
            return batch_graph_name(self.batch, self.attend)
        if self.kind == "context" and self.batch > 1:
            return batch_context_name(self.batch, self.tokens, self.attend)
        prefix = "draft_" if self.model == "draft" else ""
        return prefix + graph_name(self.kind, self.tokens, self.attend)

    @property
    def role(self) -> str:
        """"draft" (the draft model alone), "verify", "fused", or the target's "context" / "tokengen"."""
        return "draft" if self.model == "draft" else self.kind


def batch_graph_name(batch: int, attend: int) -> str:
    """A token-generation graph over `batch` sequences, e.g. 'tokengen_b2_t1_s512'."""
    return f"tokengen_b{batch}_t1_s{attend}"


def batch_context_name(batch: int, tokens: int, attend: int) -> str:
    """A context graph encoding up to `batch` prompts (pieces) at once, e.g. 'context_b4_t512_s512'."""
    return f"context_b{batch}_t{tokens}_s{attend}"


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
    return out + batch_context_graphs(build)


def batch_context_graphs(build: BuildConfig) -> list[GraphSpec]:
    """The context graph that encodes several prompts in one call (Engine.prefill_rows): CPU builds of batch_size
    >= 2 only (one dynamic-shape graph; the Neuron target keeps its static batch-1 context buckets)."""
    if build.target != "cpu" or build.batch_size < 2:
        return []
    top = build.max_context_length
    return [GraphSpec("context", top, top, build.batch_size)]


TOKENS, BATCH, ROWS = "tokens", "batch", "rows"  # dynamic-dim names
IDS, POSITIONS, LOGIT_INDEX, TABLE = 0, 1, 4, 5  # step arguments (example_args)
FEW_ROWS = 8  # rows up to which the CPU backend's GEMV kernels serve a linear (backends/cpu/kernels.py MAX_ROWS)


@dataclass(frozen=True)
class ShapeClass:
    """One compiled graph that serves every planned graph of a class (CPU): `example` gives its example inputs and
    `dynamic` the dims left dynamic, {argument index: {dim: (name, min, max)}}. Prefill: one graph for any prompt
    length (tokens 2..max_context_length), any attended length and 2..max_context_length logit rows (logit_index
    [1, R]: the vocabulary head runs over the rows asked for, see Engine.prefill_row); batched prefill (batch_size
    >= 2): one graph for 2..batch_size rows of any length (Engine.prefill_rows); decode and verify: one graph per
    batch range (1; 2..8; 9..batch_size, see _batch_range) for any attended length. Attended lengths are table widths of
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
    if spec.kind == "context" and spec.batch > 1:
        return _batch_prefill_class(spec, build, dynamic, w_example)
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


def _batch_prefill_class(spec: GraphSpec, build: BuildConfig, dynamic: dict, w_example: int) -> ShapeClass:
    """Prompts (pieces) of several rows at once: ids, positions [2..batch_size, 2..max_context_length] (rows
    right-padded to the longest piece), logit_index [B, 1] (each row's last token), table [B, blocks]."""
    tmax, hi = build.max_context_length, spec.batch
    if hi > 2:
        for arg in (IDS, POSITIONS, LOGIT_INDEX, TABLE):
            dynamic.setdefault(arg, {})[0] = (BATCH, 2, hi)
    if tmax > 2:
        for arg in (IDS, POSITIONS):
            dynamic.setdefault(arg, {})[1] = (TOKENS, 2, tmax)
    example = GraphSpec("context", min(tmax, 5), w_example * build.block_size, min(3, hi))
    return ShapeClass("prefill_b2" if hi == 2 else f"prefill_b2-{hi}", example, dynamic)


def _batch_range(batch: int, batch_size: int) -> tuple[int, int]:
    """The batch sizes one decode graph serves: 1 alone (size 1 is specialised at export), 2..8 (rows the GEMV and
    attention kernels take) and 9..batch_size (the GEMM)."""
    if batch == 1:
        return 1, 1
    if batch <= FEW_ROWS:
        return 2, min(batch_size, FEW_ROWS)
    return FEW_ROWS + 1, batch_size


def fused_graph_name(k: int, attend: int, sample: bool) -> str:
    return f"fused_{'sample' if sample else 'greedy'}_k{k}_s{attend}"


def spec_graph_list(build: BuildConfig, draft: bool = True) -> list[GraphSpec]:
    """Every speculation graph a build compiles (draft=False: prompt lookup, the verify graphs only)."""
    k, b, out = build.speculation.length, build.batch_size, []
    if draft:
        out += [GraphSpec("context", t, t, 1, model="draft") for t in build.context_bucket_list]
    for s in build.tokengen_bucket_list:
        if s < k + 2:
            continue  # a step at position >= 1 needs p + K + 1 <= s slots
        if draft:
            widths = (1, 2, CATCH_UP_TOKENS) if s >= CATCH_UP_TOKENS else (1, 2)
            out += [GraphSpec("tokengen", t, s, b, model="draft") for t in widths]
        out.append(GraphSpec("verify", k + 1, s, b))
        if draft and build.speculation.fused:
            out += [GraphSpec("fused", k, s, b, sample=sample) for sample in (False, True)]
    return out


# ---- the KV cache and the example inputs ------------------------------------------------------------------------
def cache_shape(model: LlamaModel, build: BuildConfig, blocks: int | None = None) -> CacheShape:
    """The KV cache of one rank: `blocks` blocks (default: build.default_kv_blocks)."""
    return kv_cache_shape(model.cfg, model.layout.num_kv_heads, build, blocks)


def kv_cache_shape(cfg: ModelConfig, kv_heads: int, build: BuildConfig, blocks: int | None = None) -> CacheShape:
    """The KV cache of `kv_heads` KV heads (a rank's, or every rank's together) before any model is built."""
    dtype = torch.float32 if build.dtype == "fp32" else torch.bfloat16
    if build.quant.kv_cache_dtype == "fp8":
        dtype = torch.float8_e4m3fn
    return CacheShape(cfg.num_layers, blocks or build.default_kv_blocks, kv_heads, build.block_size, cfg.head_dim,
                      dtype)


LOGIT_COPIES = 13  # [B, V] fp32 tensors alive in one step: the graph's logits, the rows taken from them, and the
# sampler's working tensors (model/sampling.py; measured: a top-k/top-p call peaks at 11 more, B=2000, V=50000)


def run_bytes(cache: CacheShape, build: BuildConfig, vocab_size: int) -> int:
    """Memory a loaded build allocates for its batch (the compile-time and the load-time check): the KV cache, and
    the logits of a full-batch step, [B, V] fp32 (a verify step: [B, K+1, V]), LOGIT_COPIES of them at once."""
    rows = build.batch_size * (build.speculation.length + 1 if build.speculation is not None else 1)
    return cache.nbytes() + LOGIT_COPIES * 4 * rows * vocab_size


def example_args(cache: CacheShape, spec: GraphSpec) -> tuple[torch.Tensor, ...]:
    """Static-shape example inputs of one step graph (a verify graph: logits at every token)."""
    b, t = spec.batch, spec.tokens
    k, v = cache.allocate()
    ids = torch.zeros(b, t, dtype=torch.int64)  # [B, T]
    pos = torch.arange(t, dtype=torch.int64).expand(b, t).contiguous()  # [B, T]
    idx = torch.full((b, spec.logit_rows), t - 1, dtype=torch.int64)  # [B, R] (R = 1 but for the prefill class)
    if spec.kind == "verify":
        idx = torch.arange(t, dtype=torch.int64).expand(b, t).contiguous()  # [B, T]
    table = torch.zeros(b, spec.attend // cache.block_size, dtype=torch.int64)  # [B, S/bs]
    return ids, pos, k, v, idx, table
