"""The engine owns the static KV cache and routes each step to the compiled graph of its bucket.

A step graph has the signature of `LlamaModel.forward` with `attend_len` fixed (see `model.llama.BucketStep`):
    graph(input_ids [B,T], positions [B,T], k_cache, v_cache, logit_index [B,n]) -> logits [B,n,V]
and is keyed by (T, S): context encoding uses (ctx_bucket, ctx_bucket), token generation (1, tg_bucket).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from neuron_infer.config import BuildConfig
from neuron_infer.errors import NeuronInferError
from neuron_infer.runtime.buckets import pick_bucket

StepFn = Callable[..., torch.Tensor]


def graph_name(kind: str, tokens: int, attend: int) -> str:
    """Canonical graph name, e.g. 'context_t128_s128', 'tokengen_t1_s512'."""
    return f"{kind}_t{tokens}_s{attend}"


def planned_graphs(build: BuildConfig) -> list[tuple[str, int, int]]:
    """(kind, T, S) of every graph a build compiles."""
    out = [("context", b, b) for b in build.context_bucket_list]
    out += [("tokengen", 1, s) for s in build.tokengen_bucket_list]
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

    def __init__(self, graphs: dict[str, StepFn], build: BuildConfig, cache: CacheShape):
        self.graphs, self.build, self.cache_shape = graphs, build, cache
        self.k_cache, self.v_cache = cache.allocate()

    def _run(self, kind: str, t: int, s: int, *args: torch.Tensor) -> torch.Tensor:
        name = graph_name(kind, t, s)
        try:
            fn = self.graphs[name]
        except KeyError as e:
            raise NeuronInferError(f"compiled graph {name!r} is missing from the artifact; recompile") from e
        with torch.inference_mode():
            return fn(args[0], args[1], self.k_cache, self.v_cache, args[2])

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Encode right-padded prompts (one per batch row) -> next-token logits [B, V] at each prompt's end."""
        b = self.build.batch_size
        longest = max(len(p) for p in prompts)
        t = pick_bucket(longest, self.build.context_bucket_list, "prompt", "--max-context-length/--context-buckets")
        ids = torch.zeros(b, t, dtype=torch.int64)  # [B, T]; rows past len(prompts) are idle padding
        last = torch.zeros(b, 1, dtype=torch.int64)  # [B, 1]
        for row, p in enumerate(prompts):
            ids[row, : len(p)] = torch.tensor(p, dtype=torch.int64)
            last[row, 0] = len(p) - 1
        positions = torch.arange(t, dtype=torch.int64).expand(b, t).contiguous()  # [B, T]
        return self._run("context", t, t, ids, positions, last)[:, 0]  # [B, V]

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens [B], positions [B] (slot each token is written to) -> logits [B, V]."""
        s = pick_bucket(int(positions.max()) + 1, self.build.tokengen_bucket_list, "sequence", "--max-length")
        ids = tokens.view(-1, 1).to(torch.int64)  # [B, 1]
        pos = positions.view(-1, 1).to(torch.int64)  # [B, 1]
        zero = torch.zeros_like(pos)  # [B, 1]: the only token
        return self._run("tokengen", 1, s, ids, pos, zero)[:, 0]  # [B, V]
