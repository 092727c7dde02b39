#!/usr/bin/env python
"""Batch-1 decode benchmark: neuron-infer (CPU graphs) vs Hugging Face eager (and llama.cpp when installed).

Everything runs in this one process/session, interleaved round by round, because this shared machine moves
10-25% between runs; compare the ratios, not the absolute numbers. Prints a Markdown table.

    python scripts/bench_decode.py                       # embedded SmolLM2-135M, bf16, 128 new tokens
    python scripts/bench_decode.py --rounds 5 --no-llamacpp

Measured: decode tokens/s over N new tokens (after the first), TTFT for 32- and 512-token prompts, and
memory-bandwidth utilisation = weight bytes read per token / time per token / read bandwidth measured here.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def read_bandwidth_gbs(repeats: int = 7, mib: int = 1024) -> float:
    """Median read bandwidth of a large fp32 sum (GB/s) with the current torch thread count."""
    x = torch.ones(mib * 1024 * 1024 // 4)
    x.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times) / 1e9


def prompt_ids(tokenizer, n: int) -> list[int]:
    text = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * (n // 8 + 4))
    return tokenizer(text)["input_ids"][:n]


class NeuronInfer:
    name = "neuron-infer"

    def __init__(self, model_dir: Path, dtype: str, backend: str | None, artifacts: Path | None):
        from neuron_infer.api import CompiledModel, compile_model
        from neuron_infer.presets import load_preset

        self.compile_s = None
        out = artifacts
        if out is None:
            build = load_preset("smollm2-cpu", {"dtype": dtype}).build
            out = Path(tempfile.mkdtemp(prefix="bench-ni-")) / "art"
            t0 = time.perf_counter()
            compile_model(model_dir, out, build, backend=backend, say=lambda m: None)
            self.compile_s = time.perf_counter() - t0
        self.m = CompiledModel.load(out, expect_checkpoint=model_dir)
        if self.m.manifest.build.dtype != dtype:
            sys.exit(f"--artifacts {out} was compiled for {self.m.manifest.build.dtype}, not --dtype {dtype}")
        self.weight_bytes = (out / "weights" / "rank0.safetensors").stat().st_size

    def ttft(self, ids: list[int]) -> float:
        t0 = time.perf_counter()
        self.m.generate_ids([ids], 1, ignore_eos=True)
        return time.perf_counter() - t0

    def decode_tps(self, ids: list[int], n: int) -> float:
        out = self.m.generate_ids([ids], n, ignore_eos=True)
        steps = out.metrics[0].token_latencies_s
        return len(steps) / sum(steps)


class HFEager:
    name = "HF transformers eager"

    def __init__(self, model_dir: Path, dtype: str):
        from transformers import LlamaForCausalLM

        dt = torch.bfloat16 if dtype == "bf16" else torch.float32
        self.m = LlamaForCausalLM.from_pretrained(model_dir, dtype=dt).eval()

    def _gen(self, ids: list[int], n: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.m.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
        return time.perf_counter() - t0

    def ttft(self, ids: list[int]) -> float:
        return self._gen(ids, 1)

    def decode_tps(self, ids: list[int], n: int) -> float:
        return (n - 1) / (self._gen(ids, n) - self._gen(ids, 1))


class LlamaCpp:
    def __init__(self, gguf: Path, label: str):
        from llama_cpp import Llama

        self.name = f"llama.cpp {label}"
        self.m = Llama(model_path=str(gguf), n_ctx=1024, n_threads=torch.get_num_threads(), verbose=False)

    def _gen(self, ids: list[int], n: int) -> float:
        self.m.reset()
        t0 = time.perf_counter()
        for i, _ in enumerate(self.m.generate(ids, top_k=1, reset=True)):
            if i + 1 >= n:
                break
        return time.perf_counter() - t0

    def ttft(self, ids: list[int]) -> float:
        return self._gen(ids, 1)

    def decode_tps(self, ids: list[int], n: int) -> float:
        return (n - 1) / (self._gen(ids, n) - self._gen(ids, 1))


def llamacpp_f16(src: Path) -> Path | None:
    """llama.cpp's F16 file made from the shipped Q4_1 GGUF (dequantize + requantize to F16: same values)."""
    import llama_cpp

    out = Path(tempfile.gettempdir()) / "neuron-infer-bench-smollm2-f16.gguf"
    if not out.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_F16
        params.allow_requantize = True
        if llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params) != 0:
            return None
    return out


