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
    bf16 inputs) before the PV matmul. Key tiles entirely above the diagonal are skipped; only the <= 128-key
    band that crosses the diagonal is masked to FP32_MIN: in place in PSUM by VectorE range_select on gen3+,
    by GpSimd affine_select on an SBUF copy of the band on gen2.
    Engine balance (the softmax, not TensorE, is the usual bottleneck): the 1536-key tiles amortise the
    per-tile [128, 1] statistics; VectorE does the row max and the o + pv add, ScalarE the exp (with its row
    sum) and the small exps, GpSimd the running max, -scale*m', l, the o * alpha rescale and the final o / l
    (ScalarE when o never left PSUM). P is transposed by one 3-D SBUF->SBUF dma_transpose per score tile for bf16
    on gen3+ (on gen3, and on gen4 up to 2048 tokens, the last quarter of the chunks goes to TensorE instead, to
    balance DMA and TensorE time), on TensorE (nc_transpose) for fp32 and on gen2.

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

Q_TILE = 128       # queries per tile (partitions of the score tile)
K_TILE = 1536      # keys per score tile: 3 fp32 PSUM banks (x2 buffers + pv + transpose = 8)
MM_N = 512         # keys per QK^T matmul (one PSUM bank)
PV_CHUNK = 128     # keys per PV matmul (contraction on partitions)
# Mask value: the most negative finite fp32 (-3.4028235e38). nki.language has no such constant (the real API lists
# none), so kernels define their own, as nki-library does.
FP32_MIN = -3.4028234663852886e38


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


def _mask_band(s_psum, q0, k0, b0, zeros):
    """Causal mask of the score columns [b0, cols) (keys k0+b0.. , at most 128 of them): key <= query.

    zeros: a [128, 1] fp32 zero tile -> gen3+ range_select in place on PSUM; () -> gen2 affine_select.
    """
    rows, cols = s_psum.shape
    band_psum = s_psum[:, b0:cols]
    if len(zeros) > 0:
        # keep key index j = k0 + b0 + f <= query q0 + p (and j >= 0)
        q_pos = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="q_pos")
        nisa.iota(dst=q_pos, pattern=[[0, 1]], offset=q0, channel_multiplier=1)
        nisa.range_select(dst=band_psum, on_true_tile=band_psum, comp_op0=nl.greater_equal,
                          comp_op1=nl.less_equal, bound0=zeros[0][0:rows, :], bound1=q_pos, range_start=k0 + b0,
                          on_false_value=FP32_MIN)
        return
    band = nl.ndarray((rows, cols - b0), dtype=nl.float32, buffer=nl.sbuf, name="diag_band")
    nisa.tensor_copy(dst=band, src=band_psum)
    # keep (q0 + p) - (k0 + b0 + f) >= 0
    nisa.affine_select(dst=band, pattern=[[-1, cols - b0]], channel_multiplier=1, on_true_tile=band,
                       on_false_value=FP32_MIN, cmp_op=nl.greater_equal, offset=q0 - k0 - b0)
    nisa.tensor_copy(dst=band_psum, src=band)


def _scores(qT_sbuf, kT_sbuf, q0, q1, k0, k1, zeros):
    """s[q, k] = q . k for one [rows, <= 1536] tile in PSUM; the band crossing the diagonal is masked."""
    rows, cols = q1 - q0, k1 - k0
    s_psum = nl.ndarray((rows, cols), dtype=nl.float32, buffer=nl.psum, name="s_psum")
    for j in range(0, cols, MM_N):
        j1 = min(cols, j + MM_N)
        nisa.nc_matmul(dst=s_psum[:, j:j1], stationary=qT_sbuf, moving=kT_sbuf[:, k0 + j:k0 + j1])
    if k1 - 1 > q0:   # keys [max(q0, k0), k1) may lie above the diagonal for some rows
        _mask_band(s_psum, q0, k0, max(q0, k0) - k0, zeros)
    return s_psum


def _transpose_p_pe(p_sbuf, c0, c1, evac_scalar):
    """P[:, c0:c1] [rows, ck] -> pT [ck, rows] in SBUF through a TensorE transpose (PSUM) and an eviction."""
    rows, ck = p_sbuf.shape[0], c1 - c0
    pT_psum = nl.ndarray((ck, rows), dtype=p_sbuf.dtype, buffer=nl.psum, name="pT_psum")
    nisa.nc_transpose(dst=pT_psum, data=p_sbuf[:, c0:c1])
    pT_sbuf = nl.ndarray((ck, rows), dtype=p_sbuf.dtype, buffer=nl.sbuf, name="pT_sbuf")
    if evac_scalar:
        nisa.activation(dst=pT_sbuf, op=nl.copy, data=pT_psum)
    else:
        nisa.tensor_copy(dst=pT_sbuf, src=pT_psum)
    return pT_sbuf


