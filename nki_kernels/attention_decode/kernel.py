"""Decode (token generation) attention: a few query tokens per sequence against a KV cache, flash-decoding
style over cache blocks, GQA, batch > 1 — see design.md.

Dimensions:
    B: batch.  Hq / Hkv: query / KV heads (query head h reads KV head q_to_kv[h]).  T: active query tokens per
    sequence (1..k, k = speculation length + 1).  S: cache length in the kernel call (the longest valid length
    of the batch, any value >= 1).  D: head dim <= 128.  R = G*T <= 128, G = query heads of one KV head.

Args:
    qT_hbm: [B, Hq, D, T] queries, head dim first, bf16 or fp32, HBM.
    kT_hbm: [B, Hkv, D, S] key cache, head dim first, same dtype, HBM.
    v_hbm:  [B, Hkv, S, D] value cache, same dtype, HBM.
    pos_hbm: [B, T] fp32 absolute position of every query token; key j is visible iff j <= pos (so the valid
        length of sequence b is pos[b, -1] + 1; entries beyond it never reach the result), HBM.
    q_to_kv: tuple of Hq ints (static).
    scale: Python float softmax scale.

Returns:
    out_hbm: [B, Hq, T, D], dtype of the inputs, shared HBM.

Notes:
    Envelope: D <= 128; R <= 128; pos[b, t] < S. Keys-on-partitions orientation: scores are computed transposed,
    s^T [128 keys, R rows] per 128-key chunk, so the few query rows sit in the free dim and every Vector/Scalar
    instruction covers a whole cache block (NCH chunks x R rows) at once, and P^T comes out of the exp already
    in the layout the PV matmul contracts over (no P transposes). PV runs with V as the stationary operand
    (o^T [D, R] += V_c^T P^T_c, moving free size R), row sums with a ones column as stationary. The cache
    streams in DMA blocks of up to 4096 keys (8 KiB per partition per K^T DMA for bf16) consumed in compute
    blocks of NCH*128 keys (NCH = min(16, 512 // R)); each K/V byte is read once per step. Masking is dynamic (key index > pos -> -1e30 before the max). The block
    max over keys (partitions) is a free-dim reduce, a 128 x R TensorE transpose and a reduce; per-row values
    (-scale*m', alpha, 1/l) reach all partitions through a K=1 ones matmul (fp32). fp32 statistics and PSUM
    accumulation; P^T is stored in the input dtype. When the query heads of a KV head are contiguous, the
    queries, bounds and outputs of all batch rows move with one DMA each, and short caches (S a multiple of
    128, S <= 4096) of several batch rows move with one K^T and one V DMA per DMA_KEYS keys (fewer fixed
    per-transfer costs at batch > 1).

Pseudocode:
    for kv, b: rows r = (h in heads(kv), t); qT[D, R]; bound[:, r] = pos[b, t] (all partitions)
      for DMA block of <= 4096 keys: K^T [D, keys], V [128, keys/128, D] -> SBUF
       for compute block of NCH*128 keys:
        sT[:, c, r] = k_c^T q_r; sT -= 1e30 * (key > bound); bm[r] = max over keys of sT
        m' = max(m, bm); a = exp(scale (m - m')); pT = exp(scale sT - scale m')
        oT[:, r] = oT a + sum_c V_c^T pT[:, c];  l = l a + sum_keys pT;  m = m'
      out[b, h, t] = transpose(oT / l)
"""
import nki
import nki.isa as nisa
import nki.language as nl

P = 128               # keys per chunk (partitions)
MAX_CHUNKS = 16       # chunks per compute block (2048 keys; s^T of the block fits one PSUM bank)
DMA_KEYS = 4096       # keys per K/V DMA block (8 KiB per partition for bf16 K^T)
NEG = -1.0e30         # added to masked scores (finite: exp underflows to exactly 0)


