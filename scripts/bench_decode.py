#!/usr/bin/env python
"""Batch-1 decode benchmark: neuron-infer (CPU graphs) vs Hugging Face eager (and llama.cpp when installed).

Everything runs in this one process/session, interleaved round by round, because this shared machine moves
10-25% between runs; compare the ratios, not the absolute numbers. Prints a Markdown table.

    python scripts/bench_decode.py                       # embedded SmolLM2-135M, bf16, 128 new tokens
    python scripts/bench_decode.py --rounds 5 --no-llamacpp
    python scripts/bench_decode.py --artifacts ART_BF16 --int8-artifacts ART_INT8 --llamacpp F16,Q8_0
    python scripts/bench_decode.py --artifacts ART_BF16 --int8-artifacts ART_INT8 --w8a8-artifacts ART_W8A8

llama.cpp's files are made from the shipped Q4_1 GGUF of the embedded model with llama.cpp's own quantize API
(F16: the Q4_1 values widened; Q8_0: those values requantized to 8 bits). Their speed depends on their bytes and
formats, not on the values, so they time what llama.cpp does with an F16 or Q8_0 file of this model.

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
    def __init__(self, model_dir: Path, dtype: str, backend: str | None, artifacts: Path | None,
                 name: str = "neuron-infer", prefix_caching: bool = True):
        from neuron_infer.api import CompiledModel, compile_model
        from neuron_infer.presets import load_preset

        self.name, self.compile_s = name, None
        out = artifacts
        if out is None:
            build = load_preset("smollm2-cpu", {"dtype": dtype}).build
            out = Path(tempfile.mkdtemp(prefix="bench-ni-")) / "art"
            t0 = time.perf_counter()
            compile_model(model_dir, out, build, backend=backend, say=lambda m: None)
            self.compile_s = time.perf_counter() - t0
        self.m = CompiledModel.load(out, expect_checkpoint=model_dir, prefix_caching=prefix_caching)
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


LLAMACPP_TYPES = ("F16", "Q8_0", "Q4_1")  # Q4_1: the shipped file itself


def llamacpp_file(src: Path, kind: str) -> Path | None:
    """llama.cpp's `kind` file of the model: the shipped Q4_1 GGUF, or made from it by llama.cpp's quantize API
    (F16: the Q4_1 values widened; Q8_0: the F16 file requantized)."""
    import llama_cpp

    if kind == "Q4_1":
        return src
    out = Path(tempfile.gettempdir()) / f"neuron-infer-bench-smollm2-{kind.lower()}.gguf"
    if not out.exists():
        base = src if kind == "F16" else llamacpp_file(src, "F16")
        if base is None:
            return None
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = {"F16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16, "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}[kind]
        params.allow_requantize = True
        tmp = out.with_suffix(".tmp")
        if llama_cpp.llama_model_quantize(str(base).encode(), str(tmp).encode(), params) != 0:
            return None
        tmp.replace(out)
    return out


def build_runners(args, model_dir: Path) -> list:
    artifacts = Path(args.artifacts) if args.artifacts else None
    runners = [NeuronInfer(model_dir, args.dtype, args.backend, artifacts)]
    if args.int8_artifacts:
        runners.append(NeuronInfer(model_dir, args.dtype, args.backend, Path(args.int8_artifacts),
                                   name="neuron-infer int8"))
    if args.w8a8_artifacts:
        runners.append(NeuronInfer(model_dir, args.dtype, args.backend, Path(args.w8a8_artifacts),
                                   name="neuron-infer w8a8"))
    runners.append(HFEager(model_dir, args.dtype))
    kinds = [k for k in args.llamacpp.split(",") if k] if not args.no_llamacpp else []
    bad = [k for k in kinds if k not in LLAMACPP_TYPES]
    if bad:
        sys.exit(f"error: --llamacpp {','.join(bad)}: choose from {','.join(LLAMACPP_TYPES)}")
    if kinds:
        try:
            from neuron_infer.embedded import find_gguf

            gguf = find_gguf()
            for kind in kinds:
                path = llamacpp_file(gguf, kind)
                if path is None:
                    print(f"llama.cpp could not write its {kind} file: skipping it", file=sys.stderr)
                    continue
                runners.append(LlamaCpp(path, kind + (" (shipped file)" if kind == "Q4_1" else "")))
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
    ap.add_argument("--llamacpp", default=",".join(LLAMACPP_TYPES),
                    help=f"llama.cpp files to run, comma list from {','.join(LLAMACPP_TYPES)}")
    ap.add_argument("--int8-artifacts", default=None,
                    help="also run this artifact (e.g. compiled with --quant int8) as 'neuron-infer int8'")
    ap.add_argument("--w8a8-artifacts", default=None,
                    help="also run this artifact (compiled with --quant w8a8) as 'neuron-infer w8a8'")
    ap.add_argument("--artifacts", default=None,
                    help="reuse this compiled artifact dir (e.g. from `neuron-infer compile --config smollm2-cpu`)")
    ap.add_argument("--long-prompt", type=int, default=512,
                    help="tokens of the long TTFT prompt (0: skip it, e.g. for artifacts with shorter context buckets)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from neuron_infer.embedded import default_model_dir

    model_dir = Path(args.model_dir) if args.model_dir else default_model_dir()
    runners = build_runners(args, model_dir)
    tok = runners[0].m.tokenizer
    p32, plong = prompt_ids(tok, 32), prompt_ids(tok, args.long_prompt)
    res = {r.name: {"tps": [], "ttft32": [], "ttft512": []} for r in runners}
    bw = []
    for rnd in range(args.rounds + 1):  # round 0 is warm-up, not recorded
        bw.append(read_bandwidth_gbs())
        for r in runners:
            tps, t32 = r.decode_tps(p32, args.new_tokens), r.ttft(p32)
            tlong = r.ttft(plong) if args.long_prompt else float("nan")
            if rnd:
                res[r.name]["tps"].append(tps), res[r.name]["ttft32"].append(t32), res[r.name]["ttft512"].append(tlong)
    report(args, runners, res, bw[1:])


def per_round(a: list[float], b: list[float]) -> float:
    """Median over rounds of a / b measured in the same round (the machine drifts between rounds)."""
    return statistics.median(x / y for x, y in zip(a, b))


def report(args, runners, res, bw: list[float]) -> None:
    ni = runners[0]
    med = {k: {m: statistics.median(v[m]) for m in v} for k, v in res.items()}
    hf = res["HF transformers eager"]["tps"]
    print(f"\nSmolLM2-135M {args.dtype}, batch 1, {args.new_tokens} new tokens, {args.threads} threads, "
          f"median of {args.rounds} interleaved rounds; read bandwidth {statistics.median(bw):.1f} GB/s "
          f"(rounds: {', '.join(f'{x:.1f}' for x in bw)}); neuron-infer weights {ni.weight_bytes / 1e6:.0f} MB, "
          + (f"compile {ni.compile_s:.0f} s" if ni.compile_s else "reused artifacts"))
    print("Ratios are medians over rounds of the ratio within a round; tok/s: higher is better, TTFT: lower.\n")
    print(f"| runtime | decode tok/s | vs HF eager | vs neuron-infer | TTFT 32 tok (ms) | TTFT {args.long_prompt} tok (ms) | MBU |")
    print("|---|---|---|---|---|---|---|")
    for r in runners:
        m, tps = med[r.name], res[r.name]["tps"]
        mbu = ""
        if r is ni:  # bytes streamed per token / time per token / the probe's bandwidth, per round
            mbu = f"{statistics.median(ni.weight_bytes * t / (b * 1e9) for t, b in zip(tps, bw)):.0%}"
        print(f"| {r.name} | {m['tps']:.1f} | {per_round(tps, hf):.2f}x | {per_round(tps, res[ni.name]['tps']):.2f}x | "
              f"{m['ttft32'] * 1000:.0f} | {m['ttft512'] * 1000:.0f} | {mbu} |".replace("| nan |", "| - |"))
    names = [r.name for r in runners]
    for quant in [n for n in ("neuron-infer int8", "neuron-infer w8a8") if n in names]:
        for peer in [n for n in names if n.startswith("llama.cpp")]:
            ratio = per_round(res[quant]["tps"], res[peer]["tps"])
            print(f"{quant} vs {peer}: {ratio:.2f}x decode tok/s (per-round median; > 1: {quant} faster)")


if __name__ == "__main__":
    main()
