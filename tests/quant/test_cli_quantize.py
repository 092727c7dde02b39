"""`neuron-infer quantize`: float checkpoint -> quantized checkpoint (same tensors as a compiled artifact, strict
reload), FP8 checkpoints: Neuron-range check (clear error without --rescale), --rescale with verification.

The command is registered on the CLI group here exactly as the lead's one-line patch does in cli.py.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from neuron_infer.api import compile_model
from neuron_infer.cli import cli, main
from neuron_infer.cli_quantize import load_quantized_checkpoint, quantize_cmd
from neuron_infer.config import BuildConfig, QuantConfig
from neuron_infer.quant.fp8 import NEURON_FP8_MAX, OCP_FP8_MAX, fp8_to_float
from tests.tiny_checkpoint import TINY_PRESETS, write_tiny_checkpoint

if "quantize" not in cli.commands:
    cli.add_command(quantize_cmd)


def _cli(args) -> int:
    try:
        main(args)
    except SystemExit as e:
        return e.code
    return 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("q") / "m", **TINY_PRESETS["tied"])


def test_float_to_int8_matches_compile_and_reloads(tiny, tmp_path):
    assert _cli(["quantize", str(tiny), "-o", str(tmp_path / "q"), "--quant", "int8", "--dtype", "fp32"]) == 0
    meta = json.loads((tmp_path / "q" / "quantization_config.json").read_text())
    assert meta["quant"]["scheme"] == "int8" and len(meta["quant"]["converted"]) == 15
    build = BuildConfig(dtype="fp32", max_context_length=32, max_length=64, context_buckets=(32,),
                        tokengen_buckets=(64,), quant=QuantConfig(scheme="int8"))
    compile_model(tiny, tmp_path / "art", build, backend="cpu-eager", say=lambda m: None)
    ours = load_file(str(tmp_path / "q" / "model.safetensors"))
    art = load_file(str(tmp_path / "art" / "weights" / "rank0.safetensors"))
    assert ours.keys() == art.keys() and all(torch.equal(ours[k], art[k]) for k in ours)  # deterministic
    model = load_quantized_checkpoint(tmp_path / "q")  # strict load
    assert type(model.model.layers[0].mlp.up_proj).__name__ == "Int8Linear"
    assert torch.equal(model.model.layers[1].mlp.down_proj.weight, art["model.layers.1.mlp.down_proj.weight"])


def test_unmatched_modules_to_not_convert_exit_2(tiny, tmp_path, capsys):
    code = _cli(["quantize", str(tiny), "-o", str(tmp_path / "q"), "--quant", "fp8",
                 "--modules-to-not-convert", "model.layers.5.mlp"])
    assert code == 2 and "match no linear layer" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()


def _fp8_checkpoint(src, dst, limit: float):
    """`src`'s linear weights as float8_e4m3fn scaled to +-limit per output channel (+ weight_scale), else copied."""
    dst.mkdir()
    sd = load_file(str(src / "model.safetensors"))
    for k in [k for k in sd if k.endswith("_proj.weight")]:
        w = sd[k].float()
        scale = w.abs().amax(dim=1) / limit  # [out]
        sd[k] = (w / scale[:, None]).clamp(-limit, limit).to(torch.float8_e4m3fn)
        sd[k + "_scale"] = scale
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())
    return sd


def test_ocp_fp8_needs_rescale_then_rescales_with_verification(tiny, tmp_path, capsys):
    sd = _fp8_checkpoint(tiny, tmp_path / "ocp", OCP_FP8_MAX)
    code = _cli(["quantize", str(tmp_path / "ocp"), "-o", str(tmp_path / "bad")])
    err = capsys.readouterr().err
    assert code == 2 and "outside Neuron's E4M3 range" in err and "--rescale" in err
    assert _cli(["quantize", str(tmp_path / "ocp"), "-o", str(tmp_path / "ok"), "--rescale"]) == 0
    out = load_file(str(tmp_path / "ok" / "model.safetensors"))
    k = "model.layers.0.mlp.up_proj.weight"
    v = fp8_to_float(out[k])
    assert out[k].dtype == torch.float8_e4m3fn and v.abs().max() <= NEURON_FP8_MAX
    before = fp8_to_float(sd[k]) * sd[k + "_scale"][:, None]
    after = v * out[k + "_scale"][:, None]
    normal = fp8_to_float(sd[k]).abs() >= 2.0 ** -5  # halved, still an e4m3 normal: pow2 rescale is exact
    assert torch.equal(before[normal], after[normal])
    step = out[k + "_scale"][:, None].expand_as(v)[~normal] * 2.0 ** -10  # else: half the subnormal step
    assert ((before - after)[~normal].abs() <= step).all()
    assert torch.equal(out["model.norm.weight"], sd["model.norm.weight"])  # everything else unchanged
    meta = json.loads((tmp_path / "ok" / "quantization_config.json").read_text())
    assert meta["fp8"]["rescaled"] and meta["fp8"]["verified"]


def test_neuron_range_fp8_passes_without_rescale(tiny, tmp_path):
    _fp8_checkpoint(tiny, tmp_path / "nrn", NEURON_FP8_MAX)
    assert _cli(["quantize", str(tmp_path / "nrn"), "-o", str(tmp_path / "ok")]) == 0


def test_bad_flag_combinations_exit_2(tiny, tmp_path, capsys):
    assert _cli(["quantize", str(tiny), "-o", str(tmp_path / "a"), "--rescale"]) == 2
    assert "no float8 tensors" in capsys.readouterr().err
    assert _cli(["quantize", str(tiny), "-o", str(tmp_path / "a")]) == 2
    assert "--quant is required" in capsys.readouterr().err
    _fp8_checkpoint(tiny, tmp_path / "f8", NEURON_FP8_MAX)
    assert _cli(["quantize", str(tmp_path / "f8"), "-o", str(tmp_path / "b"), "--quant", "int8"]) == 2
    assert "already an FP8 checkpoint" in capsys.readouterr().err
