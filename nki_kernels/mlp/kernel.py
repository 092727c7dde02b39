"""Fused SwiGLU MLP: optional RMSNorm, gate and up projections, SiLU(gate) * up, down projection — see design.md.

Dimensions:
    N: tokens (any count; processed in blocks of up to 512 tokens = the moving free size).  H: hidden size (any;
    contraction chunks of 128, the last one partial).  I: intermediate size; Ip / Hp: I and H rounded up to 128.

Args:
    x_hbm: [N, H] activations, bf16 or fp32, HBM.
    gamma_hbm: [H] RMSNorm weight, dtype of x, HBM (rmsnorm_* entry points only).
    eps: Python float RMSNorm epsilon (rmsnorm_* entry points only).
    wg_hbm, wu_hbm: [128, Ip/128, Hp/128, 128] gate / up weights W[K=H, N=I] (nn.Linear.weight.T) in the tiled
        layout of neuron_infer/tiling.py: tiled[kp, nt, kt, np] = W[kt*128 + kp, nt*128 + np], zero padded.
        dtype of x (bf16/fp32) or float8_e4m3 (Neuron E4M3, |w| <= 240) for the *_fp8 entry points, HBM
        (float8_e4m3fn bytes in the Neuron range are accepted and viewed as float8_e4m3).
    wd_hbm: [128, Hp/128, Ip/128, 128] down weight W[K=I, N=H] in the same layout and dtype, HBM.
    sg_hbm, su_hbm: [128, Ip/128] fp32 per-output-channel scales (scale of channel nt*128 + p at [p, nt]),
        sd_hbm: [128, Hp/128] fp32 (fp8 entry points only), HBM.

Returns:
    out_hbm: [N, H], dtype of x, shared HBM.

Notes:
    Orientation: weights are the *stationary* operand (one [128 K, 128 out] tile per matmul, loaded as one
    contiguous [128, Hp/128 or Ip/128, 128] slab per output chunk, several chunks per DMA so each moves
    >= 8 KiB per partition) and the normalised activations, transposed to
    [K on partitions, tokens], are the *moving* operand. The matmul results are gate^T / up^T [I chunk, tokens],
    which is exactly the layout the down projection contracts over, so the intermediate is never transposed;
    only x (in) and the output (out) pass through 128x128 TensorE transposes. Decode (few tokens) streams each
    weight byte once; prefill reuses every weight tile for 512 tokens. Per-output-channel FP8 scales sit on
    partitions and are applied while evicting PSUM (activation scale / tensor_scalar), after the matmul.
    Precision: fp32 PSUM accumulation; RMSNorm statistics fp32; the SiLU product is stored in the matmul input
    dtype (bf16 for bf16 and FP8 weights — FP8 weights multiply bf16 activations; fp32 inputs stay fp32).

Pseudocode:
    for token block tb (<= 512 tokens):
      xT[H, tb] = transpose(rmsnorm(x[tb]) or x[tb])
      for i chunk: g = Wg[:, i]^T xT; u = Wu[:, i]^T xT; hT[i] = silu(sg_i g) * (su_i u)
      for h chunk: oT = sd_h * Wd[:, h]^T hT; out[tb, h] = transpose(oT)
"""
import nki
import nki.isa as nisa
import nki.language as nl

TOK_BLOCK = 512   # tokens per block (moving free size = one fp32 PSUM bank)
P = 128           # partitions / contraction chunk / output chunk


def _norm_rows(x_sbuf, gamma_sbuf, eps, hidden, act_dtype):
    """RMSNorm of [r, H] rows (fp32 statistics) -> [r, H] in act_dtype."""
    rows = x_sbuf.shape[0]
    zero = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="zero")
    nisa.memset(dst=zero, value=0.0)
    eps_t = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="eps")
    nisa.memset(dst=eps_t, value=eps)
    sq = nl.ndarray((rows, hidden), dtype=nl.float32, buffer=nl.sbuf, name="sq")
    ss = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="sumsq")
    nisa.activation_reduce(dst=sq, op=nl.square, data=x_sbuf, reduce_op=nl.add, reduce_res=ss, bias=zero)
    inv = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf, name="inv_rms")
    nisa.activation(dst=inv, op=nl.rsqrt, data=ss, scale=1.0 / hidden, bias=eps_t)
    xn = nl.ndarray((rows, hidden), dtype=x_sbuf.dtype, buffer=nl.sbuf, name="xn")
    nisa.tensor_scalar(dst=xn, data=x_sbuf, op0=nl.multiply, operand0=inv)   # rounded like the reference
    out = nl.ndarray((rows, hidden), dtype=act_dtype, buffer=nl.sbuf, name="xn_gamma")
    nisa.tensor_tensor(dst=out, data1=xn, data2=gamma_sbuf, op=nl.multiply)
    return out