def _load_queries_all(qT_hbm, pos_hbm, heads):
    """Contiguous heads: qT [D, B, R] and bounds [128, B, R] of every batch row with one DMA each."""
    batch, _, dim, n_tok = qT_hbm.shape
    n_g = len(heads)
    qT_all = nl.ndarray((dim, batch, n_g * n_tok), dtype=qT_hbm.dtype, buffer=nl.sbuf, name="qT_all")
    # [B, G, D, T] -> [D, B, G, T]
    src = qT_hbm[:, heads[0]:heads[0] + n_g, :, :].permute((2, 0, 1, 3))
    nisa.dma_copy(dst=qT_all.reshape((dim, batch, n_g, n_tok)), src=src)
    bound = nl.ndarray((P, batch, n_g * n_tok), dtype=nl.float32, buffer=nl.sbuf, name="bound_all")
    # pos[b, t] for every partition and head (stride-0 patterns)
    nisa.dma_copy(dst=bound, src=pos_hbm.ap(pattern=[[0, P], [n_tok, batch], [0, n_g], [1, n_tok]], offset=0))
    return qT_all, bound


def _load_queries(qT_hbm, pos_hbm, b, heads):
    """Any head set, one batch row: qT [D, R] (one DMA per head) and bounds [128, R]."""
    dim, n_tok, n_g = qT_hbm.shape[2], qT_hbm.shape[3], len(heads)
    qT_sbuf = nl.ndarray((dim, n_g * n_tok), dtype=qT_hbm.dtype, buffer=nl.sbuf, name="qT_sbuf")
    for g in range(n_g):
        nisa.dma_copy(dst=qT_sbuf[:, g * n_tok:(g + 1) * n_tok], src=qT_hbm[b, heads[g], :, :])
    bound = nl.ndarray((P, n_g * n_tok), dtype=nl.float32, buffer=nl.sbuf, name="bound_bcast")
    nisa.dma_copy(dst=bound, src=pos_hbm.ap(pattern=[[0, P], [0, n_g], [1, n_tok]], offset=b * n_tok))
    return qT_sbuf, bound


def _load_block(kT_hbm, v_hbm, b, kvh, s0, s1, n_ch):
    """K^T [D, n_ch*128] and V [128, n_ch, D] for keys [s0, s1); keys past s1 are zero (and masked)."""
    dim, n = kT_hbm.shape[2], s1 - s0
    kT_sbuf = nl.ndarray((dim, n_ch * P), dtype=kT_hbm.dtype, buffer=nl.sbuf, name="kT_block")
    if n < n_ch * P:
        nisa.memset(dst=kT_sbuf[:, n:n_ch * P], value=0.0)
    nisa.dma_copy(dst=kT_sbuf[:, 0:n], src=kT_hbm[b, kvh, :, s0:s1])
    v_sbuf = nl.ndarray((P, n_ch, dim), dtype=v_hbm.dtype, buffer=nl.sbuf, name="v_block")
    full = n // P
    if full < n_ch:
        nisa.memset(dst=v_sbuf[:, full, :], value=0.0)
        nisa.dma_copy(dst=v_sbuf[0:n - full * P, full, :], src=v_hbm[b, kvh, s0 + full * P:s1, :])
    if full > 0:
        # [full*128, D] -> [full, 128, D] -> [128, full, D]
        view = v_hbm[b, kvh, s0:s0 + full * P, :].reshape((full, P, dim)).permute((1, 0, 2))
        nisa.dma_copy(dst=v_sbuf[:, 0:full, :], src=view)
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
    bound_v = bound.expand_dim(1).broadcast(1, n_ch)   # [128, R] -> [128, 1, R] -> [128, n_ch, R] (stride 0)
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


def _broadcast_cols(cols, ones_row):
    """Per-row columns [R, 1] each -> [128, n*R] (PSUM): every partition holds the rows side by side."""
    rows, n = cols[0].shape[0], len(cols)
    row_psum = nl.ndarray((1, n * rows), dtype=nl.float32, buffer=nl.psum, name="rows_T")
    for i in range(n):
        nisa.nc_transpose(dst=row_psum[:, i * rows:(i + 1) * rows], data=cols[i])
    row = nl.ndarray((1, n * rows), dtype=nl.float32, buffer=nl.sbuf, name="rows")
    nisa.tensor_copy(dst=row, src=row_psum)
    bc = nl.ndarray((P, n * rows), dtype=nl.float32, buffer=nl.psum, name="rows_bcast")
    nisa.nc_matmul(dst=bc, stationary=ones_row, moving=row)
    return bc


