#!/usr/bin/env python
"""Time to first token: neuron-infer (bf16, int8 artifacts) vs llama.cpp (F16, Q8_0) on the same prompts, one process.

    python scripts/bench_ttft.py --artifacts ART_BF16 --int8-artifacts ART_INT8
    python scripts/bench_ttft.py --artifacts ART_BF16 --lengths 25,105,420 --rounds 5

Each round times every runner on every prompt length (round 0 is a warm-up); the ratios are medians over rounds of
llama.cpp's TTFT / neuron-infer's within a round (> 1: neuron-infer answers sooner). bf16 is compared with F16 and
int8 with Q8_0. TTFT is one `generate` call for one new token (prefill + the first sample; prefix caching off), for
llama.cpp one `generate` step from a reset state. The llama.cpp files are made as scripts/bench_decode.py makes them.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import LlamaCpp, NeuronInfer, llamacpp_file, prompt_ids  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifacts", required=True,
                    help="a bf16 artifact (e.g. `neuron-infer compile --config smollm2-cpu`)")
    ap.add_argument("--int8-artifacts", default=None, help="an int8 artifact of the same model (--quant int8)")
    ap.add_argument("--lengths", default="25,105,420", help="prompt lengths in tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from neuron_infer.embedded import default_model_dir, find_gguf

    model_dir = default_model_dir()
    # prefix caching off: every round encodes the whole prompt (a repeated prompt would otherwise be a cache hit)
    pairs = [(NeuronInfer(model_dir, "bf16", None, Path(args.artifacts), "neuron-infer bf16", False), "F16")]
    if args.int8_artifacts:
        pairs.append((NeuronInfer(model_dir, "bf16", None, Path(args.int8_artifacts), "neuron-infer int8", False),
                      "Q8_0"))
    runners = []
    for ni, kind in pairs:
        runners.append(ni)
        try:
            runners.append(LlamaCpp(llamacpp_file(find_gguf(), kind), kind))
        except ImportError:
            print("llama-cpp-python not installed: neuron-infer alone", file=sys.stderr)
    lengths = [int(x) for x in args.lengths.split(",")]
    prompts = {n: prompt_ids(runners[0].m.tokenizer, n) for n in lengths}
    times = {(r.name, n): [] for r in runners for n in lengths}
    for rnd in range(args.rounds + 1):
        for n in lengths:
            for r in runners:
                t = r.ttft(prompts[n])
                if rnd:
                    times[(r.name, n)].append(t)
    print(f"\nTTFT (ms, median of {args.rounds} interleaved rounds, {args.threads} threads; lower is better)\n")
    print("| runtime | " + " | ".join(f"{n} tokens" for n in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for r in runners:
        cells = [f"{statistics.median(times[(r.name, n)]) * 1e3:.0f}" for n in lengths]
        print(f"| {r.name} | " + " | ".join(cells) + " |")
    for ni, kind in pairs:
        peer = f"llama.cpp {kind}"
        if (peer, lengths[0]) not in times:
            continue
        ratios = [statistics.median(p / q for p, q in zip(times[(peer, n)], times[(ni.name, n)])) for n in lengths]
        print(f"{ni.name} vs {peer}: " + ", ".join(f"{n} tokens {x:.2f}x" for n, x in zip(lengths, ratios))
              + " (llama.cpp's TTFT / neuron-infer's; > 1: neuron-infer sooner)")


if __name__ == "__main__":
    main()