def _dma_transposable(x_hbm, with_norm, act_dtype):
    """x can reach the [H on partitions, tokens] layout by one DMA transpose (gen3+, 2-byte dtype, no RMSNorm
    — which needs tokens on partitions —, H a multiple of 128): saves TensorE transposes and their evictions."""
    if with_norm or x_hbm.dtype != act_dtype or x_hbm.shape[1] % P != 0:
        return False
    if x_hbm.dtype != nl.bfloat16 and x_hbm.dtype != nl.float16:
        return False
    return nisa.get_nc_version() != nisa.nc_version.gen2


def _load_xT(x_hbm, gamma_hbm, eps, with_norm, t0, t1, act_dtype):
    """xT [128, Hp/128, t1-t0]: partition p of chunk kt holds feature kt*128 + p of every token in [t0, t1)."""
    hidden = x_hbm.shape[1]
    n_kt = (hidden + P - 1) // P
    xT_sbuf = nl.ndarray((P, n_kt, t1 - t0), dtype=act_dtype, buffer=nl.sbuf, name="xT")
    for s0 in range(t0, t1, P):
        s1 = min(t1, s0 + P)
        rows = s1 - s0
        if _dma_transposable(x_hbm, with_norm, act_dtype):
            # x[s0:s1] [rows, H] -> [rows, H/128, 128] -> xT [128, H/128, rows]: one HBM->SBUF DMA transpose
            src = x_hbm[s0:s1, :].reshape((rows, n_kt, P))
            nisa.dma_transpose(dst=xT_sbuf[:, :, s0 - t0:s1 - t0], src=src, axes=(2, 1, 0))
            continue
        x_sbuf = nl.ndarray((rows, hidden), dtype=x_hbm.dtype, buffer=nl.sbuf, name="x_rows")
        nisa.dma_copy(dst=x_sbuf, src=x_hbm[s0:s1, :])
        if with_norm:
            g_sbuf = nl.ndarray((rows, hidden), dtype=gamma_hbm.dtype, buffer=nl.sbuf, name="gamma_bcast")
            nisa.dma_copy(dst=g_sbuf, src=gamma_hbm.ap(pattern=[[0, rows], [1, hidden]], offset=0))
            xa = _norm_rows(x_sbuf, g_sbuf, eps, hidden, act_dtype)
        elif x_hbm.dtype == act_dtype:
            xa = x_sbuf
        else:
            xa = nl.ndarray((rows, hidden), dtype=act_dtype, buffer=nl.sbuf, name="x_cast")
            nisa.tensor_copy(dst=xa, src=x_sbuf)
        for kt in range(n_kt):
            k0, k1 = kt * P, min(hidden, (kt + 1) * P)
            t_psum = nl.ndarray((k1 - k0, rows), dtype=act_dtype, buffer=nl.psum, name="xT_psum")
            nisa.nc_transpose(dst=t_psum, data=xa[:, k0:k1])
            nisa.tensor_copy(dst=xT_sbuf[0:k1 - k0, kt, s0 - t0:s1 - t0], src=t_psum)
    return xT_sbuf


