"""Causal flash attention for prefill (context encoding) with GQA — see design.md for the loop nest and layouts.

Dimensions:
    B: batch.  Hq: query heads.  Hkv: KV heads (each query head reads KV head q_to_kv[h]; 1..8 query heads per
    KV head, any grouping).  S: sequence length (queries and keys, both from position 0), any length >= 1; tiles
    are 128 queries (partitions) x 512 keys (one fp32 PSUM bank).  D: head dim <= 128.

Args:
    qT_hbm: [B, Hq, D, S] queries, head dim first (D on partitions for QK^T), bf16 or fp32, HBM.
    kT_hbm: [B, Hkv, D, S] keys, head dim first, same dtype, HBM.
    v_hbm:  [B, Hkv, S, D] values, same dtype, HBM.
    q_to_kv: tuple of Hq ints, the KV head of each query head (static).
    scale: Python float, the softmax scale (1/sqrt(D) for Llama).

Returns:
    out_hbm: [B, Hq, S, D] attention output, dtype of the inputs, shared HBM.

Notes:
    Envelope: D <= 128; K^T and V of one (batch, KV head) stay resident in SBUF (2*S*D*itemsize bytes over 128
    partitions: S = 8192 bf16 takes 32 KiB per partition). Precision: QK^T and PV accumulate in fp32 PSUM; the
    row max m, row sum l and output accumulator are fp32; probabilities are stored in the input dtype (bf16 for
    bf16 inputs) before the PV matmul. Tiles entirely above the diagonal are skipped; only diagonal tiles are
    masked (GpSimd affine_select, FP32_MIN). P is transposed on TensorE (nc_transpose) for fp32 or gen2, and by
    an SBUF->SBUF dma_transpose for bf16 on gen3+ (keeps TensorE for matmuls).

Pseudocode:
    for b, kv: K^T, V -> SBUF
      for h in heads(kv), q tile [q0, q1):
        m = -inf; l = 0; o = 0
        for k tile [k0, k1) with k0 < q1:
          s = q^T k (PSUM); if diagonal: s = where(q >= k, s, -inf)
          m' = max(m, rowmax(s)); p = exp(scale*(s - m')), rs = rowsum(p); a = exp(scale*(m - m'))
          l = l*a + rs; o = o*a + p @ v; m = m'
        out[b, h, q0:q1] = o / l
"""
import nki
import nki.isa as nisa
import nki.language as nl

Q_TILE = 128     # queries per tile (partitions of the score tile)
K_TILE = 512     # keys per score tile (one PSUM bank of fp32)
PV_CHUNK = 128   # keys per PV matmul (contraction on partitions)


def _load_kv(kT_hbm, v_hbm, b, kvh, seq, dim):
    """K^T [D, S] and V as [128, ceil(S/128), D] (partition p of chunk c holds key c*128 + p) into SBUF."""
    kT_sbuf = nl.ndarray((dim, seq), dtype=kT_hbm.dtype, buffer=nl.sbuf, name="kT_sbuf")
    nisa.dma_copy(dst=kT_sbuf, src=kT_hbm[b, kvh, :, :])
    n_chunks = (seq + PV_CHUNK - 1) // PV_CHUNK
    full = seq // PV_CHUNK
    v_sbuf = nl.ndarray((PV_CHUNK, n_chunks, dim), dtype=v_hbm.dtype, buffer=nl.sbuf, name="v_sbuf")
    if full > 0:
        # [full*128, D] -> [full, 128, D] -> [128, full, D]
        v_view = v_hbm[b, kvh, 0:full * PV_CHUNK, :].reshape((full, PV_CHUNK, dim)).permute((1, 0, 2))
        nisa.dma_copy(dst=v_sbuf[:, 0:full, :], src=v_view)
    if full < n_chunks:
        tail = seq - full * PV_CHUNK
        nisa.dma_copy(dst=v_sbuf[0:tail, full, :], src=v_hbm[b, kvh, full * PV_CHUNK:seq, :])
    return kT_sbuf, v_sbuf


