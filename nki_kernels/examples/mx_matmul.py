"""On-device MXFP8 quantisation + MX matmul on NeuronCore-v4 (trn3) (NKI documentation)."""
import nki
import nki.isa as nisa
import nki.language as nl


@nki.jit
def mx_matmul_kernel(stat_hbm, mov_hbm):
    """out[M, N] = dequant(quantize_mx(stat)).T @ dequant(quantize_mx(mov)) over a K = 4P contraction.

    Dimensions: P partitions in {32, 64, 96, 128} (K = 4P), M <= 128 (even), N <= 512.
    Args: stat_hbm [P, M*4] and mov_hbm [P, N*4], bf16, HBM, in quad layout: element [p, f*4 + q] holds
      logical contraction row k = q*P + p of column f.
    Returns: out_hbm [M, N] fp32, shared_hbm.
    Notes: quantize_mx makes float8_e4m3fn_x4 words and E8M0 scales (one per 8 partitions x 4 slots); scale
      tiles are [P, F] with logical row g at partition 32*(g//4) + g%4. Accumulation is fp32 in PSUM.
    Pseudocode: s_q, s_sc = quantize_mx(stat); v_q, v_sc = quantize_mx(mov); out = nc_matmul_mx(...).
    """
    p, m4 = stat_hbm.shape
    n4 = mov_hbm.shape[1]
    m, n = m4 // 4, n4 // 4
    out_hbm = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.shared_hbm)
    s_sbuf = nl.ndarray((p, m4), dtype=stat_hbm.dtype, buffer=nl.sbuf)
    v_sbuf = nl.ndarray((p, n4), dtype=mov_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=s_sbuf, src=stat_hbm)
    nisa.dma_copy(dst=v_sbuf, src=mov_hbm)
    s_q = nl.ndarray((p, m), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf)
    v_q = nl.ndarray((p, n), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf)
    s_scale = nl.ndarray((p, m), dtype=nl.float8_e8m0fnu, buffer=nl.sbuf)
    v_scale = nl.ndarray((p, n), dtype=nl.float8_e8m0fnu, buffer=nl.sbuf)
    nisa.quantize_mx(dst=s_q, src=s_sbuf, dst_scale=s_scale)
    nisa.quantize_mx(dst=v_q, src=v_sbuf, dst_scale=v_scale)
    acc_psum = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul_mx(dst=acc_psum, stationary=s_q, moving=v_q, stationary_scale=s_scale, moving_scale=v_scale,
                      accumulate=False)
    o_sbuf = nl.ndarray((m, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=o_sbuf, src=acc_psum)
    nisa.dma_copy(dst=out_hbm, src=o_sbuf)
    return out_hbm
