#!/usr/bin/env python
"""Quality of each quantization scheme on the embedded SmolLM2-135M against its bf16 baseline.

Every scheme is compiled with `neuron_infer.api.compile_model` (backend "cpu-eager": the artifact's weights and
manifest are exactly what `neuron-infer compile` writes, but graphs run eagerly, because the compiled CPU graphs
add minutes of compile per scheme and the FP8/MX emulation gains nothing from them). Then, from the artifact:

* perplexity, mean next-token KL(bf16 || scheme) and top-1 agreement on NWIN fixed windows of WIN tokens of
  English text every CPython ships (`pydoc_data.topics`, topics sorted by name, windows taken from the *end* of the
  text: SmoothQuant calibration (compile/quantize_step.py) reads the *beginning*, so the two never overlap);
  logits come from the artifact's model (weights loaded the way CompiledModel.load loads them) over each window;
* greedy agreement length: `CompiledModel.generate_ids(..., ignore_eos=True)` for a fixed prompt set, number of
  leading generated tokens equal to the bf16 artifact's;
* linear weight bytes from the artifact manifest (extra["quant"]["bytes_after"]) and the whole weights file, with
  compression vs bf16.

    python scripts/quant_quality.py                              # all schemes, Markdown table to stdout
    python scripts/quant_quality.py --out docs/quant_quality.md --schemes int8,fp8
    python scripts/quant_quality.py --schemes mxfp4     # computes one case; a later run with every case reuses it

Per-case results are kept in --cache-dir (keyed by the evaluation settings and the source of the code computing the
logits), so a long table can be built one case at a time on a busy machine and rendered at the end.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# the code that decides a case's logits (a change invalidates the cached rows in --cache-dir)
SOURCE_FILES = ("neuron_infer/model/llama.py", "neuron_infer/model/ops.py", "neuron_infer/compile/builder.py",
                "neuron_infer/compile/quantize_step.py", "neuron_infer/quant/*.py")

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Photosynthesis is the process",
           "In 1492, Columbus", "To install the package, run")
# name -> (scheme, modules_to_not_convert; None = the scheme's default, i.e. the AWS recipe for fp8)
CASES = {
    "bf16": ("none", None),
    "int8": ("int8", None),
    "fp8 (AWS recipe)": ("fp8", None),
    "fp8 (all linears)": ("fp8", ()),
    "mxfp8": ("mxfp8", None),
    "mxfp4": ("mxfp4", None),
    # SmolLM2-135M has 30 decoder layers: the fp8 recipe's kept modules, written out for another scheme
    "mxfp4 (AWS recipe)": ("mxfp4", ("lm_head", "model.layers.0.mlp", "model.layers.29.mlp",
                                     "model.layers.*.self_attn")),
    "w8a8 (SmoothQuant a=0.5)": ("w8a8", None),
}


def eval_windows(tokenizer, n: int, width: int) -> list[torch.Tensor]:
    from neuron_infer.compile.quantize_step import calibration_text

    ids = tokenizer(calibration_text())["input_ids"]
    if len(ids) < n * width:
        raise SystemExit(f"pydoc text has {len(ids)} tokens; lower --windows/--window")
    return [torch.tensor(ids[len(ids) - (i + 1) * width: len(ids) - i * width]) for i in range(n)]  # from the end


def artifact_model(root: Path):
    """The artifact's LlamaModel, loaded the way CompiledModel.load does (structure, then strict weights)."""
    from neuron_infer.artifact.manifest import read_manifest
    from neuron_infer.artifact.weights import empty_model, load_rank_weights, quant_structure

    man = read_manifest(root)
    model = empty_model(man.model, man.build)
    quant_structure(model, man.build)
    load_rank_weights(model, root / "weights" / "rank0.safetensors")
    return model, man


