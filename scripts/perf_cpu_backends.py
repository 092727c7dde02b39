"""Batch-1 decode step of a SmolLM2-135M-shaped model (random bf16 weights) through several CPU graph variants.

Prints ms/token and tokens/s per variant and the speed-up over eager, all measured in the same run with the
variants interleaved (the machine is shared; compare ratios, not absolute numbers across runs).

    python scripts/perf_cpu_backends.py                       # the variants at the CPU's ISA, 30 layers (~5-8 min)
    python scripts/perf_cpu_backends.py --layers 4 --variants eager,aoti-gemv

Variants
    eager             the model's forward in eager PyTorch (bf16 F.linear -> oneDNN)
    aoti-gemv         neuron_infer's CPU backend: torch.export + AOTInductor, bf16 linears on 1-8 rows call the
                      C GEMV kernel (backends/cpu/cpu_gemv.cpp: AVX512-BF16, AVX-512 or AVX2 + FMA) where the CPU has it
    aoti-gemv-avx2    the same with the kernel forced down to AVX2 (gemv_isa="avx2"; on an AVX-512 CPU: the
                      AVX2 path; timed in a run of its own, as every forced ISA level: a process runs the first
                      kernel library it loads for every graph)
    aoti-reduction    the same without the C kernel: GEMVs on 1-5 rows are Inductor-generated fp32 multiply-and-sum
                      reductions, 6-8 rows the GEMM (the path of CPUs without AVX2 + FMA)
    aoti-gemm         the same without the GEMV rewrite (every linear an extern GEMM call)
    aoti-inlined      aoti-gemv without `computed_once` fusion barriers (Inductor recomputes
                      RMSNorm/RoPE/softmax normalisation inside the reductions reading them), no fused multiply-add
    inductor-freeze   torch.compile(fullgraph) with freezing=True (oneDNN weight prepacking) and cpp_wrapper
    aoti-int8         aoti-gemv on the int8-quantized model (quant.int8): int8 linears on 1-8 rows call the
                      int8 GEMV C kernel (backends/cpu/cpu_gemv_int8.cpp)
    aoti-int8-avx2    the same with the kernel forced down to AVX2 (gemv_isa="avx2")
    aoti-int8-avx2-vnni  forced down to AVX2 with AVX-VNNI dot products (gemv_isa="avx2-vnni"; CPUs with AVX-VNNI)
    aoti-w8a8         aoti-gemv on the w8a8-quantized model (quant.smoothquant, no smoothing: random weights): w8a8
                      linears on 1-8 rows call the w8a8 GEMV C kernel (backends/cpu/cpu_gemv_w8a8.cpp: VNNI where the
                      CPU has it)
    aoti-w8a8-avx512  the same with the kernel forced down to AVX-512 without VNNI (gemv_isa="avx512")
    aoti-w8a8-avx2-vnni, aoti-w8a8-avx2  forced down to AVX-VNNI, to AVX2
    <aoti-...>-separate  any aoti variant without merging the kernel calls of linears that share an input
                      (backends/cpu/gemv_groups.py): one call per linear, 7 per layer instead of 4
    <aoti-...>-attnref   any aoti variant with attention left to the reference reductions (model/ops.py) instead of
                      the few-row attention kernel (backends/cpu/cpu_attention.cpp)

    python scripts/perf_cpu_backends.py --variants aoti-gemv,aoti-int8 --batch 4   # int8 vs bf16, batch 4

A variant may carry a shape after "@" (default: --batch rows, one token each, a cache of as many rows), so
different step shapes are compared in one process:
    @b4       4 sequences (rows of every linear: 4)
    @t5       one sequence, 5 tokens with logits at every one (a speculative verify of 4 drafts; 5 rows)
    @rows4    one sequence on a cache of 4 sequences' blocks, named by its block table (the batch-1 bucket graph of a
              batch-4 artifact)
    python scripts/perf_cpu_backends.py --variants aoti-gemv,aoti-gemv@b4,aoti-gemv@t5,aoti-gemv@rows4
    python scripts/perf_cpu_backends.py --variants aoti-gemv@b8,aoti-reduction@b8   # 8 rows: kernel vs GEMM

--clock cpu times the process's CPU time instead of wall time: on a machine where other processes compete for the
cores the time they ran is left out (with --threads 1 what remains is the step's own compute and memory stalls).

--graph-dir DIR keeps the compiled graphs in DIR and loads a variant's graph from there when it exists (same
--layers, --attend and shape: the random weights are seeded, so every run builds the same model). On a busy
machine compile each variant in its own process with --compile-only, then time them all in one process:
    for v in aoti-gemv aoti-gemv@b4; do python scripts/perf_cpu_backends.py --graph-dir G --variants $v \
        --compile-only & done; wait
    python scripts/perf_cpu_backends.py --graph-dir G --variants aoti-gemv,aoti-gemv@b4
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from neuron_infer.backends.cpu import graph as cpu
from neuron_infer.backends.cpu import kernels as cpu_gemv
from neuron_infer.backends.cpu.graph import CpuBackend, CpuCompileOptions
from neuron_infer.config import ModelConfig, QuantConfig
from neuron_infer.model import ops
from neuron_infer.model.llama import BucketStep, LlamaModel
from neuron_infer.quant import apply_quantization

VARIANTS = ("eager", "aoti-gemv", "aoti-gemv-avx2", "aoti-reduction", "aoti-gemm", "aoti-inlined", "inductor-freeze",
            "aoti-int8", "aoti-int8-avx2-vnni", "aoti-int8-avx2", "aoti-w8a8", "aoti-w8a8-avx512",
            "aoti-w8a8-avx2-vnni", "aoti-w8a8-avx2")


def smollm2_config(layers: int) -> ModelConfig:
    return ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=layers, num_heads=9,
                       num_kv_heads=3, head_dim=64, rope_theta=100000.0, tie_word_embeddings=True)


def build_model(layers: int) -> LlamaModel:
    torch.manual_seed(0)
    model = LlamaModel(smollm2_config(layers)).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    return model


def parse_shape(shape: str, batch: int) -> tuple[int, int, int, bool]:
    """"" | "b4" | "t5" | "rows4" -> (sequences, tokens per sequence, cache rows, rows beyond the batch's)."""
    if not shape:
        return batch, 1, batch, False
    for prefix, make in (("rows", lambda n: (1, 1, n, True)), ("b", lambda n: (n, 1, n, False)),
                         ("t", lambda n: (1, n, 1, False))):
        if shape.startswith(prefix) and shape[len(prefix):].isdigit() and int(shape[len(prefix):]) >= 1:
            return make(int(shape[len(prefix):]))
    raise SystemExit(f"unknown shape @{shape}: use @b<N>, @t<N> or @rows<N>")


def build(model: LlamaModel, attend: int, shape: tuple[int, int, int, bool]) -> tuple[BucketStep, tuple]:
    batch, tokens, rows, select = shape
    cfg = model.cfg
    # [L, N, Hkv, bs=S, D]: export leaves N dynamic from 2 blocks up, so a 1-row shape gets a spare block
    # (never named by the table, never read)
    cache = (cfg.num_layers, max(rows, 2), cfg.num_kv_heads, attend, cfg.head_dim)
    k, v = torch.zeros(cache, dtype=torch.bfloat16), torch.zeros(cache, dtype=torch.bfloat16)
    pos = attend // 2  # attend over half the bucket, as a decode in the middle of it does
    positions = (pos + torch.arange(tokens)).expand(batch, tokens).contiguous()  # [B, T]
    idx = torch.arange(tokens).expand(batch, tokens).contiguous()  # [B, T]: logits at every token
    first = rows - batch if select else 0  # @rows: the last blocks
    table = torch.arange(first, first + batch).view(batch, 1)  # [B, 1]: one block of S slots per sequence
    args = (torch.full((batch, tokens), 17), positions, k, v, idx, table)
    return BucketStep(model, attend), args


@contextlib.contextmanager
def separate_calls():
    """Compile without merging the GEMV calls that share an input (one kernel call per linear)."""
    saved = cpu.group_gemvs
    cpu.group_gemvs = lambda gm: 0
    try:
        yield
    finally:
        cpu.group_gemvs = saved


@contextlib.contextmanager
def reference_attention():
    """Compile with attention as model/ops.py's reductions (the attention kernel declines every operand)."""
    saved = cpu_gemv.attention_fits
    cpu_gemv.attention_fits = lambda *args: False
    try:
        yield
    finally:
        cpu_gemv.attention_fits = saved


@contextlib.contextmanager
def inlined_producers():
    """Compile without fusion barriers and without -ffp-contract=fast."""
    saved = cpu.computed_once, ops.computed_once, cpu.INDUCTOR_CONFIGS
    cpu.computed_once = ops.computed_once = lambda t: t
    cpu.INDUCTOR_CONFIGS = {"aot_inductor.package_constants_in_so": False}
    try:
        yield
    finally:
        cpu.computed_once, ops.computed_once, cpu.INDUCTOR_CONFIGS = saved


def prepare(variant: str, step: BucketStep, args: tuple, workdir: Path, graph: str | None = None):
    """-> (callable, compile seconds, load seconds); `graph`: the compiled graph's file name (default: variant).
    A graph already in workdir is loaded, not compiled again (0 compile seconds)."""
    graph = graph or variant
    cached = variant.startswith("aoti") and (workdir / f"{graph}.json").is_file()
    with mock_compile(workdir, graph) if cached else contextlib.nullcontext():
        return _prepare(variant, step, args, workdir, graph)


def _prepare(variant: str, step: BucketStep, args: tuple, workdir: Path, graph: str):
    if variant.startswith("aoti") and variant.endswith("-separate"):
        with separate_calls():
            return _prepare(variant.removesuffix("-separate"), step, args, workdir, graph)
    if variant.startswith("aoti") and variant.endswith("-attnref"):
        with reference_attention():
            return _prepare(variant.removesuffix("-attnref"), step, args, workdir, graph)
    if variant == "eager":
        return step, 0.0, 0.0
    if variant.startswith(("aoti-int8", "aoti-w8a8")):
        model = copy.deepcopy(step.model)
        apply_quantization(model, QuantConfig(scheme=variant.split("-")[1]))
        step = BucketStep(model, step.attend_len)
        be = CpuBackend(CpuCompileOptions(gemv_isa=forced_isa(variant)))
        t0 = time.perf_counter()
        with torch.inference_mode():
            be.compile_graph(step, args, workdir, graph)
        t1 = time.perf_counter()
        return be.load_graph(workdir, graph, step), t1 - t0, time.perf_counter() - t1
    if variant.startswith("aoti"):
        kernel = variant.startswith("aoti-gemv")
        be = CpuBackend(CpuCompileOptions(gemv_max_rows=0 if variant == "aoti-gemm" else 5, gemv_kernel=kernel,
                                          gemv_isa=forced_isa(variant)))
        codegen = inlined_producers() if variant == "aoti-inlined" else contextlib.nullcontext()
        t0 = time.perf_counter()
        with torch.inference_mode(), codegen:
            be.compile_graph(step, args, workdir, graph)
        t1 = time.perf_counter()
        fn = be.load_graph(workdir, graph, step)
        return fn, t1 - t0, time.perf_counter() - t1
    if variant == "inductor-freeze":
        import torch._inductor.config as inductor_config

        torch._dynamo.reset()
        t0 = time.perf_counter()
        with inductor_config.patch(freezing=True, cpp_wrapper=True), torch.no_grad():
            fn = torch.compile(step, fullgraph=True)
            fn(*args)
        return fn, time.perf_counter() - t0, 0.0
    raise SystemExit(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")


@contextlib.contextmanager
def mock_compile(workdir: Path, graph: str):
    """While active, CpuBackend.compile_graph of `graph` into `workdir` does nothing (the graph is there)."""
    real = CpuBackend.compile_graph

    def reuse(self, module, example_args, out_dir, graph_name):
        if Path(out_dir) == workdir and graph_name == graph:
            return {}
        return real(self, module, example_args, out_dir, graph_name)

    CpuBackend.compile_graph = reuse
    try:
        yield
    finally:
        CpuBackend.compile_graph = real


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def measure(fns: dict, calls: dict, rounds: int, steps: int, clock: str = "wall") -> dict[str, list[float]]:
    """Interleaved timing: each round runs `steps` decode steps of every variant; returns ms/step per round.
    clock "cpu": this process's CPU time (all its threads), which leaves out the time other processes ran instead."""
    now = CLOCKS[clock]
    out = {name: [] for name in fns}
    with torch.inference_mode():
        for name, fn in fns.items():
            for _ in range(3):
                fn(*calls[name])
        for _ in range(rounds):
            for name, fn in fns.items():
                args = calls[name]
                t0 = now()
                for _ in range(steps):
                    fn(*args)
                out[name].append((now() - t0) / steps * 1e3)
    return out


def kernel_isa(variant: str) -> str | None:
    """The ISA level a variant's GEMV kernels are forced to ("auto": the CPU's best; None: no C kernel)."""
    name = variant.partition("@")[0].removesuffix("-attnref").removesuffix("-separate")
    if not name.startswith(("aoti-gemv", "aoti-int8", "aoti-w8a8")):
        return None
    return forced_isa(name)


def forced_isa(name: str) -> str:
    """The ISA level a variant name ends with ("aoti-int8-avx2-vnni": avx2-vnni), else "auto"."""
    return next((isa for isa in ("avx2-vnni", "avx512", "avx2") if name.endswith(f"-{isa}")), "auto")


def check_one_isa(variants: list[str], compile_only: bool) -> None:
    """Kernel libraries of every ISA level export the same C symbols and the first one loaded serves every graph of
    the process (backends/cpu/kernels.py), so timing two levels in one run would time one level twice."""
    levels = {kernel_isa(v) for v in variants} - {None}
    if len(levels) > 1 and not compile_only:
        raise SystemExit(f"error: {', '.join(variants)} call GEMV kernels built for different ISA levels "
                         f"({', '.join(sorted(levels))}); one process would run the first one loaded for all of them: "
                         "time each level in its own run")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default=",".join(v for v in VARIANTS if kernel_isa(v) in (None, "auto")))
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--attend", type=int, default=512, help="token-generation bucket (cache slots attended)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1, help="sequences per decode step (rows of every linear)")
    ap.add_argument("--graph-dir", default=None, help="keep compiled graphs here and reuse them (see above)")
    ap.add_argument("--compile-only", action="store_true", help="compile (into --graph-dir) and exit")
    ap.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                    help="wall time, or the process's CPU time (robust to other processes on a busy machine; with "
                         "--threads 1 it is the step's own compute and memory time)")
    a = ap.parse_args()
    if a.compile_only and not a.graph_dir:
        ap.error("--compile-only needs --graph-dir")
    check_one_isa(a.variants.split(","), a.compile_only)
    torch.set_num_threads(a.threads)
    model = build_model(a.layers)
    fns, info, calls = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(a.graph_dir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for spec in a.variants.split(","):
            name, _, shape = spec.partition("@")
            step, args = build(model, a.attend, parse_shape(shape, a.batch))
            with torch.inference_mode():
                ref = step(*[x.clone() for x in args])
            graph = f"{spec.replace('@', '_')}_L{a.layers}_S{a.attend}_B{a.batch}"
            fns[spec], c, ld = prepare(name, step, args, workdir, graph=graph)
            with torch.inference_mode():
                diff = (fns[spec](*[x.clone() for x in args]).float() - ref.float()).abs().max().item()
            info[spec], calls[spec] = (c, ld, diff), args
            print(f"prepared {spec}: compile {c:.1f} s, load {ld:.2f} s, max |logit diff| vs eager {diff:.3g}",
                  flush=True)
        if a.compile_only:
            return
        res = measure(fns, calls, a.rounds, a.steps, a.clock)
    base = statistics.median(res["eager"]) if "eager" in res else None
    first = next(iter(res))
    print(f"\nSmolLM2-135M shape, {a.layers} layers, bf16 activations, batch {a.batch}, attend {a.attend}, "
          f"{a.threads} threads, "
          f"{a.rounds} interleaved rounds x {a.steps} steps, {a.clock} clock")
    print(f"time vs {first}: median over rounds of (variant ms / {first} ms) in the same round; lower is faster")
    print(f"{'variant':20s} {'median ms':>10s} {'min ms':>8s} {'tok/s':>7s} {'vs eager':>9s} {'time vs first':>14s} "
          f"{'compile s':>10s} {'load s':>7s}")
    for name, ts in res.items():
        md = statistics.median(ts)
        ratio = f"x{base / md:.2f}" if base else "-"
        rel = statistics.median(x / y for x, y in zip(ts, res[first]))
        c, ld, _ = info[name]
        print(f"{name:20s} {md:10.2f} {min(ts):8.2f} {1e3 / md:7.1f} {ratio:>9s} {rel:13.2f}x {c:10.1f} {ld:7.2f}")


if __name__ == "__main__":
    main()