def _softmax_T(sT, stats, ones_row, scale, p_dtype):
    """Online-softmax step; stats = (m,) or () before the first block.

    Returns (pT [128, n_ch, R] = exp(scale (sT - m')), m' [R, 1], bc): bc [128, R] holds -scale*m' broadcast,
    and after the first block bc[:, R:2R] holds alpha = exp(scale (m - m')) broadcast.
    """
    n_ch, rows = sT.shape[1], sT.shape[2]
    bmax = _block_max(sT, rows)
    m_new = bmax
    if len(stats) > 0:
        m_new = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="m_new")
        nisa.tensor_tensor(dst=m_new, data1=stats[0], data2=bmax, op=nl.maximum)
    neg_bias = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="neg_bias")
    nisa.tensor_scalar(dst=neg_bias, data=m_new, op0=nl.multiply, operand0=-scale)
    cols = (neg_bias,)
    if len(stats) > 0:
        alpha = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="alpha")
        nisa.activation(dst=alpha, op=nl.exp, data=stats[0], bias=neg_bias, scale=scale)
        cols = (neg_bias, alpha)
    bc = _broadcast_cols(cols, ones_row)
    z = nl.ndarray((P, n_ch, rows), dtype=nl.float32, buffer=nl.sbuf, name="z")
    nb_v = bc[:, 0:rows].expand_dim(1).broadcast(1, n_ch)   # [128, R] -> [128, 1, R] -> [128, n_ch, R]
    # z = sT * scale - scale * m'
    nisa.scalar_tensor_tensor(dst=z, data=sT, op0=nl.multiply, operand0=scale, op1=nl.add, operand1=nb_v)
    pT = nl.ndarray((P, n_ch, rows), dtype=p_dtype, buffer=nl.sbuf, name="pT")
    nisa.activation(dst=pT, op=nl.exp, data=z)
    return pT, m_new, bc


def _pv_T(pT, v_sbuf, ones_col):
    """(oT [D, R] PSUM = sum_c V_c^T pT_c, row sums [1, R] SBUF = sum over keys of pT)."""
    n_ch, rows = pT.shape[1], pT.shape[2]
    oT = nl.ndarray((v_sbuf.shape[2], rows), dtype=nl.float32, buffer=nl.psum, name="oT_psum")
    for c in range(n_ch):
        nisa.nc_matmul(dst=oT, stationary=v_sbuf[:, c, :], moving=pT[:, c, :], accumulate=(c > 0))
    rs_psum = nl.ndarray((1, n_ch * rows), dtype=nl.float32, buffer=nl.psum, name="rowsum_psum")
    nisa.nc_matmul(dst=rs_psum, stationary=ones_col, moving=pT)
    rs = nl.ndarray((1, rows), dtype=nl.float32, buffer=nl.sbuf, name="rowsum")
    nisa.tensor_reduce(dst=rs, op=nl.add, data=rs_psum.reshape((1, n_ch, rows)).permute((0, 2, 1)), axis=2)
    return oT, rs


def _accumulate(acc, oT_psum, rs, bc):
    """(oT, l) <- (oT * alpha + oT_blk, l * alpha + rs) with alpha broadcast in bc[:, R:2R]; copy at first."""
    dim, rows = oT_psum.shape
    oT_new = nl.ndarray((dim, rows), dtype=nl.float32, buffer=nl.sbuf, name="oT_acc")
    l_new = nl.ndarray((1, rows), dtype=nl.float32, buffer=nl.sbuf, name="l_acc")
    if len(acc) == 0:
        nisa.tensor_copy(dst=oT_new, src=oT_psum)
        nisa.tensor_copy(dst=l_new, src=rs)
        return (oT_new, l_new)
    oT_old, l_old = acc
    scaled = nl.ndarray((dim, rows), dtype=nl.float32, buffer=nl.sbuf, name="oT_scaled")
    nisa.tensor_tensor(dst=scaled, data1=oT_old, data2=bc[0:dim, rows:2 * rows], op=nl.multiply)
    nisa.tensor_tensor(dst=oT_new, data1=oT_psum, data2=scaled, op=nl.add)
    l_scaled = nl.ndarray((1, rows), dtype=nl.float32, buffer=nl.sbuf, name="l_scaled")
    nisa.tensor_tensor(dst=l_scaled, data1=l_old, data2=bc[0:1, rows:2 * rows], op=nl.multiply)
    nisa.tensor_tensor(dst=l_new, data1=l_scaled, data2=rs, op=nl.add)
    return (oT_new, l_new)


