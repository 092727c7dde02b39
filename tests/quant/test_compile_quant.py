"""Quantization through compile -> load -> generate on tiny checkpoints (tests/tiny_checkpoint.py, preset "gqa":
hidden 96, intermediate 200, 2 layers; fp32 and bf16 files).

Criteria (declared):
* int8 / fp8 vs the float artifact (all linears converted), top-k aware: logits within a fraction of their range
  (int8 5%: per-channel error <= scale/2 ~ 0.4% of a row's max per weight; fp8 10%: 3-bit mantissa, up to 2**-4
  relative per weight, ~3.6% RMS, compounded over 2 layers and the head; measured 6.2-6.7%); the quantized
  top-1 of the prefill logits scores, in the float model, within 2 x that error of the float best. int8: same
  top-1 and >= 4 of 8 leading greedy tokens equal for every prompt. fp8: the same for prompts whose float top-2
  margin exceeds NEAR_TIE (in bf16: and one bf16 step at the top logit, tie_margin) with >= 2 of 8 leading tokens
  (this random model has a near-tie on prompt 0: margin 0.007 in fp32, 0 or one bf16 step (0.0156) in bf16
  depending on the attention's summation order, where fp8 rounding legitimately flips the token; measured
  agreement on prompt 1: 3 tokens). Greedy agreement on a real model (SmolLM2) is measured by scripts/quant_quality.py.
* mxfp8 / mxfp4 / w8a8 generate in-vocabulary tokens and their logits stay within a scheme bound of the float
  ones (relative max error: mxfp8 0.1, w8a8 0.2, mxfp4 0.6 — 2-bit element mantissa).
* --weight-tiling: identical greedy tokens; fp32 logits equal up to summation order (atol 1e-5 at logits O(1)).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from neuron_infer.api import CompiledModel, compile_model
from neuron_infer.config import BuildConfig, QuantConfig
from neuron_infer.errors import ConfigError
from neuron_infer.tiling import tiled_shape
from tests.tiny_checkpoint import TINY_PRESETS, write_tiny_checkpoint

PROMPTS = [[1, 17, 40, 99, 7, 250], [1, 300, 12]]
NEW = 8
BUILD = BuildConfig(dtype="fp32", max_context_length=32, max_length=64, context_buckets=(32,), tokengen_buckets=(64,))
QUIET = {"say": lambda m: None}
NEAR_TIE = 0.01  # float top-2 margin below which a first-token flip is rounding, not a defect
LOGIT_BOUND = {"int8": 0.05, "fp8": 0.1, "mxfp8": 0.1, "w8a8": 0.2, "mxfp4": 0.6}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("cq")
    return {"fp32": write_tiny_checkpoint(root / "fp32", **TINY_PRESETS["gqa"]),
            "bf16": write_tiny_checkpoint(root / "bf16", dtype="bfloat16", **TINY_PRESETS["gqa"])}


def run(model_dir, out, dtype="fp32", backend="cpu-eager", **quant):
    """Compile, load, prefill logits [P, V] of each prompt (fresh engine row) and greedy tokens."""
    build = dataclasses.replace(BUILD, dtype=dtype, quant=QuantConfig(**quant))
    man = compile_model(model_dir, out, build, backend=backend, **QUIET)
    m = CompiledModel.load(out)
    logits = torch.stack([m.engine.prefill([p])[0].float() for p in PROMPTS])  # [P, V]
    tokens = [o.token_ids for o in m.generate_ids(PROMPTS, NEW, ignore_eos=True).outputs]
    return man, logits, tokens


def tie_margin(top1: torch.Tensor, dtype: str) -> torch.Tensor:
    """[P] the top-2 margin up to which a first token is a tie: NEAR_TIE, and in bf16 at least one bf16 step at the
    top logit (2^(floor(log2|v|) - 7)): a tie rounds to a margin of 0 or 1 step there."""
    step = torch.exp2(torch.floor(torch.log2(top1.abs())) - 7) if dtype == "bf16" else torch.zeros_like(top1)
    return step.clamp(min=NEAR_TIE)


def lead_agree(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture(scope="module")
def floats(ckpts, tmp_path_factory):
    root = tmp_path_factory.mktemp("float")
    return {dt: run(ckpts[dt], root / dt, dt) for dt in ("fp32", "bf16")}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_int8_fp8_agree_with_float(ckpts, floats, tmp_path, scheme, dtype):
    _, logits, tokens = run(ckpts[dtype], tmp_path / "a", dtype, scheme=scheme, modules_to_not_convert=())
    _, ref, ref_tokens = floats[dtype]
    err = (logits - ref).abs().max()
    assert err <= LOGIT_BOUND[scheme] * ref.abs().max()
    chosen = ref.gather(1, logits.argmax(-1, keepdim=True)).squeeze(1)  # float logit of the quantized top-1 [P]
    assert (chosen >= ref.max(-1).values - 2 * err).all()
    top2 = ref.topk(2, -1).values  # [P, 2]
    clear = (top2[:, 0] - top2[:, 1] > tie_margin(top2[:, 0], dtype)) | (scheme == "int8")  # fp8: no first-token tie
    agree = [lead_agree(a, b) for a, b in zip(tokens, ref_tokens)]
    need = 4 if scheme == "int8" else 2
    assert clear.any() and torch.equal(logits.argmax(-1)[clear], ref.argmax(-1)[clear])
    assert all(n >= need for n, c in zip(agree, clear) if c), (agree, clear)
    assert not torch.equal(logits, ref)  # the artifact really holds quantized weights


@pytest.mark.parametrize("scheme", ["mxfp8", "mxfp4", "w8a8"])
def test_other_schemes_generate_within_bound(ckpts, floats, tmp_path, scheme):
    man, logits, tokens = run(ckpts["fp32"], tmp_path / "a", scheme=scheme)
    _, ref, _ = floats["fp32"]
    assert all(len(t) == NEW and all(0 <= i < 512 for i in t) for t in tokens)
    err = ((logits - ref).abs().max() / ref.abs().max()).item()
    assert 0 < err <= LOGIT_BOUND[scheme], err
    assert man.extra.quant["scheme"] == scheme and len(man.extra.quant["converted"]) == 15
    # the manifest's byte count is what the weights file holds for the linear layers (payload + scales)
    assert man.extra.quant["bytes_after"] == _linear_bytes_in_file(tmp_path / "a" / "weights" / "rank0.safetensors")
    # vs fp32 linears: 32 / 8.25 (MXFP8), 32 / 4.25 (MXFP4) bits less the K padding of down_proj (200 -> 224);
    # w8a8: 4x less one fp32 scale per row (measured 3.80, 7.37, 3.85)
    assert man.extra.quant["compression"] > {"mxfp8": 3.75, "mxfp4": 7.3, "w8a8": 3.8}[scheme]


def _linear_bytes_in_file(path) -> int:
    n = 0
    with safe_open(str(path), "pt") as f:
        for k in f.keys():  # noqa: SIM118  (safe_open is not a dict)
            if any(p in k for p in ("_proj.", "lm_head.")):
                t = f.get_tensor(k)
                n += t.numel() * t.element_size()
    return n


def test_manifest_bytes_and_compression(ckpts, tmp_path):
    man, _, _ = run(ckpts["fp32"], tmp_path / "a", scheme="int8", modules_to_not_convert=("lm_head",))
    q = man.extra.quant
    assert q["kept"] == ["lm_head"] and len(q["converted"]) == 14
    assert q["bytes_after"] == _linear_bytes_in_file(tmp_path / "a" / "weights" / "rank0.safetensors")
    head = 512 * 96 * 4
    proj = 2 * (96 * 96 + 2 * 96 * 48 + 96 * 96 + 3 * 96 * 200)  # q, k, v, o + gate, up, down per layer (weights)
    rows = 2 * (96 + 48 + 48 + 96 + 200 + 200 + 96)  # per-output-channel bf16 scales
    assert q["bytes_before"] == head + 4 * proj  # fp32 linears (no biases in "gqa")
    assert q["bytes_after"] == head + proj + 2 * rows  # int8 weights + bf16 scales, head kept fp32
    assert q["compression"] == pytest.approx(q["bytes_before"] / q["bytes_after"], abs=1e-4)


@pytest.mark.parametrize("scheme", ["none", "fp8"])
def test_weight_tiling_same_tokens_and_tiled_files(ckpts, floats, tmp_path, scheme):
    if scheme == "none":
        _, ref, ref_tokens = floats["fp32"]
    else:
        _, ref, ref_tokens = run(ckpts["fp32"], tmp_path / "plain", scheme="fp8")
    man, logits, tokens = run(ckpts["fp32"], tmp_path / "tiled", scheme=scheme, weight_tiling=True)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-5)  # fp32, logits O(1): summation order only
    rec = man.extra.quant["weight_tiling"]
    assert len(rec["tiled"]) == 15 and rec["kept"] == []
    with safe_open(str(tmp_path / "tiled" / "weights" / "rank0.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    assert shapes["model.layers.0.mlp.down_proj.weight"] == tiled_shape(200, 96) == (128, 1, 2, 128)
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == tiled_shape(96, 48)
    assert shapes["lm_head.weight"] == tiled_shape(96, 512)


def test_kv_cache_fp8_saturates_and_generates(tmp_path):
    d = write_tiny_checkpoint(tmp_path / "m", **TINY_PRESETS["gqa"])
    sd = load_file(str(d / "model.safetensors"))
    sd["model.layers.0.self_attn.k_proj.weight"] = sd["model.layers.0.self_attn.k_proj.weight"] * 1000.0
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})  # layer-0 keys far beyond +-240
    run(d, tmp_path / "f32")
    plain = CompiledModel.load(tmp_path / "f32")
    plain.engine.prefill([PROMPTS[0]])
    assert plain.engine.k_cache[0].abs().max() > 240  # the float cache holds values the fp8 cache must clip
    _, _, tokens = run(d, tmp_path / "kv8", kv_cache_dtype="fp8")
    m = CompiledModel.load(tmp_path / "kv8")
    m.engine.prefill([PROMPTS[0]])
    k0 = m.engine.k_cache[0].float()
    assert m.engine.k_cache.dtype == torch.float8_e4m3fn and torch.isfinite(k0).all()
    assert k0.abs().max() == 240.0
    big = plain.engine.k_cache[0] > 240
    assert torch.equal(k0[big], torch.full_like(k0[big], 240.0))  # every stored K > 240 became exactly 240
    assert all(len(t) == NEW for t in tokens)


def test_int8_compiled_cpu_backend_equals_eager(ckpts, tmp_path):
    _, eager, eager_tokens = run(ckpts["fp32"], tmp_path / "e", scheme="int8")
    _, comp, comp_tokens = run(ckpts["fp32"], tmp_path / "c", backend="cpu", scheme="int8")
    assert comp_tokens == eager_tokens
    torch.testing.assert_close(comp, eager, rtol=0, atol=1e-4)  # fp32 graph vs eager: reassociation only


def _cli(args):
    from neuron_infer.cli import main

    with pytest.raises(SystemExit) as e:
        main(args)
    return e.value.code


SMALL = ["--dtype", "fp32", "--max-context-length", "32", "--max-length", "64", "--context-buckets", "32",
         "--tokengen-buckets", "64", "--backend", "cpu-eager"]


def test_cli_unmatched_modules_to_not_convert_exit_2(ckpts, tmp_path, capsys):
    code = _cli(["compile", str(ckpts["fp32"]), "-o", str(tmp_path / "a"), "--quant", "int8",
                 "--modules-to-not-convert", "model.layers.7.mlp,lm_head", *SMALL])
    err = capsys.readouterr().err
    assert code == 2 and "model.layers.7.mlp" in err and "match no linear layer" in err
    assert not (tmp_path / "a" / "manifest.json").exists()


@pytest.mark.parametrize("scheme,match", [("mxfp4", "does not apply to --quant mxfp4"),
                                          ("w8a8", "does not apply to --quant w8a8")])
def test_cli_tiling_with_unsupported_scheme_exit_2(ckpts, tmp_path, capsys, scheme, match):
    code = _cli(["compile", str(ckpts["fp32"]), "-o", str(tmp_path / "a"), "--quant", scheme, "--weight-tiling",
                 *SMALL])
    assert code == 2 and match in capsys.readouterr().err


def test_api_tiling_with_w8a8_raises_before_calibration(ckpts, tmp_path):
    build = dataclasses.replace(BUILD, quant=QuantConfig(scheme="w8a8", weight_tiling=True))
    with pytest.raises(ConfigError, match="--weight-tiling does not apply to --quant w8a8"):
        compile_model(ckpts["fp32"], tmp_path / "a", build, backend="cpu-eager", **QUIET)


def test_mxfp4_compiled_cpu_backend_equals_eager(ckpts, tmp_path):
    """The e2m1 value table is a buffer, so AOTInductor graphs can share it (the CPU backend refuses a tensor created
    in forward: 'the module uses tensors ... that are neither parameters nor buffers')."""
    _, eager, eager_tokens = run(ckpts["fp32"], tmp_path / "e", scheme="mxfp4")
    _, comp, comp_tokens = run(ckpts["fp32"], tmp_path / "c", backend="cpu", scheme="mxfp4")
    assert comp_tokens == eager_tokens
    torch.testing.assert_close(comp, eager, rtol=0, atol=1e-4)  # fp32 graph vs eager: reassociation only
