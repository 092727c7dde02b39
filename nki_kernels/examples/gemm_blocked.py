"""Blocked GEMM: the cost model's "fast" calibration kernel (NKI documentation).

Dimensions:
    K: contraction, multiple of 128.  M: rows of the result, multiple of 512.  N: columns, multiple of 1024.

Args:
    lhsT_hbm: [K, M] (A transposed), bf16/fp16, HBM.
    rhs_hbm:  [K, N], same dtype, HBM.

Returns:
    out_hbm: [M, N] = lhsT_hbm.T @ rhs_hbm, dtype of the inputs, shared HBM.

Notes:
    Blocking (our own design): a block of BLOCK_M = 512 result rows keeps its whole lhsT column strip
    [K, 512] resident in SBUF (K/128 tiles of [128, 512]: 64 KiB per partition for K = 8192 bf16), loaded once.
    For each block of BLOCK_N = 1024 columns the K loop streams one [128, 1024] rhs tile (2 KiB per partition,
    the DMA guide's minimum) and issues 4 x 2 = 8 matmuls (stationary 128x128, moving 128x512) into 8 PSUM
    accumulators (all 8 banks). HBM traffic: lhsT once, rhs M/512 times, out once; every matmul is full size
    (K=128, M=128, N=512), so TensorE streams at its initiation-interval limit. fp32 PSUM accumulation.

Pseudocode:
    for mb: L = lhsT[:, mb] (SBUF)
      for nb: acc[4][2] = 0 (PSUM)
        for k: R = rhs[k, nb] (SBUF); for i, j: acc[i][j] += L[k, i].T @ R[:, j]
        for i: out[mb, i][nb] = bf16(acc[i][:])
"""
import nki
import nki.isa as nisa
import nki.language as nl

TILE_K = 128        # contraction rows per matmul (partitions)
TILE_M = 128        # stationary free size
TILE_N = 512        # moving free size (one PSUM bank of fp32)
M_TILES = 4         # BLOCK_M = 512
N_TILES = 2         # BLOCK_N = 1024; M_TILES * N_TILES = 8 PSUM accumulators = all 8 banks


@nki.jit
def gemm_blocked(lhsT_hbm, rhs_hbm):
    """out[M, N] = lhsT[K, M].T @ rhs[K, N] with lhsT strips resident in SBUF (see module docstring)."""
    K, M = lhsT_hbm.shape
    N = rhs_hbm.shape[1]
    block_m = M_TILES * TILE_M
    block_n = N_TILES * TILE_N
    k_tiles = K // TILE_K
    out_hbm = nl.ndarray((M, N), dtype=lhsT_hbm.dtype, buffer=nl.shared_hbm)
    for mb in range(M // block_m):
        # lhsT strip [K, block_m] held as [128, k_tiles, block_m]: partition p of tile k holds row k*128 + p.
        lhs_sbuf = nl.ndarray((TILE_K, k_tiles, block_m), dtype=lhsT_hbm.dtype, buffer=nl.sbuf)
        for k in range(k_tiles):
            nisa.dma_copy(dst=lhs_sbuf[:, k, :],
                          src=lhsT_hbm[k * TILE_K:(k + 1) * TILE_K, mb * block_m:(mb + 1) * block_m])
        for nb in range(N // block_n):
            accs = []
            for t in range(M_TILES * N_TILES):
                accs.append(nl.ndarray((TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum))
            for k in range(k_tiles):
                rhs_sbuf = nl.ndarray((TILE_K, block_n), dtype=rhs_hbm.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=rhs_sbuf,
                              src=rhs_hbm[k * TILE_K:(k + 1) * TILE_K, nb * block_n:(nb + 1) * block_n])
                for i in range(M_TILES):
                    for j in range(N_TILES):
                        nisa.nc_matmul(dst=accs[i * N_TILES + j],
                                       stationary=lhs_sbuf[:, k, i * TILE_M:(i + 1) * TILE_M],
                                       moving=rhs_sbuf[:, j * TILE_N:(j + 1) * TILE_N],
                                       accumulate=(k > 0))
            for i in range(M_TILES):
                o_sbuf = nl.ndarray((TILE_M, block_n), dtype=out_hbm.dtype, buffer=nl.sbuf)
                for j in range(N_TILES):
                    nisa.tensor_copy(dst=o_sbuf[:, j * TILE_N:(j + 1) * TILE_N], src=accs[i * N_TILES + j])
                row0 = mb * block_m + i * TILE_M
                nisa.dma_copy(dst=out_hbm[row0:row0 + TILE_M, nb * block_n:(nb + 1) * block_n], src=o_sbuf)
    return out_hbm
