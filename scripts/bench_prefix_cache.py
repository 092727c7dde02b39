"""Time to first token of a prompt whose long prefix is in the prefix cache vs the same-length prompt cold.

    python scripts/bench_prefix_cache.py ARTIFACT [--prefix 224 --suffix 16 --rounds 5]
    python scripts/bench_prefix_cache.py --compile DIR     # compile the embedded SmolLM2 (bf16, batch 1,
                                                           # context buckets 32,256, max_length 512) into DIR first
    python scripts/bench_prefix_cache.py --compile DIR --backend cpu-eager   # the same graphs run eagerly (no
                                                           # compile: the torch modules themselves)
    python scripts/bench_prefix_cache.py --server http://127.0.0.1:8000 --prefix 1000 --suffix 24
                                                           # through an OpenAI-compatible server (vLLM): TTFT of a
                                                           # streamed one-token completion

Each round times three one-token generations on one loaded model (prefix caching on): a cold prompt (a fresh
random prefix + suffix: nothing cached), then two prompts that share that prefix with new suffixes (the first
caches the prefix blocks, the second is timed as "warm"). Prints the medians and the ratio cold / warm.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from neuron_infer.api import CompiledModel, compile_model
from neuron_infer.config import BuildConfig

BUILD = BuildConfig(dtype="bf16", batch_size=1, max_context_length=256, max_length=512, context_buckets=(32, 256),
                    tokengen_buckets=(256, 512))


def ttft(model: CompiledModel, prompt: list[int]) -> float:
    return model.generate_ids([prompt], 1, ignore_eos=True).metrics[0].ttft_s


def server_ttft(url: str):
    """prompt -> seconds to the first streamed chunk of a one-token completion from the server at `url`."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/: the load generator's client
    import bench_serving as serving

    cfg = serving.BenchConfig(base_url=url, temperature=0.0, stream=True)
    client = serving.Client(url, cfg.timeout_s)
    name = client.get_json("/v1/models")["data"][0]["id"]

    def run(prompt: list[int]) -> float:
        rec = serving.RequestRecord(0)
        body = serving.request_body(cfg, name, serving.RequestSpec(0, prompt, 1))  # greedy, streamed, token ids
        client.post("/v1/completions", body, rec, stream=True)
        if rec.error or rec.ttft is None:
            raise SystemExit(f"error: {url}: {rec.error or 'no token streamed'}")
        return rec.ttft

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", nargs="?")
    ap.add_argument("--compile", metavar="DIR", help="compile the embedded model into DIR and use it")
    ap.add_argument("--prefix", type=int, default=224, help="shared prefix tokens")
    ap.add_argument("--suffix", type=int, default=16, help="tokens after the prefix")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--backend", default=None, help="with --compile: cpu (default) or cpu-eager")
    ap.add_argument("--server", metavar="URL", help="time an OpenAI-compatible server instead of an artifact")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(int(time.time()))  # fresh prefixes: a server's cache may hold older ones
    if args.server:
        measure(server_ttft(args.server), args, lambda n: torch.randint(100, 30000, (n,), generator=gen).tolist(),
                f"server {args.server}")
        return
    if args.compile:
        from neuron_infer.embedded import default_model_dir

        if not (Path(args.compile) / "manifest.json").is_file():
            compile_model(default_model_dir(), args.compile, BUILD, backend=args.backend,
                          say=lambda m: print(m, file=sys.stderr))
        args.artifact = args.compile
    if not args.artifact:
        sys.exit("error: give an ARTIFACT or --compile DIR")
    model = CompiledModel.load(args.artifact, threads="auto")
    build = model.manifest.build
    if args.prefix + args.suffix > build.max_context_length:
        sys.exit(f"error: --prefix + --suffix must be <= the artifact's max_context_length={build.max_context_length}")
    vocab = model.manifest.model.vocab_size
    measure(lambda p: ttft(model, p), args, lambda n: torch.randint(100, vocab, (n,), generator=gen).tolist(),
            f"block size {build.block_size}, {torch.get_num_threads()} threads")


def measure(first_token, args: argparse.Namespace, tokens, what: str) -> None:
    """Rounds of cold / cached prompts through `first_token(prompt) -> seconds`; prints medians and the ratio."""
    first_token(tokens(args.prefix + args.suffix))  # warm-up: first calls of every graph
    cold, warm = [], []
    for _ in range(args.rounds):
        prefix = tokens(args.prefix)
        cold.append(first_token(prefix + tokens(args.suffix)))
        first_token(prefix + tokens(args.suffix))  # the prefix is cached from here on
        warm.append(first_token(prefix + tokens(args.suffix)))
    c, w = statistics.median(cold), statistics.median(warm)
    print(f"{what}, prompt {args.prefix}+{args.suffix} tokens, {args.rounds} rounds")
    print(f"TTFT cold   median {1000 * c:8.1f} ms  ({', '.join(f'{1000 * x:.1f}' for x in cold)})")
    print(f"TTFT cached median {1000 * w:8.1f} ms  ({', '.join(f'{1000 * x:.1f}' for x in warm)})")
    print(f"cold / cached: {c / w:.2f}x (cached prefix: faster)" if w < c else
          f"cold / cached: {c / w:.2f}x (cached prefix: not faster)")


if __name__ == "__main__":
    main()
