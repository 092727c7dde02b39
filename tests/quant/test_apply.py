"""apply_quantization on an HF-named module tree: modules_to_not_convert rules, reports, structure_only loading."""
import json

import pytest
import torch

from neuron_infer.config import QuantConfig
from neuron_infer.errors import ConfigError
from neuron_infer.quant import (
    apply_quantization,
    default_fp8_not_convert,
    entry_matches,
    get_scheme,
    parse_modules_to_not_convert,
)
from neuron_infer.quant.base import QuantizedLinear
from tests.quant.fake_llama import FakeLlama, linear_names

IDS = torch.tensor([[1, 5, 9, 2, 7, 3]])


def _kinds(model):
    return {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, QuantizedLinear))}


def test_converts_every_linear_and_reports_bytes():
    model = FakeLlama().to(torch.bfloat16)
    names = linear_names(model)
    assert len(names) == 3 * 7 + 1
    rep = apply_quantization(model, QuantConfig(scheme="int8"))
    assert set(rep.converted) == set(names) and rep.kept == ()
    assert all(v == "Int8Linear" for v in _kinds(model).values())
    assert 1.8 < rep.compression < 2.0  # bf16 -> int8 + bf16 per-row scales
    assert model(IDS).shape == (1, 6, 96)


@pytest.mark.parametrize("entry,expect_kept", [
    ("lm_head", {"lm_head"}),
    ("model.layers.0.mlp.down_proj", {"model.layers.0.mlp.down_proj"}),  # exact name
    ("model.layers.0.mlp", {f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")}),  # dotted prefix
    ("layers.1.self_attn", {f"model.layers.1.self_attn.{p}_proj" for p in "qkvo"}),  # NxDI-style, no "model."
    ("model.layers.*.self_attn.o_proj", {f"model.layers.{i}.self_attn.o_proj" for i in range(3)}),  # glob
    ("*.mlp.gate_proj", {f"model.layers.{i}.mlp.gate_proj" for i in range(3)}),
])
def test_modules_to_not_convert_rules(entry, expect_kept):
    model = FakeLlama()
    rep = apply_quantization(model, QuantConfig(scheme="fp8", modules_to_not_convert=(entry,)))
    assert set(rep.kept) == expect_kept
    kinds = _kinds(model)
    assert {n for n, k in kinds.items() if k == "Linear"} == expect_kept


def test_prefix_matches_whole_components_only():
    assert entry_matches("model.layers.1", "model.layers.1.mlp.up_proj")
    assert not entry_matches("model.layers.1", "model.layers.10.mlp.up_proj")  # no partial-component match
    assert not entry_matches("mlp", "model.layers.0.mlp.up_proj")  # bare middle component is not a prefix


def test_unmatched_entry_raises_naming_it():
    model = FakeLlama()
    with pytest.raises(ConfigError, match=r"model\.layers\.7\.mlp.*match no linear"):
        apply_quantization(model, QuantConfig(scheme="int8", modules_to_not_convert=("lm_head", "model.layers.7.mlp")))
    assert all(k == "Linear" for k in _kinds(model).values())  # nothing half-converted


def test_default_fp8_recipe():
    entries = default_fp8_not_convert(3)
    assert entries[:3] == ("lm_head", "model.layers.0.mlp", "model.layers.2.mlp")
    assert entries[3:] == tuple(f"model.layers.{i}.self_attn" for i in range(3))
    model = FakeLlama()
    rep = apply_quantization(model, QuantConfig(scheme="fp8", modules_to_not_convert=entries))
    assert set(rep.converted) == {f"model.layers.1.mlp.{p}_proj" for p in ("gate", "up", "down")}
    assert default_fp8_not_convert(1) == ("lm_head", "model.layers.0.mlp", "model.layers.0.self_attn")


@pytest.mark.parametrize("scheme", ("int8", "fp8", "mxfp8", "mxfp4", "w8a8"))
def test_structure_only_load_state_dict_strict(scheme):
    src = FakeLlama(seed=0).to(torch.bfloat16)
    apply_quantization(src, QuantConfig(scheme=scheme, modules_to_not_convert=("lm_head",)))
    dst = FakeLlama(seed=1).to(torch.bfloat16)  # different float weights: everything must come from the state dict
    rep = apply_quantization(dst, QuantConfig(scheme=scheme, modules_to_not_convert=("lm_head",)),
                             structure_only=True)
    assert len(rep.converted) == 21
    dst.load_state_dict(src.state_dict(), strict=True)
    assert torch.equal(dst(IDS), src(IDS))


def test_structure_only_on_meta_model():
    with torch.device("meta"):
        model = FakeLlama()
    apply_quantization(model, QuantConfig(scheme="int8"), structure_only=True, act_dtype=torch.bfloat16)
    m = model.get_submodule("model.layers.0.mlp.up_proj")
    assert m.weight.dtype == torch.int8 and m.weight.shape == (96, 64) and m.act_dtype == torch.bfloat16


def test_parse_modules_to_not_convert(tmp_path):
    assert parse_modules_to_not_convert("lm_head, model.layers.0.mlp") == ("lm_head", "model.layers.0.mlp")
    assert parse_modules_to_not_convert(["a", "b"]) == ("a", "b")
    (tmp_path / "l.json").write_text(json.dumps(["lm_head"]))
    (tmp_path / "nxdi.json").write_text(json.dumps({"model": {"modules_to_not_convert": ["layers.0.mlp"]}}))
    (tmp_path / "d.json").write_text(json.dumps({"modules_to_not_convert": ["x"]}))
    (tmp_path / "t.txt").write_text("# keep these\nlm_head\n\nmodel.layers.*.self_attn  # attention\n")
    assert parse_modules_to_not_convert(tmp_path / "l.json") == ("lm_head",)
    assert parse_modules_to_not_convert(str(tmp_path / "nxdi.json")) == ("layers.0.mlp",)
    assert parse_modules_to_not_convert(tmp_path / "d.json") == ("x",)
    assert parse_modules_to_not_convert(tmp_path / "t.txt") == ("lm_head", "model.layers.*.self_attn")
    (tmp_path / "bad.json").write_text('{"model": 3}')
    with pytest.raises(ConfigError, match="expected a JSON list"):
        parse_modules_to_not_convert(tmp_path / "bad.json")


def test_bad_scheme_errors():
    with pytest.raises(ConfigError, match="unknown"):
        QuantConfig(scheme="int4")
    with pytest.raises(ConfigError, match="no implementation"):
        get_scheme("int4")
    with pytest.raises(ConfigError, match="floating-point"):
        apply_quantization(FakeLlama().double(), QuantConfig(scheme="int8"))


def test_quant_config_rejects_meaningless_options():
    with pytest.raises(ConfigError, match="only makes sense with --quant"):
        QuantConfig(scheme="none", modules_to_not_convert=("lm_head",))
    with pytest.raises(ConfigError, match="smoothquant_alpha"):
        QuantConfig(scheme="w8a8", smoothquant_alpha=1.5)
    with pytest.raises(ConfigError, match="kv_cache_dtype 'int8' is unknown"):
        QuantConfig(scheme="int8", kv_cache_dtype="int8")
    with pytest.raises(ConfigError, match="weight-tiling does not apply to --quant mxfp8"):
        QuantConfig(scheme="mxfp8", weight_tiling=True)


def test_unsupported_combinations():
    from neuron_infer.quant import check_combination

    with pytest.raises(ConfigError, match="weight-tiling does not apply"):
        apply_quantization(FakeLlama(), QuantConfig(scheme="mxfp4", weight_tiling=True))
    with pytest.raises(ConfigError, match="float model dtype"):
        check_combination(QuantConfig(scheme="int8"), "int8")
    with pytest.raises(ConfigError, match="weight-tiling does not apply to --quant w8a8"):
        check_combination(QuantConfig(scheme="w8a8", weight_tiling=True), "bf16")
    check_combination(QuantConfig(scheme="int8", weight_tiling=True, kv_cache_dtype="fp8"), "bf16")  # valid


def test_none_scheme_is_identity():
    model = FakeLlama()
    rep = apply_quantization(model, QuantConfig())
    assert rep.converted == () and rep.compression == 1.0
    assert all(k == "Linear" for k in _kinds(model).values())