def build_runners(args, model_dir: Path) -> list:
    artifacts = Path(args.artifacts) if args.artifacts else None
    runners = [NeuronInfer(model_dir, args.dtype, args.backend, artifacts), HFEager(model_dir, args.dtype)]
    if not args.no_llamacpp:
        try:
            from neuron_infer.embedded import find_gguf

            gguf = find_gguf()
            f16 = llamacpp_f16(gguf)
            if f16:
                runners.append(LlamaCpp(f16, "F16"))
            runners.append(LlamaCpp(gguf, "Q4_1 (shipped file)"))
        except ImportError:
            print("llama-cpp-python not installed: skipping the llama.cpp peer", file=sys.stderr)
    return runners


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=None, help="HF checkpoint (default: the embedded SmolLM2)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--backend", default=None, help="neuron-infer backend override (default: the cpu backend)")
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--artifacts", default=None,
                    help="reuse this compiled artifact dir (e.g. from `neuron-infer compile --config smollm2-cpu`)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from neuron_infer.embedded import default_model_dir

    model_dir = Path(args.model_dir) if args.model_dir else default_model_dir()
    runners = build_runners(args, model_dir)
    tok = runners[0].m.tokenizer
    p32, p512 = prompt_ids(tok, 32), prompt_ids(tok, 512)
    res = {r.name: {"tps": [], "ttft32": [], "ttft512": []} for r in runners}
    bw = []
    for rnd in range(args.rounds + 1):  # round 0 is warm-up, not recorded
        bw.append(read_bandwidth_gbs())
        for r in runners:
            tps, t32, t512 = r.decode_tps(p32, args.new_tokens), r.ttft(p32), r.ttft(p512)
            if rnd:
                res[r.name]["tps"].append(tps), res[r.name]["ttft32"].append(t32), res[r.name]["ttft512"].append(t512)
    report(args, runners, res, statistics.median(bw[1:]))


def report(args, runners, res, bw_gbs: float) -> None:
    ni = runners[0]
    med = {k: {m: statistics.median(v[m]) for m in v} for k, v in res.items()}
    base = med["HF transformers eager"]["tps"]
    print(f"\nSmolLM2-135M {args.dtype}, batch 1, {args.new_tokens} new tokens, {args.threads} threads, "
          f"median of {args.rounds} interleaved rounds; read bandwidth {bw_gbs:.1f} GB/s; neuron-infer weights "
          f"{ni.weight_bytes / 1e6:.0f} MB, " + (f"compile {ni.compile_s:.0f} s\n" if ni.compile_s else "reused artifacts\n"))
    print("| runtime | decode tok/s | vs HF eager | vs neuron-infer | TTFT 32 tok (ms) | TTFT 512 tok (ms) | MBU |")
    print("|---|---|---|---|---|---|---|")
    for r in runners:
        m = med[r.name]
        mbu = f"{ni.weight_bytes * m['tps'] / (bw_gbs * 1e9):.0%}" if r is ni else ""
        print(f"| {r.name} | {m['tps']:.1f} | {m['tps'] / base:.2f}x | {m['tps'] / med[ni.name]['tps']:.2f}x | "
              f"{m['ttft32'] * 1000:.0f} | {m['ttft512'] * 1000:.0f} | {mbu} |")


if __name__ == "__main__":
    main()