@torch.inference_mode()
def window_logits(model, windows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Next-token logits [W-1, V] fp32 of each window, one full-window forward each."""
    cfg, lay = model.cfg, model.layout
    out = []
    for w in windows:
        t = w.numel()
        dtype = model.model.embed_tokens.weight.dtype
        k = torch.zeros(cfg.num_layers, 1, lay.num_kv_heads, t, cfg.head_dim, dtype=dtype)  # [L, 1, Hkv, T, D]: 1 block
        pos = torch.arange(t).view(1, t)  # [1, T]
        table = torch.zeros(1, 1, dtype=torch.int64)  # [1, 1]: the one block
        logits = model(w.view(1, t), pos, k, torch.zeros_like(k), pos[:, :-1], t, table)  # [1, T-1, V]
        out.append(logits[0].float())
    return out


def metrics(lg: list[torch.Tensor], ref: list[torch.Tensor], windows: list[torch.Tensor]) -> tuple[float, ...]:
    n = sum(w.numel() - 1 for w in windows)
    nll = sum(F.cross_entropy(x, w[1:], reduction="sum").item() for x, w in zip(lg, windows)) / n
    kl = sum(F.kl_div(x.log_softmax(-1), r.log_softmax(-1), log_target=True, reduction="sum").item()
             for x, r in zip(lg, ref)) / n  # KL(ref || x) per token
    top1 = sum((x.argmax(-1) == r.argmax(-1)).sum().item() for x, r in zip(lg, ref)) / n
    return math.exp(nll), kl, top1


def agree_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def run_case(model_dir: Path, root: Path, scheme: str, ntc, windows, prompts: list[list[int]], new_tokens: int):
    from neuron_infer.api import CompiledModel, compile_model
    from neuron_infer.config import BuildConfig, QuantConfig

    ctx = max(64, max(len(p) for p in prompts))
    total = max(ctx + new_tokens, max(w.numel() for w in windows))  # RoPE tables must cover a whole window
    build = BuildConfig(dtype="bf16", max_context_length=ctx, max_length=total, context_buckets=(ctx,),
                        tokengen_buckets=(total,), quant=QuantConfig(scheme=scheme, modules_to_not_convert=ntc))
    t0 = time.perf_counter()
    compile_model(model_dir, root, build, backend="cpu-eager", say=lambda m: None)
    model, man = artifact_model(root)
    logits = window_logits(model, windows)
    del model
    gen = CompiledModel.load(root).generate_ids(prompts, new_tokens, ignore_eos=True)
    q = man.extra.quant
    return {"logits": logits, "greedy": [o.token_ids for o in gen.outputs], "linear_bytes": q["bytes_after"],
            "file_bytes": (root / "weights" / "rank0.safetensors").stat().st_size,
            "seconds": time.perf_counter() - t0}


def case_key(name: str, args) -> str:
    """Cache key of one case: the evaluation settings and the source of the code that computes its logits."""
    h = hashlib.sha256(json.dumps([name, CASES[name], args.windows, args.window, args.new_tokens]).encode())
    for pattern in SOURCE_FILES:
        for p in sorted(ROOT.glob(pattern)):
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def cached_case(name: str, args, model_dir: Path, windows, prompts, base: dict | None) -> dict:
    """One case's row (metrics vs bf16, greedy tokens, bytes), from --cache-dir or computed and stored there.

    The bf16 case also keeps its window logits (the reference every other case is scored against)."""
    stem = args.cache_dir / f"{name.split(' ')[0]}-{case_key(name, args)}"
    if stem.with_suffix(".json").is_file() and (base is not None or stem.with_suffix(".pt").is_file()):
        row = json.loads(stem.with_suffix(".json").read_text())
        if base is None:
            row["logits"] = torch.load(stem.with_suffix(".pt"))
        return row
    with tempfile.TemporaryDirectory(prefix="quant-quality-") as tmp:
        r = run_case(model_dir, Path(tmp) / "a", *CASES[name], windows, prompts, args.new_tokens)
    ref = r["logits"] if base is None else base["logits"]
    ppl, kl, top1 = metrics(r["logits"], ref, windows)
    row = {"ppl": ppl, "kl": kl, "top1": top1, "greedy": r["greedy"], "linear_bytes": r["linear_bytes"],
           "file_bytes": r["file_bytes"], "seconds": r["seconds"]}
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(row))
    if base is None:
        torch.save(r["logits"], stem.with_suffix(".pt"))
        row["logits"] = r["logits"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--schemes", default=",".join(CASES), help="comma-separated case names (bf16 always runs)")
    ap.add_argument("--out", type=Path, default=None, help="write the Markdown table here (default: stdout)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "neuron-infer" / "quant-quality",
                    help="per-case results are stored here and reused while the settings and the code are unchanged")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from neuron_infer.checkpoint import load_tokenizer
    from neuron_infer.embedded import default_model_dir

    model_dir = default_model_dir()
    tok = load_tokenizer(model_dir)
    windows = eval_windows(tok, args.windows, args.window)
    prompts = [list(tok(p)["input_ids"]) for p in PROMPTS]
    names = ["bf16"] + [n for n in args.schemes.split(",") if n and n != "bf16"]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    res: dict[str, dict] = {}
    for name in names:
        res[name] = cached_case(name, args, model_dir, windows, prompts, res.get("bf16"))
        print(f"{name}: {res[name]['seconds']:.0f} s\n{render(res, windows, args)}", file=sys.stderr, flush=True)
    table = render(res, windows, args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table)
    print(table)


def render(res: dict, windows, args) -> str:
    base = res["bf16"]
    ppl0 = base["ppl"]
    title = (f"SmolLM2-135M-Instruct, {len(windows)} windows x {args.window} tokens of pydoc_data text; greedy "
             f"agreement over {args.new_tokens} tokens for {len(PROMPTS)} prompts; artifacts compiled with "
             "neuron_infer.api.compile_model (backend cpu-eager, dtype bf16). Generated by scripts/quant_quality.py.")
    header = ("| scheme | linear weight bytes | compression (linears) | weights file | ppl | Δ ppl | mean KL | "
              "top-1 agree | greedy agree (per prompt) |")
    lines = [title, "", header,
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        ppl, kl, top1 = r["ppl"], r["kl"], r["top1"]
        agree = [agree_len(a, b) for a, b in zip(r["greedy"], base["greedy"])]
        lines.append(f"| {name} | {r['linear_bytes'] / 1e6:.1f} MB | {base['linear_bytes'] / r['linear_bytes']:.2f}x "
                     f"| {r['file_bytes'] / 1e6:.1f} MB | {ppl:.3f} | {100 * (ppl / ppl0 - 1):+.2f}% | {kl:.4f} | "
                     f"{100 * top1:.1f}% | {' '.join(map(str, agree))} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