def _scores(qT_sbuf, kT_sbuf, q0, q1, k0, k1):
    """s[q, k] = q . k for one [rows, cols] tile; masked (affine_select) only when it crosses the diagonal."""
    rows, cols = q1 - q0, k1 - k0
    s_psum = nl.ndarray((rows, cols), dtype=nl.float32, buffer=nl.psum, name="s_psum")
    nisa.nc_matmul(dst=s_psum, stationary=qT_sbuf, moving=kT_sbuf[:, k0:k1])
    if k1 - 1 <= q0:
        return s_psum
    s_sbuf = nl.ndarray((rows, cols), dtype=nl.float32, buffer=nl.sbuf, name="s_masked")
    nisa.tensor_copy(dst=s_sbuf, src=s_psum)
    # keep (q0 + p) - (k0 + f) >= 0
    nisa.affine_select(dst=s_sbuf, pattern=[[-1, cols]], channel_multiplier=1, on_true_tile=s_sbuf,
                       on_false_value=nl.FP32_MIN, cmp_op=nl.greater_equal, offset=q0 - k0)
    return s_sbuf


def _transpose_p(p_sbuf, c0, c1, rows, use_dma):
    """P[:, c0:c1] [rows, ck] -> pT [ck, rows] in SBUF (keys on partitions for the PV contraction)."""
    ck = c1 - c0
    pT_sbuf = nl.ndarray((ck, rows), dtype=p_sbuf.dtype, buffer=nl.sbuf, name="pT_sbuf")
    if use_dma:
        nisa.dma_transpose(dst=pT_sbuf, src=p_sbuf[:, c0:c1])
    else:
        pT_psum = nl.ndarray((ck, rows), dtype=p_sbuf.dtype, buffer=nl.psum, name="pT_psum")
        nisa.nc_transpose(dst=pT_psum, data=p_sbuf[:, c0:c1])
        nisa.tensor_copy(dst=pT_sbuf, src=pT_psum)
    return pT_sbuf


def _online_update(s_tile, stats, k0, k1, scale, p_dtype):
    """Online-softmax step on one score tile: updates m, l in place; returns (p, alpha) (alpha None at first)."""
    m_sbuf, l_sbuf, first = stats
    rows, cols = s_tile.shape[0], k1 - k0
    tile_max = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="tile_max")
    nisa.tensor_reduce(dst=tile_max, op=nl.maximum, data=s_tile, axis=1)
    m_new = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="m_new")
    if first:
        nisa.tensor_copy(dst=m_new, src=tile_max)
    else:
        nisa.tensor_tensor(dst=m_new, data1=m_sbuf, data2=tile_max, op=nl.maximum)
    neg_bias = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="neg_bias")
    nisa.tensor_scalar(dst=neg_bias, data=m_new, op0=nl.multiply, operand0=-scale)
    p_sbuf = nl.ndarray((rows, cols), dtype=p_dtype, buffer=nl.sbuf, name="p_sbuf")
    row_sum = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="row_sum")
    nisa.activation(dst=p_sbuf, op=nl.exp, data=s_tile, bias=neg_bias, scale=scale, reduce_op=nl.add,
                    reduce_res=row_sum, reduce_cmd=nisa.reduce_cmd.reset_reduce)
    alpha = m_new  # placeholder for the first tile (not used)
    if first:
        nisa.tensor_copy(dst=l_sbuf, src=row_sum)
    else:
        alpha = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="alpha")
        nisa.activation(dst=alpha, op=nl.exp, data=m_sbuf, bias=neg_bias, scale=scale)
        # l = l * alpha + row_sum
        nisa.scalar_tensor_tensor(dst=l_sbuf, data=l_sbuf, op0=nl.multiply, operand0=alpha, op1=nl.add,
                                  operand1=row_sum)
    nisa.tensor_copy(dst=m_sbuf, src=m_new)
    return p_sbuf, alpha