def _transpose_p_dma(p_sbuf, n_ch):
    """P[:, 0:n_ch*128] [rows, n_ch, 128] -> pT [128, n_ch, rows] with one SBUF->SBUF dma_transpose."""
    rows = p_sbuf.shape[0]
    pT_sbuf = nl.ndarray((PV_CHUNK, n_ch, rows), dtype=p_sbuf.dtype, buffer=nl.sbuf, name="pT_block")
    src = p_sbuf[:, 0:n_ch * PV_CHUNK].reshape((rows, n_ch, PV_CHUNK))   # [rows, n_ch*128] -> [rows, n_ch, 128]
    nisa.dma_transpose(dst=pT_sbuf, src=src, axes=(2, 1, 0))
    return pT_sbuf


def _online_update(s_psum, stats, scales, p_dtype):
    """One online-softmax step over a score tile; stats = (m, l), or () before the first tile; scales =
    (scale, neg_scale tile).

    Returns (p, m', l', alpha); alpha is m' (unused) on the first tile.
    """
    rows, cols = s_psum.shape
    scale, neg_scale = scales
    first = len(stats) == 0
    tile_max = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="tile_max")
    nisa.tensor_reduce(dst=tile_max, op=nl.maximum, data=s_psum, axis=1)
    m_new = tile_max
    if not first:
        m_old, l_old = stats
        m_new = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="m_new")
        nisa.tensor_tensor(dst=m_new, data1=m_old, data2=tile_max, op=nl.maximum, engine=nisa.engine.gpsimd)
    neg_bias = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="neg_bias")
    # -scale * m' on GpSimd (mostly idle), not ScalarE (busy with the exps); neg_scale: [128, 1] of -scale
    nisa.tensor_tensor(dst=neg_bias, data1=m_new, data2=neg_scale[0:rows, :], op=nl.multiply,
                       engine=nisa.engine.gpsimd)
    p_sbuf = nl.ndarray((rows, cols), dtype=p_dtype, buffer=nl.sbuf, name="p_sbuf")
    row_sum = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="row_sum")
    nisa.activation(dst=p_sbuf, op=nl.exp, data=s_psum, bias=neg_bias, scale=scale, reduce_op=nl.add,
                    reduce_res=row_sum, reduce_cmd=nisa.reduce_cmd.reset_reduce)
    if first:
        return p_sbuf, m_new, row_sum, m_new
    alpha = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="alpha")
    nisa.activation(dst=alpha, op=nl.exp, data=m_old, bias=neg_bias, scale=scale)
    l_scaled = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="l_scaled")
    nisa.tensor_tensor(dst=l_scaled, data1=l_old, data2=alpha, op=nl.multiply, engine=nisa.engine.gpsimd)
    l_new = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="l_new")
    nisa.tensor_tensor(dst=l_new, data1=l_scaled, data2=row_sum, op=nl.add, engine=nisa.engine.gpsimd)
    return p_sbuf, m_new, l_new, alpha


