"""Decode attention vs the float64 oracle with explicit query positions (tolerances: conftest.TOL)."""
from __future__ import annotations

import numpy as np
import pytest

from nki_kernels.attention_decode.kernel import attention_decode
from nki_kernels.attention_decode.reference import attention_reference, to_kernel_layout

from .conftest import BF16, check, kind_of, run


def _case(rng, seq, n_tok, q_to_kv, n_kv, dim, dtype, last_pos, target="trn3"):
    batch, hq = len(last_pos), len(q_to_kv)
    q = rng.standard_normal((batch, hq, n_tok, dim)).astype(dtype)
    k = rng.standard_normal((batch, n_kv, seq, dim)).astype(dtype)
    v = rng.standard_normal((batch, n_kv, seq, dim)).astype(dtype)
    pos = np.stack([np.arange(p - n_tok + 1, p + 1) for p in last_pos])           # [B, T]
    scale = 1.0 / np.sqrt(dim)
    out = run(attention_decode, *to_kernel_layout(q, k, v, pos), tuple(q_to_kv), scale, target=target)
    check(out, attention_reference(q, k, v, q_to_kv, pos, scale), kind_of(dtype))


@pytest.mark.parametrize("seq,n_tok,q_to_kv,n_kv,dim,dtype,last_pos", [
    (600, 1, (0, 0, 0), 1, 64, np.float32, (599, 250)),       # GQA 3, per-sequence lengths, S % 512 != 0
    (2300, 4, (0,) * 8, 1, 32, BF16, (2299, 1000, 7)),         # GQA 8, k=4 tokens, crosses a 2048-key block
    (130, 2, (0, 1), 2, 16, np.float32, (129, 64)),            # GQA 1
    (300, 3, (0, 0, 1), 2, 32, BF16, (299, 2)),                # non-uniform grouping; a 3-key sequence
    (2100, 1, (0,), 1, 16, np.float32, (2099, 2050)),          # one row per group over two cache blocks
    (200, 2, (0, 1, 0, 1), 2, 16, BF16, (199, 150)),            # interleaved heads: per-head DMAs
    (4200, 16, (0,) * 8, 1, 16, np.float32, (4199, 100)),      # R = 128 rows, two 4096-key DMA blocks
    (1024, 1, (0, 0), 1, 16, np.float32, (1023, 5, 500, 1000, 77)),   # 4 + 1 batch rows per K/V load
    (256, 2, (0, 0, 1, 1), 2, 32, BF16, (255, 100, 3)),       # 3 batch rows per K/V load, 2 KV heads
])
def test_decode_matches_reference(rng, seq, n_tok, q_to_kv, n_kv, dim, dtype, last_pos):
    _case(rng, seq, n_tok, q_to_kv, n_kv, dim, dtype, last_pos)


def test_decode_ignores_cache_entries_past_the_valid_length(rng):
    """Huge garbage keys/values after a sequence's valid length must get weight exactly 0."""
    q = rng.standard_normal((1, 2, 1, 16)).astype(np.float32)
    k = rng.standard_normal((1, 1, 700, 16)).astype(np.float32)
    v = rng.standard_normal((1, 1, 700, 16)).astype(np.float32)
    pos = np.array([[100]])
    ref = attention_reference(q, k, v, (0, 0), pos, 0.25)
    k[:, :, 101:] = 1e4   # would dominate the softmax if it were not masked
    v[:, :, 101:] = 3e4   # (NaN garbage is out of scope: NaN * 0 is NaN in any matmul)
    out = run(attention_decode, *to_kernel_layout(q, k, v, pos), (0, 0), 0.25)
    check(out, ref, "fp32")


def test_decode_on_gen2(rng):
    """No gen3+ instruction is used: the same kernel runs for trn1."""
    _case(rng, 300, 2, (0, 0), 1, 32, np.float32, (299, 40), target="trn1")