def _pv(p_sbuf, v_sbuf, k0, k1, rows, dim, use_dma):
    """pv [rows, D] (PSUM) = P[:, k0:k1] @ V[k0:k1] accumulated over 128-key chunks."""
    pv_psum = nl.ndarray((rows, dim), dtype=nl.float32, buffer=nl.psum, name="pv_psum")
    n_chunks = (k1 - k0 + PV_CHUNK - 1) // PV_CHUNK
    for c in range(n_chunks):
        c0, c1 = c * PV_CHUNK, min(k1 - k0, (c + 1) * PV_CHUNK)
        pT_sbuf = _transpose_p(p_sbuf, c0, c1, rows, use_dma)
        chunk = (k0 + c0) // PV_CHUNK
        nisa.nc_matmul(dst=pv_psum, stationary=pT_sbuf, moving=v_sbuf[0:c1 - c0, chunk, :], accumulate=(c > 0))
    return pv_psum


def _q_tile(qT_hbm, kT_sbuf, v_sbuf, out_hbm, b, h, q0, q1, scale, use_dma):
    """All causal key tiles of one query tile, then o / l -> out[b, h, q0:q1, :]."""
    dim = qT_hbm.shape[2]
    rows = q1 - q0
    qT_sbuf = nl.ndarray((dim, rows), dtype=qT_hbm.dtype, buffer=nl.sbuf, name="qT_sbuf")
    nisa.dma_copy(dst=qT_sbuf, src=qT_hbm[b, h, :, q0:q1])
    m_sbuf = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="m_run")
    l_sbuf = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="l_run")
    o_sbuf = nl.ndarray((rows, dim), dtype=nl.float32, buffer=nl.sbuf, name="o_acc")
    n_k = (q1 + K_TILE - 1) // K_TILE   # causal: key tiles starting at or before the last query of the tile
    for kt in range(n_k):
        k0, k1 = kt * K_TILE, min(q1, (kt + 1) * K_TILE)
        s_tile = _scores(qT_sbuf, kT_sbuf, q0, q1, k0, k1)
        p_sbuf, alpha = _online_update(s_tile, (m_sbuf, l_sbuf, kt == 0), k0, k1, scale, qT_hbm.dtype)
        pv_psum = _pv(p_sbuf, v_sbuf, k0, k1, rows, dim, use_dma)
        if kt == 0:
            nisa.tensor_copy(dst=o_sbuf, src=pv_psum)
        else:
            # o = o * alpha + pv
            nisa.scalar_tensor_tensor(dst=o_sbuf, data=o_sbuf, op0=nl.multiply, operand0=alpha, op1=nl.add,
                                      operand1=pv_psum)
    inv_l = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="inv_l")
    nisa.reciprocal(dst=inv_l, data=l_sbuf)
    res_sbuf = nl.ndarray((rows, dim), dtype=qT_hbm.dtype, buffer=nl.sbuf, name="res_sbuf")
    nisa.tensor_scalar(dst=res_sbuf, data=o_sbuf, op0=nl.multiply, operand0=inv_l)
    nisa.dma_copy(dst=out_hbm[b, h, q0:q1, :], src=res_sbuf)


@nki.jit
def flash_attention_prefill(qT_hbm, kT_hbm, v_hbm, q_to_kv, scale):
    """Causal GQA flash attention over a full prompt (see the module docstring for the template)."""
    batch, n_q, dim, seq = qT_hbm.shape
    n_kv = kT_hbm.shape[1]
    out_hbm = nl.ndarray((batch, n_q, seq, dim), dtype=qT_hbm.dtype, buffer=nl.shared_hbm, name="attn_out")
    use_dma = qT_hbm.dtype == nl.bfloat16 and nisa.get_nc_version() != nisa.nc_version.gen2
    n_qt = (seq + Q_TILE - 1) // Q_TILE
    for b in range(batch):
        for kvh in range(n_kv):
            kT_sbuf, v_sbuf = _load_kv(kT_hbm, v_hbm, b, kvh, seq, dim)
            for h in range(n_q):
                if q_to_kv[h] == kvh:
                    for qt in range(n_qt):
                        q0, q1 = qt * Q_TILE, min(seq, (qt + 1) * Q_TILE)
                        _q_tile(qT_hbm, kT_sbuf, v_sbuf, out_hbm, b, h, q0, q1, scale, use_dma)
    return out_hbm
