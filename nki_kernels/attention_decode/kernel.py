"""Decode (token generation) attention: a few query tokens per sequence against a KV cache, flash-decoding
style over cache tiles, GQA, batch > 1 — see design.md.

Dimensions:
    B: batch.  Hq / Hkv: query / KV heads (query head h reads KV head q_to_kv[h]).  T: active query tokens per
    sequence (1..k, k = speculation length + 1).  S: cache length in the kernel call (the longest valid length
    of the batch, any value >= 1).  D: head dim <= 128.  G*T <= 128, G = query heads of one KV head.

Args:
    qT_hbm: [B, Hq, D, T] queries, head dim first, bf16 or fp32, HBM.
    kT_hbm: [B, Hkv, D, S] key cache, head dim first, same dtype, HBM.
    v_hbm:  [B, Hkv, S, D] value cache, same dtype, HBM.
    pos_hbm: [B, T] fp32 absolute position of every query token; key j is visible iff j <= pos (so the valid
        length of sequence b is pos[b, -1] + 1; entries beyond it are never read into the result), HBM.
    q_to_kv: tuple of Hq ints (static).
    scale: Python float softmax scale.

Returns:
    out_hbm: [B, Hq, T, D], dtype of the inputs, shared HBM.

Notes:
    Envelope: gen3+ (range_select); D <= 128; G*T <= 128. The cache is streamed in blocks of 2048 keys (4 KiB
    per partition per DMA for bf16 K^T) and consumed in 512-key score tiles; every (query head, token) row of a
    KV-head group shares one partition block so each K/V byte is read from HBM once per step. Masking is dynamic
    (per-row bounds from pos_hbm) with range_select, which also yields the tile row max. fp32 softmax
    statistics and PSUM accumulation; P is stored in the input dtype for the PV matmul.

Pseudocode:
    for b, kv: rows = (h in heads(kv), t); qT[D, rows]; bound[rows] = pos[b, t]
      m = -inf; l = 0; o = 0
      for block of 2048 keys: K^T, V -> SBUF
        for tile of 512 keys: s = q^T k; s = where(j <= bound, s, -inf), mx = rowmax(s)
          online softmax update of (m, l, o) as in prefill
      out[b, h, t] = o / l
"""
import nki
import nki.isa as nisa
import nki.language as nl

K_TILE = 512      # keys per score tile (one fp32 PSUM bank)
KV_BLOCK = 2048   # keys per K/V DMA
PV_CHUNK = 128    # keys per PV matmul


def _load_queries(qT_hbm, pos_hbm, b, heads, dim, n_tok):
    """qT [D, rows] and per-row bounds [rows, 1] (fp32) for the query heads of one KV head."""
    rows = len(heads) * n_tok
    qT_sbuf = nl.ndarray((dim, rows), dtype=qT_hbm.dtype, buffer=nl.sbuf, name="qT_sbuf")
    bound = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="bound")
    for g in range(len(heads)):
        nisa.dma_copy(dst=qT_sbuf[:, g * n_tok:(g + 1) * n_tok], src=qT_hbm[b, heads[g], :, :])
        nisa.dma_copy(dst=bound[g * n_tok:(g + 1) * n_tok, :], src=pos_hbm[b, :])
    return qT_sbuf, bound