def _slab_group(w_hbm):
    """Output chunks per weight DMA: enough for >= 8 KiB per partition (the DMA guide's efficient size)."""
    itemsize = 2
    if w_hbm.dtype == nl.float8_e4m3:
        itemsize = 1
    if w_hbm.dtype == nl.float32:
        itemsize = 4
    per_chunk = w_hbm.shape[2] * P * itemsize
    return max(1, min(w_hbm.shape[1], (8192 + per_chunk - 1) // per_chunk))


def _load_slabs(w_hbm, nt0, nt1):
    """Weight slabs of output chunks [nt0, nt1): [128, nt1-nt0, K/128, 128], one contiguous DMA per partition."""
    w_sbuf = nl.ndarray((P, nt1 - nt0, w_hbm.shape[2], P), dtype=w_hbm.dtype, buffer=nl.sbuf, name="w_slabs")
    nisa.dma_copy(dst=w_sbuf, src=w_hbm[:, nt0:nt1, :, :])
    return w_sbuf


def _project(w_sbuf, j, act_T, k_valid, m_valid, n_tok):
    """out^T [m_valid, n_tok] (PSUM) = sum_kt W[kt, chunk j]^T act_T[kt]."""
    n_kt = w_sbuf.shape[2]
    acc = nl.ndarray((m_valid, n_tok), dtype=nl.float32, buffer=nl.psum, name="proj_psum")
    for kt in range(n_kt):
        kc = min(P, k_valid - kt * P)
        nisa.nc_matmul(dst=acc, stationary=w_sbuf[0:kc, j, kt, 0:m_valid], moving=act_T[0:kc, kt, :],
                       accumulate=(kt > 0))
    return acc


def _swiglu(wg_hbm, wu_hbm, scales, xT_sbuf, hidden, n_tok, act_dtype):
    """hT [128, Ip/128, n_tok] = silu(sg * gate^T) * (su * up^T), one 128-channel chunk at a time."""
    n_it = wg_hbm.shape[1]
    group = _slab_group(wg_hbm)
    hT_sbuf = nl.ndarray((P, n_it, n_tok), dtype=act_dtype, buffer=nl.sbuf, name="hT")
    for it0 in range(0, n_it, group):
        it1 = min(n_it, it0 + group)
        wg_sbuf = _load_slabs(wg_hbm, it0, it1)
        wu_sbuf = _load_slabs(wu_hbm, it0, it1)
        for it in range(it0, it1):
            g_psum = _project(wg_sbuf, it - it0, xT_sbuf, hidden, P, n_tok)
            u_psum = _project(wu_sbuf, it - it0, xT_sbuf, hidden, P, n_tok)
            g_act = nl.ndarray((P, n_tok), dtype=nl.float32, buffer=nl.sbuf, name="silu_gate")
            if len(scales) > 0:
                nisa.activation(dst=g_act, op=nl.silu, data=g_psum, scale=scales[0][:, it:it + 1])
                # h = (up * su) * silu(sg * gate)
                nisa.scalar_tensor_tensor(dst=hT_sbuf[:, it, :], data=u_psum, op0=nl.multiply,
                                          operand0=scales[1][:, it:it + 1], op1=nl.multiply, operand1=g_act)
            else:
                nisa.activation(dst=g_act, op=nl.silu, data=g_psum)
                nisa.tensor_tensor(dst=hT_sbuf[:, it, :], data1=u_psum, data2=g_act, op=nl.multiply)
    return hT_sbuf


def _store_out(oT_sbuf, out_hbm, t0, h0, rows_sbuf):
    """oT [hc, n_tok] -> out[t0:t0+n_tok, h0:h0+hc] through 128x128 TensorE transposes.

    rows_sbuf: a [n_tok, H] SBUF row buffer (decode: one output DMA at the end) or () (one DMA per piece).
    """
    hc, n_tok = oT_sbuf.shape
    for s0 in range(0, n_tok, P):
        s1 = min(n_tok, s0 + P)
        o_t = nl.ndarray((s1 - s0, hc), dtype=out_hbm.dtype, buffer=nl.psum, name="o_psum_t")
        nisa.nc_transpose(dst=o_t, data=oT_sbuf[:, s0:s1])
        if len(rows_sbuf) > 0:
            nisa.tensor_copy(dst=rows_sbuf[0][:, h0:h0 + hc], src=o_t)
        else:
            o_sbuf = nl.ndarray((s1 - s0, hc), dtype=out_hbm.dtype, buffer=nl.sbuf, name="o_rows")
            nisa.tensor_copy(dst=o_sbuf, src=o_t)
            nisa.dma_copy(dst=out_hbm[t0 + s0:t0 + s1, h0:h0 + hc], src=o_sbuf)


def _down(wd_hbm, sd_sbuf, hT_sbuf, out_hbm, t0, t1, n_inter):
    """out[t0:t1, :] = transpose(sd * Wd^T hT), one 128-feature chunk of H at a time."""
    hidden, out_dtype = out_hbm.shape[1], out_hbm.dtype
    n_tok, n_ht = t1 - t0, wd_hbm.shape[1]
    group = _slab_group(wd_hbm)
    rows_sbuf = ()
    if n_tok <= P:   # few tokens: gather the whole output rows and store them with one DMA
        rows_sbuf = (nl.ndarray((n_tok, hidden), dtype=out_dtype, buffer=nl.sbuf, name="out_rows"),)
    for ht0 in range(0, n_ht, group):
        ht1 = min(n_ht, ht0 + group)
        wd_sbuf = _load_slabs(wd_hbm, ht0, ht1)
        for ht in range(ht0, ht1):
            h0, h1 = ht * P, min(hidden, (ht + 1) * P)
            o_psum = _project(wd_sbuf, ht - ht0, hT_sbuf, n_inter, h1 - h0, n_tok)
            oT_sbuf = nl.ndarray((h1 - h0, n_tok), dtype=out_dtype, buffer=nl.sbuf, name="oT")
            if len(sd_sbuf) > 0:
                nisa.tensor_scalar(dst=oT_sbuf, data=o_psum, op0=nl.multiply,
                                   operand0=sd_sbuf[0][0:h1 - h0, ht:ht + 1])
            else:
                nisa.tensor_copy(dst=oT_sbuf, src=o_psum)
            _store_out(oT_sbuf, out_hbm, t0, h0, rows_sbuf)
    if n_tok <= P:
        nisa.dma_copy(dst=out_hbm[t0:t1, :], src=rows_sbuf[0])


def _load_scales(s_hbm):
    s_sbuf = nl.ndarray(s_hbm.shape, dtype=nl.float32, buffer=nl.sbuf, name="scales")
    nisa.dma_copy(dst=s_sbuf, src=s_hbm)
    return s_sbuf


def _as_neuron_e4m3(w_hbm):
    """OCP float8_e4m3fn weights (what torch passes: it has no Neuron E4M3 dtype) viewed as float8_e4m3: the bytes
    of |w| <= 240 are the same values in both, and gen2/3 matmuls accept only float8_e4m3."""
    if w_hbm.dtype == nl.float8_e4m3fn:
        return w_hbm.view(nl.float8_e4m3)
    return w_hbm


def _mlp(x_hbm, gamma_hbm, eps, with_norm, weights, scale_hbms):
    """Shared body of the four entry points (scale_hbms: () for float weights, (sg, su, sd) for FP8)."""
    wg_hbm, wu_hbm, wd_hbm = _as_neuron_e4m3(weights[0]), _as_neuron_e4m3(weights[1]), _as_neuron_e4m3(weights[2])
    n_tok, hidden = x_hbm.shape
    out_hbm = nl.ndarray((n_tok, hidden), dtype=x_hbm.dtype, buffer=nl.shared_hbm, name="mlp_out")
    act_dtype = x_hbm.dtype
    if len(scale_hbms) > 0:
        act_dtype = nl.bfloat16   # FP8 weights multiply bf16 activations
    scales = []
    for s_hbm in scale_hbms:
        scales.append(_load_scales(s_hbm))
    n_inter = wg_hbm.shape[1] * P
    for t0 in range(0, n_tok, TOK_BLOCK):
        t1 = min(n_tok, t0 + TOK_BLOCK)
        xT_sbuf = _load_xT(x_hbm, gamma_hbm, eps, with_norm, t0, t1, act_dtype)
        hT_sbuf = _swiglu(wg_hbm, wu_hbm, tuple(scales[0:2]), xT_sbuf, hidden, t1 - t0, act_dtype)
        _down(wd_hbm, tuple(scales[2:3]), hT_sbuf, out_hbm, t0, t1, n_inter)
    return out_hbm


@nki.jit
def mlp_kernel(x_hbm, wg_hbm, wu_hbm, wd_hbm):
    """down(silu(gate(x)) * up(x)) with float (bf16/fp32) tiled weights."""
    return _mlp(x_hbm, x_hbm, 0.0, False, (wg_hbm, wu_hbm, wd_hbm), ())


@nki.jit
def rmsnorm_mlp_kernel(x_hbm, gamma_hbm, eps, wg_hbm, wu_hbm, wd_hbm):
    """down(silu(gate(n)) * up(n)), n = rmsnorm(x) * gamma, float tiled weights."""
    return _mlp(x_hbm, gamma_hbm, eps, True, (wg_hbm, wu_hbm, wd_hbm), ())


@nki.jit
def mlp_fp8_kernel(x_hbm, wg_hbm, wu_hbm, wd_hbm, sg_hbm, su_hbm, sd_hbm):
    """SwiGLU MLP with FP8 (E4M3, +-240) tiled weights and per-output-channel scales applied after each matmul."""
    return _mlp(x_hbm, x_hbm, 0.0, False, (wg_hbm, wu_hbm, wd_hbm), (sg_hbm, su_hbm, sd_hbm))


@nki.jit
def rmsnorm_mlp_fp8_kernel(x_hbm, gamma_hbm, eps, wg_hbm, wu_hbm, wd_hbm, sg_hbm, su_hbm, sd_hbm):
    """RMSNorm + SwiGLU MLP with FP8 tiled weights and per-output-channel scales."""
    return _mlp(x_hbm, gamma_hbm, eps, True, (wg_hbm, wu_hbm, wd_hbm), (sg_hbm, su_hbm, sd_hbm))
