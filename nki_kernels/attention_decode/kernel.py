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
    Envelope: D <= 128; R = G*T <= 128; pos[b, t] < S. Keys-on-partitions orientation: scores are computed
    transposed, s^T[128 keys, R rows] per 128-key chunk, so the few query rows sit in the free dim and every
    Vector/Scalar instruction covers a whole cache block (NCH chunks x R rows) at once; P^T comes out of the exp
    already in the layout the PV matmul contracts over (no P transposes). Row sums come from the PV matmul
    itself through a ones column appended to V ([128, D+1]). The cache streams in blocks of NCH*128 keys
    (NCH = min(16, 512 // R); 4 KiB per partition per K^T DMA for bf16), each K/V byte read once per step.
    Masking is dynamic (key index > pos -> -1e30 before the max). The block max over keys (partitions) is a
    free-dim reduce, a 128 x R TensorE transpose and a reduce; the running max is broadcast back to the 128 key
    partitions with a ones matmul. fp32 statistics and PSUM accumulation; P^T is stored in the input dtype.

Pseudocode:
    for b, kv: rows r = (h in heads(kv), t); qT[D, R]; bound[:, r] = pos[b, t] (all partitions)
      for block of NCH*128 keys: K^T [D, keys], V|1 [128, NCH, D+1] -> SBUF
        sT[:, c, r] = k_c^T q_r; sT -= 1e30 * (key > bound); bm[r] = max over keys of sT
        m' = max(m, bm); a = exp(scale (m - m')); pT = exp(scale sT - scale m')
        o[r, 0:D+1] = o a + sum_c pT[:, c]^T V|1[:, c]; m = m'
      out[b, h, t] = o[:, 0:D] / o[:, D]
"""
import nki
import nki.isa as nisa
import nki.language as nl

P = 128               # keys per chunk (partitions)
MAX_CHUNKS = 16       # chunks per cache block (2048 keys)
NEG = -1.0e30         # added to masked scores (finite: exp underflows to exactly 0)


def _load_queries(qT_hbm, pos_hbm, b, heads, n_tok):
    """qT [D, R] and the per-row bound broadcast to all partitions [128, R] (fp32), R = len(heads) * T."""
    dim = qT_hbm.shape[2]
    rows = len(heads) * n_tok
    qT_sbuf = nl.ndarray((dim, rows), dtype=qT_hbm.dtype, buffer=nl.sbuf, name="qT_sbuf")
    bound = nl.ndarray((P, rows), dtype=nl.float32, buffer=nl.sbuf, name="bound_bcast")
    for g in range(len(heads)):
        nisa.dma_copy(dst=qT_sbuf[:, g * n_tok:(g + 1) * n_tok], src=qT_hbm[b, heads[g], :, :])
        # pos[b, 0:T] read by every partition (stride-0 partition pattern)
        nisa.dma_copy(dst=bound[:, g * n_tok:(g + 1) * n_tok],
                      src=pos_hbm.ap(pattern=[[0, P], [1, n_tok]], offset=b * n_tok))
    return qT_sbuf, bound


def _load_block(kT_hbm, v_hbm, b, kvh, s0, s1, n_ch):
    """K^T [D, n_ch*128] and V|1 [128, n_ch, D+1] for keys [s0, s1); keys past s1 are zero (masked anyway)."""
    dim, n = kT_hbm.shape[2], s1 - s0
    kT_sbuf = nl.ndarray((dim, n_ch * P), dtype=kT_hbm.dtype, buffer=nl.sbuf, name="kT_block")
    if n < n_ch * P:
        nisa.memset(dst=kT_sbuf[:, n:n_ch * P], value=0.0)
    nisa.dma_copy(dst=kT_sbuf[:, 0:n], src=kT_hbm[b, kvh, :, s0:s1])
    v_sbuf = nl.ndarray((P, n_ch, dim + 1), dtype=v_hbm.dtype, buffer=nl.sbuf, name="v_block")
    full = n // P
    if full < n_ch:
        nisa.memset(dst=v_sbuf[:, full, :], value=0.0)
        nisa.dma_copy(dst=v_sbuf[0:n - full * P, full, 0:dim], src=v_hbm[b, kvh, s0 + full * P:s1, :])
    if full > 0:
        # [full*128, D] -> [full, 128, D] -> [128, full, D]
        view = v_hbm[b, kvh, s0:s0 + full * P, :].reshape((full, P, dim)).permute((1, 0, 2))
        nisa.dma_copy(dst=v_sbuf[:, 0:full, 0:dim], src=view)
    nisa.memset(dst=v_sbuf[:, :, dim:dim + 1], value=1.0)   # ones column: PV also yields the row sums
    return kT_sbuf, v_sbuf


def _masked_scores_T(qT_sbuf, kT_sbuf, bound, s0, n_ch):
    """sT [128, n_ch, R] fp32 (SBUF): q.k for key s0 + c*128 + p, minus 1e30 where the key is past the bound."""
    rows = qT_sbuf.shape[1]
    s_psum = nl.ndarray((P, n_ch, rows), dtype=nl.float32, buffer=nl.psum, name="sT_psum")
    for c in range(n_ch):
        nisa.nc_matmul(dst=s_psum[:, c, :], stationary=kT_sbuf[:, c * P:(c + 1) * P], moving=qT_sbuf)
    key = nl.ndarray((P, n_ch, rows), dtype=nl.float32, buffer=nl.sbuf, name="key_index")
    nisa.iota(dst=key, pattern=[[P, n_ch], [0, rows]], offset=s0, channel_multiplier=1)
    past = nl.ndarray((P, n_ch, rows), dtype=nl.float32, buffer=nl.sbuf, name="past_bound")
    bound_v = bound.ap(pattern=[[rows, P], [0, n_ch], [1, rows]], offset=0)   # [128, R] -> [128, n_ch, R]
    nisa.tensor_tensor(dst=past, data1=key, data2=bound_v, op=nl.greater)
    sT = nl.ndarray((P, n_ch, rows), dtype=nl.float32, buffer=nl.sbuf, name="sT")
    # sT = past * NEG + s
    nisa.scalar_tensor_tensor(dst=sT, data=past, op0=nl.multiply, operand0=NEG, op1=nl.add, operand1=s_psum)
    return sT


def _block_max(sT, rows):
    """Max over all keys of the block for every row -> [R, 1] (free reduce, TensorE transpose, free reduce)."""
    col_max = nl.ndarray((P, rows), dtype=nl.float32, buffer=nl.sbuf, name="col_max")
    nisa.tensor_reduce(dst=col_max, op=nl.maximum, data=sT.permute((0, 2, 1)), axis=2)   # [128, R, n_ch]
    cmT = nl.ndarray((rows, P), dtype=nl.float32, buffer=nl.psum, name="col_max_T")
    nisa.nc_transpose(dst=cmT, data=col_max)
    bmax = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="block_max")
    nisa.tensor_reduce(dst=bmax, op=nl.maximum, data=cmT, axis=1)
    return bmax


def _broadcast_rows(col, ones_row):
    """[R, 1] per-row values -> [128, R] (PSUM) with every partition holding the row vector."""
    rows = col.shape[0]
    row_psum = nl.ndarray((1, rows), dtype=nl.float32, buffer=nl.psum, name="row_T")
    nisa.nc_transpose(dst=row_psum, data=col)
    row = nl.ndarray((1, rows), dtype=nl.float32, buffer=nl.sbuf, name="row")
    nisa.tensor_copy(dst=row, src=row_psum)
    bc = nl.ndarray((P, rows), dtype=nl.float32, buffer=nl.psum, name="row_bcast")
    nisa.nc_matmul(dst=bc, stationary=ones_row, moving=row)
    return bc


def _softmax_T(sT, stats, ones_row, scale, p_dtype):
    """Online-softmax step; stats = (m,) or () before the first block.

    Returns (pT [128, n_ch, R] = exp(scale (sT - m')), m' [R, 1], alpha [R, 1]; alpha is m' on the first block).
    """
    n_ch, rows = sT.shape[1], sT.shape[2]
    bmax = _block_max(sT, rows)
    m_new = bmax
    if len(stats) > 0:
        m_old = stats[0]
        m_new = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="m_new")
        nisa.tensor_tensor(dst=m_new, data1=m_old, data2=bmax, op=nl.maximum)
    neg_bias = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="neg_bias")
    nisa.tensor_scalar(dst=neg_bias, data=m_new, op0=nl.multiply, operand0=-scale)
    alpha = m_new
    if len(stats) > 0:
        alpha = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="alpha")
        nisa.activation(dst=alpha, op=nl.exp, data=m_old, bias=neg_bias, scale=scale)
    nb = _broadcast_rows(neg_bias, ones_row)
    z = nl.ndarray((P, n_ch, rows), dtype=nl.float32, buffer=nl.sbuf, name="z")
    nb_v = nb.ap(pattern=[[rows, P], [0, n_ch], [1, rows]], offset=0)       # [128, R] -> [128, n_ch, R]
    # z = sT * scale - scale * m'
    nisa.scalar_tensor_tensor(dst=z, data=sT, op0=nl.multiply, operand0=scale, op1=nl.add, operand1=nb_v)
    pT = nl.ndarray((P, n_ch, rows), dtype=p_dtype, buffer=nl.sbuf, name="pT")
    nisa.activation(dst=pT, op=nl.exp, data=z)
    return pT, m_new, alpha


def _pv(pT, v_sbuf):
    """[R, D+1] (PSUM) = sum_c pT[:, c]^T V|1[:, c]: weighted values and, in the last column, the row sums."""
    n_ch, rows = pT.shape[1], pT.shape[2]
    pv = nl.ndarray((rows, v_sbuf.shape[2]), dtype=nl.float32, buffer=nl.psum, name="pv_psum")
    for c in range(n_ch):
        nisa.nc_matmul(dst=pv, stationary=pT[:, c, :], moving=v_sbuf[:, c, :], accumulate=(c > 0))
    return pv


def _group(qT_hbm, kT_hbm, v_hbm, pos_hbm, out_hbm, b, kvh, heads, scale):
    """Attention of all query rows of one (batch, KV head) over the whole cache."""
    dim, n_tok, seq = qT_hbm.shape[2], qT_hbm.shape[3], kT_hbm.shape[3]
    qT_sbuf, bound = _load_queries(qT_hbm, pos_hbm, b, heads, n_tok)
    rows = qT_sbuf.shape[1]
    n_ch = min(MAX_CHUNKS, max(1, 512 // rows), (seq + P - 1) // P)   # s^T block fits one PSUM bank
    ones_row = nl.ndarray((1, P), dtype=nl.float32, buffer=nl.sbuf, name="ones_row")
    nisa.memset(dst=ones_row, value=1.0)
    o_sbuf = nl.ndarray((rows, dim + 1), dtype=nl.float32, buffer=nl.sbuf, name="o_acc")
    stats = ()   # no running max before the first block
    for s0 in range(0, seq, n_ch * P):
        s1 = min(seq, s0 + n_ch * P)
        blk_ch = (s1 - s0 + P - 1) // P   # the last block may be shorter
        kT_sbuf, v_sbuf = _load_block(kT_hbm, v_hbm, b, kvh, s0, s1, blk_ch)
        sT = _masked_scores_T(qT_sbuf, kT_sbuf, bound, s0, blk_ch)
        pT, m_new, alpha = _softmax_T(sT, stats, ones_row, scale, qT_hbm.dtype)
        pv = _pv(pT, v_sbuf)
        if s0 == 0:
            nisa.tensor_copy(dst=o_sbuf, src=pv)
        else:
            # o = o * alpha + pv
            nisa.scalar_tensor_tensor(dst=o_sbuf, data=o_sbuf, op0=nl.multiply, operand0=alpha, op1=nl.add,
                                      operand1=pv)
        stats = (m_new,)
    inv_l = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="inv_l")
    nisa.reciprocal(dst=inv_l, data=o_sbuf[:, dim:dim + 1])
    res_sbuf = nl.ndarray((rows, dim), dtype=qT_hbm.dtype, buffer=nl.sbuf, name="res_sbuf")
    nisa.tensor_scalar(dst=res_sbuf, data=o_sbuf[:, 0:dim], op0=nl.multiply, operand0=inv_l)
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
