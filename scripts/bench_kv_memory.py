#!/usr/bin/env python3
"""KV-cache memory of short requests on a long-context artifact: the static-size cache vs one sized for them.

    python scripts/bench_kv_memory.py DIR     # compiles the embedded SmolLM2 into DIR (eager graphs, bf16, batch 8,
                                              # max_length 4096, 128-token blocks) unless DIR already holds it

Loads the artifact twice: with its default cache (batch_size sequences of max_length, as a static cache holds) and
with `kv_cache_gib` for exactly the blocks the requests need (`--requests` x ceil((prompt + new) / block) plus the
scratch block). Runs the same `generate_ids` call (`--requests` prompts of `--prompt-len` random token ids,
`--new-tokens` greedy tokens each) on both and prints each cache's blocks and allocated MiB, the most slots busy and
blocks held at once, the ratio of the two caches, and whether the tokens are identical.
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from neuron_infer.api import CompiledModel, compile_model
from neuron_infer.config import BuildConfig
from neuron_infer.embedded import default_model_dir

BUILD = BuildConfig(dtype="bf16", batch_size=8, max_context_length=256, max_length=4096, context_buckets=(256,),
                    tokengen_buckets=(256, 4096), tokengen_batch_buckets=(8,), kv_block_size=128)


def run(model: CompiledModel, prompts: list[list[int]], new: int) -> tuple[list[list[int]], int, int]:
    """-> (tokens per prompt, most slots busy at once, most blocks held at once)"""
    busy = []
    got = model.generate_ids(prompts, new, ignore_eos=True,
                             on_tokens=lambda _o: busy.append(sum(1 for s in model.engine.slots if s)))
    return [o.token_ids for o in got.outputs], max(busy), got.metrics[0].kv_blocks_in_use


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=56)
    args = ap.parse_args(argv)
    root = Path(args.artifact)
    if not (root / "manifest.json").exists():
        compile_model(default_model_dir(), root, BUILD, backend="cpu-eager", say=lambda m: None)
    full = CompiledModel.load(root, prefix_caching=False)
    shape, bs = full.engine.cache_shape, full.engine.block_size
    need = args.requests * -(-(args.prompt_len + args.new_tokens) // bs) + 1
    sized = CompiledModel.load(root, prefix_caching=False, kv_cache_gib=need * shape.block_bytes() / 2**30)
    rng = random.Random(0)
    vocab = full.manifest.model.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    print(f"{args.requests} requests of {args.prompt_len} + {args.new_tokens} tokens, batch {full.manifest.build.batch_size}, "
          f"max_length {full.manifest.build.max_length}, {bs}-token blocks")
    print("cache | blocks (scratch included) | MiB allocated | most slots busy | most blocks held")
    outs = {}
    for name, m in (("default", full), ("sized", sized)):
        tokens, busy, held = run(m, prompts, args.new_tokens)
        outs[name] = tokens
        mib = 2 * m.engine.k_cache.nbytes / 2**20
        print(f"{name} | {m.engine.cache_shape.blocks} | {mib:.1f} | {busy} | {held}")
    print(f"sized / default: {sized.engine.cache_shape.blocks} / {shape.blocks} blocks = 1/"
          f"{shape.blocks / sized.engine.cache_shape.blocks:.1f} of the static-size cache (smaller is better); "
          f"tokens identical: {outs['default'] == outs['sized']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
