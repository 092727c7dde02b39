"""The reference attention's fast forms against the plain definition (SDPA over per-head expanded K/V)."""
import pytest
import torch
import torch.nn.functional as F

from neuron_infer.model.ops import FEW_QUERY_ROWS, attention_ref, computed_once, gather_blocks
from tests.paged import as_blocks


def plain(q, k, v, q_to_kv, positions):
    k, v = k.index_select(1, q_to_kv), v.index_select(1, q_to_kv)  # [B, Hq, S, D]
    visible = torch.arange(k.shape[2]).view(1, 1, 1, -1) <= positions.unsqueeze(1).unsqueeze(-1)
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=visible)


@pytest.mark.parametrize("t", [1, 5, FEW_QUERY_ROWS, FEW_QUERY_ROWS + 3])
def test_few_rows_and_sdpa_forms_equal_the_definition(t):
    """fp32 inputs, fp64 oracle: 1e-5 covers fp32 accumulation over S=40 keys of unit-scale values."""
    g = torch.Generator().manual_seed(t)
    b, hq, hkv, s, d = 2, 6, 2, 40, 16
    q, k, v = (torch.randn(b, h, n, d, generator=g) for h, n in ((hq, t), (hkv, s), (hkv, s)))
    q_to_kv = torch.tensor([0, 1, 1, 0, 1, 0])  # non-uniform map (TP layouts produce these)
    positions = torch.stack([torch.arange(t) + 3, torch.arange(t) + 20])  # [B, T] rows at different offsets
    out = attention_ref(q, *as_blocks(k, v, 8), q_to_kv, positions)  # the positions in shuffled blocks of 8
    assert (out.double() - plain(q, k, v, q_to_kv, positions)).abs().max().item() < 1e-5


def test_folded_groups_equal_per_head_attention():
    """GQA fold (q [B, Hkv, G*T, D], positions repeated, q_to_kv None) equals per-head attention exactly in form."""
    g = torch.Generator().manual_seed(0)
    b, hkv, grp, t, s, d = 1, 2, 3, 2, 24, 8
    q = torch.randn(b, hkv * grp, t, d, generator=g)
    k, v = torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
    positions = torch.tensor([[10, 11]])
    kc, vc, table = as_blocks(k, v, 8)
    per_head = attention_ref(q, kc, vc, table, torch.arange(hkv * grp) // grp, positions)
    folded = attention_ref(q.reshape(b, hkv, grp * t, d), kc, vc, table, None, positions.repeat(1, grp))
    assert torch.allclose(folded.reshape(b, hkv * grp, t, d), per_head, atol=1e-6)


def test_computed_once_is_the_same_tensor_in_eager():
    x = torch.randn(2, 3, 4).transpose(0, 1)  # a non-contiguous view keeps its layout
    y = computed_once(x)
    assert torch.equal(y, x) and y.stride() == x.stride() and y.data_ptr() == x.data_ptr()


def test_gather_blocks_lays_out_each_rows_positions_in_order():
    k, v = torch.randn(3, 2, 24, 4), torch.randn(3, 2, 24, 4)
    kc, vc, table = as_blocks(k, v, 8, seed=5)
    assert torch.equal(gather_blocks(kc, table), k) and torch.equal(gather_blocks(vc, table), v)