def _pv(p_sbuf, v_sbuf, k0, dim, pe_share):
    """pv [rows, D] (PSUM) = P @ V[k0:k0+cols] accumulated over 128-key chunks.

    pe_share: 1 = every chunk transposed on TensorE; n > 1 = the last 1/n of the full chunks (and a partial
    chunk) on TensorE, the others by one dma_transpose; 0 = all full chunks by dma_transpose.
    """
    rows, cols = p_sbuf.shape
    n_chunks = (cols + PV_CHUNK - 1) // PV_CHUNK
    n_full = cols // PV_CHUNK
    n_dma = 0
    if pe_share != 1:
        n_dma = n_full - (n_full // pe_share if pe_share > 1 else 0)
    pT_block = p_sbuf
    if n_dma > 0:
        pT_block = _transpose_p_dma(p_sbuf, n_dma)
    pv_psum = nl.ndarray((rows, dim), dtype=nl.float32, buffer=nl.psum, name="pv_psum")
    for c in range(n_chunks):
        c0, c1 = c * PV_CHUNK, min(cols, (c + 1) * PV_CHUNK)
        if c < n_dma:
            pT = pT_block[:, c, :]
        else:
            pT = _transpose_p_pe(p_sbuf, c0, c1, pe_share != 1 or c % 2 == 1)
        chunk = (k0 + c0) // PV_CHUNK
        nisa.nc_matmul(dst=pv_psum, stationary=pT, moving=v_sbuf[0:c1 - c0, chunk, :], accumulate=(c > 0))
    return pv_psum


def _rescale_add(o_sbuf, alpha, pv_psum):
    """o * alpha + pv: the rescale on GpSimd (alpha broadcast along the free dim), the add on VectorE."""
    rows, dim = o_sbuf.shape
    o_scaled = nl.ndarray((rows, dim), dtype=nl.float32, buffer=nl.sbuf, name="o_scaled")
    alpha_b = alpha.ap(pattern=[[1, rows], [0, dim]], offset=0)   # [rows, 1] -> [rows, D] (stride 0)
    nisa.tensor_tensor(dst=o_scaled, data1=o_sbuf, data2=alpha_b, op=nl.multiply, engine=nisa.engine.gpsimd)
    o_new = nl.ndarray((rows, dim), dtype=nl.float32, buffer=nl.sbuf, name="o_acc")
    nisa.tensor_tensor(dst=o_new, data1=pv_psum, data2=o_scaled, op=nl.add)
    return o_new


def _q_tile(qT_hbm, kv_sbuf, out_hbm, b, h, q0, q1, opts):
    """All causal key tiles of one query tile, then o / l -> out[b, h, q0:q1, :].

    opts = (scale, pe_share (see _pv), zeros (see _mask_band), neg_scale ([128, 1] of -scale)).
    """
    kT_sbuf, v_sbuf = kv_sbuf
    scale, pe_share, zeros, neg_scale = opts
    dim, rows = qT_hbm.shape[2], q1 - q0
    qT_sbuf = nl.ndarray((dim, rows), dtype=qT_hbm.dtype, buffer=nl.sbuf, name="qT_sbuf")
    nisa.dma_copy(dst=qT_sbuf, src=qT_hbm[b, h, :, q0:q1])
    stats, o_acc = (), qT_sbuf
    for k0 in range(0, q1, K_TILE):   # causal: key tiles starting at or before the last query of the tile
        k1 = min(q1, k0 + K_TILE)
        s_psum = _scores(qT_sbuf, kT_sbuf, q0, q1, k0, k1, zeros)
        p_sbuf, m_sbuf, l_sbuf, alpha = _online_update(s_psum, stats, (scale, neg_scale), qT_hbm.dtype)
        stats = (m_sbuf, l_sbuf)
        pv_psum = _pv(p_sbuf, v_sbuf, k0, dim, pe_share)
        if k0 == 0:
            o_acc = pv_psum                       # one key tile: o stays in PSUM (no VectorE copy)
            if k1 < q1:
                o_acc = nl.ndarray((rows, dim), dtype=nl.float32, buffer=nl.sbuf, name="o_acc")
                nisa.tensor_copy(dst=o_acc, src=pv_psum)
        else:
            o_acc = _rescale_add(o_acc, alpha, pv_psum)
    inv_l = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="inv_l")
    nisa.reciprocal(dst=inv_l, data=stats[1])
    res_sbuf = nl.ndarray((rows, dim), dtype=qT_hbm.dtype, buffer=nl.sbuf, name="res_sbuf")
    if q1 <= K_TILE:   # o / l: ScalarE reads o from PSUM; GpSimd (idle, SBUF only) takes the SBUF case
        nisa.activation(dst=res_sbuf, op=nl.copy, data=o_acc, scale=inv_l)
    else:
        inv_b = inv_l.ap(pattern=[[1, rows], [0, dim]], offset=0)   # [rows, 1] -> [rows, D] (stride 0)
        nisa.tensor_tensor(dst=res_sbuf, data1=o_acc, data2=inv_b, op=nl.multiply, engine=nisa.engine.gpsimd)
    nisa.dma_copy(dst=out_hbm[b, h, q0:q1, :], src=res_sbuf)


def _pe_share(dtype, seq):
    """P-transpose policy (see _pv): fp32 or gen2 -> all TensorE (evictions alternate VectorE / ScalarE);
    gen3 bf16 -> 1/4 on TensorE (its SBUF->SBUF DMA transpose is slower); gen4 bf16 -> all dma_transpose for
    long prompts (TensorE is the busiest engine there), 1/4 on TensorE up to 2048 tokens (DMA is)."""
    version = nisa.get_nc_version()
    if dtype != nl.bfloat16 or version == nisa.nc_version.gen2:
        return 1
    if version == nisa.nc_version.gen3 or seq <= 2048:
        return 4
    return 0


@nki.jit
def flash_attention_prefill(qT_hbm, kT_hbm, v_hbm, q_to_kv, scale):
    """Causal GQA flash attention over a full prompt (see the module docstring for the template)."""
    batch, n_q, dim, seq = qT_hbm.shape
    n_kv = kT_hbm.shape[1]
    out_hbm = nl.ndarray((batch, n_q, seq, dim), dtype=qT_hbm.dtype, buffer=nl.shared_hbm, name="attn_out")
    zeros = ()
    if nisa.get_nc_version() != nisa.nc_version.gen2:   # range_select bound tile, allocated once
        zeros = (nl.ndarray((Q_TILE, 1), dtype=nl.float32, buffer=nl.sbuf, name="zeros"),)
        nisa.memset(dst=zeros[0], value=0.0)
    neg_scale = nl.ndarray((Q_TILE, 1), dtype=nl.float32, buffer=nl.sbuf, name="neg_scale")
    nisa.memset(dst=neg_scale, value=-scale)
    opts = (scale, _pe_share(qT_hbm.dtype, seq), zeros, neg_scale)
    for b in range(batch):
        for kvh in range(n_kv):
            kv_sbuf = _load_kv(kT_hbm, v_hbm, b, kvh, seq, dim)
            for h in range(n_q):
                if q_to_kv[h] == kvh:
                    for q0 in range(0, seq, Q_TILE):
                        _q_tile(qT_hbm, kv_sbuf, out_hbm, b, h, q0, min(seq, q0 + Q_TILE), opts)
    return out_hbm
