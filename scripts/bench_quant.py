#!/usr/bin/env python
"""Batch-1 decode tokens/s and weight bytes per quantization scheme vs bf16 on CPU, in one run (interleaved rounds).

Each case is the embedded SmolLM2-135M compiled with `neuron_infer.compile.builder.compile_model` using the build
of a preset (default `smollm2-cpu`: AOTInductor graphs, context buckets 128/512, token-generation buckets
256/1024) with `quant.scheme` (and `quant.modules_to_not_convert`) overridden. Artifacts are compiled once into
`--cache-dir` and reused: the directory name hashes the build, the package versions, the checkpoint fingerprint
and the source of the code that shapes a CPU graph (SOURCE_FILES), so an edited forward
recompiles and an unchanged one does not. `--compile-only` fills the cache and exits (one scheme at a time, so a
shared machine is not swamped).

Timing: `CompiledModel.generate_ids([prompt], N, ignore_eos=True)`; decode tokens/s = decode steps / their summed
latency (runtime Metrics; the first token, i.e. prefill, excluded). One round runs every case once; rounds
interleave the cases (a shared machine drifts 10-25% between minutes), the table reports the median over rounds
and the median over rounds of (case tok/s / bf16 tok/s of the same round).

Memory: from each artifact's manifest, `extra.quant.bytes_after` (bytes of every linear layer: payload, scales,
bias) and the size of the weights file (everything, including the bf16 embedding SmolLM2 ties its head to).

    python scripts/bench_quant.py --compile-only --cases int8        # fill the cache, one case
    python scripts/bench_quant.py                                    # bf16 + int8,fp8,w8a8,mxfp8,mxfp4
    python scripts/bench_quant.py --cases int8,fp8-all --rounds 7 --new-tokens 96
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = "The quick brown fox jumps over the lazy dog near the river bank, and then"
# case name -> (quant scheme, modules_to_not_convert; None = the scheme's default, i.e. the AWS recipe for fp8)
CASES = {
    "bf16": ("none", None),
    "int8": ("int8", None),
    "fp8": ("fp8", None),
    "fp8-all": ("fp8", ()),
    "w8a8": ("w8a8", None),
    "mxfp8": ("mxfp8", None),
    "mxfp4": ("mxfp4", None),
}
# the code that decides what a CPU graph computes (not the Neuron/NKI files, which other work edits often)
SOURCE_FILES = ("neuron_infer/model/llama.py", "neuron_infer/model/ops.py", "neuron_infer/backends/cpu/graph.py",
                "neuron_infer/compile/builder.py", "neuron_infer/compile/quantize_step.py", "neuron_infer/quant/*.py")


def source_hash(scheme: str) -> str:
    """sha256 over the code that decides what a compiled graph computes (the quant modules only when quantized)."""
    h = hashlib.sha256()
    for pattern in SOURCE_FILES:
        if scheme == "none" and pattern.startswith("neuron_infer/quant/"):
            continue
        for p in sorted(ROOT.glob(pattern)):
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def import_graph_code() -> dict[str, str]:
    """Import the graph code now and return the source hashes it was imported at (compile_case re-checks them),
    so an artifact's cache key always describes the code that compiled it, even if files change during the run."""
    import neuron_infer.backends.cpu.graph
    import neuron_infer.compile.builder
    import neuron_infer.compile.quantize_step
    import neuron_infer.model.llama
    import neuron_infer.model.ops
    import neuron_infer.quant.fp8
    import neuron_infer.quant.int8
    import neuron_infer.quant.mx
    import neuron_infer.quant.smoothquant
    import neuron_infer.quant.tiled  # noqa: F401  (imported for the side effect: the code is now fixed in memory)

    return {scheme: source_hash(scheme) for scheme in {s for s, _ in CASES.values()}}


def case_build(preset: str, case: str):
    from neuron_infer.presets import load_preset

    scheme, keep = CASES[case]
    overrides = {"quant.scheme": scheme}
    if keep is not None:
        overrides["quant.modules_to_not_convert"] = list(keep)
    return load_preset(preset, overrides).build


