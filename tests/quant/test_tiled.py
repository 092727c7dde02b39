"""TiledLinear (--weight-tiling): exact round trip to the source module, forward == tiled-layout twin == source,
kernel operands == what nki_ops packs for the MLP kernel, clear errors for modules tiling cannot express.

Sizes are not multiples of 128 (96 -> 200) so the zero padding of the layout is exercised.
Tolerances: the forward runs the source module's own math on bit-identical values, so it equals the source
module's output exactly; the fp32 twin (tiling.tiled_matmul, einsum over the tiled dims) sums in another
order: 1e-5 relative to the output range (fp32 reassociation over K <= 200 terms is ~1e-7 relative).
"""
import numpy as np
import pytest
import torch
from torch import nn

from neuron_infer.config import QuantConfig
from neuron_infer.errors import ConfigError
from neuron_infer.quant import apply_quantization
from neuron_infer.quant.fp8 import FP8Linear
from neuron_infer.quant.int8 import Int8Linear
from neuron_infer.quant.smoothquant import W8A8Linear
from neuron_infer.quant.tiled import TiledLinear, pack_channel_scales, tile_model, tile_structure, untile_model
from neuron_infer.tiling import tile_weight, tiled_shape
from tests.quant.fake_llama import FakeLlama

IN, OUT = 96, 200


def _source(kind: str, dtype=torch.float32, bias=True) -> nn.Module:
    torch.manual_seed(0)
    lin = nn.Linear(IN, OUT, bias=bias).to(dtype)
    if kind == "float":
        return lin
    return (FP8Linear if kind == "fp8" else Int8Linear).from_linear(lin)


@pytest.mark.parametrize("kind", ["float", "fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_forward_and_twin(kind, dtype):
    src = _source(kind, dtype)
    t = TiledLinear.from_module(src)
    assert tuple(t.weight.shape) == tiled_shape(IN, OUT) == (128, 2, 1, 128)
    back = t.to_untiled()
    assert type(back) is type(src)
    for (k, a), (k2, b) in zip(src.state_dict().items(), back.state_dict().items()):
        assert k == k2 and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), k
    x = torch.randn(3, 5, IN).to(dtype)
    with torch.no_grad():
        y, y_src, y_ref = t(x), src(x), t.reference_forward(x)
    if kind == "int8":  # Int8Linear may take torch's int8pack GEMV path (bf16 rounding of x): compare its own twin
        y_src = src.reference_forward(x)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: output rounding (2**-8 relative) of two orders
    scale = y_ref.float().abs().max()
    assert (y.float() - y_src.float()).abs().max() <= tol * scale
    assert (y.float() - y_ref.float()).abs().max() <= tol * scale
    assert torch.equal(t.dequantized_weight(), (src.weight.float() if kind == "float" else src.dequantized_weight()))


def test_kernel_operands_match_the_mlp_kernel_packing():
    from nki_kernels.mlp.reference import pack_scales  # the packing the kernel's own tests use

    fp8 = _source("fp8", bias=False)
    codes, scales = TiledLinear.from_module(fp8).kernel_operands()
    expect = tile_weight(fp8.weight.view(torch.uint8).T.contiguous().numpy())  # [K, N] bytes -> tiled
    assert codes.shape == tiled_shape(IN, OUT) and np.array_equal(codes.view(np.uint8), expect)
    np.testing.assert_array_equal(scales, pack_scales(fp8.weight_scale.numpy()))
    np.testing.assert_array_equal(pack_channel_scales(np.arange(3.0)), pack_scales(np.arange(3.0)))
    lin = _source("float", torch.bfloat16, bias=False)
    (w,) = TiledLinear.from_module(lin).kernel_operands()
    assert np.array_equal(w.view(np.int16), tile_weight(lin.weight.detach().T.contiguous().view(torch.int16).numpy()))
    with pytest.raises(ConfigError, match="no int8-weight entry point"):
        TiledLinear.from_module(_source("int8")).kernel_operands()


def test_tile_model_is_invertible_and_structure_loads_strictly():
    model = FakeLlama()
    apply_quantization(model, QuantConfig(scheme="fp8", modules_to_not_convert=("lm_head",)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        y0 = model(ids)
        record = tile_model(model)
        y1 = model(ids)
    assert len(record["tiled"]) == 22 and record["kept"] == []
    assert record["weight_bytes_tiled"] >= record["weight_bytes_untiled"]  # zero padding to multiples of 128
    torch.testing.assert_close(y1, y0, rtol=0, atol=1e-5)  # same values, same F.linear: equal up to fp32 order
    skeleton = FakeLlama()
    apply_quantization(skeleton, QuantConfig(scheme="fp8", modules_to_not_convert=("lm_head",)), structure_only=True)
    tile_structure(skeleton)
    skeleton.load_state_dict(model.state_dict(), strict=True)
    untile_model(model)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k].view(torch.uint8), after[k].view(torch.uint8)) for k in before)


def test_modules_tiling_cannot_express_raise():
    model = FakeLlama()
    model.lm_head = W8A8Linear.empty(model.lm_head.in_features, model.lm_head.out_features, False, torch.float32)
    with pytest.raises(ConfigError, match="cannot tile a W8A8Linear"):
        tile_model(model)
    with pytest.raises(ConfigError, match="does not apply to --quant mxfp8"):
        QuantConfig(scheme="mxfp8", weight_tiling=True)
