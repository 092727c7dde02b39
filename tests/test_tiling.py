"""Weight tiling [K, N] -> [128, N/128, K/128, 128]: exact layout, round trip incl. padding, tiled matmul."""
import numpy as np
import pytest
import torch

from neuron_infer.tiling import TILE, tile_linear_weight, tile_weight, tiled_matmul, tiled_shape, untile_weight


@pytest.mark.parametrize("k,n", [(128, 256), (256, 128), (130, 70), (576, 1536), (64, 300)])
def test_round_trip_torch_and_numpy(k, n):
    w = torch.randn(k, n)
    t = tile_weight(w)
    assert tuple(t.shape) == tiled_shape(k, n) and t.is_contiguous()
    assert torch.equal(untile_weight(t, k, n), w)
    wn = np.arange(k * n, dtype=np.int32).reshape(k, n)
    assert np.array_equal(untile_weight(tile_weight(wn), k, n), wn)


def test_exact_layout_and_zero_padding():
    k, n = 300, 200  # pads to 384 x 256
    w = torch.arange(k * n, dtype=torch.float32).reshape(k, n) + 1  # no zeros in w
    t = tile_weight(w)
    assert tuple(t.shape) == (128, 2, 3, 128)
    for kp, nt, kt, np_ in [(0, 0, 0, 0), (5, 1, 2, 7), (127, 0, 1, 127), (43, 1, 2, 71)]:
        r, c = kt * TILE + kp, nt * TILE + np_
        expect = w[r, c] if (r < k and c < n) else 0.0
        assert t[kp, nt, kt, np_] == expect
    assert int((t == 0).sum()) == 384 * 256 - k * n  # padding is exactly the zeros


def test_dtype_agnostic_for_quantized_payloads():
    q = torch.randint(-127, 128, (200, 130), dtype=torch.int8)
    assert torch.equal(untile_weight(tile_weight(q), 200, 130), q)
    f8 = torch.randn(256, 128).to(torch.float8_e4m3fn)
    assert torch.equal(untile_weight(tile_weight(f8), 256, 128).view(torch.uint8), f8.view(torch.uint8))


def test_tiled_matmul_equals_dense():
    lin_w = torch.randn(70, 130, dtype=torch.float64)  # HF [out=70, in=130]
    x = torch.randn(3, 130, dtype=torch.float64)
    y = tiled_matmul(x, tile_linear_weight(lin_w), n=70)
    assert torch.allclose(y, x @ lin_w.T, rtol=1e-12, atol=1e-12)


def test_bad_shapes():
    with pytest.raises(ValueError, match="2-D"):
        tile_weight(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="needs"):
        untile_weight(torch.zeros(128, 1, 1, 128), 300, 100)