def _load_block(kT_hbm, v_hbm, b, kvh, s0, s1, dim):
    """K^T[:, s0:s1] -> [D, n] and V[s0:s1] -> [128, ceil(n/128), D] (partition p of chunk c = key s0+c*128+p)."""
    n = s1 - s0
    kT_sbuf = nl.ndarray((dim, n), dtype=kT_hbm.dtype, buffer=nl.sbuf, name="kT_block")
    nisa.dma_copy(dst=kT_sbuf, src=kT_hbm[b, kvh, :, s0:s1])
    n_chunks = (n + PV_CHUNK - 1) // PV_CHUNK
    full = n // PV_CHUNK
    v_sbuf = nl.ndarray((PV_CHUNK, n_chunks, dim), dtype=v_hbm.dtype, buffer=nl.sbuf, name="v_block")
    if full > 0:
        # [full*128, D] -> [full, 128, D] -> [128, full, D]
        view = v_hbm[b, kvh, s0:s0 + full * PV_CHUNK, :].reshape((full, PV_CHUNK, dim)).permute((1, 0, 2))
        nisa.dma_copy(dst=v_sbuf[:, 0:full, :], src=view)
    if full < n_chunks:
        nisa.dma_copy(dst=v_sbuf[0:n - full * PV_CHUNK, full, :], src=v_hbm[b, kvh, s0 + full * PV_CHUNK:s1, :])
    return kT_sbuf, v_sbuf


def _masked_scores(qT_sbuf, kT_sbuf, c0, c1, k0, bound, zero):
    """s [rows, c1-c0] with keys j = k0 + f > bound masked to FP32_MIN; also returns the row max."""
    rows, cols = qT_sbuf.shape[1], c1 - c0
    s_psum = nl.ndarray((rows, cols), dtype=nl.float32, buffer=nl.psum, name="s_psum")
    nisa.nc_matmul(dst=s_psum, stationary=qT_sbuf, moving=kT_sbuf[:, c0:c1])
    s_sbuf = nl.ndarray((rows, cols), dtype=nl.float32, buffer=nl.sbuf, name="s_masked")
    tile_max = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="tile_max")
    nisa.range_select(dst=s_sbuf, on_true_tile=s_psum, comp_op0=nl.greater_equal, comp_op1=nl.less_equal,
                      bound0=zero, bound1=bound, reduce_cmd=nisa.reduce_cmd.reset_reduce, reduce_res=tile_max,
                      reduce_op=nl.maximum, range_start=k0, on_false_value=nl.FP32_MIN)
    return s_sbuf, tile_max


def _update(s_sbuf, tile_max, stats, scale, p_dtype):
    """m' = max(m, tile max); p = exp(scale (s - m')); l = l a + rowsum(p). Returns (p, a or None-like)."""
    m_sbuf, l_sbuf, first = stats
    rows, cols = s_sbuf.shape
    m_new = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="m_new")
    if first:
        nisa.tensor_copy(dst=m_new, src=tile_max)
    else:
        nisa.tensor_tensor(dst=m_new, data1=m_sbuf, data2=tile_max, op=nl.maximum)
    neg_bias = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="neg_bias")
    nisa.tensor_scalar(dst=neg_bias, data=m_new, op0=nl.multiply, operand0=-scale)
    p_sbuf = nl.ndarray((rows, cols), dtype=p_dtype, buffer=nl.sbuf, name="p_sbuf")
    row_sum = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="row_sum")
    nisa.activation(dst=p_sbuf, op=nl.exp, data=s_sbuf, bias=neg_bias, scale=scale, reduce_op=nl.add,
                    reduce_res=row_sum, reduce_cmd=nisa.reduce_cmd.reset_reduce)
    alpha = m_new
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


def _pv(p_sbuf, v_sbuf, c0, c1, dim):
    """pv [rows, D] (PSUM) = P @ V[c0:c1] over 128-key chunks; P transposed on TensorE."""
    rows = p_sbuf.shape[0]
    pv_psum = nl.ndarray((rows, dim), dtype=nl.float32, buffer=nl.psum, name="pv_psum")
    n_chunks = (c1 - c0 + PV_CHUNK - 1) // PV_CHUNK
    for c in range(n_chunks):
        a0, a1 = c * PV_CHUNK, min(c1 - c0, (c + 1) * PV_CHUNK)
        pT_psum = nl.ndarray((a1 - a0, rows), dtype=p_sbuf.dtype, buffer=nl.psum, name="pT_psum")
        nisa.nc_transpose(dst=pT_psum, data=p_sbuf[:, a0:a1])
        pT_sbuf = nl.ndarray((a1 - a0, rows), dtype=p_sbuf.dtype, buffer=nl.sbuf, name="pT_sbuf")
        nisa.tensor_copy(dst=pT_sbuf, src=pT_psum)
        chunk = (c0 + a0) // PV_CHUNK
        nisa.nc_matmul(dst=pv_psum, stationary=pT_sbuf, moving=v_sbuf[0:a1 - a0, chunk, :], accumulate=(c > 0))
    return pv_psum