def _finish(acc, ones_row, res):
    """res [R, D] (SBUF, output dtype) = transpose(oT * (1 / l))."""
    oT, l_row = acc
    dim, rows = oT.shape
    inv = nl.ndarray((1, rows), dtype=nl.float32, buffer=nl.sbuf, name="inv_l")
    nisa.reciprocal(dst=inv, data=l_row)
    inv_bc = nl.ndarray((dim, rows), dtype=nl.float32, buffer=nl.psum, name="inv_bcast")
    nisa.nc_matmul(dst=inv_bc, stationary=ones_row[:, 0:dim], moving=inv)
    resT = nl.ndarray((dim, rows), dtype=nl.float32, buffer=nl.sbuf, name="resT")
    nisa.tensor_tensor(dst=resT, data1=inv_bc, data2=oT, op=nl.multiply)
    res_psum = nl.ndarray((rows, dim), dtype=nl.float32, buffer=nl.psum, name="res_psum")
    nisa.nc_transpose(dst=res_psum, data=resT)
    nisa.tensor_copy(dst=res, src=res_psum)


def _rows_per_load(batch, seq):
    """Batch rows whose whole K/V cache moves in one DMA each (<= DMA_KEYS keys in all): fewer fixed DMA costs
    for short caches at batch > 1. 1 when the cache is long or not a whole number of 128-key chunks."""
    if seq % P != 0 or seq > DMA_KEYS:
        return 1
    return max(1, min(batch, DMA_KEYS // seq))


def _load_rows(kT_hbm, v_hbm, b0, b1, kvh):
    """K^T [D, rows, S] and V [128, rows, S/128, D] of batch rows [b0, b1) (S a multiple of 128), one DMA each."""
    n_kv, dim, seq = kT_hbm.shape[1], kT_hbm.shape[2], kT_hbm.shape[3]
    n, n_ch, row = b1 - b0, seq // P, n_kv * dim * seq     # row: elements per batch row of K^T (and of V)
    base = (b0 * n_kv + kvh) * dim * seq
    kT_rows = nl.ndarray((dim, n, seq), dtype=kT_hbm.dtype, buffer=nl.sbuf, name="kT_rows")
    # K^T[b0+i, kvh, d, s] -> kT_rows[d, i, s]
    nisa.dma_copy(dst=kT_rows, src=kT_hbm.ap(pattern=[[seq, dim], [row, n], [1, seq]], offset=base))
    v_rows = nl.ndarray((P, n, n_ch, dim), dtype=v_hbm.dtype, buffer=nl.sbuf, name="v_rows")
    # V[b0+i, kvh, c*128 + p, d] -> v_rows[p, i, c, d]
    nisa.dma_copy(dst=v_rows, src=v_hbm.ap(pattern=[[dim, P], [row, n], [P * dim, n_ch], [1, dim]], offset=base))
    return kT_rows, v_rows


def _group(qT_sbuf, bound, kv, scale, res):
    """Attention of the R query rows of one (batch, KV head) over the whole cache -> res [R, D] (SBUF).

    kv = (kT_hbm, v_hbm, b, kvh, resident): resident = () to stream the cache in DMA blocks, or
    (K^T [D, S], V [128, S/128, D]) already in SBUF (`_load_rows`).
    """
    kT_hbm, v_hbm, b, kvh, resident = kv
    seq, rows = kT_hbm.shape[3], qT_sbuf.shape[1]
    n_ch = min(MAX_CHUNKS, max(1, 512 // rows), (seq + P - 1) // P)   # s^T block fits one PSUM bank
    ones_row = nl.ndarray((1, P), dtype=nl.float32, buffer=nl.sbuf, name="ones_row")
    nisa.memset(dst=ones_row, value=1.0)
    ones_col = nl.ndarray((P, 1), dtype=qT_sbuf.dtype, buffer=nl.sbuf, name="ones_col")
    nisa.memset(dst=ones_col, value=1.0)
    dma_keys = max(1, DMA_KEYS // (n_ch * P)) * n_ch * P   # whole compute blocks per DMA block
    if len(resident) > 0:
        dma_keys = seq                                      # one block: the whole cache is already resident
    stats, acc = (), ()   # running max; (oT, l) accumulators — empty before the first block
    for d0 in range(0, seq, dma_keys):
        d1 = min(seq, d0 + dma_keys)
        if len(resident) > 0:
            kT_sbuf, v_sbuf = resident
        else:
            kT_sbuf, v_sbuf = _load_block(kT_hbm, v_hbm, b, kvh, d0, d1, (d1 - d0 + P - 1) // P)
        for s0 in range(d0, d1, n_ch * P):
            s1 = min(d1, s0 + n_ch * P)
            c0, blk_ch = (s0 - d0) // P, (s1 - s0 + P - 1) // P   # the last block may be shorter
            sT = _masked_scores_T(qT_sbuf, kT_sbuf[:, c0 * P:(c0 + blk_ch) * P], bound, s0, blk_ch)
            pT, m_new, bc = _softmax_T(sT, stats, ones_row, scale, qT_sbuf.dtype)
            oT_psum, rs = _pv_T(pT, v_sbuf[:, c0:c0 + blk_ch, :], ones_col)
            acc = _accumulate(acc, oT_psum, rs, bc)
            stats = (m_new,)
    _finish(acc, ones_row, res)


def _kv_head(qT_hbm, kT_hbm, v_hbm, pos_hbm, out_hbm, kvh, heads, scale):
    """All batch rows of one KV head: batched query/bound/output DMAs when the heads are contiguous."""
    batch, _, dim, n_tok = qT_hbm.shape
    rows = len(heads) * n_tok
    if heads[len(heads) - 1] - heads[0] == len(heads) - 1:
        qT_all, bound_all = _load_queries_all(qT_hbm, pos_hbm, heads)
        res_all = nl.ndarray((rows, batch, dim), dtype=out_hbm.dtype, buffer=nl.sbuf, name="res_all")
        per_load = _rows_per_load(batch, kT_hbm.shape[3])
        for b0 in range(0, batch, per_load):
            b1 = min(batch, b0 + per_load)
            loaded = ()
            if per_load > 1:
                loaded = _load_rows(kT_hbm, v_hbm, b0, b1, kvh)
            for b in range(b0, b1):
                resident = ()
                if per_load > 1:
                    resident = (loaded[0][:, b - b0, :], loaded[1][:, b - b0, :, :])
                _group(qT_all[:, b, :], bound_all[:, b, :], (kT_hbm, v_hbm, b, kvh, resident), scale,
                       res_all[:, b, :])
        # out[:, h0:h1] [B, G, T, D] viewed [G, T, B, D] == res_all [(G T), B, D] element for element
        dst = out_hbm[:, heads[0]:heads[0] + len(heads), :, :].permute((1, 2, 0, 3))
        nisa.dma_copy(dst=dst, src=res_all)
    else:
        for b in range(batch):
            qT_sbuf, bound = _load_queries(qT_hbm, pos_hbm, b, heads)
            res = nl.ndarray((rows, dim), dtype=out_hbm.dtype, buffer=nl.sbuf, name="res")
            _group(qT_sbuf, bound, (kT_hbm, v_hbm, b, kvh, ()), scale, res)
            for g in range(len(heads)):
                nisa.dma_copy(dst=out_hbm[b, heads[g], :, :], src=res[g * n_tok:(g + 1) * n_tok, :])


@nki.jit
def attention_decode(qT_hbm, kT_hbm, v_hbm, pos_hbm, q_to_kv, scale):
    """Decode attention against a KV cache with per-row position bounds (module docstring has the template)."""
    batch, n_q, dim, n_tok = qT_hbm.shape
    n_kv = kT_hbm.shape[1]
    out_hbm = nl.ndarray((batch, n_q, n_tok, dim), dtype=qT_hbm.dtype, buffer=nl.shared_hbm, name="attn_out")
    for kvh in range(n_kv):
        heads = []
        for h in range(n_q):
            if q_to_kv[h] == kvh:
                heads.append(h)
        if len(heads) > 0:
            _kv_head(qT_hbm, kT_hbm, v_hbm, pos_hbm, out_hbm, kvh, tuple(heads), scale)
    return out_hbm