def artifact_dir(cache: Path, preset: str, case: str, model_dir: Path, sources: dict[str, str]) -> Path:
    from neuron_infer.artifact.manifest import package_versions
    from neuron_infer.checkpoint import checkpoint_fingerprint

    build = case_build(preset, case)
    key = json.dumps({"build": build.to_dict(), "versions": package_versions(), "source": sources[CASES[case][0]],
                      "fp": checkpoint_fingerprint(model_dir)}, sort_keys=True)
    return cache / f"{case}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def ensure_compiled(cache: Path, preset: str, case: str, model_dir: Path, sources: dict[str, str]) -> Path:
    """The case's artifact directory, compiled now if the cache does not hold it."""
    from neuron_infer.artifact.manifest import read_manifest
    from neuron_infer.compile.builder import compile_model
    from neuron_infer.errors import ArtifactError

    out = artifact_dir(cache, preset, case, model_dir, sources)
    try:
        read_manifest(out, verify_files=False)
        return out
    except ArtifactError:
        pass
    t0 = time.perf_counter()
    print(f"{case}: compiling into {out}", file=sys.stderr, flush=True)
    compile_model(model_dir, out, case_build(preset, case), overwrite=True, say=lambda m: None)
    scheme = CASES[case][0]
    if source_hash(scheme) != sources[scheme]:
        shutil.rmtree(out)
        raise RuntimeError("the graph code changed on disk during the run (this process imported the old version); "
                           "rerun so the cache key matches the compiled code")
    print(f"{case}: compiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return out


def decode_tps(m, ids: list[int], n: int) -> float:
    steps = m.generate_ids([ids], n, ignore_eos=True).metrics[0].token_latencies_s
    return len(steps) / sum(steps)


def memory_row(root: Path) -> dict:
    from neuron_infer.artifact.manifest import read_manifest

    man = read_manifest(root, verify_files=False)
    q = man.extra.quant
    return {"linear_bytes": q["bytes_after"], "file_bytes": (root / "weights" / "rank0.safetensors").stat().st_size,
            "converted": len(q["converted"]), "kept": len(q["kept"]), "compile_s": man.extra.compile_seconds}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="int8,fp8,w8a8,mxfp8,mxfp4",
                    help=f"comma-separated, from {', '.join(CASES)}; bf16 always runs (with --compile-only: if listed)")
    ap.add_argument("--preset", default="smollm2-cpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "neuron-infer" / "bench-quant")
    ap.add_argument("--compile-only", action="store_true", help="compile the missing artifacts, then exit")
    args = ap.parse_args()
    cases = [c for c in args.cases.split(",") if c and c != "bf16"]
    if not args.compile_only or "bf16" in args.cases.split(","):
        cases.insert(0, "bf16")  # the baseline of every speed ratio
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    args.case_list = cases
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    from neuron_infer.api import CompiledModel
    from neuron_infer.embedded import default_model_dir

    model_dir = default_model_dir()
    sources = import_graph_code()
    roots, errors = {}, {}
    for c in args.case_list:
        try:
            roots[c] = ensure_compiled(args.cache_dir, args.preset, c, model_dir, sources)
        except Exception as e:  # noqa: BLE001  (reported in the table; the other cases still run)
            errors[c] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            print(f"{c}: FAILED {errors[c]}", file=sys.stderr, flush=True)
    if args.compile_only:
        return
    if "bf16" not in roots:
        raise SystemExit(f"the bf16 baseline did not compile: {errors.get('bf16')}")
    models = {c: CompiledModel.load(r) for c, r in roots.items()}
    ids = list(models["bf16"].tokenizer(PROMPT)["input_ids"])
    for m in models.values():
        decode_tps(m, ids, 8)  # warm-up (first calls page the graphs and weights in)
    tps: dict[str, list[float]] = {c: [] for c in models}
    for r in range(args.rounds):
        for c, m in models.items():
            tps[c].append(decode_tps(m, ids, args.new_tokens))
        print(f"round {r + 1}: " + ", ".join(f"{c} {v[-1]:.1f}" for c, v in tps.items()), file=sys.stderr, flush=True)
    print(render({c: memory_row(r) for c, r in roots.items()}, tps, errors, args, len(ids)))


def render(mem: dict, tps: dict, errors: dict, args, prompt_len: int) -> str:
    base = mem["bf16"]
    title = (f"SmolLM2-135M-Instruct, preset {args.preset} (AOTInductor graphs), batch 1, bf16 activations, "
             f"{args.threads} threads, prompt {prompt_len} tokens + {args.new_tokens} new, median of {args.rounds} "
             f"interleaved rounds (torch {torch.__version__}). Generated by scripts/bench_quant.py.")
    header = ("| case | linear weight bytes | vs bf16 | weights file | vs bf16 | decode tok/s (median) | per round "
              "| speed-up vs bf16 |")
    lines = [title, "", header, "|---|---|---|---|---|---|---|---|"]
    for c, v in tps.items():
        m = mem[c]
        ratios = [a / b for a, b in zip(v, tps["bf16"])]
        lines.append(f"| {c} | {m['linear_bytes'] / 1e6:.1f} MB | {base['linear_bytes'] / m['linear_bytes']:.2f}x "
                     f"| {m['file_bytes'] / 1e6:.1f} MB | {base['file_bytes'] / m['file_bytes']:.2f}x "
                     f"| {statistics.median(v):.1f} | {' '.join(f'{x:.1f}' for x in v)} "
                     f"| {statistics.median(ratios):.2f}x |")
    for c, e in errors.items():
        lines.append(f"| {c} | - | - | - | - | compile failed: {e} | | |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
