"""Element-wise addition of two HBM tensors, tiled over 128-row partitions (handles a partial last tile)."""
import nki
import nki.isa as nisa
import nki.language as nl


@nki.jit
def tensor_add_kernel(a_hbm, b_hbm):
    """out = a + b.

    Dimensions: R rows (any), F columns (F * itemsize must fit in SBUF per partition).
    Args: a_hbm, b_hbm: [R, F] same dtype, HBM.
    Returns: out_hbm [R, F] in shared_hbm.
    Pseudocode: for each 128-row tile: dma a, b -> SBUF; tensor_tensor(add); dma -> out.
    """
    rows, cols = a_hbm.shape
    out_hbm = nl.ndarray((rows, cols), dtype=a_hbm.dtype, buffer=nl.shared_hbm)
    pmax = nl.tile_size.pmax
    for t in nl.affine_range((rows + pmax - 1) // pmax):
        r0 = t * pmax
        r1 = min(rows, r0 + pmax)
        a_sbuf = nl.ndarray((r1 - r0, cols), dtype=a_hbm.dtype, buffer=nl.sbuf)
        b_sbuf = nl.ndarray((r1 - r0, cols), dtype=b_hbm.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=a_sbuf, src=a_hbm[r0:r1, :])
        nisa.dma_copy(dst=b_sbuf, src=b_hbm[r0:r1, :])
        c_sbuf = nl.ndarray((r1 - r0, cols), dtype=a_hbm.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=c_sbuf, data1=a_sbuf, data2=b_sbuf, op=nl.add)
        nisa.dma_copy(dst=out_hbm[r0:r1, :], src=c_sbuf)
    return out_hbm
