"""Tiled GEMM ``out = lhsT.T @ rhs`` with PSUM fp32 accumulation over K (NKI documentation)."""
import nki
import nki.isa as nisa
import nki.language as nl


@nki.jit
def gemm_kernel(lhsT_hbm, rhs_hbm):
    """out[M, N] = lhsT[K, M].T @ rhs[K, N].

    Dimensions: K, M, N any size (partial tiles handled); tiles K 128 (partitions), M 128 (stationary free),
    N 512 (moving free = one fp32 PSUM bank).
    Args: lhsT_hbm [K, M] (A pre-transposed so K is on partitions), rhs_hbm [K, N]; bf16/fp16/fp8 or fp32 (both).
    Returns: out_hbm [M, N], dtype of lhsT, shared_hbm.
    Notes: accumulation is fp32 in PSUM; the result is cast once when evicted to SBUF.
    Pseudocode: for m, n tiles: psum = sum_k matmul(lhsT[k, m], rhs[k, n]); out[m, n] = cast(psum).
    """
    k_total, m_total = lhsT_hbm.shape
    n_total = rhs_hbm.shape[1]
    out_hbm = nl.ndarray((m_total, n_total), dtype=lhsT_hbm.dtype, buffer=nl.shared_hbm)
    tk, tm, tn = nl.tile_size.pmax, nl.tile_size.gemm_stationary_fmax, nl.tile_size.gemm_moving_fmax
    n_k = (k_total + tk - 1) // tk
    for m in nl.affine_range((m_total + tm - 1) // tm):
        m0, m1 = m * tm, min(m_total, (m + 1) * tm)
        for n in nl.affine_range((n_total + tn - 1) // tn):
            n0, n1 = n * tn, min(n_total, (n + 1) * tn)
            acc_psum = nl.ndarray((m1 - m0, n1 - n0), dtype=nl.float32, buffer=nl.psum)
            for k in nl.affine_range(n_k):
                k0, k1 = k * tk, min(k_total, (k + 1) * tk)
                a_sbuf = nl.ndarray((k1 - k0, m1 - m0), dtype=lhsT_hbm.dtype, buffer=nl.sbuf)
                b_sbuf = nl.ndarray((k1 - k0, n1 - n0), dtype=rhs_hbm.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=a_sbuf, src=lhsT_hbm[k0:k1, m0:m1])
                nisa.dma_copy(dst=b_sbuf, src=rhs_hbm[k0:k1, n0:n1])
                nisa.nc_matmul(dst=acc_psum, stationary=a_sbuf, moving=b_sbuf, accumulate=(k > 0))
            o_sbuf = nl.ndarray((m1 - m0, n1 - n0), dtype=out_hbm.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=o_sbuf, src=acc_psum)
            nisa.dma_copy(dst=out_hbm[m0:m1, n0:n1], src=o_sbuf)
    return out_hbm