def _group(qT_hbm, kT_hbm, v_hbm, pos_hbm, out_hbm, b, kvh, heads, scale):
    """Attention of all query rows of one (batch, KV head) over the whole cache."""
    dim, n_tok = qT_hbm.shape[2], qT_hbm.shape[3]
    seq = kT_hbm.shape[3]
    qT_sbuf, bound = _load_queries(qT_hbm, pos_hbm, b, heads, dim, n_tok)
    rows = qT_sbuf.shape[1]
    zero = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="zero")
    nisa.memset(dst=zero, value=0.0)
    m_sbuf = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="m_run")
    l_sbuf = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="l_run")
    o_sbuf = nl.ndarray((rows, dim), dtype=nl.float32, buffer=nl.sbuf, name="o_acc")
    for blk in range((seq + KV_BLOCK - 1) // KV_BLOCK):
        s0, s1 = blk * KV_BLOCK, min(seq, (blk + 1) * KV_BLOCK)
        kT_sbuf, v_sbuf = _load_block(kT_hbm, v_hbm, b, kvh, s0, s1, dim)
        for t in range((s1 - s0 + K_TILE - 1) // K_TILE):
            c0, c1 = t * K_TILE, min(s1 - s0, (t + 1) * K_TILE)
            first = blk == 0 and t == 0
            s_sbuf, tile_max = _masked_scores(qT_sbuf, kT_sbuf, c0, c1, s0 + c0, bound, zero)
            p_sbuf, alpha = _update(s_sbuf, tile_max, (m_sbuf, l_sbuf, first), scale, qT_hbm.dtype)
            pv_psum = _pv(p_sbuf, v_sbuf, c0, c1, dim)
            if first:
                nisa.tensor_copy(dst=o_sbuf, src=pv_psum)
            else:
                # o = o * alpha + pv
                nisa.scalar_tensor_tensor(dst=o_sbuf, data=o_sbuf, op0=nl.multiply, operand0=alpha,
                                          op1=nl.add, operand1=pv_psum)
    inv_l = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="inv_l")
    nisa.reciprocal(dst=inv_l, data=l_sbuf)
    res_sbuf = nl.ndarray((rows, dim), dtype=qT_hbm.dtype, buffer=nl.sbuf, name="res_sbuf")
    nisa.tensor_scalar(dst=res_sbuf, data=o_sbuf, op0=nl.multiply, operand0=inv_l)
    for g in range(len(heads)):
        nisa.dma_copy(dst=out_hbm[b, heads[g], :, :], src=res_sbuf[g * n_tok:(g + 1) * n_tok, :])


@nki.jit
def attention_decode(qT_hbm, kT_hbm, v_hbm, pos_hbm, q_to_kv, scale):
    """Decode attention against a KV cache with per-row position bounds (module docstring has the template)."""
    batch, n_q, dim, n_tok = qT_hbm.shape
    n_kv = kT_hbm.shape[1]
    out_hbm = nl.ndarray((batch, n_q, n_tok, dim), dtype=qT_hbm.dtype, buffer=nl.shared_hbm, name="attn_out")
    for b in range(batch):
        for kvh in range(n_kv):
            heads = []
            for h in range(n_q):
                if q_to_kv[h] == kvh:
                    heads.append(h)
            if len(heads) > 0:
                _group(qT_hbm, kT_hbm, v_hbm, pos_hbm, out_hbm, b, kvh, tuple(heads), scale)
    return out_hbm
