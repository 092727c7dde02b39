"""RMSNorm ``y = x / sqrt(mean(x^2) + eps) * gamma`` (NKI documentation)."""
import nki
import nki.isa as nisa
import nki.language as nl


@nki.jit
def rmsnorm_kernel(x_hbm, gamma_hbm, eps):
    """Dimensions: R rows (tiled by 128, partial last tile), H hidden.
    Args: x_hbm [R, H] fp32/bf16; gamma_hbm [H] same family; eps: Python float.
    Returns: out_hbm [R, H], dtype of x, shared_hbm.
    Notes: sum of squares and 1/rms in fp32. gamma is partition-broadcast by a stride-0 HBM access pattern
    (one DMA per row tile).
    Pseudocode: ss = sum(x^2) (activation_reduce); inv = rsqrt(ss / H + eps); y = x * inv * gamma.
    """
    rows, hidden = x_hbm.shape
    out_hbm = nl.ndarray((rows, hidden), dtype=x_hbm.dtype, buffer=nl.shared_hbm)
    for t in nl.affine_range((rows + 127) // 128):
        r0, r1 = t * 128, min(rows, (t + 1) * 128)
        p = r1 - r0
        x_sbuf = nl.ndarray((p, hidden), dtype=x_hbm.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_sbuf, src=x_hbm[r0:r1, :])
        g_sbuf = nl.ndarray((p, hidden), dtype=gamma_hbm.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=g_sbuf, src=gamma_hbm.ap(pattern=[[0, p], [1, hidden]], offset=0))
        zero = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=zero, value=0.0)
        eps_tile = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=eps_tile, value=eps)
        sq = nl.ndarray((p, hidden), dtype=nl.float32, buffer=nl.sbuf)
        ss = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation_reduce(dst=sq, op=nl.square, data=x_sbuf, reduce_op=nl.add, reduce_res=ss, bias=zero)
        inv = nl.ndarray((p, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=inv, op=nl.rsqrt, data=ss, scale=1.0 / hidden, bias=eps_tile)
        y_sbuf = nl.ndarray((p, hidden), dtype=x_hbm.dtype, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=y_sbuf, data=x_sbuf, op0=nl.multiply, operand0=inv, op1=nl.multiply,
                                  operand1=g_sbuf)
        nisa.dma_copy(dst=out_hbm[r0:r1, :], src=y_sbuf)
    return out_hbm
