"""The engine owns the static KV cache and routes each step to the compiled graph of its bucket.

A step graph has the signature of `LlamaModel.forward` with `attend_len` fixed (see `model.llama.BucketStep`):
    context encoding (one sequence into its cache row, batch 1):
        graph(input_ids [1,T], positions [1,T], k_cache, v_cache, logit_index [1,1], seq_ids [1]) -> [1,1,V]
    token generation (every row of the static batch):
        graph(input_ids [B,1], positions [B,1], k_cache, v_cache, logit_index [B,1]) -> [B,1,V]
    token generation on b < B rows (the batch buckets, BuildConfig.tokengen_batch_list):
        graph(input_ids [b,1], positions [b,1], k_cache, v_cache, logit_index [b,1], seq_ids [b]) -> [b,1,V]
Graphs are keyed by (kind, T, S): context (ctx_bucket, ctx_bucket), tokengen (1, tg_bucket), and the batch-bucket
tokengen graphs by (b, 1, tg_bucket). Encoding one sequence at a time lets a new request join while others keep
decoding (continuous batching) without touching their rows; a step over n running sequences uses the smallest batch
bucket >= n (a step costs what its rows cost, not what the artifact's batch size costs), as NxDI's
token_generation_batches and vllm-neuron's num_seqs_buckets do.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from neuron_infer.config import BuildConfig
from neuron_infer.errors import NeuronInferError
from neuron_infer.runtime.buckets import pick_bucket

StepFn = Callable[..., torch.Tensor]


def graph_name(kind: str, tokens: int, attend: int) -> str:
    """Canonical graph name, e.g. 'context_t128_s128', 'tokengen_t1_s512'."""
    return f"{kind}_t{tokens}_s{attend}"


@dataclass(frozen=True)
class GraphSpec:
    kind: str  # "context" | "tokengen"
    tokens: int  # T
    attend: int  # S (cache slots visible)
    batch: int
    select_rows: bool  # takes seq_ids (writes/reads only the named cache rows)

    @property
    def name(self) -> str:
        if self.kind == "tokengen" and self.select_rows:
            return batch_graph_name(self.batch, self.attend)
        return graph_name(self.kind, self.tokens, self.attend)


def batch_graph_name(batch: int, attend: int) -> str:
    """A token-generation graph over `batch` selected cache rows, e.g. 'tokengen_b2_t1_s512'."""
    return f"tokengen_b{batch}_t1_s{attend}"


def planned_graphs(build: BuildConfig) -> list[GraphSpec]:
    """Every graph a build compiles."""
    out = [GraphSpec("context", b, b, 1, True) for b in build.context_bucket_list]
    out += [GraphSpec("tokengen", 1, s, build.batch_size, False) for s in build.tokengen_bucket_list]
    out += [GraphSpec("tokengen", 1, s, b, True)
            for b in build.tokengen_batch_list if b < build.batch_size for s in build.tokengen_bucket_list]
    return out


@dataclass(frozen=True)
class CacheShape:
    layers: int
    batch: int
    kv_heads: int  # local to this rank
    max_length: int
    head_dim: int
    dtype: torch.dtype

    def allocate(self) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.layers, self.batch, self.kv_heads, self.max_length, self.head_dim)  # [L, B, Hkv, S, D]
        return torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype)

    def nbytes(self) -> int:
        elems = 2 * self.layers * self.batch * self.kv_heads * self.max_length * self.head_dim
        return elems * torch.empty((), dtype=self.dtype).element_size()


class Engine:
    """Runs prefill and decode steps for one static batch."""

    def __init__(self, graphs: dict[str, StepFn], build: BuildConfig, cache: CacheShape, vocab_size: int):
        self.graphs, self.build, self.cache_shape, self.vocab_size = graphs, build, cache, vocab_size
        self.k_cache, self.v_cache = cache.allocate()
        self.spec = None  # runtime.spec_engine.SpecEngine over this engine and a draft, set by the loader

    def _run(self, kind: str, t: int, s: int, ids, pos, logit_index, *rest: torch.Tensor,
             name: str | None = None) -> torch.Tensor:
        name = name or graph_name(kind, t, s)
        try:
            fn = self.graphs[name]
        except KeyError as e:
            raise NeuronInferError(f"compiled graph {name!r} is missing from the artifact; recompile") from e
        with torch.inference_mode():
            return fn(ids, pos, self.k_cache, self.v_cache, logit_index, *rest)

    def prefill_row(self, row: int, prompt: list[int]) -> torch.Tensor:
        """Encode one prompt into cache row `row` (other rows untouched) -> next-token logits [V]."""
        t = pick_bucket(len(prompt), self.build.context_bucket_list, "prompt",
                        "--max-context-length/--context-buckets")
        ids = torch.zeros(1, t, dtype=torch.int64)  # [1, T], right-padded; padding writes slots >= len (unused)
        ids[0, : len(prompt)] = torch.tensor(prompt, dtype=torch.int64)
        positions = torch.arange(t, dtype=torch.int64).view(1, t)  # [1, T]
        last = torch.tensor([[len(prompt) - 1]], dtype=torch.int64)  # [1, 1]
        seq = torch.tensor([row], dtype=torch.int64)  # [1]
        return self._run("context", t, t, ids, positions, last, seq)[0, 0]  # [V]

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Encode prompts into rows 0..n-1 -> next-token logits [B, V] (idle rows: zeros)."""
        out = torch.zeros(self.build.batch_size, self.vocab_size, dtype=torch.float32)  # [B, V]
        for row, p in enumerate(prompts):
            out[row] = self.prefill_row(row, p)
        return out

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens [B], positions [B] (slot each token is written to) -> logits [B, V]."""
        s = pick_bucket(int(positions.max()) + 1, self.build.tokengen_bucket_list, "sequence", "--max-length")
        ids = tokens.view(-1, 1).to(torch.int64)  # [B, 1]
        pos = positions.view(-1, 1).to(torch.int64)  # [B, 1]
        zero = torch.zeros_like(pos)  # [B, 1]: the only token
        return self._run("tokengen", 1, s, ids, pos, zero)[:, 0]  # [B, V]

    def decode_rows(self, rows: list[int], tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A step over the named cache rows only: rows (distinct), tokens [n], positions [n] -> logits [n, V].

        Runs the smallest batch-bucket graph >= n; its spare batch rows are padded with free cache rows (token 0 at
        position 0: garbage in rows that are re-encoded before any use). At n > the largest bucket below the
        artifact's batch size, the full-batch graph runs over every row.
        """
        n, full = len(rows), self.build.batch_size
        b = next((x for x in self.build.tokengen_batch_list if x >= n), full)
        if b >= full:
            all_tokens = torch.zeros(full, dtype=torch.int64)  # [B]
            all_pos = torch.zeros(full, dtype=torch.int64)  # [B]
            all_tokens[rows], all_pos[rows] = tokens, positions
            return self.decode(all_tokens, all_pos)[rows]  # [n, V]
        taken = set(rows)
        pad = [r for r in range(full) if r not in taken][: b - n]
        seq = torch.tensor(list(rows) + pad, dtype=torch.int64)  # [b] cache row of each batch row
        ids = torch.zeros(b, 1, dtype=torch.int64)  # [b, 1]
        pos = torch.zeros(b, 1, dtype=torch.int64)  # [b, 1]
        ids[:n, 0], pos[:n, 0] = tokens, positions
        s = pick_bucket(int(positions.max()) + 1, self.build.tokengen_bucket_list, "sequence", "--max-length")
        out = self._run("tokengen", 1, s, ids, pos, torch.zeros_like(pos), seq, name=batch_graph_name(b, s))
        return out[:n, 0]  # [n, V]
