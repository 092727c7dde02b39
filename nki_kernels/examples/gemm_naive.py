"""Naive tiled GEMM: the cost model's "slow" calibration kernel (NKI documentation).

Dimensions:
    K: contraction, multiple of 128.  M: rows of the result, multiple of 128.  N: columns, multiple of 512.

Args:
    lhsT_hbm: [K, M] (A transposed), bf16/fp16/fp32, HBM.
    rhs_hbm:  [K, N], same dtype as lhsT_hbm, HBM.

Returns:
    out_hbm: [M, N] = lhsT_hbm.T @ rhs_hbm, dtype of the inputs, shared HBM.

Notes:
    Every (m, n, k) step reloads both operand tiles from HBM (a 128x128 stationary tile and a 128x512 moving tile)
    right before its matmul: no reuse, small DMAs (256 B and 1 KiB per partition). This is the textbook
    "before optimisation" kernel; gemm_blocked.py is the same math with operand reuse. fp32 PSUM accumulation.

Pseudocode:
    for m, n: acc = 0 (PSUM); for k: acc += lhsT[k, m].T @ rhs[k, n]; out[m, n] = bf16(acc)
"""
import nki
import nki.isa as nisa
import nki.language as nl

TILE_K = 128   # contraction rows per matmul (partitions)
TILE_M = 128   # stationary free size
TILE_N = 512   # moving free size (one PSUM bank of fp32)


@nki.jit
def gemm_naive(lhsT_hbm, rhs_hbm):
    """out[M, N] = lhsT[K, M].T @ rhs[K, N], one DMA pair per matmul (see module docstring)."""
    K, M = lhsT_hbm.shape
    N = rhs_hbm.shape[1]
    out_hbm = nl.ndarray((M, N), dtype=lhsT_hbm.dtype, buffer=nl.shared_hbm)
    for m in range(M // TILE_M):
        for n in range(N // TILE_N):
            acc_psum = nl.ndarray((TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum)
            for k in range(K // TILE_K):
                a_sbuf = nl.ndarray((TILE_K, TILE_M), dtype=lhsT_hbm.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=a_sbuf, src=lhsT_hbm[k * TILE_K:(k + 1) * TILE_K, m * TILE_M:(m + 1) * TILE_M])
                b_sbuf = nl.ndarray((TILE_K, TILE_N), dtype=rhs_hbm.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=b_sbuf, src=rhs_hbm[k * TILE_K:(k + 1) * TILE_K, n * TILE_N:(n + 1) * TILE_N])
                nisa.nc_matmul(dst=acc_psum, stationary=a_sbuf, moving=b_sbuf, accumulate=(k > 0))
            o_sbuf = nl.ndarray((TILE_M, TILE_N), dtype=out_hbm.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=o_sbuf, src=acc_psum)
            nisa.dma_copy(dst=out_hbm[m * TILE_M:(m + 1) * TILE_M, n * TILE_N:(n + 1) * TILE_N], src=o_sbuf)
    return out_hbm
