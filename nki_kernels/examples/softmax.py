"""Row softmax with fp32 statistics (NKI documentation)."""
import nki
import nki.isa as nisa
import nki.language as nl


@nki.jit
def softmax_kernel(x_hbm):
    """out[r, :] = softmax(x[r, :]).

    Dimensions: R rows (tiled by 128, partial last tile), F columns (one SBUF tile per row block).
    Args: x_hbm [R, F] fp32 or bf16, HBM.
    Returns: out_hbm [R, F], dtype of x, shared_hbm.
    Notes: row max and row sum are kept in fp32; exp and its row sum come from one ScalarE activation.
    Pseudocode: negmax = -max(x); p = exp(x + negmax) with rowsum; out = p * (1 / rowsum).
    """
    rows, cols = x_hbm.shape
    out_hbm = nl.ndarray((rows, cols), dtype=x_hbm.dtype, buffer=nl.shared_hbm)
    for t in nl.affine_range((rows + 127) // 128):
        r0, r1 = t * 128, min(rows, (t + 1) * 128)
        p = r1 - r0
        x_sbuf = nl.ndarray((p, cols), dtype=x_hbm.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_sbuf, src=x_hbm[r0:r1, :])
        negmax = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=negmax, op=nl.maximum, data=x_sbuf, axis=1, negate=True)
        e_sbuf = nl.ndarray((p, cols), dtype=nl.float32, buffer=nl.sbuf)
        rowsum = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=e_sbuf, op=nl.exp, data=x_sbuf, bias=negmax, reduce_op=nl.add, reduce_res=rowsum,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        inv = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=inv, data=rowsum)
        y_sbuf = nl.ndarray((p, cols), dtype=x_hbm.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=y_sbuf, data=e_sbuf, op0=nl.multiply, operand0=inv)
        nisa.dma_copy(dst=out_hbm[r0:r1, :], src=y_sbuf)
    return out_hbm
